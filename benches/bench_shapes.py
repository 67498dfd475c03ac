"""Real checkpoint shapes at the memory limit (issue 37): every loader of ckptio
and the strongest peers on an LLM-shaped and an even state dict, from /dev/shm
and from the page cache, each as a ratio to limits measured in the same run.

    python benches/bench_shapes.py --device cuda [--llm 4G] [--even 8G] [--rounds 2]
    python benches/bench_shapes.py --device cpu --llm 256M --even 256M   # a smoke test

Shapes (benches/benchlib.py): ``llm`` (1,995 bf16 tensors: two vocab x hidden
embeddings, 166 layers of q/k/v/o and gate/up/down matrices, 1-D norms and
biases of 512 B to 2 KiB) and ``even`` (512 equal bf16 tensors).

Per shape, the state dict is saved once in each format (ckptio.save's torch
zip, a safetensors file, a sharded safetensors folder, a DCP folder through
ckptio's writer) into a folder of /dev/shm; the rows run there, then on a
buffered copy of the folder on the disk under ``--dir`` (every page in the
page cache, fincore checks); with ``--places ...,cold``, cold from that disk
copy too (one round, the page cache dropped before each row, against a raw
O_DIRECT read). Each round runs every row once, in turn; rows keep their
median. Rows:

- limits: ``pinned copy`` (host-to-device copy of the same bytes from pinned
  memory, CUDA only) and ``raw read``: the bytes of the same file read by a
  raw parallel reader into one destination buffer (KvikIO's POSIX path with
  as many threads as cores on CUDA, when importable; ckptio's engine reading
  every record into one buffer, no Python per tensor, always). On CUDA also
  ``host copy floor``: the engine's read of the same records into pinned host
  memory, the CPU half of a read from memory without its host-to-device half
  (a floor under the pinned-copy target, not a row the ratios divide by).
- ckptio: ``load`` (torch zip), ``load(out=)`` and ``load_state_dict`` in
  place, ``safetensors.load_file``, ``load_sharded``, ``dcp.load`` with
  ckptio's reader (in place, as DCP loads).
- peers (first round only where slow): torch.load, safetensors.load_file,
  InstantTensor (default backend; its BUFFERED policy from the page cache),
  fastsafetensors (no GDS; O_DIRECT on and off), torch's DCP reader.

``--profile`` splits ckptio.load into the engine's read and the rest (the
per-tensor Python: unpickling, allocation, building tensors) and prints the
top of a cProfile of one load.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import mmap
import os
import pstats
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

CORES = os.cpu_count() or 1
# KvikIO reads its settings at import: its POSIX path, a thread per core.
os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
os.environ.setdefault("KVIKIO_NTHREADS", str(min(CORES, 16)))

import benchlib  # noqa: E402
import ckptio  # noqa: E402
import ckptio.dcp  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from ckptio import _native  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402
from ckptio.tools.bench import cold_read, drop_cache  # noqa: E402

GiB = 2**30
SLOW = {"torch.load", "safetensors.load_file", "torch dcp.load"}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fincore(path: str) -> int | None:
    """Bytes of the files under ``path`` in the page cache, None where unknown."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    try:
        r = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
            capture_output=True,
            text=True,
            check=True,
        )
        return sum(int(x) for x in r.stdout.split())
    except (OSError, subprocess.CalledProcessError, ValueError):
        return None


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_all(sd: dict[str, torch.Tensor], folder: str) -> dict[str, str]:
    """Each format of ``sd`` in ``folder``: {format: path}."""
    p = {
        "pt": os.path.join(folder, "model.pt"),
        "st": os.path.join(folder, "model.safetensors"),
        "sharded": os.path.join(folder, "sharded"),
        "dcp": os.path.join(folder, "dcp"),
    }
    ckptio.save(sd, p["pt"])
    ckptio.safetensors.save_file(sd, p["st"])
    ckptio.safetensors.save_sharded(sd, p["sharded"], max_shard_size="2GB")
    dcp.save(sd, storage_writer=ckptio.dcp.FileSystemWriter(p["dcp"]), no_dist=True)
    return p


