"""Memory that loads and stagings fill: fresh host memory, storages allocated
empty on their device, torch's CUDA cache.

A load's host storages and private staging buffers are fresh memory, and the
first touch of fresh memory costs a page fault per page: with 4 KiB pages as
much as the copy that fills it. Transparent huge pages in ``madvise`` mode
(the default of the hosts ckptio runs on) hand 2 MiB pages to memory that asks
before its first touch: 2.4x (16 cores) to 3.6x (2 cores) faster to fault in.

:func:`host_storage` is such memory (``_native.HostMemory``: an anonymous
mapping, advised MADV_HUGEPAGE, starting on a huge-page boundary), wrapped as
a torch storage that owns it: the mapping goes when the last tensor using it
does. ``CKPTIO_HUGE_PAGES=0`` turns the advice off (4 KiB pages, as before).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import gc
import os
from collections.abc import Iterator

import torch

from ckptio import _native

#: The page size O_DIRECT reads land on: host storages start at a file offset's
#: distance from one (its phase), so the reads need no staging copy.
PAGE = 4096


def host_storage(nbytes: int, phase: int = 0) -> torch.UntypedStorage:
    """``nbytes`` of uninitialised (zero-filled on first touch) host memory,
    starting ``phase`` bytes (0 to 4095) past a page boundary, huge pages asked for."""
    mem = _native.HostMemory(nbytes + phase)
    # A ctypes array over the mapping exports it to torch.frombuffer and holds
    # its owner: the storage keeps the array, the array keeps the mapping.
    buf = (ctypes.c_ubyte * (nbytes + phase)).from_address(mem.addr)
    buf._ckptio_owner = mem  # type: ignore[attr-defined]
    t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=phase)
    return t.untyped_storage()


def advise_shared(storage: torch.UntypedStorage) -> bool:
    """Ask for huge pages on a shared storage not touched yet (a memfd mapped by
    torch), where the host hands them to shared memory; whether it asked."""
    return bool(_native.advise_huge(storage.data_ptr(), storage.nbytes(), True))


def mappings() -> list[tuple[int, int, str, int]] | None:
    """This process's memory mappings as /proc/self/maps lists them, by address:
    (start, end, permissions such as ``"rw-p"``, file offset of the start);
    None where procfs cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            rows = []
            for line in f:
                span, perms, offset = line.split(None, 3)[:3]
                lo, hi = span.split("-")
                rows.append((int(lo, 16), int(hi, 16), perms, int(offset, 16)))
    except (OSError, ValueError):
        return None
    return rows


_MADV_POPULATE_WRITE = 23  # Linux 5.14
_populate_works = True


