"""Where a first host staging of a GPU state dict spends its time, and which
first-copy policy is faster (decides ckptio.staging's policy; GPU only).

    python benches/bench_staging.py --size 8G --tensors 512

For fresh staging buffers (anonymous and shared memory), one 8 GiB state dict:
``pin-first``: each chunk is prefaulted and pinned by the copy thread, then
copied at the pinned speed (a first save); then the same buffers again (the
steady state); ``stage_pin ahead``: fresh buffers pinned first (what
``DefaultStager.prepare`` does), then copied. Then a file in /dev/shm read to
the GPU through its mapped, registered pages, and a plain pinned copy.
(Measured once and dropped: a first copy to fresh pageable memory, pinned
afterwards, ran at 1.1 GiB/s, 5.5x slower than pinning first.)
"""

from __future__ import annotations

import argparse
import mmap
import os
import time

import torch
from ckptio import _native

GiB = 1 << 30


def buffers(n: int, each: int, shared: bool) -> list[tuple[object, object]]:
    out = []
    for _ in range(n):
        if shared:
            st = torch.UntypedStorage._new_shared(each)
            keep: object = st
        else:
            mm = mmap.mmap(-1, each)
            mm.madvise(mmap.MADV_HUGEPAGE)
            st = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
            keep = (mm, st)
        out.append((keep, _native.HostPin(st.data_ptr(), each, pin=True, chunk_size=64 << 20)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8G")
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--threads", type=int, default=16)
    a = ap.parse_args()
    size = int(a.size[:-1]) * GiB if a.size[-1] in "gG" else int(a.size)
    each = size // a.tensors
    src = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(a.tensors)]
    torch.cuda.synchronize()

    def copy(bufs: list) -> float:
        jobs = [(s.data_ptr(), 0, p, 0, each) for s, (_, p) in zip(src, bufs, strict=True)]
        t0 = time.perf_counter()
        _native.stage_copy(jobs, threads=a.threads)
        return time.perf_counter() - t0

    def rate(t: float) -> str:
        return f"{t:6.3f} s {size / GiB / t:6.1f} GiB/s"

    for shared in (False, True):
        kind = "shared" if shared else "anon"
        b = buffers(a.tensors, each, shared)
        t1 = copy(b)
        t2 = copy(b)
        print(f"{kind:6} pin-first       first {rate(t1)} | steady {rate(t2)}", flush=True)
        for _, p in b:
            p.close()
        del b
        b = buffers(a.tensors, each, shared)
        t0 = time.perf_counter()
        pinned = _native.stage_pin([p for _, p in b], a.threads)
        tp = time.perf_counter() - t0
        t1 = copy(b)
        print(
            f"{kind:6} stage_pin ahead {tp:6.3f} s ({pinned / GiB:.1f} GiB) "
            f"| first copy {rate(t1)}",
            flush=True,
        )
        for _, p in b:
            p.close()
        del b
    # Does the number of registrations matter? One slab, pinned in big chunks.
    for chunk in (64 << 20, 1 << 30):
        mm = mmap.mmap(-1, size)
        mm.madvise(mmap.MADV_HUGEPAGE)
        slab = torch.frombuffer(mm, dtype=torch.uint8)
        pin = _native.HostPin(slab.data_ptr(), size, pin=True, chunk_size=chunk)
        t0 = time.perf_counter()
        _native.stage_pin([pin], a.threads)
        tp = time.perf_counter() - t0
        pin.close()
        print(f"slab of {size / GiB:.0f} GiB, fresh, pinned in {chunk >> 20} MiB chunks {rate(tp)}")
        del slab
        mm.close()
    mapped_read(size, a.threads)
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(flat, non_blocking=True)
    torch.cuda.synchronize()
    print(f"plain pinned D2H {rate(time.perf_counter() - t0)}")


def mapped_read(size: int, threads: int) -> None:
    """A file in /dev/shm to the GPU without a CPU copy: map it, pin the mapped
    page-cache pages (cuMemHostRegister), DMA, unpin. Times each step."""
    path = "/dev/shm/ckptio_bench_mapped.bin"
    with open(path, "wb") as f:
        block = os.urandom(1 << 20) * 64
        for _ in range(0, size, len(block)):
            f.write(block)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    try:
        for window in (64 << 20, 256 << 20):
            with open(path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED)
            host = torch.frombuffer(mm, dtype=torch.uint8)
            pin = _native.HostPin(host.data_ptr(), size, pin=True, chunk_size=window)
            t0 = time.perf_counter()
            pinned = _native.stage_pin([pin], threads)
            tr = time.perf_counter() - t0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            tc = time.perf_counter() - t0
            t0 = time.perf_counter()
            pin.close()
            tu = time.perf_counter() - t0
            ok = torch.equal(dev[: 1 << 20].cpu(), host[: 1 << 20])
            del host
            mm.close()
            g = size / GiB
            print(
                f"mapped /dev/shm window {window >> 20} MiB, {threads} threads: register "
                f"{g / tr:6.1f} GiB/s ({pinned / GiB:.1f} GiB) | H2D {g / tc:6.1f} GiB/s | "
                f"unregister {g / tu:6.1f} GiB/s | all three in turn {g / (tr + tc + tu):6.1f} "
                f"GiB/s ok={ok}",
                flush=True,
            )
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
