"""One way through for every format's loads and saves.

``ckptio.save``/``load``, ``ckptio.safetensors``, the DCP reader and writer and
``GdsFile`` all move bytes the same way, through this module:

1. they list **segments**, ``(file offset, address, nbytes, device)`` with
   device -1 for host memory, and the **owners** of that memory (storages,
   tensors), which the native call holds until it returns;
2. :func:`write`, :func:`write_storages` or :func:`read` hands them to the
   native file (``AtomicWriter``, ``Reader`` or ``DeviceFile``) together with
   the **current CUDA stream** of every device involved: the core records an
   event there and orders its own copies after it (the bounce lanes' streams
   wait for it, cuFile transfers wait for it on the host), so work queued
   before the call is respected without stalling the host, and data loaded is
   ready for any stream when the call returns;
3. :func:`report` turns the native report into an :class:`IOReport`, which
   ``ckptio.last_report()`` returns.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from ckptio import _native

T = TypeVar("T")

#: (file offset, address, nbytes, device); device -1 is host memory.
Segment = tuple[int, int, int, int]


@dataclasses.dataclass(frozen=True)
class IOReport:
    """What one save or load did: how many bytes, how fast, through which path."""

    path: str
    nbytes: int
    seconds: float
    #: The backend in effect for CUDA memory, from the ``backend`` argument or
    #: CKPTIO_BACKEND: "auto" (cuFile where it takes the file, else bounce
    #: buffers; reads take bounce buffers where cuFile runs in compat mode),
    #: "cufile" or "bounce". What actually ran is ``device_path``.
    backend: str
    direct: bool
    direct_reason: str | None
    threads: int
    storages: int
    #: With cuFile: "p2p" (true GPUDirect) or "compat" (cuFile bounces through host memory).
    gds_mode: str | None = None
    #: Why device memory did not go through cuFile, when it did not.
    fallback_reason: str | None = None
    #: load(verify=True): every record's CRC-32 was checked (but those in ``unchecked``).
    verified: bool = False
    #: Records whose bytes could not be checked: no CRC-32 stored, or read by cuFile.
    unchecked: tuple[str, ...] = ()
    #: How CUDA memory moved: "cufile", "bounce" (pinned host buffers), or None
    #: when only host memory moved.
    device_path: str | None = None
    #: Page-locked host memory ckptio holds after the call, all engines and
    #: stagers together (``ckptio.release_buffers()`` gives the engines' back).
    pinned_bytes: int = 0
    #: Loads into existing tensors (``out=``, ``load_state_dict``) with
    #: strict=False: destinations the checkpoint had no tensor for, and
    #: checkpoint tensors without a destination (not read).
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    #: Loads: "memory" (the file's bytes were in memory: tmpfs, or cached pages)
    #: or "disk"; ``read_reason`` says why ("tmpfs", "page cache: 100% of ...
    #: sampled pages", "cold: ..."), ``read_source`` how ("map": copied from a
    #: mapping of the page cache, "pread", "direct": O_DIRECT, "buffered").
    read_path: str | None = None
    read_source: str | None = None
    read_reason: str | None = None
    #: Loads: bytes this process read from storage, and (``group=``, read once
    #: and shared) bytes it received from the other ranks of the group.
    bytes_read: int = 0
    bytes_received: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds > 0 else float("inf")


_last = threading.local()


def last_report() -> IOReport | None:
    """The report of this thread's last ckptio.save or ckptio.load."""
    return getattr(_last, "report", None)


def report(
    path: str,
    t0: float,
    stats: dict[str, Any],
    storages: int,
    verified: bool = False,
    unchecked: tuple[str, ...] = (),
) -> IOReport:
    """The IOReport of a native transfer's ``stats`` (also ``last_report()``'s)."""
    rep = IOReport(
        path=path,
        nbytes=stats["bytes"],
        seconds=time.perf_counter() - t0,
        backend=stats["backend"],
        direct=stats["direct"],
        direct_reason=stats["direct_reason"],
        threads=stats["threads"],
        storages=storages,
        gds_mode=stats.get("gds_mode"),
        fallback_reason=stats.get("fallback_reason"),
        verified=verified,
        unchecked=unchecked,
        device_path=stats.get("device_path"),
        pinned_bytes=stats.get("pinned_bytes", 0),
        read_path=stats.get("read_path"),
        read_source=stats.get("read_source"),
        read_reason=stats.get("read_reason"),
        bytes_read=stats.get("bytes_read", 0),
        bytes_received=stats.get("bytes_received", 0),
    )
    _last.report = rep
    return rep


