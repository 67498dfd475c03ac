"""Where ckptio.load and dcp.load (ckptio's reader) of the LLM shape spend the
time that is not the engine's read (issue 37): each step of both, timed alone
without a profiler, as the loaders run them, beside the engine's raw read of
the same records; then (``--profile``) a cProfile of the DCP reader's read_data.

ckptio.load (serialization._load_archive): open the archive, read its pickle
natively, reserve and allocate the storages, read while the tensors are made.
dcp.load: the ``.metadata`` (read, C unpickling, the allow-list's restore
walk, the checks), torch's planner (and ckptio's), read_data.

usage: PYTHONPATH=python python probes/probe_llm_setup.py [--size 4G]
       [--device cuda] [--rounds 5] [--dir /dev/shm] [--profile] [--small-item 0]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import ckptio
import ckptio.dcp
import torch
import torch.distributed.checkpoint as dcp
from ckptio.formats import dcp as fmt
from ckptio.formats import torchzip
from ckptio.io import devices, memory, transfer
from ckptio.io.engines import IoOptions
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from bench_shapes import raw_engine_read  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402

# ckptio's planner; None in builds before it (the A/B runs' older side).
FAST_PLANNER = getattr(ckptio.dcp, "DefaultLoadPlanner", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("4G"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--profile", action="store_true", help="and a cProfile of read_data")
    p.add_argument(
        "--small-item",
        type=int,
        default=None,
        help="the DCP reader's small-item bound (formats.dcp.SMALL_ITEM) for this run",
    )
    a = p.parse_args()
    if a.small_item is not None:
        fmt.SMALL_ITEM = a.small_item
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dev = a.device
    sd = benchlib.llm_state_dict(a.size, dev)
    nbytes = sum(t.nbytes for t in sd.values())
    folder = tempfile.mkdtemp(dir=a.dir)
    try:
        pt = os.path.join(folder, "model.pt")
        ckptio.save(sd, pt)
        dcp_dir = os.path.join(folder, "dcp")
        dcp.save(sd, storage_writer=ckptio.dcp.FileSystemWriter(dcp_dir), no_dist=True)
        dests = {k: torch.empty_like(v) for k, v in sd.items()}
        del sd
        flat = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, device=dev)
        raw = raw_engine_read(pt, flat)

        def sync() -> None:
            if dev.startswith("cuda"):
                torch.cuda.synchronize()

        steps: dict[str, list[float]] = {}

        def timed(name: str, fn: Callable[[], Any]) -> Any:
            sync()
            t0 = time.perf_counter()
            got = fn()
            sync()
            steps.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
            return got

        size = f"{nbytes / 2**30:.2f} GiB"
        print(f"# {len(dests)} tensors, {size}, {dev}, {a.dir}, {a.rounds} rounds")
        for _ in range(a.rounds):
            timed("raw read (engine)", raw)
            got = timed("ckptio.load", lambda: ckptio.load(pt, map_location=dev))
            del got
            load_steps(pt, dev, timed)
            timed("dcp.load (ckptio reader)", lambda: dcp_load(dcp_dir, dests))
            if FAST_PLANNER is not None:  # absent from builds before it (A/B runs)
                timed(
                    "dcp.load (ckptio reader, planner)",
                    lambda: dcp_load(dcp_dir, dests, FAST_PLANNER()),
                )
            dcp_steps(dcp_dir, dests, timed)
        for name, ms in steps.items():
            print(f"{name:36s} {statistics.median(ms):8.2f} ms  (min {min(ms):.2f})")
        if not a.profile:
            return
        planner = DefaultLoadPlanner()
        reader = ckptio.dcp.FileSystemReader(dcp_dir)
        md = reader.read_metadata()
        planner.set_up_planner(dests, md, True)
        local = reader.prepare_local_plan(planner.create_local_plan())
        reader.set_up_storage_reader(md, True)
        prof = cProfile.Profile()
        sync()
        prof.enable()
        reader.read_data(local, planner).wait()
        sync()
        prof.disable()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats_of(prof, s).sort_stats(key).print_stats(22)
            print(f"\n## cProfile of read_data, by {key}")
            print("\n".join(s.getvalue().splitlines()[4:34]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def pstats_of(prof: cProfile.Profile, stream: io.StringIO) -> Any:
    import pstats

    return pstats.Stats(prof, stream=stream)


def dcp_load(folder: str, dests: dict[str, torch.Tensor], planner: Any = None) -> None:
    reader = ckptio.dcp.FileSystemReader(folder)
    dcp.load(dests, storage_reader=reader, planner=planner, no_dist=True)


def load_steps(pt: str, dev: str, timed: Callable[[str, Callable[[], Any]], Any]) -> None:
    """The steps of ckptio.load(pt, map_location=dev) (serialization._load_archive)."""
    io_ = IoOptions()
    with memory.gc_paused():
        archive = timed(
            "  load: open_archive", lambda: torchzip.open_archive(pt, io_.direct, io_.backend)
        )
        timed("  load: byteorder", lambda: torchzip.native_byteorder(archive))
        parsed, found = timed("  load: native_pickle", lambda: torchzip.native_pickle(archive))
        sizes = [f[1] for f in found]
        target = timed(
            "  load: fill_device", lambda: devices.fill_device(torch.device(dev), found[0][3])
        )
        if target.type == "cuda":
            timed("  load: reserve_cuda", lambda: memory.reserve_cuda(target, sizes))

        def alloc() -> list[torch.UntypedStorage]:
            return [memory.empty_storage(n, target, off % memory.PAGE) for off, n, _, _ in found]

        storages = timed("  load: allocate storages", alloc)
        segs = [
            (off, st.data_ptr(), n, -1 if target.type == "cpu" else (target.index or 0))
            for (off, n, _, _), st in zip(found, storages, strict=True)
            if n
        ]
        dtypes = [f[2] for f in found]
        timed(
            "  load: read (no tensors made)",
            lambda: transfer.read(archive.reader, io_.engine(), segs, storages),
        )
        timed(
            "  load: tensors made (rebuild)",
            lambda: torchzip.rebuild(parsed, storages, dtypes, pt),
        )


def dcp_steps(
    folder: str, dests: dict[str, torch.Tensor], timed: Callable[[str, Callable[[], Any]], Any]
) -> None:
    """The steps of dcp.load with ckptio's reader."""
    path = os.path.join(folder, ".metadata")
    raw = timed("  dcp: .metadata read", lambda: open(path, "rb").read())
    timed("  dcp: .metadata pickle.loads", lambda: pickle.loads(raw))
    timed("  dcp: .metadata allow-listed", lambda: fmt._unpickle(raw, path, False))
    md = timed("  dcp: .metadata parse+check", lambda: fmt.parse_metadata(raw, path))
    reader = ckptio.dcp.FileSystemReader(folder)
    md = timed("  dcp: reader.read_metadata", reader.read_metadata)
    planner = DefaultLoadPlanner()

    def plan(planner: DefaultLoadPlanner) -> Any:
        planner.set_up_planner(dests, md, True)
        return planner.create_local_plan()

    if FAST_PLANNER is not None:
        timed("  dcp: ckptio planner", lambda: plan(FAST_PLANNER()))
    local = timed("  dcp: torch planner", lambda: plan(planner))
    reader.set_up_storage_reader(md, True)
    local = reader.prepare_local_plan(local)
    timed("  dcp: read_data", lambda: reader.read_data(local, planner).wait())


if __name__ == "__main__":
    main()