def raw_engine_read(path: str, dest: torch.Tensor) -> Callable[[], Any]:
    """Every data record of the torch zip ``path`` read by the engine into one
    buffer, back to back, in one call: the engine's limit, no Python per tensor."""
    reader = _native.Reader(path)
    dev = -1 if dest.device.type == "cpu" else (dest.device.index or 0)
    segs, at = [], dest.data_ptr()
    for name, off, n in reader.records():
        if "/data/" in name and n:
            segs.append((off, at, n, dev))
            at += n
    assert at - dest.data_ptr() <= dest.numel()
    engine = ckptio.io.engines.IoOptions().engine()
    streams = [(dev, torch.cuda.current_stream(dev).cuda_stream)] if dev >= 0 else []
    return lambda: reader.read_segments(engine, segs, [dest], streams)


def kvikio_read(path: str, dest: torch.Tensor) -> Callable[[], Any] | None:
    """KvikIO's raw parallel read of the whole file into GPU memory (None without it)."""
    try:
        import kvikio
    except ImportError:
        return None
    n = os.path.getsize(path)

    def run() -> None:
        f = kvikio.CuFile(path, "r")
        try:
            f.pread(dest[:n], n).get()
        finally:
            f.close()

    return run


def instanttensor_loader(device: str, buffered: bool) -> Callable[[str], Any] | None:
    try:
        from instanttensor import BackendPolicy, safe_open
    except ImportError:
        return None
    kw = {"backend": BackendPolicy.BUFFERED} if buffered else {}
    dev = torch.device(device)
    dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    def load(path: str) -> dict[str, torch.Tensor]:
        with safe_open(path, "pt", device=dev, **kw) as f:
            return dict(f.tensors())

    return load


def rows_for(
    p: dict[str, str], sd: dict[str, torch.Tensor], device: str, place: str, nbytes: int
) -> dict[str, Callable[[], Any]]:
    """The rows of one place: name -> a call that loads (its result is dropped)."""
    rows: dict[str, Callable[[], Any]] = {}
    flat = torch.empty(nbytes + (1 << 20), dtype=torch.uint8, device=device)
    if device.startswith("cuda"):
        pinned = torch.empty(min(nbytes, 1 << 30), dtype=torch.uint8).pin_memory()
        rows["pinned copy"] = lambda: benchlib.h2d_seconds(flat[:nbytes], pinned)
    rows["raw read (engine)"] = raw_engine_read(p["pt"], flat)
    if device.startswith("cuda"):
        # The read's CPU half alone: the same records copied by the engine into
        # pinned host memory (no host-to-device copy). A load from memory needs
        # both copies; this one bounds it where the pinned copy does not.
        host = torch.empty(nbytes + (1 << 20), dtype=torch.uint8).pin_memory()
        rows["host copy floor (engine into pinned)"] = raw_engine_read(p["pt"], host)
    k = kvikio_read(p["st"], flat) if device.startswith("cuda") else None
    if k is not None:
        rows["raw read (KvikIO)"] = k
    dests = {k: torch.empty_like(v) for k, v in sd.items()}
    module = benchlib.module_of({k: list(v.shape) for k, v in sd.items()}, torch.bfloat16, device)
    # Rows alternate between files: a load right after another of the same file
    # would meet the kernel still unmapping it, which users' loads do not.
    rows["ckptio.load"] = lambda: ckptio.load(p["pt"], map_location=device)
    rows["ckptio.safetensors.load_file"] = lambda: ckptio.safetensors.load_file(
        p["st"], device=device
    )
    rows["ckptio.load(out=)"] = lambda: ckptio.load(p["pt"], out=dests)
    rows["ckptio.safetensors.load_sharded"] = lambda: ckptio.safetensors.load_sharded(
        p["sharded"], device=device
    )
    rows["ckptio.load_state_dict"] = lambda: ckptio.load_state_dict(module, p["pt"])
    rows["ckptio dcp.load"] = lambda: dcp.load(
        dests, storage_reader=ckptio.dcp.FileSystemReader(p["dcp"]), no_dist=True
    )
    rows["ckptio dcp.load, ckptio planner"] = lambda: dcp.load(
        dests,
        storage_reader=ckptio.dcp.FileSystemReader(p["dcp"]),
        planner=ckptio.dcp.DefaultLoadPlanner(),
        no_dist=True,
    )
    rows["torch dcp.load"] = lambda: dcp.load(
        dests, storage_reader=dcp.FileSystemReader(p["dcp"]), no_dist=True
    )
    rows["torch.load"] = lambda: torch.load(p["pt"], map_location=device, weights_only=True)
    try:
        import safetensors.torch as st
    except ImportError:
        st = None
    if st is not None:
        rows["safetensors.load_file"] = lambda: st.load_file(p["st"], device=device)
    if device.startswith("cuda"):
        it = instanttensor_loader(device, buffered=False)
        if it is not None:
            rows["InstantTensor"] = lambda: it(p["st"])
            if place == "cache":
                itb = instanttensor_loader(device, buffered=True)
                rows["InstantTensor (BUFFERED)"] = lambda: itb(p["st"])
        for odirect in (True, False):
            fl = benchlib.fastsafetensors_loader(device, True, odirect, copy=True)
            if fl is not None:
                tag = "O_DIRECT" if odirect else "buffered"
                rows[f"fastsafetensors ({tag})"] = lambda fl=fl: fl(p["st"])
    return rows


