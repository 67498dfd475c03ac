"""dcp.load round by round (issue 37): torch's ``dcp.load`` of the LLM-shaped
state dict (benchlib.llm_state_dict, 1,995 items) with ckptio's
FileSystemReader into the same existing tensors, ``--loads`` loads with
torch's planner, then as many with ``ckptio.dcp.DefaultLoadPlanner``; the
median, mean, min and max of each. The mean and max show what a full
collection of the cyclic garbage collector costs where it lands in a load
(the median hides it); run two builds alternated for an A/B.

usage: PYTHONPATH=python python probes/probe_dcp_load_rounds.py [--size 64M] [--loads 15]
"""

from __future__ import annotations

import argparse
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("64M"))
    p.add_argument("--loads", type=int, default=15)
    p.add_argument("--dir", default="/dev/shm")
    a = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sd = benchlib.llm_state_dict(a.size, "cpu")
    folder = tempfile.mkdtemp(dir=a.dir)
    try:
        path = os.path.join(folder, "dcp")
        dcp.save(sd, storage_writer=ckptio.dcp.FileSystemWriter(path), no_dist=True)
        dests = {k: torch.empty_like(v) for k, v in sd.items()}
        print(f"# {len(dests)} items, torch {torch.__version__}, {a.loads} loads each")
        for name, planner in (("torch planner", None), ("ckptio planner", True)):
            ms = []
            for _ in range(a.loads):
                t0 = time.perf_counter()
                dcp.load(
                    dests,
                    storage_reader=ckptio.dcp.FileSystemReader(path),
                    planner=ckptio.dcp.DefaultLoadPlanner() if planner else None,
                    no_dist=True,
                )
                ms.append((time.perf_counter() - t0) * 1e3)
            print(
                f"{name:16s} median {statistics.median(ms):6.1f} mean {statistics.mean(ms):6.1f}"
                f" min {min(ms):6.1f} max {max(ms):6.1f} ms"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
