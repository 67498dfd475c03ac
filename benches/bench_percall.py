"""Per-call cost: many small transfers, where what a native call costs besides
its bytes (starting threads, handing work over, checking the segments) shows.

Files sit in the page cache (read once after the save), so no disk time hides
the cost; host memory only (the CPU development VM has no GPU). Cases, each
``--rounds`` times in turn, median per case:

  load64k      1,000 ``ckptio.load`` of a 64 KiB file (one tensor): us per load
  read64k      1,000 engine reads of the same 64 KiB record alone
               (``_transfer.read`` of one segment on a ``Reader``): us per read
  dcp64        ``dcp.save`` and ``dcp.load`` of 64 tensors of 16 KiB into a
               folder of 64 data files (``thread_count=64``): ms per save, load
  tensors20k   ``ckptio.save`` and ``ckptio.load`` of 20,000 tensors of 4 KiB:
               ms per save, load
  check20k     one ``write_segments`` of the 20,000 tensors' segments with
               their owners on a finished writer: the call's argument handling
               and checks alone, no I/O (refused after the checks): ms per call

It uses only calls every build has, so the same script measures two builds in
one session (docs/benchmarks.md, "Per-call cost"):

  python benches/bench_percall.py [--rounds 5] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import ckptio
import torch
from ckptio import _native
from ckptio.io import transfer as _transfer
from ckptio.io.engines import engine as _engine


def warm(path: str) -> None:
    """Every file under ``path`` read once: its pages in the page cache."""
    files = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    )
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 20):
                pass


def load64k(work: str, n: int = 1000) -> dict[str, float]:
    p = os.path.join(work, "small.pt")
    ckptio.save({"w": torch.randn(16384)}, p)  # 64 KiB of data
    warm(p)
    ckptio.load(p)
    t0 = time.perf_counter()
    for _ in range(n):
        ckptio.load(p)
    return {"us per load": (time.perf_counter() - t0) / n * 1e6}


def read64k(work: str, n: int = 1000) -> dict[str, float]:
    p = os.path.join(work, "small.pt")
    if not os.path.exists(p):
        ckptio.save({"w": torch.randn(16384)}, p)
    warm(p)
    r = _native.Reader(p)
    _, off, size = next(x for x in r.records() if "/data/" in x[0])
    buf = torch.empty(size, dtype=torch.uint8)
    seg = [(off, buf.data_ptr(), size, -1)]
    engine = _engine(None, None, None)
    _transfer.read(r, engine, seg, [buf])
    t0 = time.perf_counter()
    for _ in range(n):
        _transfer.read(r, engine, seg, [buf])
    return {"us per read": (time.perf_counter() - t0) / n * 1e6}


def dcp64(work: str) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    sd = {f"t{i}": torch.randn(4096) for i in range(64)}
    folder = os.path.join(work, "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one rank, as torch says
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=FileSystemWriter(folder, thread_count=64))
        save = time.perf_counter() - t0
        warm(folder)
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        t0 = time.perf_counter()
        dcp.load(out, storage_reader=FileSystemReader(folder))
        load = time.perf_counter() - t0
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    files = sum(1 for f in os.listdir(folder) if f.endswith(".distcp"))
    assert files == 64, files
    return {"ms per save": save * 1e3, "ms per load": load * 1e3}


def _tensors20k() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i // 8}.p{i % 8}": torch.randn(1024, generator=g) for i in range(20_000)}


def tensors20k(work: str) -> dict[str, float]:
    sd = _tensors20k()
    p = os.path.join(work, "many.pt")
    t0 = time.perf_counter()
    ckptio.save(sd, p)
    save = time.perf_counter() - t0
    warm(p)
    t0 = time.perf_counter()
    out = ckptio.load(p)
    load = time.perf_counter() - t0
    assert out.keys() == sd.keys()
    return {"ms per save": save * 1e3, "ms per load": load * 1e3}


def check20k(work: str, n: int = 20) -> dict[str, float]:
    sd = _tensors20k()
    owners = [t.untyped_storage() for t in sd.values()]
    segs = [(i * 4096, s.data_ptr(), s.nbytes(), -1) for i, s in enumerate(owners)]
    w = _native.AtomicWriter(os.path.join(work, "done.bin"))
    w.abort()
    engine = _engine(None, None, None)
    best = []
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            w.write_segments(engine, segs, owners, [])
        except ValueError:  # "already committed or aborted": after the checks
            pass
        best.append(time.perf_counter() - t0)
    return {"ms per call": statistics.median(best) * 1e3}


CASES: dict[str, Callable[[str], dict[str, float]]] = {
    "load64k": load64k,
    "read64k": read64k,
    "dcp64": dcp64,
    "tensors20k": tensors20k,
    "check20k": check20k,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp folder)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cases = [c for c in a.cases.split(",") if c]
    runs: dict[str, dict[str, list[float]]] = {c: {} for c in cases}
    work = tempfile.mkdtemp(prefix="bench-percall-", dir=a.dir)
    try:
        for _ in range(a.rounds):
            for c in cases:
                sub = os.path.join(work, c)
                shutil.rmtree(sub, ignore_errors=True)
                os.makedirs(sub)
                for k, v in CASES[c](sub).items():
                    runs[c].setdefault(k, []).append(v)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"ckptio from {os.path.dirname(ckptio.__file__)}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {a.rounds} rounds (median, [min, max])"
    )
    for c in cases:
        for k, vs in runs[c].items():
            print(f"{c:<11} {k:<12} {statistics.median(vs):9.1f}  [{min(vs):.1f}, {max(vs):.1f}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