# Rows whose call returns its own seconds (what it times excludes its set-up).
SELF_TIMED = {"pinned copy", "raw read (O_DIRECT)"}


def cold_rows(p: dict[str, str], device: str, nbytes: int) -> dict[str, Callable[[], Any]]:
    """The rows of a cold read from the disk (each after the page cache of the
    folder is dropped): the raw O_DIRECT read of the torch file (8 threads, 64 MiB
    requests, into a reused page-aligned buffer) as the limit, ckptio's loaders
    and the peers that read a disk directly (InstantTensor's default io_uring
    O_DIRECT backend, fastsafetensors with O_DIRECT)."""
    ring = memoryview(mmap.mmap(-1, 1 << 30))
    size = os.path.getsize(p["pt"]) // 4096 * 4096  # O_DIRECT reads whole blocks
    rows: dict[str, Callable[[], Any]] = {
        "raw read (O_DIRECT)": lambda: cold_read(p["pt"], ring, os.O_DIRECT, 8, 64 << 20, size),
        "ckptio.load": lambda: ckptio.load(p["pt"], map_location=device),
        "ckptio.safetensors.load_file": lambda: ckptio.safetensors.load_file(
            p["st"], device=device
        ),
    }
    if device.startswith("cuda"):
        it = instanttensor_loader(device, buffered=False)
        if it is not None:
            rows["InstantTensor"] = lambda: it(p["st"])
        fl = benchlib.fastsafetensors_loader(device, True, odirect=True, copy=True)
        if fl is not None:
            rows["fastsafetensors (O_DIRECT)"] = lambda: fl(p["st"])
    return rows


