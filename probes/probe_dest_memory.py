"""Does the destination's memory decide a cold read's speed, whatever the loader?

The dev-VM target of issue 16 compares ckptio.load with "a raw O_DIRECT read
into an already-faulted buffer". This reads one checkpoint's records cold with
the engine (same segments, same threads, same alignment) into several buffers
that are all of one kind or another (private and shared anonymous mappings,
``_native.HostMemory`` as ckptio's host storages are made), every one faulted
in before the first read, in alternating order per round. If buffers of the
same kind differ as much as kinds do, what decides is where the memory sits
(on a VM: how the hypervisor backs those guest pages), not the kind of memory
or the loader. Also times ckptio.load and the bench's raw read in the rounds.

Usage: python probes/probe_dest_memory.py [--size 1] [--rounds 6] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time

import ckptio
from ckptio import _native
from ckptio.io import transfer as _transfer
from ckptio.io.engines import engine as _engine
from ckptio.tools import bench


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=1.0, help="GiB")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    folder = tempfile.mkdtemp(dir=a.dir)
    path = os.path.join(folder, "m.pt")
    ckptio.save(bench.synthetic_state_dict(int(a.size * 2**30), "cpu"), path)
    size = os.path.getsize(path)
    n = -(-size // 4096) * 4096
    reader = _native.Reader(path, None, None)
    records = [(off, sz) for name, off, sz in reader.records() if "/data/" in name]
    engine = _engine(None, None, None)

    def anon(flags: int) -> tuple[int, object]:
        m = mmap.mmap(-1, n, flags=flags | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        ctypes.memset(addr, 1, n)
        return addr, m

    def host() -> tuple[int, object]:
        m = _native.HostMemory(n)
        ctypes.memset(m.addr, 1, n)
        return m.addr, m

    bufs = {
        "private anon #1": anon(mmap.MAP_PRIVATE),
        "HostMemory #1": host(),
        "private anon #2": anon(mmap.MAP_PRIVATE),
        "HostMemory #2": host(),
        "shared anon #1": anon(mmap.MAP_SHARED),
        "private anon #3": anon(mmap.MAP_PRIVATE),
    }
    raw_into = bufs["shared anon #1"][1]
    view = memoryview(raw_into)[: size // 4096 * 4096]  # type: ignore[arg-type]
    runs = {
        k: (lambda a=addr, o=owner: _read(reader, engine, records, a, o))
        for k, (addr, owner) in bufs.items()
    }
    runs["ckptio.load (new storages)"] = lambda: ckptio.load(path)
    runs["bench raw read (shared anon #1)"] = lambda: bench.cold_read(path, view, os.O_DIRECT)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rnd in range(a.rounds):
        order = list(runs.items())
        for name, fn in order if rnd % 2 == 0 else order[::-1]:
            bench.drop_cache(path)
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            del out
    gib = sum(sz for _, sz in records) / 2**30
    print(f"# {gib:.2f} GiB in {len(records)} records, cold, {a.rounds} rounds (alternating order)")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(
            f"{name:32s} {s:6.3f} s  {gib / s:5.2f} GiB/s  rounds: "
            + " ".join(f"{t:.2f}" for t in ts)
        )
    view.release()
    os.remove(path)
    os.rmdir(folder)


def _read(
    reader: _native.Reader, engine: _native.Engine, records, addr: int, owner: object
) -> None:
    segments = [(off, addr + off, sz, -1) for off, sz in records]
    _transfer.read(reader, engine, segments, [owner])


if __name__ == "__main__":
    main()
