"""Loads of one file from /dev/shm back to back against loads after a pause:
what the previous load's mapping costs the next one. Each row times a load
(in place, 1 GiB, CPU) that follows another load of the same file after the
given gap; "flush" waits for the previous mapping to be released first.

Usage: python probes/probe_back_to_back.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ckptio
import torch
from ckptio import _native


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    folder = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(folder, "m.pt")
    ckptio.save({f"l{i}": torch.randn(4 * 2**20) for i in range(64)}, path)
    out = {f"l{i}": torch.empty(4 * 2**20) for i in range(64)}
    ckptio.load(path, out=out)
    gaps = {
        "0": lambda: None,
        "sleep 5ms": lambda: time.sleep(0.005),
        "sleep 50ms": lambda: time.sleep(0.05),
        "flush": _native.host_memory,  # releases kept mappings, waits for unmaps
        "flush+sleep50": lambda: (_native.host_memory(), time.sleep(0.05)),
    }
    res: dict[str, list[float]] = {k: [] for k in gaps}
    for _ in range(a.rounds):
        for k, gap in gaps.items():
            ckptio.load(path, out=out)
            gap()
            t0 = time.perf_counter()
            ckptio.load(path, out=out)
            res[k].append(time.perf_counter() - t0)
    for k, v in res.items():
        v = sorted(v)
        print(f"{k:<16} median {v[len(v) // 2]:.3f} s  range {v[0]:.3f}-{v[-1]:.3f}")
    os.remove(path)
    os.rmdir(folder)


if __name__ == "__main__":
    main()
