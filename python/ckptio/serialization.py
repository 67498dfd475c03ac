"""``ckptio.save`` / ``ckptio.load`` / ``ckptio.records``: torch.save and torch.load
through the ckptio engine.

``save`` pickles the object as torch.save does (natively for state dicts, byte
for byte torch's pickle), lays the archive out (``formats.torchzip``) and hands
it to the Rust core in one call: headers and storages written by the engine in
few large I/Os, CRC-32s stored as the bytes pass, committed atomically.

``load`` is a router and its executors. The router (:func:`_torch_loads` before
the file is opened, :func:`_opened` after) says in one place when torch.load must
run as is; otherwise the pickle is read natively where it is a plain state dict
(:func:`_plan_native`), else torch.load rebuilds the object over a lazy mapping
of the file that is never read (:class:`_Restorer`), or, where the pickle may
read tensor values as it decodes, over storages the engine has filled before
(:func:`_load_prefilled`); either way each storage is allocated empty on its
destination and the engine reads every record straight into it. ``out=`` loads
in place (``ckptio.loading.inplace``).
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.serialization import config as _torch_config

from ckptio import _native
from ckptio import safetensors as _safetensors
from ckptio.errors import (
    CkptioError,
    FormatError,
    LocationError,
    MapLocationError,
    NotPickleError,
    PickleEndError,
    corrupt,
    save_destination_error,
)
from ckptio.formats import detect, torchzip
from ckptio.formats.torchzip import RecordInfo as RecordInfo
from ckptio.formats.torchzip import TensorInfo as TensorInfo
from ckptio.io import devices, memory, paths, remote, reports, transfer
from ckptio.io.devices import MapLocation
from ckptio.io.engines import IoOptions
from ckptio.io.reports import IOReport as IOReport
from ckptio.io.reports import last_report as last_report
from ckptio.loading import inplace, sharing, stored

__all__ = ["save", "load", "records", "last_report", "IOReport", "RecordInfo", "TensorInfo"]


# --------------------------------------------------------------------------- save


@torchzip.callers_serialization
def save(
    obj: object,
    f: str | os.PathLike[str] | Any,
    pickle_module: Any = pickle,
    pickle_protocol: int = torch.serialization.DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    backend: str | None = None,
    storage_options: remote.StorageOptions = None,
) -> None:
    """Save ``obj`` like ``torch.save(obj, f)``, fast and crash-safe.

    Takes torch.save's arguments with their meaning. The file is a regular
    torch.save zip archive (plain ``torch.load`` reads it, also with
    ``mmap=True``) whose storages of 1 MiB or more start at multiples of 4096
    bytes, smaller ones packed at torch's 64 bytes; where
    ``torch.utils.serialization.config.save.storage_alignment`` is set (as the
    GPUDirect Storage tutorial sets it), every storage starts at a multiple of
    it. (With a ``pickle_module`` or ``pickle_protocol`` of the caller's, or
    ``_disable_byteorder_record``, torch pickles and every storage starts at
    4096 at least.) It is written to a temp file in the same folder and renamed
    over ``f`` only once complete and fsynced: a failed or killed save leaves
    the previous file untouched. Returns None, as torch.save does;
    ``ckptio.last_report()`` says how it ran.

    ``f`` may also be a file object, as for torch.save. Over a regular file
    (``open(path, "wb")``, at position 0, not in append mode) the metadata goes
    through the object and the storages' bytes through the engine straight
    into the same file (O_DIRECT where the file takes it), every record with
    its CRC-32; what is lost is the atomic replace and fsync (the caller owns
    the file: a crash midway leaves it torn).
    Other objects (BytesIO, pipes) get the same bytes written through the
    object by torch itself (no engine, no O_DIRECT, no atomic replace).
    ``_use_new_zipfile_serialization=False`` (torch's legacy format), and saves
    under ``torch.serialization.skip_data()``, are written by torch itself,
    atomically for a path.

    threads / chunk_size: I/O threads and bytes per chunk (defaults from
    CKPTIO_THREADS / CKPTIO_CHUNK_SIZE, else 8 and 16 MiB; files on tmpfs get
    CKPTIO_MEMORY_THREADS / CKPTIO_MEMORY_CHUNK_SIZE, else one per core within 8-32
    and 4 MiB, unless given here or by CKPTIO_THREADS / CKPTIO_CHUNK_SIZE: there
    I/O is memory copies, which scale with cores).
    direct: O_DIRECT "auto" (default: where the filesystem takes it), True/"on"
    (required) or False/"off". backend: how CUDA storages move, "auto" (default, or
    CKPTIO_BACKEND: cuFile where it can register the file, else pinned bounce
    buffers; loads take the bounce buffers where cuFile runs in compat mode),
    "cufile" (or an error) or "bounce" (pinned bounce buffers). What ran is
    the report's ``device_path``.
    Bytes are copied after the work queued on the current CUDA streams (the
    copies wait for it on the GPU; the host is not blocked for it).

    ``f`` may be an object URL (``s3://bucket/key``, ``gs://``, ``az://``): the
    archive is uploaded in parallel parts as one multipart upload, whose
    completion replaces the object whole (a failed save leaves the old one);
    the parts are made straight from the tensors' memory, host or CUDA
    (CRC-32s as the bytes pass), or, for torch's own pickling arguments and
    legacy format, uploaded in parts as torch.save writes them (no local copy;
    under ``torch.serialization.skip_data()``, a file written first in a local
    scratch folder: ``CKPTIO_SCRATCH``, else the temp folder). ``storage_options``: the
    store's settings over the standard variables (``ckptio.io.remote``;
    docs/objectstore.md).
    """
    torch_args = (pickle_module, pickle_protocol, _disable_byteorder_record)
    remote.check_options(f, storage_options, single=True)
    if remote.is_url(f) and not _skipping_data():
        url = os.fsdecode(os.fspath(f))
        if _use_new_zipfile_serialization and _packs(*torch_args):
            _save_remote(obj, url, storage_options)
        else:
            _save_streamed(obj, url, storage_options, torch_args, _use_new_zipfile_serialization)
        return
    if remote.is_url(f) or storage_options is not None:
        kw: dict[str, Any] = dict(
            threads=threads, chunk_size=chunk_size, direct=direct, backend=backend
        )
        new_zip, no_byteorder = _use_new_zipfile_serialization, _disable_byteorder_record
        args = (pickle_module, pickle_protocol, new_zip, no_byteorder)
        remote.via_local(f, storage_options, lambda p: save(obj, p, *args, **kw), write=True)
        return
    paths.file_like(f, "save", "write")
    io = IoOptions.of(threads, chunk_size, direct, backend)
    t0 = time.perf_counter()
    engine = io.engine()
    by_torch = _torch_writes(_use_new_zipfile_serialization)
    if not paths.is_path(f):
        _save_object(obj, f, torch_args, _use_new_zipfile_serialization, engine, io, t0)
        return
    path = paths.path(f, "save")
    if by_torch is None and _packs(*torch_args):
        _save_packed(obj, path, engine, io, t0)
        return
    writer = _atomic_writer(path, io)
    try:
        found: dict[str, torch.UntypedStorage] = {}
        try:
            with os.fdopen(os.dup(writer.fileno()), "wb") as fh:
                if by_torch is not None:
                    zip_ = _use_new_zipfile_serialization
                    with torchzip.torch_writing():
                        torch.save(obj, fh, pickle_module, pickle_protocol, zip_, *torch_args[2:])
                else:
                    torchzip.write_metadata(obj, fh, found, *torch_args)
        except OSError as e:
            if e.errno is None or e.filename is not None:
                raise
            # torch wrote the metadata through a file object: name the file.
            raise OSError(
                e.errno, f"writing checkpoint metadata failed: {e.strerror}", writer.tmp_path
            ) from e
        if by_torch is None:
            storages = _storage_segments(found)
            stats = transfer.write_storages(writer, engine, storages, list(found.values()))
        else:
            stats = reports.torch_stats(os.path.getsize(writer.tmp_path), by_torch)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    reports.report(path, t0, stats, len(found))


def _atomic_writer(path: str, io: IoOptions) -> _native.AtomicWriter:
    """The destination opened: a missing folder, a folder, an empty name are
    also the RuntimeError torch.save raises for them (``errors.save_destination_error``)."""
    try:
        return _native.AtomicWriter(path, io.direct, io.backend)
    except (OSError, ValueError) as e:
        err = save_destination_error(e, path)
        if err is e:
            raise
        raise err from None


def _torch_writes(new_zip: bool) -> str | None:
    """Why torch.save itself must write the whole file, or None: torch's legacy
    format (no records to place), or the caller's ``torch.serialization.skip_data()``
    (no storage bytes to write: torch leaves their space empty)."""
    if not new_zip:
        return "legacy format: torch wrote it"
    if _skipping_data():
        return "skip_data: torch wrote the file without storage bytes"
    return None


def _skipping_data() -> bool:
    """Whether the caller is inside ``torch.serialization.skip_data()`` (torch
    keeps it in a thread-local of its own)."""
    return bool(torch.serialization._serialization_tls.skip_data)


def _packs(pickle_module: Any, pickle_protocol: int, disable_byteorder: bool) -> bool:
    """Whether ckptio pickles and lays out the archive itself: torch.save's own
    pickle arguments (``torchzip`` pickles protocol 2 as torch's default
    pickler does)."""
    return pickle_module is pickle and pickle_protocol == 2 and not disable_byteorder


def _save_packed(obj: object, path: str, engine: _native.Engine, io: IoOptions, t0: float) -> None:
    """``save`` to a path, the archive laid out here (small storages packed) and
    written by the engine in one pass."""
    with memory.gc_paused():
        pkl, storages = torchzip.pickled(obj)
        entries = torchzip.archive_entries(pkl, storages, torchzip.asked_alignment())
    writer = _atomic_writer(path, io)
    try:
        owners = [s[4] for s in storages]
        stats = transfer.write_archive(writer, engine, entries, torchzip.PREFIX, owners)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    reports.report(path, t0, stats, len(storages))


def _save_remote(obj: object, url: str, options: remote.StorageOptions) -> None:
    """``save`` to an object, the archive laid out here and uploaded part by
    part straight from the storages' memory (host or CUDA)."""
    t0 = time.perf_counter()
    with memory.gc_paused():
        pkl, storages = torchzip.pickled(obj)
        entries = torchzip.archive_entries(pkl, storages, torchzip.asked_alignment())
    stats = transfer.upload_archive(url, entries, [s[4] for s in storages], options)
    reports.report(url, t0, stats, len(storages))


def _save_streamed(
    obj: object,
    url: str,
    options: remote.StorageOptions,
    torch_args: tuple[Any, int, bool],
    new_zip: bool,
) -> None:
    """``save`` to an object where torch.save writes the bytes (its pickling
    arguments, its legacy format): uploaded in parts as torch writes them
    (``remote.ObjectFile``), no local copy; committed once torch.save returns."""
    t0 = time.perf_counter()
    why = _torch_writes(new_zip) or "torch's pickling arguments: torch wrote the archive"
    with remote.ObjectFile(url, options) as fh:
        with torchzip.torch_writing():
            # torch's stubs: a path or an IO; a RawIOBase is a file object it writes to
            torch.save(obj, fh, torch_args[0], torch_args[1], new_zip, torch_args[2])  # type: ignore[arg-type]
    assert fh.committed is not None
    stats = dict(reports.torch_stats(fh.committed["size"], why), backend="store")
    reports.report(url, t0, stats, 0)


def _save_object(
    obj: object,
    f: Any,
    torch_args: tuple[Any, int, bool],
    new_zip: bool,
    engine: _native.Engine,
    io: IoOptions,
    t0: float,
) -> None:
    """``save`` into a file object (see its docstring)."""
    by_torch = _torch_writes(new_zip)
    fd = paths.descriptor(f) if by_torch is None else None
    dev_file = None
    if fd is not None:
        try:  # a second open of the very file, for the engine
            dev_file = _native.DeviceFile(f"/proc/self/fd/{fd}", True, io.direct, io.backend)
        except OSError:  # e.g. the file's mode forbids a new open for writing
            dev_file = None
    name = paths.object_name(f, fd)
    if dev_file is None:
        start = _position(f)
        with torchzip.torch_writing():
            torch.save(obj, f, torch_args[0], torch_args[1], new_zip, torch_args[2])
        end = _position(f)
        n = end - start if start is not None and end is not None else 0
        why = by_torch or "a file object without a usable descriptor"
        reports.report(name, t0, reports.torch_stats(n, why), 0)
        return
    found: dict[str, torch.UntypedStorage] = {}
    f.flush()
    torchzip.write_metadata(obj, f, found, *torch_args)
    f.flush()
    # Into their records, and each record's CRC-32 (the bytes pass through
    # this process: verify and load(verify=True) protect the file as a path's).
    storages = _storage_segments(found)
    stats = transfer.write_storages(dev_file, engine, storages, list(found.values()))
    f.seek(0, os.SEEK_END)  # as after torch.save: at the end of what the save wrote
    reports.report(name, t0, stats, len(found))


def _position(f: Any) -> int | None:
    """``f.tell()``, None for a stream without one (a pipe, a socket)."""
    try:
        return int(f.tell())
    except (AttributeError, OSError, ValueError):
        return None


def _storage_segments(found: dict[str, torch.UntypedStorage]) -> list[tuple[str, int, int, int]]:
    """(key, address, nbytes, device) of each storage torch.save filed under key."""
    return [
        (key, st.data_ptr(), st.nbytes(), devices.device_code(st, f"storage {key}"))
        for key, st in found.items()
    ]


# --------------------------------------------------------------------------- load: the router


@sharing.groupable("ckptio.load")
@torchzip.callers_serialization
def load(
    f: str | os.PathLike[str] | Any,
    map_location: MapLocation = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    backend: str | None = None,
    verify: bool = False,
    out: Any = None,
    strict: bool = True,
    cast: bool = False,
    group: Any = None,
    storage_options: remote.StorageOptions = None,
    **pickle_load_args: Any,
) -> Any:
    """Load a torch.save zip checkpoint like ``torch.load``, bytes read in parallel.

    Takes torch.load's arguments with their meaning (``weights_only`` resolves
    as torch resolves it: True unless a ``pickle_module`` is given or
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says otherwise). Reads any torch.save zip
    file (also 64-byte-aligned ones from plain torch.save). Views and shared
    storages stay shared. Storages mapped to a CUDA device are read straight
    into device memory (cuFile or pinned bounce buffers, see ``save``'s
    ``backend``) and are ready for kernels on any stream when load returns.
    ``ckptio.last_report()`` says which path ran.

    Where ckptio cannot do better, torch.load runs as is, on the same file:
    ``mmap=True``; ``map_location="meta"`` and under ``FakeTensorMode`` (no
    bytes to read); tensor subclasses that torch rebuilds from the
    ``map_location`` itself; byte-swapped storages; TorchScript and
    torch's legacy (non-zip) files. A pickle whose decoding may read tensor
    values (sparse and nested tensors; with ``weights_only=False``, any global
    outside torch's weights-only allow-list: a class of yours whose
    ``__setstate__`` reads its tensors, a quantized module, a Generator, an
    ``argparse.Namespace`` of hyperparameters) has every storage read by the
    engine first, then decoded by torch.load over them (the report's
    ``direct_reason`` says so); with a callable ``map_location``, or a
    location the engine does not fill, torch.load reads it as is.
    A path ending in ``.safetensors`` is read
    by ``ckptio.safetensors.load_file``, as torch.load hands it to safetensors.
    ``f`` may be a file object: over a regular file (at position 0) the engine
    reads the very file behind its descriptor; other objects (BytesIO) go
    through torch.load.

    ``verify=True`` checks every record against its CRC-32 before returning:
    the pickle before it is unpickled, each storage over the bytes read (in
    the I/O threads), and raises ``ckptio.FormatError`` naming the first bad
    record. Records without a stored CRC-32, and those read by cuFile, are
    listed in ``last_report().unchecked``. It needs a path or a file object
    over a regular file.

    ``out``: load in place. ``out`` is a structure like the checkpoint's
    (nested dicts, lists, tuples) whose tensors exist already, on the host or
    any CUDA device: each tensor of the checkpoint is read straight into the
    tensor of ``out`` at the same key path (contiguous ones directly, others
    through a temporary of at most 64 MiB at a time), with no allocation for
    the checkpoint. Returns the checkpoint's structure as torch.load would,
    its tensors being ``out``'s (filled) and its other values torch.load's.
    Shapes must match; dtypes too unless ``cast=True``. ``strict`` (default):
    every tensor of ``out`` must have one in the checkpoint and the other way
    round; with strict=False the others are left alone (checkpoint tensors
    without a destination are not read and are left out of the result) and
    listed in ``last_report().missing_keys`` / ``unexpected_keys``. Every
    mismatch is found before anything is written (``ckptio.InPlaceLoadError``
    subclasses, naming the keys); a read that fails midway is a
    ``PartialLoadError`` (the destinations are partially filled).
    ``map_location`` and ``mmap`` do not apply (the destinations decide); ``f``
    is a path or a file object over a regular file.

    ``group``: a ``torch.distributed`` process group whose ranks all call
    ``load`` of the same checkpoint together (with ``out=`` too): each byte is
    read from storage by one rank (the storages split between the ranks by
    bytes) and shared over the group's collectives (NCCL for CUDA memory,
    gloo for host memory), every rank getting the whole result. Ranks that
    see a different file raise ``ckptio.GroupMismatchError`` together; a rank
    whose load fails raises its error, every other rank
    ``ckptio.PeerLoadError``. ``last_report().bytes_read`` / ``bytes_received``
    say what came from storage and from the other ranks. See docs/group.md.

    ``f`` may be an object URL (``s3://bucket/key``, ``gs://``, ``az://``; with
    ``storage_options`` as for ``save``): one version of the object is read by
    parallel ranged GETs, a plain state dict's storages straight into its
    tensors (its directory and small records in two requests, each storage's
    local header in the same GET as its bytes; CUDA destinations through a
    bounded host buffer; ``verify=True`` checks the CRC-32s on the way); with
    ``out=``, ``group=``, pickle arguments or what torch.load must unpickle,
    into a local scratch copy, loaded as above, and removed.
    """
    remote.check_options(f, storage_options, single=True)
    if remote.is_url(f) and out is not None and not (pickle_load_args or mmap):
        inplace.check_flags(strict=strict, cast=cast, verify=verify)
        if map_location is None and pickle_module is None:
            torchzip.resolve_weights_only(weights_only, pickle_module)
            got = _load_into_remote(os.fsdecode(os.fspath(f)), out, storage_options, verify)
            if got is not _NOT_STRAIGHT:
                return got
    straight = _straight_from_store(map_location, pickle_module, mmap, out)
    if remote.is_url(f) and straight and not pickle_load_args:
        torchzip.resolve_weights_only(weights_only, pickle_module)
        obj = _load_remote(os.fsdecode(os.fspath(f)), map_location, storage_options, verify)
        if obj is not _NOT_STRAIGHT:
            return obj
    if remote.is_url(f) or storage_options is not None:
        kw: dict[str, Any] = dict(
            map_location=map_location, pickle_module=pickle_module, weights_only=weights_only,
            mmap=mmap, threads=threads, chunk_size=chunk_size, direct=direct, backend=backend,
            verify=verify, out=out, strict=strict, cast=cast, group=group,
        )  # fmt: skip
        return remote.via_local(
            f, storage_options, lambda p: load(p, **kw, **pickle_load_args), write=False
        )
    t0 = time.perf_counter()
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, not {type(verify).__name__}")
    paths.file_like(f, "load", "read")
    weights_only = torchzip.resolve_weights_only(weights_only, pickle_module)
    torch_kw: dict[str, Any] = dict(
        pickle_module=pickle_module, weights_only=weights_only, **pickle_load_args
    )
    io = IoOptions.of(threads, chunk_size, direct, backend)
    if out is not None:
        return _load_into(f, out, map_location, mmap, torch_kw, strict, cast, verify, io)
    if paths.is_path(f):
        path = shown = paths.path(f, "load")
        if path.endswith(".safetensors"):  # torch.load hands these to safetensors
            return _load_safetensors(path, map_location, io)
    else:
        fd = paths.descriptor(f)
        if fd is None:
            if verify:
                raise ValueError(
                    f"load(verify=True) needs a path or a file object over a regular file, "
                    f"not {type(f).__name__}"
                )
            no_fd = "a file object without a usable descriptor"
            return _by_torch(t0, f, no_fd, map_location, mmap=mmap, **torch_kw)
        path, shown = f"/proc/self/fd/{fd}", paths.object_name(f, fd)
    why = _torch_loads(path, map_location, mmap)
    if why == "mmap":
        torchzip.refuse_deflated_mmap(path, shown)
    archive = None
    if why is None:
        archive, why = _opened(path, shown, io)
    if why is not None:
        if verify:  # torch reads the bytes itself here: check the whole file first.
            _verify_all(path, io, why, shown)
        try:
            return _by_torch(t0, path, why, map_location, mmap=mmap, name=shown, **torch_kw)
        except PickleEndError as e:
            if why not in (detect.NOT_LEGACY, detect.LEGACY):
                raise
            # No zip: the file itself is the pickle, cut short (or empty).
            raise corrupt(shown, f"{why}, and a pickle that ends early", PickleEndError) from e
        except pickle.UnpicklingError as e:
            if why != detect.NOT_LEGACY or isinstance(e, FormatError):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            raise corrupt(shown, f"{why} (torch.load: {first})", NotPickleError) from e
    assert archive is not None
    return _load_archive(t0, archive, map_location, torch_kw, io, verify)


#: What ``_load_remote`` returns where the object goes through a scratch copy.
_NOT_STRAIGHT = object()


def _straight_from_store(
    map_location: MapLocation,
    pickle_module: Any,
    mmap: bool | None,
    out: Any,
) -> bool:
    """Whether a load from a store may read the storages straight into new
    tensors (``_load_remote``): none of what needs a local file."""
    return (
        out is None and pickle_module is None
        and not (mmap or (mmap is None and _torch_config.load.mmap))
        and (map_location is None or isinstance(map_location, (str, torch.device, dict)))
    )  # fmt: skip


def _load_remote(
    url: str, map_location: MapLocation, options: remote.StorageOptions, verify: bool
) -> Any:
    """A torch.save object loaded from a store with no local copy: the
    directory and small records mapped in few requests, the pickle read
    natively, each storage's bytes read into its memory (host, or CUDA through
    a bounded host buffer) by ranged GETs of one version that also bring its
    local header (which confirms where the data lies). ``verify``: every
    record's CRC-32 checked (the small ones before the pickle is read, each
    storage's over its bytes as they arrive). ``_NOT_STRAIGHT`` where the
    archive or its pickle needs torch.load, or its layout is not torch.save's."""
    t0 = time.perf_counter()
    if url.endswith(".safetensors"):
        return _NOT_STRAIGHT
    try:
        mapped = torchzip.map_stored(url, options)
    except FormatError:
        head, info = remote.read(url, 0, detect.HEAD, options)
        if detect.torch_load_reads(head, info["size"]) is not None:
            return _NOT_STRAIGHT  # no zip archive: torch.load reads a local copy
        raise
    archive = mapped.archive
    prefix = archive.prefix
    # The pickle and the small records, before anything is decoded.
    small_unchecked = stored.check_small_records(url, mapped) if verify else []
    if f"{prefix}/constants.pkl" in archive.where or not torchzip.native_byteorder(archive):
        return _NOT_STRAIGHT
    got = torchzip.native_pickle(archive)
    if got is None:
        return _NOT_STRAIGHT
    parsed, found = got
    dests = []
    for _, _, _, location in found:
        dev = devices.fill_device(map_location, location)
        if dev is None:  # a location torch.load must restore
            return _NOT_STRAIGHT
        dests.append(dev)
    storages = [
        memory.empty_storage(n, dev) for (_, n, _, _), dev in zip(found, dests, strict=True)
    ]
    # Each storage's local header and data follow each other: one GET brings
    # both (CUDA storages: the data through the core's bounded host buffer).
    reads = [
        ((off, st.data_ptr(), n, devices.device_code(st, "storage")), st)
        for (off, n, _, _), st in zip(found, storages, strict=True)
        if n
    ]
    plan = stored.Reads(stored.StoredFile.of_archive(mapped), reads)
    [stats] = stored.read_all([plan], options, verify)  # once over a group, where there is one
    if plan.moved():
        return _NOT_STRAIGHT  # not torch.save's layout: the scratch copy reads it
    unchecked = [*small_unchecked, *stats.get("unchecked", ())]
    obj = torchzip.rebuild(parsed, storages, [f[2] for f in found], url)
    reports.report(url, t0, stats, len(found), verify, tuple(unchecked))
    return obj


def _load_into_remote(url: str, out: Any, options: remote.StorageOptions, verify: bool) -> Any:
    """``load(url, out=out)`` with no local copy, for the usual case: every
    tensor of the checkpoint pairs with a destination of ``out`` (and every
    destination with one), each read straight into it (``loading.stored``;
    ``verify``: only where each tensor covers its whole record, whose CRC-32
    is then checked). ``_NOT_STRAIGHT`` otherwise, or where a header says the
    layout is not torch.save's: the scratch copy loads it (writing every
    destination again), with the in-place machinery's checks and errors."""
    t0 = time.perf_counter()
    opened = stored.open_archive(url, options, verify)
    if opened is None:
        return _NOT_STRAIGHT
    meta, files, small_unchecked = opened
    result, pairs, missing, unexpected = inplace.pair_structure(meta, out)
    if missing or unexpected:
        return _NOT_STRAIGHT
    got = stored.read_pairs(url, files, pairs, options, verify)
    if got is None:
        return _NOT_STRAIGHT
    stats, unchecked, n = got
    reports.report(url, t0, stats, n, verify, (*small_unchecked, *unchecked))
    return result


def _torch_loads(path: str, map_location: MapLocation, mmap: bool | None) -> str | None:
    """Why torch.load must read ``path`` as is (known before it is opened), or
    None: ``mmap`` (the argument, else torch's ``config.load.mmap``), nothing to
    read (``skip_data``, meta, FakeTensorMode) or a file that is no zip archive
    (``detect.torch_load_reads``: torch reads it as its legacy format)."""
    if mmap or (mmap is None and _torch_config.load.mmap):
        return "mmap"
    if _skipping_data():
        return "skip_data: nothing to read"
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "meta":
        return "map_location meta: nothing to read"
    if torch._guards.detect_fake_mode(None) is not None:
        return "FakeTensorMode: nothing to read"
    with paths.open_regular(path) as fh:
        return detect.torch_load_reads(fh.read(detect.HEAD), os.fstat(fh.fileno()).st_size)


def _opened(path: str, shown: str, io: IoOptions) -> tuple[torchzip.Archive | None, str | None]:
    """The archive opened, and why torch.load must read it after all (None: it
    need not): a TorchScript archive (handed to torch.jit), records a zip tool
    compressed (inflated by torch), byte-swapped storages (swapped by torch)."""
    try:
        archive = torchzip.open_archive(path, io.direct, io.backend, shown)
    except torchzip.ReadByTorch as e:
        return None, e.why
    if f"{archive.prefix}/constants.pkl" in archive.where:
        return archive, torchzip.TORCHSCRIPT
    if not torchzip.native_byteorder(archive):
        return archive, "byte-swapped storages"
    return archive, None


# --------------------------------------------------------------------------- load: executors


def _by_torch(
    t0: float, src: Any, why: str, *args: Any, name: str | None = None, **kwargs: Any
) -> Any:
    """torch.load as is; the report says so."""
    shown = name or (os.fsdecode(src) if paths.is_path(src) else paths.object_name(src))
    given = (args[0] if args else kwargs.get("map_location")) is not None
    with torchzip.unpickling(shown, caller_location=given):
        obj = torch.load(src, *args, **kwargs)
    try:
        n = os.path.getsize(src) if paths.is_path(src) else 0
    except OSError:
        n = 0
    stats = dict(reports.torch_stats(n, f"torch.load read it: {why}"), bytes_read=n)
    reports.report(shown, t0, stats, 0)
    return obj


def _load_safetensors(path: str, map_location: MapLocation, io: IoOptions) -> Any:
    """torch.load of a ``.safetensors`` path: safetensors' load_file, to the device
    a str or torch.device map_location names (torch refuses dicts and callables)."""
    if isinstance(map_location, dict) or (
        callable(map_location) and not isinstance(map_location, torch.device)
    ):
        kind = "dict" if isinstance(map_location, dict) else "callable"
        raise RuntimeError(
            f"Loading safetensors file with {kind} map_location is not supported. "
            "Use a device string or torch.device instead."
        )
    device = "cpu" if map_location is None else str(map_location)
    return _safetensors.load_file(
        path,
        device,
        threads=io.threads,
        chunk_size=io.chunk_size,
        direct=io.direct,
        device_backend=io.backend,
    )


def _load_archive(
    t0: float,
    archive: torchzip.Archive,
    map_location: MapLocation,
    torch_kw: dict[str, Any],
    io: IoOptions,
    verify: bool,
) -> Any:
    """An opened archive's object, every storage read by the engine straight into
    its destination: the pickle read natively where it is a plain state dict,
    else by torch.load over a lazy mapping of the file, or over storages filled
    before it runs where the pickle may read their values as it decodes
    (:func:`_load_prefilled`; a tensor subclass that torch rebuilds from
    ``map_location`` itself: torch.load reads it all)."""
    if not (
        map_location is None
        or isinstance(map_location, (str, torch.device, dict))
        or callable(map_location)
    ):
        raise TypeError(
            "map_location must be None, a str, a torch.device, a dict or a callable, "
            f"not {type(map_location).__name__}"
        )
    if isinstance(map_location, dict):
        bad = next((v for v in map_location.values() if not isinstance(v, str)), None)
        if bad is not None:  # torch.load's TypeError, before anything is read
            raise TypeError(
                "map_location: a dict maps location strings to location strings, "
                f"not to {type(bad).__name__} ({bad!r})"
            )
    shown = archive.path
    data_prefix = f"{archive.prefix}/data/"
    unchecked: list[str] = []
    if verify:  # the pickle and the small records, before anything is decoded
        small = [name for name, _, _ in archive.records if not name.startswith(data_prefix)]
        rows = archive.reader.verify(io.engine(), small, strict=True)
        unchecked += [n for n, state, _, _ in rows if state == "unchecked"]
    native = None
    if torch_kw["pickle_module"] is None and len(torch_kw) == 2:  # no pickle arguments
        native = _plan_native(archive, map_location)
    stats: dict[str, Any] | None = None  # the read, where it ran before the pickle decoded
    if native is not None:
        segments, owners, build = native
    else:
        # /proc/self/fd/N: torch reads the very file we mapped, even if the path is
        # replaced meanwhile by a concurrent save.
        src = f"/proc/self/fd/{archive.fileno()}"
        scan = torchzip.scan_pickle(archive)
        if scan.refused is not None and torch_kw["weights_only"]:
            # torch.load refuses the pickle before it needs a storage: read none
            why = f"{scan.refused}: torch's weights-only unpickler refuses it"
            return _by_torch(t0, src, why, map_location, name=shown, **torch_kw)
        if scan.reads is not None:
            # The pickle may read tensor values as it decodes: every storage is
            # read before torch.load runs (or torch.load reads it all).
            got = _load_prefilled(archive, src, scan, map_location, torch_kw, io, verify)
            if isinstance(got, str):
                return _by_torch(t0, src, got, map_location, name=shown, **torch_kw)
            obj, stats, n_read = got
        else:
            restorer = _Restorer(map_location, list(archive.data.values()), shown)
            try:
                with torchzip.unpickling(shown):
                    # torch's stubs say map_location gets a Storage: it gets an UntypedStorage
                    obj = torch.load(src, map_location=restorer, mmap=True, **torch_kw)  # type: ignore[arg-type]
            except RuntimeError as e:
                if not torchzip.declines_restorer(e) or callable(map_location):
                    raise
                # A tensor subclass that torch rebuilds from map_location itself, which
                # must then be the caller's own (a str, device or dict): torch loads it.
                if verify:  # torch.load reads the storages: check their records first
                    _verify_data(archive, io)
                why = "a tensor subclass"
                return _by_torch(t0, src, why, map_location, name=shown, **torch_kw)
            segments, owners = restorer.segments(archive.data)
    if stats is None:  # not read yet (by _load_prefilled)
        n_read = len(segments)
        if native is not None and sharing.current() is None:
            # the tensors are made while the engine reads
            stats, obj = transfer.read_while(
                archive.reader, io.engine(), segments, owners, build, verify=verify
            )
        else:
            stats = _read_storages(archive, segments, owners, io, verify)
            if native is not None:
                obj = build()
    if verify:
        done = set(stats["verified"]) | set(stats["unchecked"])
        unchecked += stats["unchecked"]
        rest = [n for n, _, _ in archive.records if n.startswith(data_prefix) and n not in done]
        if rest:  # records torch filled itself (other devices, callables)
            rows = archive.reader.verify(io.engine(), rest, strict=True)
            unchecked += [n for n, state, _, _ in rows if state == "unchecked"]
        reports.report(shown, t0, stats, n_read, True, tuple(unchecked))
    else:
        reports.report(shown, t0, stats, n_read)
    return obj


def _read_storages(
    archive: torchzip.Archive,
    segments: list[tuple[int, int, int, int]],
    owners: list[Any],
    io: IoOptions,
    verify: bool,
) -> dict[str, Any]:
    """The engine's reads of an archive's storages (``verify``: each whole
    record checked against its CRC-32), once over the group where a load runs
    in one (``sharing.current``). Memory handed out by the caching allocator may
    still be in use by work queued on the current stream: the engine's copies
    are ordered after it."""
    shared = sharing.current()
    if shared is None:
        return transfer.read(archive.reader, io.engine(), segments, owners, verify=verify)
    size = os.fstat(archive.fileno()).st_size
    src_file = sharing.SharedFile(archive.path, archive.reader, size)
    # A CRC-32 is checked over a whole record read: not split with verify.
    pieces = sharing.segment_pieces(0, segments, owners, splittable=not verify)
    return shared.read([src_file], pieces, io, verify)


#: The report's words for a load whose storages the engine read before
#: torch.load decoded the pickle (:func:`_load_prefilled`).
_PREFILLED = "the engine read every storage before torch.load decoded the pickle"


def _load_prefilled(
    archive: torchzip.Archive,
    src: str,
    scan: torchzip.PickleScan,
    map_location: MapLocation,
    torch_kw: dict[str, Any],
    io: IoOptions,
    verify: bool,
) -> tuple[Any, dict[str, Any], int] | str:
    """The object of an archive whose pickle may read tensor values while it is
    decoded (``scan.reads``: a class's ``__setstate__``, a quantized module's
    prepacking, sparse tensors' validation): every storage the scan lists read
    by the engine into its destination first, then torch.load(mmap=True) run
    with :class:`_Prefilled` as map_location, which hands torch the filled
    storage for each one it asks for. Returns (the object, the read's stats,
    the storages read), or why torch.load must read the whole file instead
    (the storages read are dropped): a callable map_location, a location the
    engine does not fill, a pickle the scan does not list as torch meets it,
    a tensor subclass torch rebuilds from the map_location itself. FormatError
    for a storage no record holds (as :class:`_Restorer`)."""
    reads = scan.reads or ""  # set: the caller's condition
    plan = _plan_prefill(archive, scan, map_location)
    if isinstance(plan, str):
        if verify:  # torch.load reads the storages: check their records first
            _verify_data(archive, io)
        return reads if scan.storages is None else f"{reads}; {plan}"
    segments, owners, planned = plan
    stats = _read_storages(archive, segments, owners, io, verify)
    restorer = _Prefilled(planned)
    try:
        with torchzip.unpickling(archive.path):
            # torch's stubs say map_location gets a Storage: it gets an UntypedStorage
            obj = torch.load(src, map_location=restorer, mmap=True, **torch_kw)  # type: ignore[arg-type]
    except Exception as e:
        if restorer.mismatch is not None:
            return f"{reads}; {restorer.mismatch}"
        if torchzip.declines_restorer(e):
            return f"{reads}; a tensor subclass"
        raise
    if restorer.mismatch is not None:  # raised in torch.load, and swallowed there
        return f"{reads}; {restorer.mismatch}"
    why = stats.get("direct_reason")
    ours = f"{_PREFILLED} ({reads})"
    stats = dict(stats, direct_reason=f"{why}; {ours}" if why else ours)
    return obj, stats, len(segments)


def _verify_data(archive: torchzip.Archive, io: IoOptions) -> None:
    """Every storage's record against its CRC-32 (FormatError naming the first
    bad one), before torch.load reads them."""
    data_prefix = f"{archive.prefix}/data/"
    names = [n for n, _, _ in archive.records if n.startswith(data_prefix)]
    if names:
        archive.reader.verify(io.engine(), names, strict=True)


@memory.gc_paused()  # a storage per record: see memory.gc_paused
def _plan_prefill(
    archive: torchzip.Archive, scan: torchzip.PickleScan, map_location: MapLocation
) -> tuple[list[tuple[int, int, int, int]], list[torch.UntypedStorage], list[_Planned]] | str:
    """Each storage ``scan`` lists allocated empty on its destination
    (``devices.fill_device``, as :func:`_plan_native`): (the engine's reads,
    their owners, each storage's record and destination in the scan's
    order), or why torch.load must read the file: a callable map_location, a
    storage of a type torch does not name, a location the engine does not
    fill. FormatError for a storage whose record is missing or of another size."""
    if callable(map_location) and not isinstance(map_location, torch.device):
        return "a callable map_location"
    if scan.restores_itself:
        return "a tensor subclass"
    if scan.storages is None:
        return "a pickle that does not scan"
    prefix, where, path = archive.prefix, archive.where, archive.path
    known: dict[Any, torch.device | None] = {}
    found: list[tuple[int, int, str, torch.device]] = []
    for st in scan.storages:
        if st.nbytes is None:
            return f"storage {st.key!r}: a storage type or size torch must read"
        record = f"{prefix}/data/{st.key}"
        rec = where.get(record)
        if rec is None:
            raise corrupt(
                path, f"the pickle declares storage {st.key!r}, but there is no record {record}"
            )
        if rec[1] != st.nbytes:
            raise corrupt(
                f"{path}, record {record}",
                f"it holds {rec[1]} bytes, the pickle declares a storage of {st.nbytes}",
            )
        loc = st.location
        dev = known.get(loc, ...) if isinstance(loc, str) else None
        if dev is ...:
            dev = known[loc] = devices.fill_device(map_location, loc)
        if dev is None:
            return f"storage {st.key!r} at {loc!r}: a location torch.load restores"
        found.append((rec[0], rec[1], loc, dev))
    records = [(off, n) for off, n, _, _ in found]
    storages, segments, owners = _allocate(records, [f[3] for f in found], map_location)
    planned = [
        _Planned(off, n, loc, dest) for (off, n, loc, _), dest in zip(found, storages, strict=True)
    ]
    return segments, owners, planned


def _allocate(
    records: list[tuple[int, int]], dests: list[torch.device], map_location: MapLocation
) -> tuple[list[torch.UntypedStorage], list[tuple[int, int, int, int]], list[torch.UntypedStorage]]:
    """A storage, empty, on its destination for each (data offset, nbytes) of a
    record (a CUDA reservation first where one map_location sends all to a
    device: ``memory.reserve_cuda``): (the storages, the engine's reads of the
    records into them, their owners: the storages that hold bytes)."""
    if isinstance(map_location, (str, torch.device)):
        for dev in {d for d in dests if d.type == "cuda"}:
            memory.reserve_cuda(dev, [n for _, n in records])
    storages: list[torch.UntypedStorage] = []
    segments, owners = [], []
    # Per device: the engine's index for it, whether small storages come
    # straight from torch (all but host ones of ALIGNED_ALLOC_MIN or more). Looked
    # up once per device, not per storage: 20,000 storages took 2.9 us each, now ~1.
    index = {d: -1 if d.type == "cpu" else d.index for d in set(dests)}
    new, page, big = torch.UntypedStorage, memory.PAGE, memory.ALIGNED_ALLOC_MIN
    for (off, n), dev in zip(records, dests, strict=True):
        i = index[dev]
        if i >= 0:
            st = new(n, device=dev)
        elif n < big:
            st = new(n)  # host memory (without device=: a fifth less time)
        else:
            st = memory.empty_storage(n, dev, off % page)
        storages.append(st)
        if n:
            segments.append((off, st.data_ptr(), n, i))
            owners.append(st)
    return storages, segments, owners


class _Planned(NamedTuple):
    """A storage of :func:`_plan_prefill`: its record's data offset and size,
    the location tag the pickle gives it, its destination (filled by the engine)."""

    offset: int
    nbytes: int
    location: str
    dest: torch.UntypedStorage


class _NotPrefilled(CkptioError):
    """torch.load asked :class:`_Prefilled` for a storage that is not the one
    planned: stops torch.load (a CkptioError: ``torchzip.unpickling`` passes it)."""


class _Prefilled:
    """torch.load's map_location over storages the engine has filled already
    (:func:`_load_prefilled`).

    torch.load hands its map_location each storage once, as its persistent_load
    first meets it: the k-th handed is the k-th of the scan, which this checks
    before handing back the filled one: the same size and location, and (torch
    runs with ``mmap=True``: each storage a slice of one mapping of the file)
    an address that puts it on its record: the first non-empty one sets the
    mapping's base (checked against the mapping itself where it can be read),
    every later one lies at that base plus its record's data offset. Anything
    else sets ``mismatch`` and raises :class:`_NotPrefilled`: no tensor gets
    bytes of another record, torch.load reads the file instead.
    """

    def __init__(self, planned: list[_Planned]) -> None:
        self.planned = planned
        self.handed = 0
        self.base: int | None = None
        self.mismatch: str | None = None

    def __call__(self, storage: torch.UntypedStorage, location: str) -> Any:
        k = self.handed
        self.handed += 1
        if k >= len(self.planned):
            return self._refuse(f"torch.load asked for storage {k + 1}, the scan lists {k}")
        want = self.planned[k]
        n = storage.nbytes()
        if n != want.nbytes or location != want.location:
            return self._refuse(
                f"torch.load's storage {k} is {n} bytes at {location!r}, the scan's "
                f"{want.nbytes} at {want.location!r}"
            )
        if n:
            ptr = storage.data_ptr()
            if self.base is None:
                self.base = ptr - want.offset
                mapped = torchzip.mapping_base(ptr)
                if mapped is not None and mapped != self.base:
                    return self._refuse(
                        f"torch.load's storage {k} lies at offset {ptr - mapped} of the file, "
                        f"the scan's record at {want.offset}"
                    )
            elif ptr - self.base != want.offset:
                return self._refuse(
                    f"torch.load's storage {k} lies at offset {ptr - self.base} of the file, "
                    f"the scan's record at {want.offset}"
                )
        return want.dest

    def _refuse(self, why: str) -> Any:
        self.mismatch = f"the storages torch.load met are not the scan's ({why})"
        raise _NotPrefilled(self.mismatch)


@memory.gc_paused()  # a storage and a tensor per record: see memory.gc_paused
def _plan_native(
    archive: torchzip.Archive, map_location: MapLocation
) -> tuple[list[tuple[int, int, int, int]], list[torch.UntypedStorage], Callable[[], Any]] | None:
    """Load without torch.load: the pickle read natively (``torchzip.native_pickle``),
    each storage allocated on its destination, the object made once the engine
    has read the bytes (``torchzip.rebuild``). Returns (the engine's reads, their
    owners: the storages that hold bytes, the builder), or None where torch.load
    must run: see ``torchzip.native_pickle``, and a callable map_location, a
    location the engine does not fill."""
    if callable(map_location) and not isinstance(map_location, torch.device):
        return None
    got = torchzip.native_pickle(archive)
    if got is None:
        return None
    parsed, found = got
    known: dict[str, torch.device | None] = {}
    dests = []
    for _, _, _, location in found:
        dev = known.get(location, ...)
        if dev is ...:
            dev = known[location] = devices.fill_device(map_location, location)
        if dev is None:
            return None
        dests.append(dev)
    storages, segments, owners = _allocate([(f[0], f[1]) for f in found], dests, map_location)
    dtypes = [f[2] for f in found]
    path = archive.path
    return segments, owners, lambda: torchzip.rebuild(parsed, storages, dtypes, path, devices=dests)


class _Restorer:
    """torch.load's map_location: allocates every storage empty on its destination.

    torch.load runs with ``mmap=True``, so each storage it hands over is a slice
    of a lazy mapping of the file (never touched here); its address tells the
    record it came from. The bytes are read later by the engine.
    """

    def __init__(self, map_location: MapLocation, sizes: list[int], path: str) -> None:
        self.map_location = map_location
        self.path = path
        # (address in the file mapping, nbytes, destination storage)
        self.pending: list[tuple[int, int, torch.UntypedStorage]] = []
        # Every data record's size, where they all go to one device (a str or
        # torch.device map_location); else no reservation (see memory.reserve_cuda).
        one_device = isinstance(map_location, (str, torch.device))
        self.sizes = sizes if one_device else None
        self.record_sizes = set(sizes)
        self.reserved: set[torch.device] = set()
        # A slice of torch's mapping of the file: while it lives, the mapping
        # says where the file starts (torchzip.file_offsets, where sizes alone
        # leave several starts possible).
        self.anchor: torch.UntypedStorage | None = None

    def __call__(self, storage: torch.UntypedStorage, location: str) -> Any:
        if callable(self.map_location) and not isinstance(self.map_location, torch.device):
            # A user callable may do anything with the storage, so it gets what
            # torch.load without mmap gives it: the bytes in memory of the
            # process. The mapping's slice itself would stay in what it returns
            # (``lambda s, loc: s``): changed by a save over the file, SIGBUS
            # once the file is truncated.
            own = torch.UntypedStorage(storage.nbytes())
            own.copy_(storage)
            result = self.map_location(own, location)
            if result is None:
                result = torch.serialization.default_restore_location(storage, location)
            if not isinstance(result, torch.UntypedStorage):
                # torch.load fails later, deep in its own code, on what this returned.
                raise MapLocationError(
                    f"{self.path}: map_location returned {type(result).__name__} "
                    f"({result!r:.60}) for a storage tagged {location!r}; it takes "
                    "(storage, location) and returns a storage, or None for torch's default"
                )
            return result
        dev = devices.fill_device(self.map_location, location)
        if dev is None:  # not ours to fill: torch copies from the mapping (or raises)
            loc = devices.relocated(self.map_location, location)
            try:
                return torch.serialization.default_restore_location(storage, loc)
            except RuntimeError as e:
                if loc == location:  # a tag of the file's: unpickling() types it
                    raise
                # The caller's map_location names a device torch cannot restore
                # to: torch's RuntimeError, not a damaged checkpoint.
                raise LocationError(
                    f"{e} (map_location {self.map_location!r}, while loading {self.path})"
                ) from e
        if storage.nbytes() and storage.nbytes() not in self.record_sizes:
            # The pickle declares a storage no record holds (torch cuts the
            # mapped slice at the end of the file): refuse before allocating it.
            raise corrupt(
                self.path,
                f"the pickle declares a storage of {storage.nbytes()} bytes, "
                "which no data record of the archive holds",
            )
        if dev.type == "cuda" and self.sizes is not None and dev not in self.reserved:
            self.reserved.add(dev)
            memory.reserve_cuda(dev, self.sizes)
        dest = memory.empty_storage(storage.nbytes(), dev)
        self.pending.append((storage.data_ptr(), storage.nbytes(), dest))
        if self.anchor is None:  # keeps torch's mapping, never read, until segments()
            self.anchor = storage
        return dest

    def segments(
        self, data: dict[int, int]
    ) -> tuple[list[tuple[int, int, int, int]], list[torch.UntypedStorage]]:
        """The engine's reads for the storages torch.load handed over, and their owners."""
        offsets = torchzip.file_offsets(self.pending, data, self.path)
        self.anchor = None
        segments, owners = [], []
        for off, (_, n, dest) in zip(offsets, self.pending, strict=True):
            if dest.nbytes() != n:
                # The pickle grew a storage past its record (torch's own mmap load refuses).
                raise corrupt(
                    self.path, f"a tensor needs {dest.nbytes()} bytes of a record that holds {n}"
                )
            if n:
                segments.append((off, dest.data_ptr(), n, devices.device_code(dest, "destination")))
                owners.append(dest)
        return segments, owners


def _load_into(
    f: Any,
    out: Any,
    map_location: MapLocation,
    mmap: bool | None,
    torch_kw: dict[str, Any],
    strict: bool,
    cast: bool,
    verify: bool,
    io: IoOptions,
) -> Any:
    """load(f, out=out): the checkpoint opened as a mapped view, its tensors read
    into those of ``out`` (``ckptio.loading.inplace``)."""
    t0 = time.perf_counter()
    if map_location is not None or mmap:
        raise TypeError("load(out=...) takes no map_location or mmap: the destinations decide")
    if paths.is_path(f):
        path = shown = paths.path(f, "load")
    else:
        fd = paths.descriptor(f)
        if fd is None:
            raise TypeError(
                "load(out=...) needs a path or a file object over a regular file, "
                f"not {type(f).__name__}"
            )
        path, shown = f"/proc/self/fd/{fd}", paths.object_name(f, fd)
    found = detect.detect(path)  # torch's legacy format: a FormatError that says so
    detect.check_verify(found, verify)
    if found.format == detect.SAFETENSORS:
        return _safetensors.load_file(
            path, out=out, strict=strict, cast=cast, threads=io.threads,
            chunk_size=io.chunk_size, direct=io.direct, device_backend=io.backend,
        )  # fmt: skip
    if found.format != detect.TORCH:
        raise FormatError(
            f"{shown}: a {found.format} checkpoint: load(out=) reads torch.save archives and "
            "safetensors files (load_state_dict reads sharded ones, dcp.load DCP folders)"
        )
    inplace.check_flags(strict=strict, cast=cast, verify=verify)
    with memory.gc_paused():  # objects per tensor, no cycles: see memory.gc_paused
        src, mapped = torchzip.open_torch(
            path,
            name=shown,
            direct=io.direct,
            backend=io.backend,
            verify_engine=io.engine() if verify else None,
            torch_kw=torch_kw,
            lazy=True,  # every tensor is paired (read, or copied) or left out
        )
        result = inplace.fill_structure(
            f"ckptio.load(out=): {shown}",
            src,
            out,
            [mapped],
            io,
            strict=strict,
            cast=cast,
            verify=verify,
            t0=t0,
        )
        # Tensors the walk leaves where they were (in a set: no destination
        # pairs with them) must not view the file once returned, as torch.load's.
        del src  # (a tuple at the root is the checkpoint's own, with its views)
        inplace.detach_kept([mapped])
        return result


def _verify_all(path: str, io: IoOptions, why: str, name: str) -> None:
    """Every record of the archive at ``path`` against its CRC-32 (FormatError naming
    the first bad one), before torch.load reads it for ``why``; a ValueError for a
    file in torch's legacy format, which holds none."""
    if why == detect.LEGACY:
        raise ValueError(
            f"{name}: verify=True needs a zip archive (torch's legacy format, torch < 1.6, "
            "stores no CRC-32)"
        )
    if why == torchzip.DEFLATED:
        return  # every record checked already, before torch.load was chosen for it
    try:
        archive = torchzip.open_archive(path, io.direct, None)
    except torchzip.ReadByTorch as e:
        if e.why != torchzip.DEFLATED:  # (open_archive checked a deflated one's)
            torchzip.check_crcs(path, name)  # compressed records: zipfile inflates them
        return
    archive.reader.verify(io.engine(), None, True)


def records(f: str | os.PathLike[str], *, weights_only: bool = True) -> list[RecordInfo]:
    """Every record of a torch.save checkpoint: name, data offset, size, stored
    CRC-32 and the tensors stored in it.

    Reads no tensor data: offsets come from the zip mapper, dtypes and shapes
    from a load onto the meta device. (``ckptio.listing`` describes a checkpoint
    of any format.)
    """
    return torchzip.list_records(paths.path(f, "records"), weights_only=weights_only)
