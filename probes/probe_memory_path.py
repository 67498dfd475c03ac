"""Which memory threads and memory chunk load a checkpoint in /dev/shm fastest?

The memory path copies a file's page cache into pinned slots (two per thread, a
chunk each) that the GPU then reads; the defaults are one memory thread per core
and 4 MiB. Smaller slots might stay in the last-level cache between the CPU's
write and the DMA's read; larger ones make fewer DMAs (each costs about 3 us of
the copy engine: ``probe_dma_pieces.py``) but put more bytes in flight.

For each configuration, in alternating order per round, in one process: the CPU
copy floor (``_native.memory_copy_floor``: the copy alone, no GPU),
``ckptio.load_state_dict`` in place and ``ckptio.load`` into new tensors of a
bf16 checkpoint in /dev/shm, each load with its engine read alone, as ratios to
the pinned host-to-device copy of the same bytes timed in the round (without
CUDA the loads go to the host and there is no ratio).

A configuration is THREADSxCHUNK (``threads=``, ``chunk_size=``: an explicit
count or chunk holds for tmpfs files too) or CHUNK alone, at the engine's memory
threads. ``--chunks`` is ``--configs`` by its other name: the chunk sweep of
``probe-memory-chunk-*.txt`` (``--chunks 256K,512K,1M,2M,4M``) and the lanes of
``probe-memory-lanes-*.txt`` (the default configurations) are one harness.

Usage: python probes/probe_memory_path.py [--size 8] [--tensors 512] [--rounds 5]
       [--configs 16x4M,12x8M,8x8M,12x4M | --chunks 512K,1M,2M,4M]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

import ckptio
import torch
from ckptio import _native
from ckptio.io.engines import engine as _engine
from ckptio.io.units import parse_size as _size

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--tensors", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--configs",
        "--chunks",
        default="16x4M,12x8M,8x8M,12x4M",
        help="THREADSxCHUNK or CHUNK (the engine's memory threads), comma-separated",
    )
    a = p.parse_args()
    configs = []
    for c in a.configs.split(","):
        t, _, ch = c.rpartition("x")
        configs.append((c, int(t) if t else None, _size(ch)))
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    path, model, nbytes = benchlib.shm_checkpoint(a.size, a.tensors, dev)
    own_threads = _engine(None, None, None).memory_threads
    if cuda:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    reads = benchlib.EngineReads()

    def timed(fn) -> tuple[float, float]:
        """Seconds of ``fn()``, its device work included, and of its engine reads."""
        if cuda:
            torch.cuda.synchronize()
        reads.reset()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
        del out
        return s, reads.seconds

    # Warm: each configuration's lanes pinned once, the file's page tables filled.
    for _name, t, ch in configs:
        ckptio.load_state_dict(model, path, threads=t, chunk_size=ch)
        ckptio.load(path, map_location=dev, threads=t, chunk_size=ch)
    rows: dict[str, list[tuple[float, float | None]]] = {}
    ref = []
    for r in range(a.rounds):
        if cuda:
            ref.append(timed(lambda: dst.copy_(host, non_blocking=True))[0])
        for name, t, ch in configs if r % 2 == 0 else configs[::-1]:
            s, _ = _native.memory_copy_floor(path, "map", t or own_threads, ch)
            rows.setdefault(f"CPU copy floor {name}", []).append((s, None))
            rows.setdefault(f"in place       {name}", []).append(
                timed(
                    lambda t=t, ch=ch: ckptio.load_state_dict(model, path, threads=t, chunk_size=ch)
                )
            )
            rows.setdefault(f"ckptio.load    {name}", []).append(
                timed(
                    lambda t=t, ch=ch: ckptio.load(path, map_location=dev, threads=t, chunk_size=ch)
                )
            )
    reads.close()
    h = statistics.median(ref) if ref else None
    print(
        f"# {nbytes / GiB:.1f} GiB bf16, {a.tensors} tensors on {dev}, {path}; "
        f"{a.rounds} rounds alternating; the engine's memory threads: {own_threads}"
    )
    if h:
        print(f"# pinned H2D {nbytes / h / GiB:.2f} GiB/s (median)")
    print(
        f"{'what':<26} {'s':>6} {'GiB/s':>6} {'vs pinned':>9} {'engine alone':>12} "
        f"{'rest (ms)':>9}  rounds (vs pinned)"
    )
    for k, v in rows.items():
        m = statistics.median(s for s, _ in v)
        engine = [(s, e) for s, e in v if e is not None]
        e = statistics.median(x for _, x in engine) if engine else None
        rest = f"{statistics.median(s - x for s, x in engine) * 1e3:9.1f}" if engine else " " * 9
        vs = f"{h / m:9.3f}" if h else " " * 9
        alone = f"{h / e:12.3f}" if h and e else " " * 12
        each = " ".join(f"{h / s:.3f}" for s, _ in v) if h else ""
        print(f"{k:<26} {m:6.3f} {nbytes / GiB / m:6.2f} {vs} {alone} {rest}  {each}".rstrip())
    shutil.rmtree(os.path.dirname(path))


if __name__ == "__main__":
    main()
