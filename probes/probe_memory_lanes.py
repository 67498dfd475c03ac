"""Which memory threads and memory chunk load from /dev/shm to CUDA fastest?

Two measurements behind the question (H200, 2026-12-02): the DMA alone of 8
GiB from pinned memory in 4 MiB copies runs at 0.96x one large copy, in 8 MiB
copies at 0.98x (``probe_dma_pieces.py``); and the engine's read of a raw 8 GiB
file from /dev/shm ran at 0.92x the pinned copy with 16 threads of 4 MiB slots
(the defaults), 0.94x with 8 or 12 threads of 8 MiB, 0.86x with 16 of 8 MiB
(``probe_zero_copy_hybrid.py --shares 0``, retired: in a8ed46e). This times, in
alternating order per round and in one process, ``ckptio.load_state_dict`` in place and
``ckptio.load(map_location="cuda")`` of an 8 GiB bf16 checkpoint (512 tensors)
in /dev/shm for each (threads, chunk) configuration, with each load's engine
read alone, as ratios to the pinned copy of the same bytes.

Usage: python probes/probe_memory_lanes.py [--size 8] [--rounds 5]
       [--configs 16x4M,12x8M,8x8M,12x4M]
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
from ckptio.io.units import parse_size as _size

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--tensors", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--configs", default="16x4M,12x8M,8x8M,12x4M")
    a = p.parse_args()
    path, model, nbytes = benchlib.shm_checkpoint(a.size, a.tensors, "cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    configs = []
    for c in a.configs.split(","):
        t, ch = c.split("x")
        configs.append((c, int(t), _size(ch)))
    reads = benchlib.EngineReads()

    def timed(fn) -> tuple[float, float]:
        torch.cuda.synchronize()
        reads.reset()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        del out
        return s, reads.seconds

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)

    rows: dict[str, list[tuple[float, float]]] = {}
    for _name, t, ch in configs:  # warm: each configuration's lanes pinned once
        ckptio.load_state_dict(model, path, threads=t, chunk_size=ch)
        ckptio.load(path, map_location="cuda", threads=t, chunk_size=ch)
    ref = []
    for r in range(a.rounds):
        ref.append(timed(h2d)[0])
        for name, t, ch in configs if r % 2 == 0 else configs[::-1]:
            rows.setdefault(f"in place   {name}", []).append(
                timed(
                    lambda t=t, ch=ch: ckptio.load_state_dict(model, path, threads=t, chunk_size=ch)
                )
            )
            rows.setdefault(f"ckptio.load {name}", []).append(
                timed(
                    lambda t=t, ch=ch: ckptio.load(
                        path, map_location="cuda", threads=t, chunk_size=ch
                    )
                )
            )
    reads.close()
    h = statistics.median(ref)
    print(
        f"# {nbytes / GiB:.1f} GiB bf16, {a.tensors} tensors, {path}; {a.rounds} rounds alternating"
    )
    print(f"# pinned H2D {nbytes / h / GiB:.2f} GiB/s (median)")
    print("what                    s      vs pinned  engine alone  rest (ms)  rounds (vs pinned)")
    for k, v in rows.items():
        m = statistics.median(s for s, _ in v)
        e = statistics.median(x for _, x in v)
        rest = statistics.median(s - x for s, x in v) * 1e3
        each = " ".join(f"{h / s:.3f}" for s, _ in v)
        print(f"{k:20s} {m:6.3f} {h / m:9.3f} {h / e:12.3f} {rest:10.1f}  {each}")
    shutil.rmtree(os.path.dirname(path))


if __name__ == "__main__":
    main()
