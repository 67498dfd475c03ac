"""Would a load from /dev/shm to CUDA run faster with part of the file sent
zero-copy (its page cache registered with the driver, the GPU reading it
straight), beside the memory path's CPU copy into pinned slots?

The memory path alone reads at 0.87-0.91x the pinned host-to-device copy on
every H200 host, whatever that host's CPU copy floor (1.00-1.58x pinned): the
copy threads and the DMA share the memory bus, and each 4 MiB slot is a DMA of
its own. Zero-copy alone is bounded by registration (28 GiB/s on 8 threads,
floor (b) of bench_memory). Run together, each on its own part of the file,
the DMA engine may stay busy while fewer bytes cross the bus twice.

For each split (the share sent zero-copy) and zero-copy thread count, in
alternating order per round: the engine's read of the first part (one
DeviceFile.read_segments on a thread) while the zero-copy threads map,
populate, register, copy and unregister 64 MiB pieces of the rest. Printed as
ratios to the pinned copy of the same bytes, measured in the same run.

Usage: python probes/probe_zero_copy_hybrid.py [--size 8] [--rounds 3]
       [--shares 0,0.125,0.25,0.375] [--zc-threads 4,8] [--memory-threads 0]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
from ckptio import _native
from ckptio.io.engines import engine as _engine
from ckptio.tools import bench

GiB = 2**30
PIECE = 64 << 20
READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY

vp = ctypes.c_void_p
cu, libc = bench.libcuda(), bench.libc()


ck = bench.cuda_check


def zero_copy(path: str, start: int, n: int, dst: int, threads: int, ctx: Any) -> None:
    """Bytes [start, n) of ``path`` to ``dst + start``: mapped, and in 64 MiB pieces
    on ``threads`` threads populated, registered, copied; unregistered once copied."""
    fd = os.open(path, os.O_RDONLY)
    try:
        base = libc.mmap(None, n - start, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    finally:
        os.close(fd)
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    registered: list[int] = []

    def piece(o: int, st: Any) -> None:
        ln = min(PIECE, n - start - o)
        libc.madvise(base + o, ln, bench.MADV_POPULATE_READ)
        ck(cu.cuMemHostRegister_v2(base + o, ln, READ_ONLY), "register")
        registered.append(base + o)
        ck(cu.cuMemcpyHtoDAsync_v2(dst + start + o, base + o, ln, st), "copy")

    try:
        bench.on_streams(threads, list(range(0, n - start, PIECE)), piece, ctx)
    finally:
        for a in registered:  # every stream synced
            cu.cuMemHostUnregister(a)
        libc.munmap(base, n - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shares", default="0,0.125,0.25,0.375")
    p.add_argument("--zc-threads", default="4,8")
    p.add_argument("--memory-threads", type=int, default=0, help="0: the engine's default")
    a = p.parse_args()
    n = int(a.size * GiB) // PIECE * PIECE
    folder = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(folder, "raw.bin")
    block = torch.randint(0, 255, (PIECE,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        for _ in range(n // PIECE):
            f.write(block)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ctx = vp()
    ck(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    engine = _engine(None, None, None, a.memory_threads or None)
    dev = _native.DeviceFile(path, False, None, "bounce")
    stream = torch.cuda.current_stream().cuda_stream
    pinned = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)

    def hybrid(share: float, zc_threads: int) -> float:
        cut = n - int(n * share) // PIECE * PIECE
        segs = [(o, dst.data_ptr() + o, min(16 << 20, cut - o), 0) for o in range(0, cut, 16 << 20)]
        err: list[BaseException] = []

        def rest() -> None:
            try:
                zero_copy(path, cut, n, dst.data_ptr(), zc_threads, ctx)
            except BaseException as e:
                err.append(e)

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        zc = threading.Thread(target=rest) if cut < n else None
        if zc:
            zc.start()
        if cut:
            dev.read_segments(engine, segs, [dst], [(0, stream)])
        if zc:
            zc.join()
        torch.cuda.synchronize()
        if err:
            raise err[0]
        return time.perf_counter() - t0

    shares = [float(s) for s in a.shares.split(",")]
    zts = [int(t) for t in a.zc_threads.split(",")]
    cases = [(s, t) for s in shares for t in (zts if s else zts[:1])]
    times: dict[Any, list[float]] = {c: [] for c in cases}
    ref: list[float] = []
    hybrid(0.0, 1)  # warm: engine lanes pinned, mapping kept
    check = torch.frombuffer(bytearray(block[: 1 << 20]), dtype=torch.uint8)
    for r in range(a.rounds):
        ref.append(bench.h2d_seconds(dst, pinned))
        for c in cases if r % 2 == 0 else cases[::-1]:
            dst.zero_()
            times[c].append(hybrid(*c))
            for o in (0, n - PIECE, n // 2 // PIECE * PIECE):
                if not torch.equal(dst[o : o + (1 << 20)].cpu(), check):
                    raise SystemExit(f"wrong bytes at {o} after {c}")
    h = statistics.median(ref)
    print(f"# {n / GiB:.1f} GiB from {path}; pinned H2D {n / h / GiB:.2f} GiB/s (median)")
    print(f"# engine memory threads: {engine.memory_threads}; {a.rounds} rounds, alternating")
    print("zero-copy share  zc threads  seconds  GiB/s  vs pinned  rounds (vs pinned)")
    for (s, t), ts in times.items():
        m = statistics.median(ts)
        each = " ".join(f"{h / x:.3f}" for x in ts)
        print(f"{s:15.3f} {t:11d} {m:8.3f} {n / m / GiB:6.2f} {h / m:9.3f}  {each}")
    os.unlink(path)
    os.rmdir(folder)


if __name__ == "__main__":
    main()
