"""Where a first host staging of a GPU state dict spends its time (decides how
ckptio.staging allocates and pins its buffers; GPU only).

    python benches/bench_staging.py --size 8G --tensors 512

For fresh staging buffers of each kind of memory (anonymous with and without
MADV_HUGEPAGE, an unnamed memfd, private and shared by descriptor as
DefaultStager makes them, torch's zero-filled shared memory), one 8 GiB state dict:
``pin-first``: each buffer is prefaulted and pinned whole by the first copy
thread that reaches it, then copied at the pinned speed (a first save); then the
same buffers again (the steady state); ``stage_pin ahead``: fresh buffers pinned
first (what ``DefaultStager.prepare`` does), then copied. Then the pinning of one
slab of the whole size (a single huge storage), and a plain pinned copy.
(Measured and dropped: a first copy to fresh pageable memory, pinned afterwards,
ran at 1.1 GiB/s, 5.5x slower than pinning first; through pinned bounce lanes,
0.51-0.55 s for 8 GiB against 0.59-0.67 s pinning first. With 64 MiB
registrations, before buffers were registered whole, one 8 GiB slab took
1.6-1.9 s to pin.)
"""

from __future__ import annotations

import argparse
import mmap
import time

import torch
from ckptio import _native
from ckptio.io.units import parse_size as _size
from ckptio.staging import _host_storage

GiB = 1 << 30


def buffers(n: int, each: int, kind: str) -> list[tuple[object, object]]:
    out = []
    for _ in range(n):
        if kind == "torch-shared":  # torch's shared memory (a zero-filled /dev/shm file)
            st = torch.UntypedStorage._new_shared(each)
            keep: object = st
        elif kind in ("memfd", "memfd-shared"):  # what DefaultStager uses
            st = _host_storage(each, shared=kind == "memfd-shared")
            keep = st
        else:
            # Private: mmap.mmap(-1, n) alone is shared anonymous memory (shmem),
            # which MADV_HUGEPAGE leaves in 4 KiB pages where shmem_enabled is
            # never (runs before 2026-12-01 measured that for "anon+thp").
            mm = mmap.mmap(-1, each, flags=mmap.MAP_PRIVATE)
            if kind == "anon+thp":
                mm.madvise(mmap.MADV_HUGEPAGE)
            st = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
            keep = (mm, st)
        out.append((keep, _native.HostPin(st, st.data_ptr(), each, pin=True, chunk_size=64 << 20)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8G")
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--threads", type=int, default=16)
    a = ap.parse_args()
    size = _size(a.size)
    each = size // a.tensors
    src = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(a.tensors)]
    torch.cuda.synchronize()

    def copy(bufs: list) -> float:
        jobs = [(s.data_ptr(), 0, p, 0, each) for s, (_, p) in zip(src, bufs, strict=True)]
        t0 = time.perf_counter()
        _native.stage_copy(jobs, src, threads=a.threads)
        return time.perf_counter() - t0

    def rate(t: float) -> str:
        return f"{t:6.3f} s {size / GiB / t:6.1f} GiB/s"

    for kind in ("anon+thp", "anon", "memfd", "memfd-shared", "torch-shared"):
        b = buffers(a.tensors, each, kind)
        t1 = copy(b)
        t2 = copy(b)
        print(f"{kind:12} pin-first       first {rate(t1)} | steady {rate(t2)}", flush=True)
        for _, p in b:
            p.close()
        del b
        b = buffers(a.tensors, each, kind)
        t0 = time.perf_counter()
        pinned = _native.stage_pin([p for _, p in b], a.threads)
        tp = time.perf_counter() - t0
        t1 = copy(b)
        print(
            f"{kind:12} stage_pin ahead {tp:6.3f} s ({pinned / GiB:.1f} GiB) "
            f"| first copy {rate(t1)}",
            flush=True,
        )
        for _, p in b:
            p.close()
        del b
    # One slab (anonymous memory with THP, as the anon+thp rows), pinned whole.
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    mm.madvise(mmap.MADV_HUGEPAGE)
    slab = torch.frombuffer(mm, dtype=torch.uint8)
    pin = _native.HostPin(slab, slab.data_ptr(), size, pin=True)
    t0 = time.perf_counter()
    _native.stage_pin([pin], a.threads)
    tp = time.perf_counter() - t0
    pin.close()
    print(f"slab of {size / GiB:.0f} GiB anon+thp, pinned whole {rate(tp)}")
    del slab
    mm.close()
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    print(f"plain pinned D2H {rate(time.perf_counter() - t0)}")


if __name__ == "__main__":
    main()