def drop_folder(folder: str) -> Callable[[], None]:
    """A call that evicts every file under ``folder`` from the page cache."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]

    def drop() -> None:
        for f in files:
            drop_cache(f)

    return drop


def measure(
    rows: dict[str, Callable[[], Any]],
    device: str,
    rounds: int,
    before: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Median seconds per row over ``rounds`` rounds (slow peers: first round);
    ``before()`` runs before each row, untimed (cold: the page cache dropped)."""
    times: dict[str, list[float]] = {k: [] for k in rows}
    for r in range(rounds):
        names = list(rows) if r % 2 == 0 else list(reversed(rows))
        for name in names:
            if r and name in SLOW:
                continue
            if before is not None:
                before()
            sync(device)
            t0 = time.perf_counter()
            try:
                got = rows[name]()
                sync(device)
            except Exception as e:  # a peer that cannot run here: say why, go on
                print(f"# {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                rows_failed = times.pop(name, None)
                del rows_failed
                continue
            dt = time.perf_counter() - t0
            if name in SELF_TIMED:
                dt = got
            times.setdefault(name, []).append(dt)
            del got
    return {k: statistics.median(v) for k, v in times.items() if v}


def profile(p: dict[str, str], device: str, nbytes: int) -> dict[str, float]:
    """ckptio.load split into the engine's reads and the rest; a cProfile's top."""
    reads = benchlib.EngineReads()
    try:
        sync(device)
        t0 = time.perf_counter()
        got = ckptio.load(p["pt"], map_location=device)
        sync(device)
        total = time.perf_counter() - t0
        del got
        out = {"load_s": total, "engine_read_s": reads.seconds, "outside_s": total - reads.seconds}
    finally:
        reads.close()
    prof = cProfile.Profile()
    prof.enable()
    got = ckptio.load(p["pt"], map_location=device)
    sync(device)
    prof.disable()
    del got
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
    print("\n".join(s.getvalue().splitlines()[:40]), flush=True)
    out.update(profile_dcp(p, device))
    return out


def profile_dcp(p: dict[str, str], device: str) -> dict[str, float]:
    """dcp.load with ckptio's reader split into its steps, each timed alone as
    torch's dcp.load runs them: the reader's ``.metadata``, torch's planner (per
    item: the floor ckptio's reader cannot go under; ckptio's planner beside
    it), the reader's read_data;
    the median of three each."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    dests = ckptio.load(p["pt"], map_location=device)
    parts: dict[str, list[float]] = {}

    def timed(name: str, fn: Any, *args: Any, **kw: Any) -> Any:
        sync(device)
        t0 = time.perf_counter()
        got = fn(*args, **kw)
        sync(device)
        parts.setdefault(name, []).append(time.perf_counter() - t0)
        return got

    def read_data(reader: Any, local: Any, planner: DefaultLoadPlanner) -> None:
        reader.read_data(local, planner).wait()

    def plan(planner: DefaultLoadPlanner, md: Any) -> Any:
        planner.set_up_planner(dests, md, True)
        return planner.create_local_plan()

    for _ in range(3):
        reader = ckptio.dcp.FileSystemReader(p["dcp"])
        timed("dcp_load_s", dcp.load, dests, storage_reader=reader, no_dist=True)
        reader = ckptio.dcp.FileSystemReader(p["dcp"])
        md = timed("dcp_metadata_s", reader.read_metadata)
        planner = DefaultLoadPlanner()
        timed("dcp_ckptio_planner_s", plan, ckptio.dcp.DefaultLoadPlanner(), md)
        local = timed("dcp_torch_planner_s", plan, planner, md)
        reader.set_up_storage_reader(md, True)
        local = reader.prepare_local_plan(local)
        timed("dcp_read_data_s", read_data, reader, local, planner)
    return {k: statistics.median(v) for k, v in parts.items()}


# Issue 37's targets: every ckptio loader >= 0.85x the pinned copy and >= 0.95x the
# raw read of the same file; the torch format >= 0.95x safetensors.
LOADERS = (
    "ckptio.load",
    "ckptio.load(out=)",
    "ckptio.load_state_dict",
    "ckptio.safetensors.load_file",
    "ckptio.safetensors.load_sharded",
    "ckptio dcp.load",
    "ckptio dcp.load, ckptio planner",
)


def targets(res: dict[str, float], shape: str, place: str) -> None:
    """Print each target's ratio for one shape and place (GiB/s in ``res``)."""
    pinned = res.get("pinned copy")
    raw = max((v for k, v in res.items() if k.startswith("raw read")), default=None)
    st = res.get("ckptio.safetensors.load_file")
    print(f"targets, {shape}, {place}:")
    for k in LOADERS:
        if k not in res:
            continue
        parts = []
        if pinned:
            r = res[k] / pinned
            parts.append(f"{r:.2f}x pinned (>= 0.85: {'met' if r >= 0.85 else 'missed'})")
        if raw:
            r = res[k] / raw
            parts.append(f"{r:.2f}x raw (>= 0.95: {'met' if r >= 0.95 else 'missed'})")
        print(f"  {k}: " + ", ".join(parts))
    if pinned:
        # What stops the pinned-copy target where the raw read itself misses it.
        floors = [k for k in res if k.startswith(("raw read", "host copy floor"))]
        shown = ", ".join(f"{k} {res[k] / pinned:.2f}x" for k in floors)
        print(f"  floors x pinned: {shown}")
    if st:
        for k in ("ckptio.load", "ckptio.load(out=)", "ckptio.load_state_dict"):
            if k in res:
                r = res[k] / st
                print(
                    f"  {k} / safetensors.load_file: {r:.2f}x (>= 0.95: "
                    f"{'met' if r >= 0.95 else 'missed'})"
                )


def run_shape(shape: str, nbytes: int, a: argparse.Namespace, results: dict[str, Any]) -> None:
    device = a.device
    torch.manual_seed(0)
    sd = (
        benchlib.llm_state_dict(nbytes, device)
        if shape == "llm"
        else benchlib.even_state_dict(nbytes, 512, device)
    )
    nbytes = sum(t.nbytes for t in sd.values())
    print(f"\n## {shape}: {len(sd)} tensors, {nbytes / GiB:.2f} GiB, {device}", flush=True)
    shm = tempfile.mkdtemp(prefix="ckptio-shapes-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="ckptio-shapes-", dir=a.dir)
    try:
        p = write_all(sd, shm)
        folder = os.path.join(disk, "c")
        for place in a.places:
            if place in ("cache", "cold") and not os.path.isdir(folder):
                shutil.copytree(shm, folder)  # buffered: every page stays cached
                shutil.rmtree(shm, ignore_errors=True)
                p = {k: os.path.join(folder, os.path.relpath(v, shm)) for k, v in p.items()}
            if place == "cache":
                cached, total = fincore(folder), tree_bytes(folder)
                print(f"# page cache: {cached} of {total} bytes cached", flush=True)
            if place == "cold":
                rows = cold_rows(p, device, nbytes)
                med = measure(rows, device, 1, before=drop_folder(folder))
            else:
                rows = rows_for(p, sd, device, place, nbytes)
                med = measure(rows, device, a.rounds)
            limit = med.get("pinned copy")
            raws = ("raw read (KvikIO)", "raw read (engine)", "raw read (O_DIRECT)")
            raw = max(
                (nbytes / med[k] for k in raws if k in med),
                default=None,
            )
            print(f"\n| {shape}, {place} | GiB/s | x pinned | x raw |\n| --- | --- | --- | --- |")
            for k, s in med.items():
                g = nbytes / s / GiB
                xp = f"{nbytes / s / (nbytes / limit):.2f}" if limit else "-"
                xr = f"{nbytes / s / raw:.2f}" if raw else "-"
                print(f"| {k} | {g:.1f} | {xp} | {xr} |", flush=True)
            res = {k: nbytes / s / GiB for k, s in med.items()}
            targets(res, shape, place)
            if a.profile and place != "cold":
                res["profile"] = profile(p, device, nbytes)
                print(f"# profile: {res['profile']}", flush=True)
            results[f"{shape}/{place}"] = res
            del rows
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    size = lambda v: 0 if v.strip() == "0" else parse_size(v)  # noqa: E731
    ap.add_argument("--llm", type=size, default=4 * GiB, help="0 skips it")
    ap.add_argument("--even", type=size, default=8 * GiB, help="0 skips it")
    ap.add_argument(
        "--places",
        default="shm,cache",
        type=lambda s: s.split(","),
        help="shm, cache, cold (from the disk, one round: slow)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="the disk folder (default: the temp dir)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"# torch {torch.__version__}, ckptio {ckptio.__version__}, {CORES} cores", flush=True)
    results: dict[str, Any] = {}
    with contextlib.suppress(KeyboardInterrupt):
        for shape, n in (("llm", a.llm), ("even", a.even)):
            if n:
                run_shape(shape, n, a, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
