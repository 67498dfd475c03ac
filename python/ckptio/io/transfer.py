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
3. the native report (a dict) becomes the call's :class:`~ckptio.io.reports.IOReport`
   (:mod:`ckptio.io.reports`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ckptio import _native
from ckptio.io.devices import streams
from ckptio.io.engines import IoOptions

T = TypeVar("T")

#: (file offset, address, nbytes, device); device -1 is host memory.
Segment = tuple[int, int, int, int]


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
    writer: _native.AtomicWriter | _native.DeviceFile,
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


class File(Protocol):
    """A file of a read of several files: its name in reports, the native file."""

    path: str
    file: _native.Reader | _native.DeviceFile


def read_files(
    files: Sequence[File],
    per_file: dict[int, tuple[list[Segment], list[Any]]],
    io: IoOptions,
    verify: bool,
) -> list[dict[str, Any]]:
    """Read ``per_file`` ({index in ``files``: (segments, owners)}), the files side
    by side (:meth:`IoOptions.shared_engine`); one stats dict per file, with
    "path". ``verify``: each whole record read from a ``Reader`` is checked
    against its CRC-32."""
    engine, workers = io.shared_engine(len(per_file))

    def one(fi: int) -> dict[str, Any]:
        segs, owners = per_file[fi]
        f = files[fi]
        check = verify and isinstance(f.file, _native.Reader)
        return dict(read(f.file, engine, segs, owners, verify=check), path=f.path)

    if workers == 1:
        return [one(fi) for fi in per_file]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, per_file))


def release_buffers() -> int:
    """Give back the memory every ckptio engine keeps between transfers (staging
    and pinned bounce buffers); they are allocated again on need. Stagers free
    theirs on ``close()``. Returns the bytes given back."""
    return _native.release_buffers()


def replace_file(path: str, data: bytes) -> None:
    """A small file (an index, DCP's ``.metadata``) replaced atomically: a temp
    file beside it, fsync, rename, fsync of the folder."""
    w = _native.AtomicWriter(path, "off", None, False)
    try:
        w.write_bytes(0, data)
        w.commit()
    except BaseException:
        w.abort()
        raise
