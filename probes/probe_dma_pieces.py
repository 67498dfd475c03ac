"""Does the size of each host-to-device copy cap the memory path?

The memory path copies a file into pinned 4 MiB slots and queues one
host-to-device copy per slot; its read runs at 0.87-0.92x one large pinned
copy on every H200 host, whatever the host's CPU copy floor. This times the
DMA alone: 8 GiB from a pinned buffer (1 GiB, reused) to the GPU in pieces of
1-64 MiB, queued by 1 or 16 threads each on a stream of its own (as the
lanes queue them), with no CPU copy, against one copy per GiB. Rounds
alternate; medians, as ratios to the one-copy time.

Usage: python probes/probe_dma_pieces.py [--size 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402

GiB = 2**30
MiB = 2**20
cu = benchlib.libcuda()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    n = int(a.size * GiB) // GiB * GiB
    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def pieces(piece: int, threads: int) -> float:
        base, dbase = src.data_ptr(), dst.data_ptr()

        def one(o: int, st) -> None:
            benchlib.cuda_check(
                cu.cuMemcpyHtoDAsync_v2(dbase + o, base + o % GiB, piece, st), "cuMemcpyHtoDAsync"
            )

        return benchlib.on_streams(threads, list(range(0, n, piece)), one)

    cases = [(pc * MiB, t) for t in (16, 1) for pc in (1, 2, 4, 8, 16, 64)]
    times: dict = {c: [] for c in cases}
    ref: list[float] = []
    benchlib.h2d_seconds(dst, src)
    for r in range(a.rounds):
        ref.append(benchlib.h2d_seconds(dst, src))
        for c in cases if r % 2 == 0 else cases[::-1]:
            times[c].append(pieces(*c))
    h = statistics.median(ref)
    print(f"# {n / GiB:.0f} GiB pinned -> GPU: one copy per GiB {n / h / GiB:.2f} GiB/s (median)")
    print("piece MiB  threads  GiB/s  vs one copy  rounds")
    for (pc, t), ts in times.items():
        m = statistics.median(ts)
        each = " ".join(f"{h / x:.3f}" for x in ts)
        print(f"{pc // MiB:9d} {t:8d} {n / m / GiB:6.2f} {h / m:11.3f}  {each}")


if __name__ == "__main__":
    main()
