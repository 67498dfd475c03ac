"""Which memory chunk loads from /dev/shm to CUDA fastest?

The memory path copies a file's page cache into pinned slots (two per
thread, a chunk each) that the GPU then reads. Its default chunk is 4 MiB
(16 threads: 128 MiB of slots); the H200 membench found 16 MiB chunks 0.66-0.75x
as fast for the CPU copy alone. Smaller slots may stay in the last-level cache
between the CPU's write and the DMA's read, sparing the memory bus a pass per
byte. For each chunk (``chunk_size=``, which sets the memory chunk too), in
alternating order per round: the CPU copy floor (no GPU), ``ckptio.load`` into
new CUDA tensors, and ``ckptio.load_state_dict`` in place, each as a ratio to the
pinned host-to-device copy of the same bytes.

Usage: python probes/probe_memory_chunk.py [--size 8] [--tensors 512] [--rounds 3]
       [--chunks 512K,1M,2M,4M]
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
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--tensors", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunks", default="512K,1M,2M,4M")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    path, model, nbytes = benchlib.shm_checkpoint(a.size, a.tensors, dev)

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        del out
        return time.perf_counter() - t0

    h2d = 0.0
    if cuda:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        h2d = min(timed(lambda: dst.copy_(host, non_blocking=True)) for _ in range(3))
        del host, dst
        print(f"pinned H2D copy {nbytes / GiB / h2d:.2f} GiB/s", flush=True)
    threads = _engine(None, None, None).memory_threads  # the memory path's own
    chunks = [_size(c) for c in a.chunks.split(",")]
    ckptio.load(path, map_location=dev)  # page tables and lanes warm
    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(a.rounds):
        for c in chunks if rnd % 2 == 0 else chunks[::-1]:
            s, _ = _native.memory_copy_floor(path, "map", threads, c)
            times.setdefault(("CPU copy floor", c), []).append(s)
            times.setdefault(("ckptio.load", c), []).append(
                timed(lambda c=c: ckptio.load(path, map_location=dev, chunk_size=c))
            )
            times.setdefault(("load_state_dict in place", c), []).append(
                timed(lambda c=c: ckptio.load_state_dict(model, path, chunk_size=c))
            )
    for (what, c), ts in times.items():
        s = statistics.median(ts)
        ratio = f"  {h2d / s:.2f}x pinned" if h2d else ""
        print(f"{what:<26} {c >> 10:>6} KiB  {nbytes / GiB / s:6.2f} GiB/s{ratio}", flush=True)
    shutil.rmtree(os.path.dirname(path))


if __name__ == "__main__":
    main()
