"""Loads of many tensors from /dev/shm, where the time per tensor outside the
bytes shows (issue 37): ckptio.load of a torch.save file against
ckptio.safetensors.load_file of the same tensors, torch.load and safetensors'
load_file, in interleaved rounds, medians in ms and us per tensor.

Shapes: 20,000 x 4 KiB float32, 2,000 x 64 KiB, and the LLM shape (1,995 bf16
tensors, ``--llm`` bytes); each saved by torch.save and by safetensors.

usage: PYTHONPATH=python python probes/probe_many_load.py [--device cuda]
       [--rounds 5] [--llm 1G] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ckptio
import ckptio.safetensors
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--llm", type=parse_size, default=parse_size("1G"))
    p.add_argument("--dir", default="/dev/shm")
    a = p.parse_args()
    dev = a.device
    try:
        import safetensors.torch as st
    except ImportError:
        st = None
    shapes: dict[str, dict[str, torch.Tensor]] = {
        "20000 x 4 KiB": {f"layers.{i}.w": torch.randn(1024) for i in range(20000)},
        "2000 x 64 KiB": {f"layers.{i}.w": torch.randn(16384) for i in range(2000)},
        "LLM shape": benchlib.llm_state_dict(a.llm, "cpu"),
    }
    folder = tempfile.mkdtemp(dir=a.dir)

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    pt = os.path.join(folder, "m.pt")
    sf = os.path.join(folder, "m.safetensors")
    try:
        print(f"# {dev}, {a.dir}, {a.rounds} interleaved rounds, medians")
        for name, sd in shapes.items():
            torch.save(sd, pt)
            ckptio.safetensors.save_file(sd, sf)
            n = len(sd)
            calls: dict[str, Callable[[], Any]] = {
                "ckptio.load": lambda: ckptio.load(pt, map_location=dev),
                "ckptio.safetensors.load_file": lambda: ckptio.safetensors.load_file(sf, dev),
                "torch.load(mmap=True)": lambda: torch.load(pt, map_location=dev, mmap=True),
            }
            if st is not None:
                calls["safetensors load_file"] = lambda: st.load_file(sf, device=dev)
            times: dict[str, list[float]] = {k: [] for k in calls}
            for f in calls.values():
                f()  # warm: the page cache is /dev/shm's; allocator caches
            for _ in range(a.rounds):
                for k, f in calls.items():
                    sync()
                    t = time.perf_counter()
                    out = f()
                    sync()
                    times[k].append(time.perf_counter() - t)
                    del out
            base = statistics.median(times["ckptio.safetensors.load_file"])
            print(f"## {name}: {n} tensors, {sum(t.nbytes for t in sd.values()) / 2**20:.0f} MiB")
            for k, ts in times.items():
                m = statistics.median(ts)
                print(
                    f"{k:32s} {m * 1e3:8.2f} ms  {m / n * 1e6:6.2f} us/tensor  "
                    f"x load_file {base / m:5.2f}"
                )
            os.remove(pt)
            os.remove(sf)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
