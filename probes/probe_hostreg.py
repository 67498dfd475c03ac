"""Probes behind three design choices (results: benches/results/probe-h200-2026-11-30.txt).

    python probes/probe_hostreg.py --size 4G   # /dev/shm -> GPU: registered mapping
                                                # vs pageable vs pread into pinned, by
                                                # threads; 512 D2D copies, ctypes vs foreach
    python probes/probe_hostreg.py first 8G    # first host staging: fault-in vs pinning
    python probes/probe_hostreg.py loads 8G    # ckptio.load from /dev/shm by threads
    python probes/probe_hostreg.py bounce 8G   # first host staging without pinning:
                                                # fault-in, memcpy from a pinned lane,
                                                # D2H through two lanes per thread
    python probes/probe_hostreg.py alloc 8G    # a load's destinations: 512 cudaMallocs
                                                # or one segment; loads into a fresh cache
    python probes/probe_hostreg.py backends 8G # ckptio.load from /dev/shm by backend
                                                # and by the state of torch's cache
    python probes/probe_hostreg.py tmpfs 2G    # preads of a tmpfs file by the state of
                                                # its pages (no GPU needed)
    python probes/probe_hostreg.py sources 2G  # the engine's read of a checkpoint in memory
                                                # (tmpfs, page-cached disk file) into faulted
                                                # host memory, first and repeat, by memory
                                                # path (map, pread); no GPU needed

On the H200 host: registering the page cache (READ_ONLY) costs more than the copy
it saves, pread into pinned memory scales with threads (so files on tmpfs get
memory_threads), and faulting in fresh memory, not pinning, is what a first
save pays for: filling fresh pages from the GPU through pinned lanes, without
pinning them, ran at 15-24 GiB/s, no faster than pinning as the copies go
(so that was not kept). A new engine's first load pays for its pinned lanes
(~0.5 s per GiB), hence 4 MiB chunks for tmpfs (lanes of 256 MiB, not 1 GiB).
Filling 512 fresh cudaMalloc segments costs more than allocating them, hence one
reserved segment for a load into a fresh cache (0.21-0.24 s for 8 GiB, 33-37 GiB/s);
a load right after the file was written ran slower (0.35 s) than the next ones:
the first read of freshly allocated tmpfs pages is slower for any reader (the
``tmpfs`` mode: not so for pages rewritten in place), and every crash-safe save
writes a new file. The slow read is a page's second access, where the kernel
activates it on its LRU lists: write() counts as the first, so the first read
pays; for a file filled through a mapping the second read does.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time

import torch
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402

READ_ONLY = 8


def _on_threads(threads: int, work) -> float:
    """Seconds for ``work(k)`` to run on threads k = 0..threads-1 at once."""
    return benchlib.timed_threads(
        [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4G")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--chunk", default="64M")
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    n, chunk = _size(a.size), _size(a.chunk)
    cu = ctypes.CDLL("libcuda.so.1")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    ctx = ctypes.c_void_p()
    cu.cuCtxGetCurrent(ctypes.byref(ctx))

    def ck(r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    path = os.path.join(a.dir, "probe-hostreg.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    t = time.perf_counter()
    os.posix_fallocate(fd, 0, n)
    print(f"fallocate {n >> 20} MiB: {time.perf_counter() - t:.3f} s", flush=True)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    p = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    print(f"mapped at {p:#x}", flush=True)

    def whole(flags: int) -> None:
        t0 = time.perf_counter()
        r = cu.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(n), ctypes.c_uint(flags))
        t1 = time.perf_counter()
        if r != 0:
            print(f"  whole register flags={flags}: CUresult {r} after {t1 - t0:.3f} s", flush=True)
            return
        ck(
            cu.cuMemcpyHtoD_v2(
                ctypes.c_uint64(dst.data_ptr()), ctypes.c_void_p(p), ctypes.c_size_t(n)
            ),
            "htod",
        )
        t2 = time.perf_counter()
        ck(cu.cuMemHostUnregister(ctypes.c_void_p(p)), "unregister")
        t3 = time.perf_counter()
        gib = n / 2**30
        print(
            f"  whole flags={flags}: register {t1 - t0:.3f} s, "
            f"copy {t2 - t1:.3f} s ({gib / (t2 - t1):.1f} GiB/s), "
            f"unregister {t3 - t2:.3f} s, total {gib / (t3 - t0):.1f} GiB/s",
            flush=True,
        )

    for flags in (0, READ_ONLY, READ_ONLY):
        whole(flags)

    def chunked(threads: int, mode: str) -> None:
        offs = list(range(0, n, chunk))
        lock = threading.Lock()
        err: list[str] = []
        pinned = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(threads)]

        def work(i: int) -> None:
            ck(cu.cuCtxSetCurrent(ctx), "ctx")
            s = torch.cuda.Stream()
            sp = ctypes.c_void_p(s.cuda_stream)
            rfd = os.open(path, os.O_RDONLY)
            while True:
                with lock:
                    if not offs:
                        break
                    o = offs.pop()
                ln = min(chunk, n - o)

                def h2d(src: int, o: int = o, ln: int = ln) -> None:
                    dst_p = ctypes.c_uint64(dst.data_ptr() + o)
                    r = cu.cuMemcpyHtoDAsync_v2(
                        dst_p, ctypes.c_void_p(src), ctypes.c_size_t(ln), sp
                    )
                    ck(r, "h2d")
                    ck(cu.cuStreamSynchronize(sp), "sync")

                if mode == "register":
                    r = cu.cuMemHostRegister_v2(
                        ctypes.c_void_p(p + o), ctypes.c_size_t(ln), ctypes.c_uint(READ_ONLY)
                    )
                    if r != 0:
                        err.append(f"register {r}")
                        break
                    h2d(p + o)
                    ck(cu.cuMemHostUnregister(ctypes.c_void_p(p + o)), "unreg")
                elif mode == "pageable":
                    h2d(p + o)
                else:  # pread into pinned, then copy (the bounce path without overlap)
                    pb = pinned[i]
                    os.preadv(rfd, [memoryview(pb.numpy())[:ln]], o)
                    h2d(pb.data_ptr())
            os.close(rfd)

        dt = _on_threads(threads, work)
        print(
            f"  chunked {mode:9s} threads={threads:2d} chunk={chunk >> 20}M: "
            f"{n / 2**30 / dt:.1f} GiB/s {err[:1]}",
            flush=True,
        )

    for mode in ("register", "pageable", "pread"):
        for th in (4, a.threads, 16):
            chunked(th, mode)

    # Device-to-device: 512 copies, one cuMemcpyDtoDAsync each, from Python.
    srcs = [torch.empty(16 << 20, dtype=torch.uint8, device="cuda") for _ in range(512)]
    dsts = [torch.empty(16 << 20, dtype=torch.uint8, device="cuda") for _ in range(512)]
    s = torch.cuda.Stream()
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sp = ctypes.c_void_p(s.cuda_stream)
        for x, y in zip(dsts, srcs, strict=True):
            cu.cuMemcpyDtoDAsync_v2(
                ctypes.c_uint64(x.data_ptr()),
                ctypes.c_uint64(y.data_ptr()),
                ctypes.c_size_t(16 << 20),
                sp,
            )
        t1 = time.perf_counter()
        with torch.cuda.stream(s):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        t2 = time.perf_counter()
        s.synchronize()
        t3 = time.perf_counter()
        print(
            f"  d2d 512x16M: ctypes loop {1e3 * (t1 - t0):.2f} ms, "
            f"foreach_copy_ {1e3 * (t2 - t1):.2f} ms, drain {1e3 * (t3 - t2):.1f} ms",
            flush=True,
        )
    ver = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(ver))
    print(
        "driver",
        ver.value,
        "cuMemcpyBatchAsync:",
        hasattr(cu, "cuMemcpyBatchAsync"),
        hasattr(cu, "cuMemcpyBatchAsync_v2"),
    )
    os.close(fd)
    os.unlink(path)


def first_touch(n: int) -> None:
    """Split the first host staging cost: fault-in (MADV_POPULATE_WRITE) vs pinning."""
    import ckptio._native as nat  # noqa: F401 - loads the same libcuda

    cu = ctypes.CDLL("libcuda.so.1")
    torch.zeros(1, device="cuda")
    ctx = ctypes.c_void_p()
    cu.cuCtxGetCurrent(ctypes.byref(ctx))
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    piece = 64 << 20

    def par(threads: int, fn) -> float:
        offs = list(range(0, n, piece))
        lock = threading.Lock()

        def work(_: int) -> None:
            cu.cuCtxSetCurrent(ctx)
            while True:
                with lock:
                    if not offs:
                        return
                    o = offs.pop()
                fn(o)

        return _on_threads(threads, work)

    for threads in (8, 16):
        fd = os.memfd_create("probe")
        os.ftruncate(fd, n)
        p = libc.mmap(None, n, 3, mmap.MAP_SHARED, fd, 0)
        pop = par(threads, lambda o, p=p: libc.madvise(p + o, piece, 23))
        reg = par(
            threads,
            lambda o, p=p: cu.cuMemHostRegister_v2(
                ctypes.c_void_p(p + o), ctypes.c_size_t(piece), ctypes.c_uint(0)
            ),
        )
        unreg = par(threads, lambda o, p=p: cu.cuMemHostUnregister(ctypes.c_void_p(p + o)))
        gib = n / 2**30
        print(
            f"  memfd {gib:.0f} GiB threads={threads}: "
            f"populate {pop:.3f} s ({gib / pop:.1f} GiB/s), "
            f"register {reg:.3f} s ({gib / reg:.1f} GiB/s), unregister {unreg:.3f} s",
            flush=True,
        )
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap(p, n)
        os.close(fd)


def bounce(n: int, threads: int, kinds: list[str], piece: int = 16 << 20) -> None:
    """What a first host staging costs if it skips pinning: fresh 16 MiB memfds
    (as the stager makes them) faulted in, filled by memcpy from a pinned lane,
    and filled from the GPU through two pinned lanes per thread."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    lanes = [
        [torch.empty(piece // 2, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        for _ in range(threads)
    ]
    streams = [torch.cuda.Stream() for _ in range(threads)]
    torch.cuda.synchronize()

    def fresh(kind: str) -> list[int]:
        out = []
        for _ in range(n // piece):
            if kind == "memfd":
                fd = os.memfd_create("probe")
                os.ftruncate(fd, piece)
                out.append(libc.mmap(None, piece, 3, mmap.MAP_SHARED, fd, 0))
                os.close(fd)
            else:  # private anonymous, 2 MiB aligned so that THP can back it
                raw = libc.mmap(None, piece + (2 << 20), 3, 0x22, -1, 0)
                p = (raw + (2 << 20) - 1) & ~((2 << 20) - 1)
                libc.madvise(p, piece, 14 if kind == "anon+thp" else 15)  # (NO)HUGEPAGE
                out.append(p)
        return out

    def par(bufs: list[int], fn) -> float:
        todo = list(enumerate(bufs))
        lock = threading.Lock()

        def work(k: int) -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    i, p = todo.pop()
                fn(k, i, p)

        return _on_threads(threads, work)

    def memcpy(k: int, i: int, p: int) -> None:
        ctypes.memmove(p, lanes[k][0].data_ptr(), piece // 2)
        ctypes.memmove(p + piece // 2, lanes[k][0].data_ptr(), piece // 2)

    def d2h(k: int, i: int, p: int) -> None:
        half = piece // 2
        with torch.cuda.stream(streams[k]):
            a, b = lanes[k]
            a.copy_(src[i * piece : i * piece + half], non_blocking=True)
            streams[k].synchronize()
            b.copy_(src[i * piece + half : (i + 1) * piece], non_blocking=True)
            ctypes.memmove(p, a.data_ptr(), half)
            streams[k].synchronize()
            ctypes.memmove(p + half, b.data_ptr(), half)

    def register(k: int, i: int, p: int) -> None:
        cu.cuMemHostRegister_v2(ctypes.c_void_p(p), ctypes.c_size_t(piece), ctypes.c_uint(0))

    cu = ctypes.CDLL("libcuda.so.1")
    gib = n / 2**30
    for kind in kinds:
        for what, fn in (
            ("populate", lambda k, i, p: libc.madvise(p, piece, 23)),
            ("memcpy from pinned lane, fresh", memcpy),
            ("D2H via 2 lanes/thread, fresh", d2h),
        ):
            bufs = fresh(kind)
            dt = par(bufs, fn)
            print(f"  {kind:8s} {what:31s} {threads} thr: {dt:.3f} s {gib / dt:6.1f} GiB/s")
            if what.startswith("D2H"):
                dt = par(bufs, d2h)
                print(f"  {kind:8s} {'D2H via 2 lanes, faulted':31s} {threads} thr: {dt:.3f} s")
                dt = par(bufs, register)
                print(f"  {kind:8s} {'register after':31s} {threads} thr: {dt:.3f} s", flush=True)
                for p in bufs:
                    cu.cuMemHostUnregister(ctypes.c_void_p(p))
            for p in bufs:  # (an anonymous buffer's alignment slack stays mapped)
                libc.munmap(p, piece)


def shm_loads(n: int) -> None:
    """ckptio.load of an n-byte bf16 state dict from /dev/shm, by threads and chunk;
    ``io``: the share of the engine's read (the rest: unpickling, allocation)."""
    import ckptio

    io = benchlib.EngineReads()
    sd = bench.synthetic_state_dict(n, "cuda", torch.bfloat16)
    p = "/dev/shm/probe-load.pt"
    ckptio.save(sd, p)
    # Each config is a new engine: its first load pays for the pinned lanes.
    for threads, chunk in ((None, None), (16, 16 << 20), (32, 8 << 20), (32, 4 << 20)):
        for _ in range(2):
            torch.cuda.synchronize()
            io.reset()
            t0 = time.perf_counter()
            out = ckptio.load(p, map_location="cuda", threads=threads, chunk_size=chunk)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            del out
            print(
                f"  ckptio.load shm threads={threads} chunk={chunk}: {dt:.3f} s "
                f"{n / 2**30 / dt:.1f} GiB/s, io {io.seconds:.3f} s "
                f"({ckptio.last_report().device_path}, {ckptio.last_report().threads} threads)",
                flush=True,
            )
        torch.cuda.empty_cache()  # the next config allocates afresh, as a new process would
    os.unlink(p)


def alloc(n: int, rounds: int = 3) -> None:
    """What a load's destinations cost: 512 cudaMallocs against one segment of the
    same total, and ckptio.load from /dev/shm after empty_cache() with and
    without such a segment reserved (freed back to torch's cache) first."""
    import ckptio

    io = benchlib.EngineReads()
    sd = bench.synthetic_state_dict(n, "cuda", torch.bfloat16)
    sizes = [v.untyped_storage().nbytes() for v in sd.values()]
    total = sum(sizes)
    p = "/dev/shm/probe-load.pt"
    ckptio.save(sd, p)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def reserve() -> None:
        del_me = torch.empty(total, dtype=torch.uint8, device="cuda")
        del del_me

    keep: list[torch.UntypedStorage] = []
    out: dict = {}
    for r in range(rounds):
        torch.cuda.empty_cache()
        t_many = timed(lambda: keep.extend(torch.UntypedStorage(s, device="cuda") for s in sizes))
        keep.clear()
        torch.cuda.empty_cache()
        t_one = timed(reserve)
        t_carve = timed(lambda: keep.extend(torch.UntypedStorage(s, device="cuda") for s in sizes))
        keep.clear()
        print(
            f"  round {r}: {len(sizes)} cudaMallocs {t_many * 1e3:.1f} ms; "
            f"one of {total >> 20} MiB {t_one * 1e3:.1f} ms, "
            f"then {len(sizes)} from it {t_carve * 1e3:.1f} ms",
            flush=True,
        )
        for mode in ("plain", "reserved") if r % 2 == 0 else ("reserved", "plain"):
            torch.cuda.empty_cache()
            io.reset()
            if mode == "reserved":
                t = timed(lambda: (reserve(), out.update(x=ckptio.load(p, map_location="cuda"))))
            else:
                t = timed(lambda: out.update(x=ckptio.load(p, map_location="cuda")))
            out.clear()
            print(
                f"  round {r}: ckptio.load {mode:8s} {t:.3f} s {n / 2**30 / t:.1f} GiB/s "
                f"(engine read {io.seconds:.3f} s)"
            )
        torch.cuda.empty_cache()
        t = timed(lambda: out.update(x=torch.load(p, map_location="cuda")))
        out.clear()
        print(f"  round {r}: torch.load           {t:.3f} s {n / 2**30 / t:.1f} GiB/s", flush=True)
    os.unlink(p)


def backends(n: int, reps: int = 2) -> None:
    """ckptio.load from /dev/shm by backend (auto may take cuFile's compat mode
    there) and by the state of torch's cache (empty, or holding the last load)."""
    import ckptio

    sd = bench.synthetic_state_dict(n, "cuda", torch.bfloat16)
    p = "/dev/shm/probe-load.pt"
    ckptio.save(sd, p)
    out: dict = {}
    for backend in ("posix", None, "posix", None):
        for cache in ("empty", "held"):
            for _ in range(reps):
                out.clear()
                if cache == "empty":
                    torch.cuda.empty_cache()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out.update(x=ckptio.load(p, map_location="cuda", backend=backend))
                torch.cuda.synchronize()
                t = time.perf_counter() - t0
                rep = ckptio.last_report()
                print(
                    f"  backend={backend or 'auto'} ran={rep.device_path} ({rep.gds_mode}) "
                    f"cache={cache}: {t:.3f} s {n / 2**30 / t:.1f} GiB/s",
                    flush=True,
                )
    os.unlink(p)


def tmpfs_pages(n: int, threads: int = 8) -> None:
    """Reads of a /dev/shm file (``threads`` preads of 4 MiB) by the state of its
    pages: freshly allocated by the write, read before, rewritten in place,
    freshly allocated through a mapping. The slow read is each page's second
    access (write() counts as one, a fault through a mapping does not): the one
    where the kernel moves the page to its active LRU list."""

    path = "/dev/shm/probe-pages.bin"
    block = os.urandom(64 << 20)
    into = memoryview(mmap.mmap(-1, n))
    for off in range(0, n, len(block)):  # fault the destination in beforehand
        into[off : off + len(block)] = block[: n - off]

    def write(flags: int) -> None:
        fd = os.open(path, os.O_WRONLY | flags, 0o600)
        try:
            for off in range(0, n, len(block)):
                os.pwrite(fd, block[: n - off], off)
        finally:
            os.close(fd)

    def write_mapped() -> None:
        # A new file filled through a mapping: its pages are allocated by page
        # faults, which (unlike write()) do not count as an access; MADV_SEQUENTIAL
        # keeps munmap from counting one either.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, n)
            m = mmap.mmap(fd, n)
            m.madvise(mmap.MADV_SEQUENTIAL)
            for off in range(0, n, len(block)):
                m[off : off + len(block)] = block[: n - off]
            m.close()
        finally:
            os.close(fd)

    def then_reads(what: str, write_fn, k: int) -> None:
        t0 = time.perf_counter()
        write_fn()  # one thread, 64 MiB per call
        w = n / 2**30 / (time.perf_counter() - t0)
        gib = [n / 2**30 / bench.cold_read(path, into, 0, threads, 4 << 20) for _ in range(k)]
        reads = " ".join(f"{g:5.1f}" for g in gib)
        print(f"  {what:<28} write {w:5.1f}, then reads: {reads} GiB/s")

    try:
        for _ in range(2):
            then_reads("new file (fresh pages)", lambda: write(os.O_CREAT | os.O_TRUNC), 3)
            then_reads("rewritten in place", lambda: write(0), 2)
            then_reads("new file written by mmap", write_mapped, 3)
    finally:
        os.unlink(path)


def sources(n: int, rounds: int = 3, disk: str = "/tmp") -> None:
    """The engine's read of a checkpoint whose bytes are in memory, into host memory
    faulted in beforehand (the data path alone: no destination faults), right after
    the save ("first": freshly written pages) and again, through a mapping of the page
    cache and with pread; the file on /dev/shm, then on ``disk`` read once by ``cat``."""
    import subprocess

    import ckptio
    from ckptio import _native

    sd = bench.synthetic_state_dict(n, "cpu", torch.bfloat16)
    dst = torch.empty(n + (64 << 20), dtype=torch.uint8)
    dst.fill_(1)
    engines = {m: _native.Engine(memory_path=m) for m in ("map", "pread")}
    for where in ("/dev/shm", disk):
        p = os.path.join(where, "probe-sources.pt")
        for _ in range(rounds):
            for mode, eng in engines.items():
                ckptio.save(sd, p)
                if where != "/dev/shm":
                    bench.drop_cache(p)
                    subprocess.run(["cat", p], stdout=subprocess.DEVNULL, check=True)
                rd = _native.Reader(p)
                segs, at = [], dst.data_ptr()
                for name, off, size in rd.records():
                    if "/data/" in name:
                        segs.append((off, at, size, -1))
                        at += size
                gib = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    st = rd.read_into(eng, segs)
                    gib.append(n / 2**30 / (time.perf_counter() - t0))
                _native.host_memory()  # the mappings go before the next round
                print(
                    f"  {where:<9} {mode:<5} first {gib[0]:5.2f}, then {gib[1]:5.2f} {gib[2]:5.2f} "
                    f"GiB/s ({st['read_path']}: {st['read_reason']}, {st['threads']} threads)",
                    flush=True,
                )
                del rd
        os.unlink(p)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["first"]:
        first_touch(_size(sys.argv[2]))
    elif sys.argv[1:2] == ["bounce"]:
        for line in open("/sys/kernel/mm/transparent_hugepage/enabled"):
            print("  THP enabled:", line.strip())
        bounce(_size(sys.argv[2]), 16, ["anon+thp", "anon", "memfd"])
    elif sys.argv[1:2] == ["backends"]:
        backends(_size(sys.argv[2]))
    elif sys.argv[1:2] == ["alloc"]:
        alloc(_size(sys.argv[2]))
    elif sys.argv[1:2] == ["tmpfs"]:
        tmpfs_pages(_size(sys.argv[2]))
    elif sys.argv[1:2] == ["sources"]:
        sources(_size(sys.argv[2]))
    elif sys.argv[1:2] == ["loads"]:
        shm_loads(_size(sys.argv[2]))
    else:
        main()