def device_code(storage: torch.UntypedStorage | torch.Tensor, what: str) -> int:
    """-1 for host memory, the CUDA ordinal for device memory."""
    if isinstance(storage, torch.Tensor):  # 40 ns each, where .device costs 0.5 us
        if storage.is_cpu:
            return -1
        if storage.is_cuda:
            return storage.get_device()
    dev = storage.device
    if dev.type == "cpu":
        return -1
    if dev.type == "cuda":
        return dev.index if dev.index is not None else torch.cuda.current_device()
    raise ValueError(f"{what} is on device {dev}; ckptio moves cpu and cuda storages only")


def streams(devices: Iterable[int]) -> list[tuple[int, int]]:
    """(device, raw CUstream) of the current stream of each CUDA device in ``devices``."""
    return [(d, torch.cuda.current_stream(d).cuda_stream) for d in sorted(set(devices)) if d >= 0]


def _streams_of(segments: list[Segment]) -> list[tuple[int, int]]:
    return streams(s[3] for s in segments)


def write(
    target: _native.AtomicWriter | _native.DeviceFile,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    *,
    file_len: int | None = None,
    checksum: bool = False,
    patches: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Write ``segments`` (memory owned by ``owners``) into ``target``, after the
    work queued on the current streams; ``file_len`` is preallocated first, and
    ``checksum`` adds "crc32" (each segment's CRC-32, None where cuFile moved it).
    ``patches`` (an ``AtomicWriter``): [(segment index, file offset)] where the
    engine stores a segment's CRC-32 as its bytes pass (a zip data descriptor)."""
    streams = _streams_of(segments)
    if patches:
        return target.write_segments(  # type: ignore[call-arg]
            engine, segments, owners, streams, file_len, checksum, patches
        )
    return target.write_segments(engine, segments, owners, streams, file_len, checksum)


def write_archive(
    writer: _native.AtomicWriter,
    engine: _native.Engine,
    entries: list[tuple[str, Any, int]],
    prefix: str,
    owners: list[Any],
) -> dict[str, Any]:
    """Write a whole torch.save archive into ``writer``: ``entries`` = [(record
    name, bytes or (address, nbytes, device), alignment)] in file order, the
    storages' memory owned by ``owners``, after the work queued on the current
    streams; headers and data in one engine pass, then the central directory."""
    devices = (e[1][2] for e in entries if isinstance(e[1], tuple))
    return writer.write_archive(engine, entries, prefix, owners, streams(devices))


def write_storages(
    writer: _native.AtomicWriter,
    engine: _native.Engine,
    storages: list[tuple[str, int, int, int]],
    owners: list[Any],
) -> dict[str, Any]:
    """Write (key, address, nbytes, device) storages into their records of the
    torch.save archive in ``writer``, and fill the records' CRC-32s."""
    return writer.write_storages(engine, storages, owners, streams(s[3] for s in storages))


def read(
    source: _native.Reader | _native.DeviceFile,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    *,
    verify: bool = False,
) -> dict[str, Any]:
    """Fill ``segments`` (memory owned by ``owners``) from ``source``, after the
    work queued on the current streams (which may still use the destinations);
    the data is ready for any stream on return. ``verify`` (a ``Reader``): check
    each whole record read against its CRC-32; (a ``DeviceFile``) return each
    segment's CRC-32 as "crc32", for the caller to check."""
    return _read(source, engine, segments, owners, _streams_of(segments), verify)


def read_while(
    source: _native.Reader,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    meanwhile: Callable[[], T],
    *,
    verify: bool = False,
) -> tuple[dict[str, Any], T]:
    """:func:`read`, with ``meanwhile()`` run on the calling thread while the
    engine reads on another (the native read holds no GIL): (the read's stats,
    ``meanwhile``'s result). ``meanwhile`` must not touch the destinations'
    bytes: making the tensors of a load over its storages is what it is for.
    An error of the read comes first, then one of ``meanwhile``."""
    streams = _streams_of(segments)  # the caller's current streams (thread-local)
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["stats"] = _read(source, engine, segments, owners, streams, verify)
        except BaseException as e:  # re-raised on the calling thread
            done["error"] = e

    reader = threading.Thread(target=run, name="ckptio-read", daemon=True)
    reader.start()
    try:
        result = meanwhile()
    finally:
        reader.join()
        if "error" in done:
            raise done["error"]
    return done["stats"], result


def _read(
    source: _native.Reader | _native.DeviceFile,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    streams: list[tuple[int, int]],
    verify: bool,
) -> dict[str, Any]:
    if verify:
        stats = source.read_segments(engine, segments, owners, streams, True)  # type: ignore[call-arg]
    else:
        stats = source.read_segments(engine, segments, owners, streams)
    stats["bytes_read"] = stats["bytes"]
    return stats


def release_buffers() -> int:
    """Give back the memory every ckptio engine keeps between transfers (staging
    and pinned bounce buffers); they are allocated again on need. Stagers free
    theirs on ``close()``. Returns the bytes given back."""
    return _native.release_buffers()
