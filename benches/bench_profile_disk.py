"""ckptio.save and cold ckptio.load of a GPU checkpoint by knob, next to the
raw writes and reads of the disk, in interleaved rounds.

    python benches/bench_profile_disk.py [--sizes 2G,8G] [--rounds 5] [--dir /tmp]
        [--device cuda]
    python benches/bench_profile_disk.py --pause 10 ...   # reads right after writes and frees

The disk of the GPU machine drifts by 10-20% within minutes, more than the
knobs change, so besides each row's median this prints the median of the
per-round ratios: each save against the raw write of its round, each load
against the better raw read of its round (paired, the drift cancels). Loads
are split into phases: open (the archive's map: central directory and local
headers), unpickle (torch.load over the mapping, with the destination
allocations), sync, and read (the engine moving the bytes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
import time

import ckptio
import torch
from ckptio import serialization as S
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench

GiB = 2**30
RAW_W = "raw write+fsync 8x64M"
RAW_R = ("raw read O_DIRECT 8x64M", "raw read buffered 8x64M")
KNOBS = {
    "default": {},
    "chunk=32M": {"chunk_size": 32 << 20},
    "chunk=64M": {"chunk_size": 64 << 20},
    "posix": {"backend": "posix"},
    "cufile": {"backend": "cufile"},
    "buffered": {"direct": False},  # loads only
}


class _Timed:
    """The reader, its read_segments timed."""

    def __init__(self, reader, phases: dict[str, float]) -> None:
        self._r, self._phases = reader, phases

    def read_segments(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self._r.read_segments(*a, **k)
        finally:
            self._phases["read"] += time.perf_counter() - t0

    def __getattr__(self, name):
        return getattr(self._r, name)


def timed_load(path: str, device: str, **kw) -> dict[str, float]:
    """One cold load: seconds by phase and in all."""
    phases: dict[str, float] = collections.defaultdict(float)
    real_open, real_load = S._open, torch.load

    def timing(name, fn, wrap=lambda r: r):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try:
                return wrap(fn(*a, **k))
            finally:
                phases[name] += time.perf_counter() - t0

        return inner

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    bench.drop_cache(path)
    S._open = timing("open", real_open, lambda r: _Timed(r, phases))
    torch.load = timing("unpickle", real_load)
    try:
        sync()
        t0 = time.perf_counter()
        out = ckptio.load(path, map_location=device, **kw)
        sync()
        phases["total"] = time.perf_counter() - t0
    finally:
        S._open, torch.load = real_open, real_load
    del out
    return dict(phases)


def paired(base: list[float], ours: list[float]) -> float:
    """Median over rounds of base/ours seconds (ours' speed relative to base's)."""
    return statistics.median(b / t for b, t in zip(base, ours, strict=True))


@contextlib.contextmanager
def workspace(size: int, folder: str, device: str):
    """(folder, state dict of ``size``, its checkpoint ck.pt there, a ring of
    random bytes for the raw writes and reads, 64 MiB per thread); the folder
    goes afterwards. The save warms the engine's pinned lanes."""
    tmp = tempfile.mkdtemp(prefix="ckptio-prof-", dir=folder)
    try:
        sd = bench.synthetic_state_dict(size, device, torch.bfloat16)
        path = os.path.join(tmp, "ck.pt")
        ckptio.save(sd, path)
        with mmap.mmap(-1, 8 * (64 << 20)) as ring:
            ring.write(os.urandom(1 << 20) * 512)
            view = memoryview(ring)
            try:
                yield tmp, sd, path, view
            finally:
                view.release()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def speed(name: str, seconds: list[float], nbytes: int, width: int) -> str:
    """A row's name, median seconds and GiB/s, and its range over rounds."""
    med = statistics.median(seconds)
    return (
        f"{name:{width}s} {med:6.3f} s {nbytes / GiB / med:5.2f} GiB/s"
        f" ({nbytes / GiB / max(seconds):.2f}-{nbytes / GiB / min(seconds):.2f})"
    )


