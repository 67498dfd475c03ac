"""DCP loads and saves of many items round by round, and what the cyclic
garbage collector costs them (issue 37): torch's ``dcp.load`` of the
LLM-shaped state dict (benchlib.llm_state_dict, 1,995 items) with ckptio's
FileSystemReader into the same existing tensors.
``--mode switch``: ``--loads`` loads with the collector on, then off, twice,
alternated; each load's time printed. A full collection walks every tracked
object of the process; torch's planner allocates enough per item to set one
off every few loads. ``--mode planners``: the collector left as it is,
``--loads`` loads with torch's planner, then with ``ckptio.dcp.DefaultLoadPlanner``:
the median, mean, min and max of each (a full collection where it lands in a
load shows in the mean and max, not the median); run two builds alternated
for an A/B. ``--mode saves``: ``--loads`` ``dcp.save`` calls of the same state
dict with ckptio's writer, each into a new folder (one per step, as trainers
keep them), the same four figures.

usage: PYTHONPATH=python python probes/probe_dcp_gc.py [--size 64M] [--loads 5]
       [--mode switch|planners|saves]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import ckptio.dcp
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("64M"))
    p.add_argument("--loads", type=int, default=5)
    p.add_argument("--mode", choices=("switch", "planners", "saves"), default="switch")
    a = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sd = benchlib.llm_state_dict(a.size, "cpu")
    folder = tempfile.mkdtemp(dir="/dev/shm")
    try:
        dcp.save(sd, storage_writer=FileSystemWriter(folder), no_dist=True)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        print(
            f"# {len(sd)} items, {len(gc.get_objects())} objects tracked, torch {torch.__version__}"
        )

        def loads(planner: type | None) -> list[float]:
            ms = []
            for _ in range(a.loads):
                t0 = time.perf_counter()
                dcp.load(
                    dest,
                    storage_reader=FileSystemReader(folder),
                    planner=planner() if planner else None,
                    no_dist=True,
                )
                ms.append((time.perf_counter() - t0) * 1e3)
            return ms

        def saves() -> list[float]:
            ms = []
            for i in range(a.loads):
                where = os.path.join(folder, f"step{i}")
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=FileSystemWriter(where), no_dist=True)
                ms.append((time.perf_counter() - t0) * 1e3)
                shutil.rmtree(where)
            return ms

        if a.mode != "switch":
            ckptio_planner = ckptio.dcp.DefaultLoadPlanner
            runs = {
                "planners": [
                    ("torch planner", lambda: loads(None)),
                    ("ckptio planner", lambda: loads(ckptio_planner)),
                ],
                "saves": [("dcp.save", saves)],
            }[a.mode]
            for label, run in runs:
                ms = run()
                med, mean = statistics.median(ms), statistics.mean(ms)
                print(
                    f"{label:16s} median {med:6.1f} mean {mean:6.1f}"
                    f" min {min(ms):6.1f} max {max(ms):6.1f} ms"
                )
            return
        for label in ("collector on", "collector off") * 2:
            if label == "collector off":
                gc.disable()
            try:
                ms = loads(None)
            finally:
                gc.enable()
            print(f"{label:14s} dcp.load ms: {', '.join(f'{m:.0f}' for m in ms)}")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
