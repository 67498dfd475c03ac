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
