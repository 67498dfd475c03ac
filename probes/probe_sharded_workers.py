"""How load_sharded reads its shards against one file (issue 37): the LLM-shaped
state dict (benchlib.llm_state_dict) saved by save_sharded (2 GB shards, as
bench_shapes.py saves it) and loaded by ``ckptio.safetensors.load_sharded``
(the shards read one after another, each by the whole engine, the next file's
tensors made while one is read) against ``load_file`` of the same tensors in
one file; rounds alternated, from /dev/shm and from ``--dir``.

Its first run (H100, stop 53, benches/results/gpu-2026-12-07-s53/probe.log)
set the shards read side by side, the engine's threads split among them (as
load_sharded read them then), against one by one: 151.5 ms against 116.8 from
/dev/shm (load_file 126.2), 2255 against 2233 from the disk; load_sharded has
read them one by one since.

usage: PYTHONPATH=python python probes/probe_sharded_workers.py [--size 4G]
       [--device cuda] [--rounds 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import ckptio
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("4G"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    sd = benchlib.llm_state_dict(a.size, a.device)
    nbytes = sum(t.nbytes for t in sd.values())
    print(f"# {len(sd)} tensors, {nbytes / 2**30:.2f} GiB, {a.device}, {a.rounds} rounds")

    def sync() -> None:
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()

    for place in ("/dev/shm", a.dir):
        folder = tempfile.mkdtemp(dir=place)
        sharded = os.path.join(folder, "sharded")
        single = os.path.join(folder, "model.safetensors")
        ckptio.safetensors.save_sharded(sd, sharded, max_shard_size="2GB")
        ckptio.safetensors.save_file(sd, single)
        shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
        sizes = [os.path.getsize(os.path.join(sharded, f)) / 2**30 for f in shards]
        print(f"## {place}: shards of {', '.join(f'{s:.2f}' for s in sizes)} GiB")
        rows = {"load_sharded": (sharded, True), "load_file (one file)": (single, False)}
        times: dict[str, list[float]] = {k: [] for k in rows}
        for r in range(a.rounds + 1):
            order = list(rows) if r % 2 else list(reversed(rows))
            for name in order:
                path, is_sharded = rows[name]
                sync()
                t0 = time.perf_counter()
                if is_sharded:
                    out = ckptio.safetensors.load_sharded(path, device=a.device)
                else:
                    out = ckptio.safetensors.load_file(path, device=a.device)
                sync()
                dt = time.perf_counter() - t0
                assert len(out) == len(sd)
                del out
                if r:  # the first round warms up
                    times[name].append(dt)
        base = statistics.median(times["load_file (one file)"])
        for name, ts in times.items():
            m = statistics.median(ts)
            print(
                f"{name:32s} {m * 1e3:8.1f} ms {nbytes / m / 2**30:6.1f} GiB/s "
                f"{base / m:5.2f}x load_file  (rounds: {', '.join(f'{t * 1e3:.0f}' for t in ts)})"
            )
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
