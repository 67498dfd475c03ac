"""Where an in-place load of the LLM shape spends its time outside the read
(issue 37): ckptio.load(out=) and ckptio.load_state_dict of the 4 GiB LLM-shaped
state dict (benchlib.llm_state_dict) from /dev/shm into existing tensors, each
beside the engine's raw read of the same records (bench_shapes.raw_engine_read)
in the same rounds, then the steps of load(out=) timed without a profiler (open
the archive and its pickle, pair with out, plan, read), then the top of a
cProfile of one load of each.

usage: PYTHONPATH=python python probes/probe_inplace_llm.py [--size 4G]
       [--device cuda] [--rounds 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import ckptio
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from bench_shapes import raw_engine_read  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("4G"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    dev = a.device
    sd = benchlib.llm_state_dict(a.size, dev)
    nbytes = sum(t.nbytes for t in sd.values())
    folder = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(folder, "model.pt")
    ckptio.save(sd, path)
    dests = {k: torch.empty_like(v) for k, v in sd.items()}
    module = benchlib.module_of({k: list(v.shape) for k, v in sd.items()}, torch.bfloat16, dev)
    flat = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, device=dev)
    rows = {
        "raw read (engine)": raw_engine_read(path, flat),
        "ckptio.load(out=)": lambda: ckptio.load(path, out=dests),
        "ckptio.load_state_dict": lambda: ckptio.load_state_dict(module, path),
        "ckptio.load": lambda: ckptio.load(path, map_location=dev),
    }

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(a.rounds):
        for name in rows if r % 2 == 0 else reversed(rows):
            sync()
            t0 = time.perf_counter()
            got = rows[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
            del got
    raw = statistics.median(times["raw read (engine)"])
    print(f"# {len(sd)} tensors, {nbytes / 2**30:.2f} GiB, {dev}, {a.rounds} rounds (medians)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:28s} {m * 1e3:7.1f} ms  {nbytes / m / 2**30:5.1f} GiB/s  {raw / m:.2f}x raw")
    steps = split_steps(path, dests, sync, a.rounds)
    print("\n## load(out=) by step, no profiler (medians)")
    for name, ts in steps.items():
        print(f"{name:28s} {statistics.median(ts) * 1e3:7.1f} ms")
    for name in ("ckptio.load(out=)", "ckptio.load_state_dict"):
        prof = cProfile.Profile()
        sync()
        prof.enable()
        rows[name]()
        sync()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        print(f"\n## cProfile of {name}")
        print("\n".join(s.getvalue().splitlines()[4:32]))
    os.unlink(path)
    os.rmdir(folder)


def split_steps(path: str, dests: dict, sync, rounds: int) -> dict[str, list[float]]:
    """The steps of ckptio.load(path, out=dests) (serialization._load_into),
    each timed: open (the archive, its pickle, the placeholders), pair (with
    out), plan (every pair checked and placed), read (the engine's reads)."""
    from ckptio.formats import torchzip
    from ckptio.io import memory
    from ckptio.io.engines import IoOptions
    from ckptio.loading import inplace

    io_ = IoOptions()
    steps: dict[str, list[float]] = {k: [] for k in ("open", "pair", "plan", "read", "all")}
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        with memory.gc_paused():
            src, mapped = torchzip.open_torch(path, lazy=True)
            t1 = time.perf_counter()
            _, pairs, _, _ = inplace.pair_structure(src, dests)
            t2 = time.perf_counter()
            plan = inplace.plan(pairs, [mapped])
            t3 = time.perf_counter()
            inplace.execute(plan, io_)
            sync()
            t4 = time.perf_counter()
        for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
            steps[k].append(v)
        del src, mapped, pairs, plan
    return steps


if __name__ == "__main__":
    main()
