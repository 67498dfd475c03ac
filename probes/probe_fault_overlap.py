"""Does faulting in fresh memory ahead of O_DIRECT reads hide the faults?

A load into new host tensors pays a page fault per 4 KiB page of its
destination (on the 2-core dev VM about as long as the disk read). This reads
a file cold with O_DIRECT (8 threads, 64 MiB chunks) into: a buffer already
faulted in; fresh memory (the kernel faults it in while pinning it for each
read); fresh memory that 1 or 2 threads fault in ahead of the readers
(MADV_POPULATE_WRITE per chunk, each read waiting for its chunk). Rounds
alternate; medians printed.

Usage: python probes/probe_fault_overlap.py FILE [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import threading

from ckptio.tools import bench

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23


def read_into(
    path: str, n: int, m: mmap.mmap, faulters: int, chunk: int, readers: int = 8
) -> float:
    """Seconds to read ``n`` bytes of ``path`` cold into ``m``, ``faulters``
    threads faulting its chunks in ahead of the ``readers``."""
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    count = (n + chunk - 1) // chunk
    ready = [threading.Event() for _ in range(count)]
    if not faulters:
        for e in ready:
            e.set()
    bench.drop_cache(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    view = memoryview(m)
    nxt = [0, 0]
    lock = threading.Lock()

    def take(i: int) -> int:
        with lock:
            k = nxt[i]
            nxt[i] += 1
        return k

    def fault() -> None:
        while (k := take(0)) < count:
            _libc.madvise(base + k * chunk, min(chunk, n - k * chunk), MADV_POPULATE_WRITE)
            ready[k].set()

    def read() -> None:
        while (k := take(1)) < count:
            ready[k].wait()
            o, end = k * chunk, min((k + 1) * chunk, n)
            while o < end:
                o += os.preadv(fd, [view[o:end]], o)

    threads = [threading.Thread(target=fault) for _ in range(faulters)]
    threads += [threading.Thread(target=read) for _ in range(readers)]
    s = bench.timed_threads(threads)
    view.release()
    os.close(fd)
    return s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    n = min(os.path.getsize(a.file) // 4096 * 4096, 1 << 30)
    # Private, as a load's storages are (mmap's default is shared: shmem).
    faulted = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
    faulted.write(b"\1" * n)
    cases = {
        "faulted buffer": (False, 0, 64 << 20),
        "fresh memory": (True, 0, 64 << 20),
        "fresh, 1 thread faulting ahead": (True, 1, 64 << 20),
        "fresh, 2 threads faulting ahead": (True, 2, 64 << 20),
        "fresh, 2 threads faulting ahead, 16 MiB": (True, 2, 16 << 20),
    }
    times: dict[str, list[float]] = {}
    for _ in range(a.rounds):
        for name, (fresh, faulters, chunk) in cases.items():
            m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE) if fresh else faulted
            times.setdefault(name, []).append(read_into(a.file, n, m, faulters, chunk))
            if fresh:
                m.close()
    for name, ts in times.items():
        print(f"{name:<42} {statistics.median(ts):.3f} s  ({' '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    main()
