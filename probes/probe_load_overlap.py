"""Whether making the tensors during the read helps ``ckptio.load`` of many
tensors (issue 37): the LLM-shaped state dict (benchlib.llm_state_dict, 1,995
bf16 tensors) from /dev/shm to ``--device``, ``ckptio.load`` as it is (the
engine reads on a kept thread while the calling thread makes the tensors,
``transfer.read_while``) against the same load with the tensors made after the
read (no thread), and with the interpreter's switch interval at 0.5 ms during
the load (the read's thread waits less for the GIL the tensors' making holds),
beside the engine's raw read of the same records; rounds alternated, medians.

usage: PYTHONPATH=python python probes/probe_load_overlap.py [--size 4G]
       [--device cuda] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import ckptio
import torch
from ckptio.io import transfer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from bench_shapes import raw_engine_read  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402

_read_while = transfer.read_while


def _read_then_make(
    source: Any, engine: Any, segments: Any, owners: Any, meanwhile: Any, *, verify: bool = False
) -> Any:
    stats = transfer.read(source, engine, segments, owners, verify=verify)
    return stats, meanwhile()


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
    del sd
    flat = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, device=dev)

    def load() -> Any:
        return ckptio.load(path, map_location=dev)

    def after() -> Any:
        transfer.read_while = _read_then_make  # type: ignore[assignment]
        try:
            return load()
        finally:
            transfer.read_while = _read_while

    def switch() -> Any:
        was = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        try:
            return load()
        finally:
            sys.setswitchinterval(was)

    rows = {
        "raw read (engine)": raw_engine_read(path, flat),
        "ckptio.load (tensors during the read)": load,
        "ckptio.load (tensors after the read)": after,
        "ckptio.load (switch interval 0.5 ms)": switch,
    }

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(a.rounds + 1):
        for name in rows if r % 2 else reversed(rows):
            sync()
            t0 = time.perf_counter()
            got = rows[name]()
            sync()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
            del got
    raw = statistics.median(times["raw read (engine)"])
    print(f"# {os.path.getsize(path) / 2**30:.2f} GiB file, {dev}, {a.rounds} rounds (medians)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(
            f"{name:40s} {m * 1e3:7.1f} ms {nbytes / m / 2**30:5.1f} GiB/s {raw / m:.2f}x raw"
            f"  (rounds: {', '.join(f'{t * 1e3:.0f}' for t in ts)})"
        )
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