def case(size: int, folder: str, rounds: int, device: str, knobs: list[str]) -> None:
    with workspace(size, folder, device) as (tmp, sd, path, view):
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        flen = os.path.getsize(path)
        head = f"{nbytes / GiB:.2f} GiB, {len(sd)} tensors, file {flen} bytes, {tmp}"
        print(f"\n## {head}", flush=True)
        res: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
        notes: dict[str, str] = {}
        aligned = flen // 4096 * 4096  # O_DIRECT moves whole blocks
        for _ in range(rounds):
            raw = os.path.join(tmp, "raw.bin")
            res[RAW_W].append({"total": bench.raw_write(raw, view, 8, 64 << 20, aligned + 4096)[0]})
            os.unlink(raw)
            for knob in knobs:
                if knob == "buffered":
                    continue
                kw = KNOBS[knob]
                bench.settle_disk(tmp)
                t0 = time.perf_counter()
                ckptio.save(sd, path, **kw)
                res[f"ckptio.save {knob}"].append({"total": time.perf_counter() - t0})
            for name, flags, n in ((RAW_R[0], os.O_DIRECT, aligned), (RAW_R[1], 0, flen)):
                res[name].append({"total": bench.cold_read(path, view, flags, 8, 64 << 20, n)})
            for knob in knobs:
                res[f"ckptio.load {knob}"].append(timed_load(path, device, **KNOBS[knob]))
                rep = ckptio.last_report()
                notes[f"ckptio.load {knob}"] = f"ran={rep.device_path} direct={rep.direct}"
        for name, runs in res.items():
            tot = [r["total"] for r in runs]
            line = speed(name, tot, nbytes, 28)
            if name.startswith("ckptio.save"):
                base = [r["total"] for r in res[RAW_W]]
                line += f"  paired {paired(base, tot):.2f}x raw write"
            elif name.startswith("ckptio.load"):
                raws = zip(*(res[k] for k in RAW_R), strict=True)
                best = [min(r["total"] for r in rs) for rs in raws]
                line += f"  paired {paired(best, tot):.2f}x best raw read"
                for ph in ("open", "unpickle", "read"):
                    line += f"  {ph} {statistics.median(r.get(ph, 0.0) for r in runs):.3f}"
                line += "  " + notes[name]
            print(line, flush=True)


def right_after_write(size: int, folder: str, rounds: int, device: str, pause: float) -> None:
    """Reads right after a write, with and without a file of the same size
    freed just before (a save that replaces a checkpoint frees the old one),
    and ``pause`` seconds later; rounds interleaved. Every read starts with
    bench.drop_cache, which lets the disk settle: what shows is what settling
    misses."""
    with workspace(size, folder, device) as (tmp, sd, ck, view):
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        raw, other = os.path.join(tmp, "raw.bin"), os.path.join(tmp, "other.bin")
        print(f"\n## {nbytes / GiB:.2f} GiB: reads after writes and frees", flush=True)
        res: dict[str, list[float]] = collections.defaultdict(list)

        def raw_read(name: str) -> None:
            res[name].append(bench.cold_read(raw, view, os.O_DIRECT, 8, 64 << 20, nbytes))

        for _ in range(rounds):
            bench.raw_write(raw, view, 8, 64 << 20, nbytes)
            raw_read("raw read, right after its write")
            bench.raw_write(other, view, 8, 64 << 20, nbytes)
            bench.settle_disk(tmp)
            os.unlink(other)
            raw_read("raw read, right after freeing a file")
            os.unlink(raw)
            os.unlink(ck)
            ckptio.save(sd, ck)  # a new file: nothing freed
            res["ckptio.load, after a save to a new file"].append(timed_load(ck, device)["total"])
            ckptio.save(sd, ck)  # replaces (frees) the previous one
            res["ckptio.load, after a save that replaced"].append(timed_load(ck, device)["total"])
            ckptio.save(sd, ck)
            time.sleep(pause)
            res[f"ckptio.load, {pause:g} s after that"].append(timed_load(ck, device)["total"])
        for name, tot in res.items():
            print(speed(name, tot, nbytes, 42), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2G")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run without a GPU")
    ap.add_argument(
        "--pause",
        type=float,
        default=0,
        help="reads right after writes and frees, and this many seconds later",
    )
    ap.add_argument(
        "--knobs",
        default="default,chunk=32M,chunk=64M,buffered",
        help=f"comma-separated, of {', '.join(KNOBS)}",
    )
    a = ap.parse_args()
    knobs = a.knobs.split(",")
    if unknown := set(knobs) - KNOBS.keys():
        ap.error(f"unknown knobs: {sorted(unknown)}")
    for s in a.sizes.split(","):
        if a.pause:
            right_after_write(_size(s), a.dir, a.rounds, a.device, a.pause)
        else:
            case(_size(s), a.dir, a.rounds, a.device, knobs)


if __name__ == "__main__":
    main()
