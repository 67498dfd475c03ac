"""Fresh host memory for large storages, with huge pages asked for.

A load's host storages and private staging buffers are fresh memory, and the
first touch of fresh memory costs a page fault per page: with 4 KiB pages as
much as the copy that fills it. Transparent huge pages in ``madvise`` mode
(the default of the hosts ckptio runs on) hand 2 MiB pages to memory that asks
before its first touch: 2.4x (16 cores) to 3.6x (2 cores) faster to fault in.

:func:`empty_storage` is such memory (``_native.HostMemory``: an anonymous
mapping, advised MADV_HUGEPAGE, starting on a huge-page boundary), wrapped as
a torch storage that owns it: the mapping goes when the last tensor using it
does. ``CKPTIO_HUGE_PAGES=0`` turns the advice off (4 KiB pages, as before).
"""

from __future__ import annotations

import ctypes
import os

import torch

from ckptio import _native


def empty_storage(nbytes: int, phase: int = 0) -> torch.UntypedStorage:
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