def populate(addr: int, nbytes: int) -> bool:
    """Fault in the whole pages of ``[addr, addr + nbytes)`` (writable memory of
    this process) in one call, the kernel's fast path (no trap per page); their
    contents stay as they are, so another thread may be writing them. Best
    effort: False where the kernel lacks MADV_POPULATE_WRITE (then never again)."""
    global _populate_works
    lo = -(-addr // 4096) * 4096
    hi = (addr + nbytes) // 4096 * 4096
    if not _populate_works or hi <= lo:
        return False
    if _libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == getattr(os, "EINVAL", 22):
        _populate_works = False
    return False


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def empty_storage(nbytes: int, device: torch.device, phase: int = 0) -> torch.UntypedStorage:
    """An uninitialised storage; large host ones are fresh anonymous memory with
    huge pages asked for (:func:`host_storage`: faulted in 2.4-3.6x faster than 4 KiB
    pages), starting ``phase`` bytes past a 4 KiB boundary (a file offset's
    distance from one) so that O_DIRECT reads land in them without a staging
    copy. (Like torch.load's mmap storages, they cannot be resized.)"""
    if device.type != "cpu" or nbytes < ALIGNED_ALLOC_MIN:
        return torch.UntypedStorage(nbytes, device=device)
    return host_storage(nbytes, phase % PAGE)


ALIGNED_ALLOC_MIN = 1 << 20


def reserve_cuda(device: torch.device, sizes: list[int]) -> None:
    """Leave one free segment in torch's CUDA cache that storages of ``sizes``
    (all bound for ``device``) are then carved from, instead of a cudaMalloc each.

    A load into a fresh process (resuming a run) otherwise makes hundreds of
    segments, and filling them costs more than the cudaMallocs: 8 GiB in 512
    storages from /dev/shm loaded in 0.21-0.24 s against 0.24-0.36 s
    (``probes/probe_hostreg.py alloc``). Each storage is still its own block:
    freeing one frees it, as after torch.load. Only with torch's own caching
    allocator (not cudaMallocAsync, not a pluggable one, whose statistics raise).
    """
    try:
        if torch.cuda.get_allocator_backend() != "native":
            return
        room, cached_free = cuda_room(device)
        max_split = torch.cuda.memory_stats(device).get("max_split_size", -1)
    except (RuntimeError, AttributeError):  # a pluggable allocator, an older torch
        return
    n = reservation(sizes, cached_free, room, max_split)
    if n:
        try:
            torch.empty(n, dtype=torch.uint8, device=device)  # freed at once, kept cached
        except torch.OutOfMemoryError:  # the room went meanwhile: allocate one by one
            pass


def cuda_room(device: torch.device | int) -> tuple[int, int]:
    """(bytes this process may still take from ``device`` as new segments, bytes
    torch's cache holds free there). set_per_process_memory_fraction caps the
    first below what the device has free. Raises RuntimeError where torch's
    allocator keeps no statistics (a pluggable one)."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    cached_free = held - torch.cuda.memory_allocated(device)
    try:
        fraction = torch.cuda.get_per_process_memory_fraction(device)
    except (RuntimeError, AttributeError):  # an allocator or a torch without one
        fraction = 1.0
    return min(free, int(total * fraction) - held), cached_free


def reservation(sizes: list[int], cached_free: int, room: int, max_split: int) -> int:
    """Bytes ``reserve_cuda`` asks for (0: none). Only storages over 1 MiB count
    (torch's large pool; smaller ones share 2 MiB segments anyway), rounded as
    torch rounds them, less what the cache holds free (a load after a load
    needs nothing; free pieces that fit are used first, torch picking the
    smallest free block that fits). None where the allocator would not split
    the segment (``max_split`` below it; -1: no limit), or where this process
    lacks the room plus a margin."""
    need = sum(-(-n // 512) * 512 for n in sizes if n > _SMALL_POOL_MAX) - cached_free
    if need < _RESERVE_MIN or need > room - _RESERVE_MARGIN or 0 <= max_split < need:
        return 0
    return need


_SMALL_POOL_MAX = 1 << 20
_RESERVE_MIN = 64 << 20
_RESERVE_MARGIN = 256 << 20


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a large pickle is written or read, or
    a load plans its tensors: they allocate many objects and no cycles, and the
    collections they set off walk every object the process tracks (200,000
    with torch imported: in-place loads of 512 tensors on the dev VM took 31 ms
    on average with it paused, 40 ms without, some 200 ms)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of a strided tensor's elements."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


class Claims:
    """Spans of memory claimed by reads so far, none overlapping another: a read
    straight into a destination claims its bytes; one whose bytes another read
    claimed (tied weights: two keys, one tensor) goes through a temporary and a
    copy instead, since two reads of one call cannot fill the same memory."""

    def __init__(self) -> None:
        self._starts: dict[int, list[int]] = {}  # per device code, sorted
        self._ends: dict[int, list[int]] = {}

    def claim(self, device: int, lo: int, nbytes: int) -> bool:
        """Claim ``[lo, lo + nbytes)`` of ``device`` (a device code) if free."""
        starts = self._starts.setdefault(device, [])
        ends = self._ends.setdefault(device, [])
        hi = lo + nbytes
        i = bisect.bisect_right(starts, lo)
        if (i and ends[i - 1] > lo) or (i < len(starts) and starts[i] < hi):
            return False
        starts.insert(i, lo)
        ends.insert(i, hi)
        return True
