"""Would deeper bounce lanes read a file in memory to the GPU faster?

Floor (d) of bench_memory showed that the DMA loses only 1% to the memory
threads' CPU copies, yet the engine's read from /dev/shm runs at 0.88-0.92x the
pinned copy. Each lane has two pinned slots: after queueing chunk N it waits for
chunk N-1's copy before it copies N+1, so a thread idles whenever N-1 still
queues behind the other threads' copies. With a third slot it would copy on.

This replays the lanes' pipeline in Python (ctypes releases the GIL around the
memmove and the driver calls): ``threads`` threads take 4 MiB chunks of a file
in /dev/shm in turn, copy each from one shared mapping (its page tables filled
first) into the next of ``depth`` pinned slots, and queue its host-to-device
copy on that slot's stream; a slot's stream is synced only before the slot is
reused. depth 2 is the engine's order. For each depth, and the engine's own read
of the same file (``DeviceFile.read_segments``), in alternating order per round:
seconds, as a ratio to one pinned copy of as many bytes measured in the same run.

Usage: python probes/probe_lane_depth.py [--size 8] [--rounds 5] [--depths 2,3,4]
       [--threads 0 (the engine's memory threads)] [--chunk-mib 0 (its memory chunk)]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from ckptio import _native
from ckptio.io.engines import engine as _engine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402

GiB = 2**30
MiB = 2**20
cu = benchlib.libcuda()
ck = benchlib.cuda_check


def pipeline(
    base: int, n: int, dbase: int, slots: list[list[int]], chunk: int, depth: int, ctx: object
) -> float:
    """Seconds for ``len(slots)`` threads to move ``n`` bytes from ``base`` to
    ``dbase`` through ``depth`` pinned slots each, as described above."""
    todo = iter(range(0, n, chunk))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(mine: list[int]) -> None:
        streams = [ctypes.c_void_p() for _ in range(depth)]
        busy = [False] * depth
        try:
            ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            for st in streams:
                ck(cu.cuStreamCreate(ctypes.byref(st), 1), "cuStreamCreate")
            j = 0
            while True:
                with lock:
                    off = next(todo, None)
                if off is None:
                    break
                k, j = j % depth, j + 1
                if busy[k]:
                    ck(cu.cuStreamSynchronize(streams[k]), "cuStreamSynchronize")
                ln = min(chunk, n - off)
                ctypes.memmove(mine[k], base + off, ln)
                ck(cu.cuMemcpyHtoDAsync_v2(dbase + off, mine[k], ln, streams[k]), "cuMemcpy")
                busy[k] = True
            for st in streams:
                ck(cu.cuStreamSynchronize(st), "cuStreamSynchronize")
        except BaseException as e:
            errors.append(e)
        finally:
            for st in streams:
                if st.value:
                    cu.cuStreamDestroy_v2(st)

    s = benchlib.timed_threads([threading.Thread(target=work, args=(m,)) for m in slots])
    if errors:
        raise errors[0]
    return s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--depths", default="2,3,4")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--chunk-mib", type=int, default=0)
    a = p.parse_args()
    n = int(a.size * GiB) // (64 * MiB) * (64 * MiB)
    engine = _engine(None, None, None)
    threads = a.threads or engine.memory_threads
    chunk = (a.chunk_mib * MiB) or engine.memory_chunk_size
    depths = [int(d) for d in a.depths.split(",")]
    folder = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(folder, "raw.bin")
    try:
        block = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8).numpy().tobytes()
        with open(path, "wb") as f:
            for _ in range(n // (64 * MiB)):
                f.write(block)
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, n, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
        finally:
            os.close(fd)
        base = np.frombuffer(m, dtype=np.uint8).ctypes.data
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
        pins = [
            torch.empty(max(depths) * chunk, dtype=torch.uint8, pin_memory=True)
            for _ in range(threads)
        ]
        slots = [[t.data_ptr() + k * chunk for k in range(max(depths))] for t in pins]
        torch.cuda.synchronize()
        ctx = ctypes.c_void_p()
        ck(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        dev = _native.DeviceFile(path, False, None, "bounce")
        stream = torch.cuda.current_stream().cuda_stream
        segs = [(o, dst.data_ptr() + o, min(16 * MiB, n - o), 0) for o in range(0, n, 16 * MiB)]

        def engine_read() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.read_segments(engine, segs, [dst], [(0, stream)])
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        cases = {"engine read (DeviceFile.read_segments)": engine_read}
        for d in depths:
            cases[f"lanes in Python, depth {d}"] = lambda d=d: pipeline(
                base, n, dst.data_ptr(), slots, chunk, d, ctx
            )
        times: dict[str, list[float]] = {k: [] for k in cases}
        ref: list[float] = []
        benchlib.h2d_seconds(dst, src)
        for fn in cases.values():  # warm: lanes made, mappings kept, threads spawned once
            fn()
        for r in range(a.rounds):
            ref.append(benchlib.h2d_seconds(dst, src))
            for k in list(cases) if r % 2 == 0 else list(cases)[::-1]:
                times[k].append(cases[k]())
        h = statistics.median(ref)
        print(
            f"# {n / GiB:.0f} GiB in /dev/shm -> GPU, {threads} threads, {chunk // MiB} MiB "
            f"chunks, {a.rounds} rounds; pinned copy {n / h / GiB:.2f} GiB/s (median)"
        )
        print(f"{'what':<42} {'GiB/s':>6} {'vs pinned':>9}  by round")
        for k, ts in times.items():
            md = statistics.median(ts)
            each = " ".join(f"{h / x:.3f}" for x in ts)
            print(f"{k:<42} {n / md / GiB:6.2f} {h / md:9.3f}  {each}")
        for d in depths[1:]:
            a2, ad = (
                times[f"lanes in Python, depth {depths[0]}"],
                times[f"lanes in Python, depth {d}"],
            )
            paired = statistics.median(x / y for x, y in zip(a2, ad, strict=True))
            print(f"depth {d} / depth {depths[0]} speed, paired by round: {paired:.3f}x")
        del m
    finally:
        try:
            os.unlink(path)
        finally:
            os.rmdir(folder)


if __name__ == "__main__":
    main()
