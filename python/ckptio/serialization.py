"""save / load / records: torch.save-compatible checkpoints through the ckptio engine.

The data path never detours through Python: ``save`` lets ``torch.save`` write
only the metadata (under ``torch.serialization.skip_data``, storages aligned to
4 KiB), learns which storage goes to which record while torch pickles, and
hands (record key, data pointer, nbytes, device) to the Rust engine, which
writes the bytes in parallel and commits the file atomically. ``load`` lets
``torch.load`` rebuild the object (structure, dtypes, views, aliasing) over a
lazy file mapping that is never read, allocates each storage empty on its
destination device, and has the engine read the bytes straight into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import io
import os
import pickle
import stat
import sys
import threading
import time
import types
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckptio import _hostmem, _native, _transfer
from ckptio._transfer import IOReport as IOReport
from ckptio._transfer import _last as _last
from ckptio._transfer import device_code as _device_code
from ckptio._transfer import last_report as last_report
from ckptio._transfer import report as _report

#: Storage alignment of files ckptio writes (what O_DIRECT and GPUDirect Storage want).
STORAGE_ALIGNMENT = 4096

MapLocation = (
    None | str | torch.device | dict[str, str] | Callable[[torch.UntypedStorage, str], Any]
)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor that lives in a record: where it sits in the object, its dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int


@dataclasses.dataclass(frozen=True)
class RecordInfo:
    """One record of a checkpoint archive."""

    name: str
    offset: int
    nbytes: int
    tensors: tuple[TensorInfo, ...] = ()
    #: The stored CRC-32, None where the archive has none (cuFile-written records,
    #: torch.save with compute_crc32 off).
    crc32: int | None = None

    @property
    def alignment(self) -> int:
        """The largest power of two (up to 4096) dividing the record's data offset."""
        a = 1
        while a < STORAGE_ALIGNMENT and self.offset % (a * 2) == 0:
            a *= 2
        return a


@functools.lru_cache(maxsize=8, typed=True)
def _engine(
    threads: int | None,
    chunk_size: int | None,
    direct: str | None,
    memory_threads: int | None = None,
) -> _native.Engine:
    # One engine per configuration: its threads' buffers are reused save after save.
    for name, v in (
        ("threads", threads),
        ("chunk_size", chunk_size),
        ("memory_threads", memory_threads),
    ):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(f"{name} must be an int, not {type(v).__name__}")
        if v is not None and v < 1:
            raise ValueError(f"{name} must be a positive int, not {v!r}")
    return _native.Engine(threads, chunk_size, direct, memory_threads)


def _direct_arg(direct: bool | str | None) -> str | None:
    if direct is None or isinstance(direct, str):
        return direct
    if isinstance(direct, bool):
        return "on" if direct else "off"
    raise TypeError(
        f"direct must be None, a bool or 'auto'/'on'/'off', not {type(direct).__name__}"
    )


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, bytes, os.PathLike))


def _path(f: Any, what: str) -> str:
    if _is_path(f):
        return os.fsdecode(f)
    raise TypeError(f"ckptio.{what} needs a file path (str or os.PathLike), not {type(f).__name__}")


def _descriptor(f: Any) -> int | None:
    """The descriptor behind a file object where the engine can move its bytes:
    a regular file, not in append mode, positioned at 0 (torch.save and
    torch.load place the archive at the start of the stream). None otherwise
    (BytesIO, pipes, sockets, a stream past its start): then the bytes go
    through the object itself."""
    try:
        fd = f.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode) or f.tell() != 0:
            return None
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return None
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    return int(fd)


def _object_name(f: Any, fd: int | None = None) -> str:
    name = getattr(f, "name", None)
    if isinstance(name, (str, bytes)):
        return os.fsdecode(name)
    return f"<{type(f).__name__}>" if fd is None else f"/proc/self/fd/{fd}"


# torch's serialization config is process-global: set and restore it under a lock.
_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def _crc32_on() -> Iterator[None]:
    """torch computes the CRC-32 of the records it writes (data.pkl, version...),
    also where ``torch.serialization.set_crc32_options(False)`` turned it off:
    ckptio marks its archives as carrying every CRC-32. Data records are not
    written by torch (skip_data), so this costs nothing."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None or get():
        yield
        return
    set_(True)
    try:
        yield
    finally:
        set_(False)


@contextlib.contextmanager
def _storage_alignment(n: int) -> Iterator[None]:
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch without the knob writes 64-byte alignment: still valid
        yield
        return
    old = config.save.storage_alignment
    config.save.storage_alignment = n
    try:
        yield
    finally:
        config.save.storage_alignment = old


def _capturing_pickle_module(
    found: dict[str, torch.UntypedStorage], base: Any = pickle
) -> types.ModuleType:
    """A pickle module (``base``'s) whose Pickler records which storage
    torch.save files under which key.

    torch.save subclasses ``pickle_module.Pickler`` to add its ``persistent_id``;
    ``__init_subclass__`` wraps that method, so the C pickler stays in use.
    """

    class Pickler(base.Pickler):  # type: ignore[name-defined,misc]
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            inner = cls.persistent_id

            def persistent_id(self: Any, obj: Any) -> Any:
                pid = inner(self, obj)
                if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                    storage = (
                        obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    )
                    found.setdefault(pid[2], storage)
                return pid

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    mod = types.ModuleType("ckptio._capturing_pickle")
    for name in (
        "dump",
        "dumps",
        "load",
        "loads",
        "Unpickler",
        "HIGHEST_PROTOCOL",
        "DEFAULT_PROTOCOL",
        "PickleError",
        "PicklingError",
        "UnpicklingError",
    ):
        setattr(mod, name, getattr(base, name, getattr(pickle, name)))
    mod.Pickler = Pickler  # type: ignore[attr-defined]
    return mod


def _write_metadata(
    obj: object,
    fh: Any,
    found: dict[str, torch.UntypedStorage],
    pickle_module: Any,
    pickle_protocol: int,
    disable_byteorder: bool,
) -> None:
    """torch.save of everything but the storages' bytes (skip_data), storages at
    4 KiB, into ``fh``; ``found`` learns which storage went to which record."""
    with _CONFIG_LOCK, _storage_alignment(STORAGE_ALIGNMENT), _crc32_on():
        with torch.serialization.skip_data():
            torch.save(
                obj,
                fh,
                pickle_module=_capturing_pickle_module(found, pickle_module),
                pickle_protocol=pickle_protocol,
                _disable_byteorder_record=disable_byteorder,
            )


def _storage_segments(
    found: dict[str, torch.UntypedStorage], data: dict[str, tuple[int, int]] | None
) -> list[tuple[Any, ...]]:
    """(key, address, nbytes, device) per storage; with ``data`` (record name ->
    (offset, size)) (offset, address, nbytes, device), checked against the record."""
    out: list[tuple[Any, ...]] = []
    for key, st in found.items():
        dev = _device_code(st, f"storage {key}")
        if data is None:
            out.append((key, st.data_ptr(), st.nbytes(), dev))
            continue
        rec = data.get(key)
        if rec is None or rec[1] != st.nbytes():
            raise _native.FormatError(f"no record of {st.nbytes()} bytes for storage {key}")
        if st.nbytes():
            out.append((rec[0], st.data_ptr(), st.nbytes(), dev))
    return out


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
) -> None:
    """Save ``obj`` like ``torch.save(obj, f)``, fast and crash-safe.

    Takes torch.save's arguments with their meaning. The file is a regular
    torch.save zip archive (plain ``torch.load`` reads it) whose storages start
    at multiples of 4096 bytes. It is written to a temp file in the same folder
    and renamed over ``f`` only once complete and fsynced: a failed or killed
    save leaves the previous file untouched. Returns None, as torch.save does;
    ``ckptio.last_report()`` says how it ran.

    ``f`` may also be a file object, as for torch.save. Over a regular file
    (``open(path, "wb")``, at position 0, not in append mode) the metadata goes
    through the object and the storages' bytes through the engine straight
    into the same file (O_DIRECT where the file takes it); what is lost is the
    atomic replace and fsync (the caller owns the file: a crash midway leaves
    it torn) and the data records' CRC-32 (0: "unchecked" for ``verify``).
    Other objects (BytesIO, pipes) get the same bytes written through the
    object by torch itself (no engine, no O_DIRECT, no atomic replace).
    ``_use_new_zipfile_serialization=False`` (torch's legacy format) is written
    by torch itself, atomically for a path.

    threads / chunk_size: I/O threads and bytes per chunk (defaults from
    CKPTIO_THREADS / CKPTIO_CHUNK_SIZE, else 8 and 16 MiB; files on tmpfs get
    CKPTIO_MEMORY_THREADS / CKPTIO_MEMORY_CHUNK_SIZE, else 2 x cores within 8-32
    and 4 MiB, unless given here or by CKPTIO_THREADS / CKPTIO_CHUNK_SIZE: there
    I/O is memory copies, which scale with cores).
    direct: O_DIRECT "auto" (default: where the filesystem takes it), True/"on"
    (required) or False/"off". backend: how CUDA storages move, "auto" (default, or
    CKPTIO_BACKEND: cuFile where it can register the file, else pinned bounce
    buffers), "cufile" (or an error) or "bounce" (pinned bounce buffers; "posix"
    is an older name for it). The report says which ran (``device_path``).
    Bytes are copied after the work queued on the current CUDA streams (the
    copies wait for it on the GPU; the host is not blocked for it).
    """
    _file_like(f, "save", "write")
    torch_args = (pickle_module, pickle_protocol, _disable_byteorder_record)
    d = _direct_arg(direct)
    t0 = time.perf_counter()
    engine = _engine(threads, chunk_size, d)
    if not _is_path(f):
        _save_object(obj, f, torch_args, _use_new_zipfile_serialization, engine, d, backend, t0)
        return
    path = _path(f, "save")
    writer = _native.AtomicWriter(path, d, backend)
    try:
        found: dict[str, torch.UntypedStorage] = {}
        try:
            with os.fdopen(os.dup(writer.fileno()), "wb") as fh:
                if not _use_new_zipfile_serialization:  # no records to place: torch writes it
                    torch.save(obj, fh, pickle_module, pickle_protocol, False, *torch_args[2:])
                else:
                    _write_metadata(obj, fh, found, *torch_args)
        except OSError as e:
            if e.errno is None or e.filename is not None:
                raise
            # torch wrote the metadata through a file object: name the file.
            raise OSError(
                e.errno, f"writing checkpoint metadata failed: {e.strerror}", writer.tmp_path
            ) from e
        if _use_new_zipfile_serialization:
            storages = _storage_segments(found, None)
            stats = _transfer.write_storages(writer, engine, storages, list(found.values()))
        else:
            stats = _torch_stats(os.path.getsize(writer.tmp_path), "legacy format: torch wrote it")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    _report(path, t0, stats, len(found))


def _torch_stats(nbytes: int, why: str) -> dict[str, Any]:
    """A report's stats where torch moved the bytes itself."""
    return {
        "bytes": nbytes,
        "backend": "auto",
        "device_path": None,
        "direct": False,
        "direct_reason": why,
        "threads": 1,
    }


def _save_object(
    obj: object,
    f: Any,
    torch_args: tuple[Any, int, bool],
    new_zip: bool,
    engine: _native.Engine,
    direct: str | None,
    backend: str | None,
    t0: float,
) -> None:
    """``save`` into a file object (see its docstring)."""
    fd = _descriptor(f) if new_zip else None
    dev_file = None
    if fd is not None:
        try:  # a second open of the very file, for the engine
            dev_file = _native.DeviceFile(f"/proc/self/fd/{fd}", True, direct, backend)
        except OSError:  # e.g. the file's mode forbids a new open for writing
            dev_file = None
    name = _object_name(f, fd)
    if dev_file is None:
        start = f.tell() if hasattr(f, "tell") else 0
        with _CONFIG_LOCK, _storage_alignment(STORAGE_ALIGNMENT), _crc32_on():
            torch.save(obj, f, torch_args[0], torch_args[1], new_zip, torch_args[2])
        n = f.tell() - start if hasattr(f, "tell") else 0
        _report(name, t0, _torch_stats(n, "a file object without a usable descriptor"), 0)
        return
    found: dict[str, torch.UntypedStorage] = {}
    f.flush()
    _write_metadata(obj, f, found, *torch_args)
    f.flush()
    records_ = _native.map_archive(f"/proc/self/fd/{fd}")
    data = {
        name_.rpartition("/data/")[2]: (off, size)
        for name_, off, size in records_
        if "/data/" in name_
    }
    segments = _storage_segments(found, data)
    stats = _transfer.write(dev_file, engine, segments, list(found.values()))
    _report(name, t0, stats, len(found))


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
        # torch.device map_location); else no reservation (see _reserve_cuda).
        one_device = isinstance(map_location, (str, torch.device))
        self.sizes = sizes if one_device else None
        self.record_sizes = set(sizes)
        self.reserved: set[torch.device] = set()

    def _mapped(self, location: str) -> str:
        """The location string after a str / device / dict map_location."""
        ml = self.map_location
        if isinstance(ml, dict):
            return ml.get(location, location)
        if isinstance(ml, (str, torch.device)):
            return str(ml)
        return location

    def __call__(self, storage: torch.UntypedStorage, location: str) -> Any:
        if callable(self.map_location) and not isinstance(self.map_location, torch.device):
            # A user callable may do anything with the storage; the mapping
            # holds the real bytes, so its result is right as it is.
            result = self.map_location(storage, location)
            if result is None:
                result = torch.serialization.default_restore_location(storage, location)
            return result
        loc = self._mapped(location)
        dev = _engine_device(loc)
        if dev is None:  # not ours to fill: torch copies from the mapping (or raises)
            return torch.serialization.default_restore_location(storage, loc)
        if storage.nbytes() and storage.nbytes() not in self.record_sizes:
            # The pickle declares a storage no record holds (torch cuts the
            # mapped slice at the end of the file): refuse before allocating it.
            raise _native.FormatError(
                f"{self.path}: the pickle declares a storage of {storage.nbytes()} bytes, "
                "which no data record of the archive holds"
            )
        if dev.type == "cuda" and self.sizes is not None and dev not in self.reserved:
            self.reserved.add(dev)
            _reserve_cuda(dev, self.sizes)
        dest = _empty_storage(storage.nbytes(), dev)
        self.pending.append((storage.data_ptr(), storage.nbytes(), dest))
        return dest


def _engine_device(location: str) -> torch.device | None:
    """The device the engine fills for ``location``: cpu, or a present CUDA device."""
    dev = torch.device(location)
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index < torch.cuda.device_count():
            return torch.device("cuda", index)
    return None


def _empty_storage(nbytes: int, device: torch.device, phase: int = 0) -> torch.UntypedStorage:
    """An uninitialised storage; large host ones are fresh anonymous memory with
    huge pages asked for (``_hostmem``: faulted in 2.4-3.6x faster than 4 KiB
    pages), starting ``phase`` bytes past a 4 KiB boundary (a file offset's
    distance from one) so that O_DIRECT reads land in them without a staging
    copy. (Like torch.load's mmap storages, they cannot be resized.)"""
    if device.type != "cpu" or nbytes < _ALIGNED_ALLOC_MIN:
        return torch.UntypedStorage(nbytes, device=device)
    return _hostmem.empty_storage(nbytes, phase % STORAGE_ALIGNMENT)


_ALIGNED_ALLOC_MIN = 1 << 20


def _reserve_cuda(device: torch.device, sizes: list[int]) -> None:
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
        room, cached_free = _cuda_room(device)
        max_split = torch.cuda.memory_stats(device).get("max_split_size", -1)
    except (RuntimeError, AttributeError):  # a pluggable allocator, an older torch
        return
    n = _reservation(sizes, cached_free, room, max_split)
    if n:
        try:
            torch.empty(n, dtype=torch.uint8, device=device)  # freed at once, kept cached
        except torch.OutOfMemoryError:  # the room went meanwhile: allocate one by one
            pass


def _cuda_room(device: torch.device | int) -> tuple[int, int]:
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


def _reservation(sizes: list[int], cached_free: int, room: int, max_split: int) -> int:
    """Bytes ``_reserve_cuda`` asks for (0: none). Only storages over 1 MiB count
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


def _file_offsets(
    pending: list[tuple[int, int, torch.UntypedStorage]], data: dict[int, int], path: str
) -> list[int]:
    """File offset of each pending storage, from its address in the file mapping.

    All addresses share one base (the mapping's start); find the base that puts
    every storage exactly on a data record of its size.
    """
    sized = [(p, n) for p, n, _ in pending if n > 0]
    if not sized:
        return [0] * len(pending)
    p0, n0 = sized[0]
    for off, size in sorted(data.items()):
        if size != n0:
            continue
        base = p0 - off
        if all(data.get(p - base) == n for p, n in sized):
            return [p - base for p, _, _ in pending]
    raise _native.FormatError(f"{path}: storages in the pickle do not match the archive's records")


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
    torch's legacy (non-zip) files. A path ending in ``.safetensors`` is read
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
    """
    t0 = time.perf_counter()
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, not {type(verify).__name__}")
    _file_like(f, "load", "read")
    torch_kw: dict[str, Any] = dict(
        pickle_module=pickle_module, weights_only=weights_only, **pickle_load_args
    )
    if out is not None:
        return _load_into(
            f, out, map_location, mmap, torch_kw, strict, cast, verify,
            (threads, chunk_size, direct, backend),
        )  # fmt: skip
    if not _is_path(f):
        fd = _descriptor(f)
        if fd is None:
            if verify:
                raise ValueError(
                    f"load(verify=True) needs a path or a file object over a regular file, "
                    f"not {type(f).__name__}"
                )
            return _by_torch(
                t0,
                f,
                "a file object without a usable descriptor",
                map_location,
                mmap=mmap,
                **torch_kw,
            )
        path = f"/proc/self/fd/{fd}"
        shown = _object_name(f, fd)
    else:
        path = shown = _path(f, "load")
        if path.endswith(".safetensors"):
            return _load_safetensors(path, map_location, threads, chunk_size, direct, backend)
    torch_only = bool(mmap) or _torch_only(path, map_location)
    if verify and torch_only:
        # torch reads the bytes itself here: check the whole file first.
        _verify_all(path, threads, chunk_size, direct)
    if torch_only:
        why = "mmap" if mmap else "nothing to read, or not a zip archive"
        return _by_torch(t0, path, why, map_location, mmap=mmap, **torch_kw)
    if not (
        map_location is None
        or isinstance(map_location, (str, torch.device, dict))
        or callable(map_location)
    ):
        raise TypeError(
            "map_location must be None, a str, a torch.device, a dict or a callable, "
            f"not {type(map_location).__name__}"
        )
    d = _direct_arg(direct)
    engine = _engine(threads, chunk_size, d)
    try:
        reader = _open(path, d, backend)
    except _native.FormatError:
        if not _is_torchscript(path):
            raise
        return _by_torch(t0, path, "a TorchScript archive", map_location, **torch_kw)
    records_ = reader.records()
    prefix = reader.prefix
    names = {name for name, _, _ in records_}
    if f"{prefix}/constants.pkl" in names:  # TorchScript: torch.load hands it to torch.jit
        return _by_torch(t0, path, "a TorchScript archive", map_location, **torch_kw)
    data_prefix = f"{prefix}/data/"
    data = {off: size for name, off, size in records_ if name.startswith(data_prefix)}
    unchecked: list[str] = []
    if verify:  # the pickle and the small records, before anything is decoded
        small = [name for name, _, _ in records_ if not name.startswith(data_prefix)]
        rows = reader.verify(engine, small, strict=True)
        unchecked += [n for n, state, _, _ in rows if state == "unchecked"]
    if not _native_byteorder(reader, shown):
        # Byte-swapped storages are rare: let torch swap them (it reads the
        # data records itself, so those are checked first).
        if verify:
            _verify_all(path, threads, chunk_size, direct)
        return _by_torch(t0, path, "byte-swapped storages", map_location, **torch_kw)
    restorer = _Restorer(map_location, list(data.values()), shown)
    # /proc/self/fd/N: torch reads the very file we mapped, even if the path is
    # replaced meanwhile by a concurrent save.
    try:
        with _unpickling(shown):
            obj = torch.load(
                f"/proc/self/fd/{reader.fileno()}", map_location=restorer, mmap=True, **torch_kw
            )
    except RuntimeError as e:
        if not str(e).startswith("Callable map_location not supported") or callable(map_location):
            raise
        # A tensor subclass that torch rebuilds from map_location itself, which
        # must then be the caller's own (a str, device or dict): torch loads it.
        src = f"/proc/self/fd/{reader.fileno()}"
        return _by_torch(t0, src, "a tensor subclass", map_location, **torch_kw)
    offsets = _file_offsets(restorer.pending, data, path)
    segments, owners = [], []
    for off, (_, n, dest) in zip(offsets, restorer.pending, strict=True):
        if dest.nbytes() != n:
            # The pickle grew a storage past its record (torch's own mmap load refuses).
            raise _native.FormatError(
                f"{path}: a tensor needs {dest.nbytes()} bytes of a record that holds {n}"
            )
        if n:
            segments.append((off, dest.data_ptr(), n, _device_code(dest, "destination")))
            owners.append(dest)
    # Memory handed out by the caching allocator may still be in use by work
    # queued on the current stream: the engine's copies are ordered after it.
    stats = _transfer.read(reader, engine, segments, owners, verify=verify)
    if verify:
        done = set(stats["verified"]) | set(stats["unchecked"])
        unchecked += stats["unchecked"]
        rest = [n for n, _, _ in records_ if n.startswith(data_prefix) and n not in done]
        if rest:  # records torch filled itself (other devices, callables)
            rows = reader.verify(engine, rest, strict=True)
            unchecked += [n for n, state, _, _ in rows if state == "unchecked"]
        _report(shown, t0, stats, len(segments), True, tuple(unchecked))
    else:
        _report(shown, t0, stats, len(segments))
    return obj


def _load_into(
    f: Any,
    out: Any,
    map_location: MapLocation,
    mmap: bool | None,
    torch_kw: dict[str, Any],
    strict: bool,
    cast: bool,
    verify: bool,
    io: tuple[int | None, int | None, bool | str | None, str | None],
) -> Any:
    """load(f, out=out): into the tensors of ``out`` (ckptio.inplace)."""
    from ckptio import inplace

    if map_location is not None or mmap:
        raise TypeError("load(out=...) takes no map_location or mmap: the destinations decide")
    if _is_path(f):
        path = shown = _path(f, "load")
    else:
        fd = _descriptor(f)
        if fd is None:
            raise TypeError(
                "load(out=...) needs a path or a file object over a regular file, "
                f"not {type(f).__name__}"
            )
        path, shown = f"/proc/self/fd/{fd}", _object_name(f, fd)
    if path.endswith(".safetensors"):
        from ckptio import safetensors as cst

        threads, chunk_size, direct, backend = io
        return cst.load_file(
            path, out=out, strict=strict, cast=cast, threads=threads,
            chunk_size=chunk_size, direct=direct, device_backend=backend,
        )  # fmt: skip
    return inplace.load_into(
        path,
        out,
        strict=strict,
        cast=cast,
        verify=verify,
        io=inplace.IoOptions.of(*io),
        torch_kw=torch_kw,
        name=shown,
    )


@contextlib.contextmanager
def _unpickling(path: str) -> Iterator[None]:
    """torch's refusal of a pickle (weights_only) names the file and what was refused."""
    try:
        yield
    except pickle.UnpicklingError as e:
        lines = [s.strip() for s in str(e).splitlines() if s.strip()]
        what = "could not be unpickled"
        if len(lines) > 1 and lines[0].startswith("Weights only load failed"):
            lines = lines[1:]  # torch's preamble; the reason follows
            what = "refused by torch's weights_only unpickler"
        reason = lines[0] if lines else type(e).__name__
        raise pickle.UnpicklingError(f"{path}: record data.pkl {what}: {reason}") from e


def _by_torch(t0: float, src: Any, why: str, *args: Any, **kwargs: Any) -> Any:
    """torch.load as is; the report says so."""
    name = os.fsdecode(src) if _is_path(src) else _object_name(src)
    with _unpickling(name):
        obj = torch.load(src, *args, **kwargs)
    try:
        n = os.path.getsize(src) if _is_path(src) else 0
    except OSError:
        n = 0
    _report(name, t0, _torch_stats(n, f"torch.load read it: {why}"), 0)
    return obj


def _is_torchscript(path: str) -> bool:
    """A TorchScript zip (compressed code records, which torch.load hands to torch.jit)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/constants.pkl") for n in z.namelist())
    except Exception:  # noqa: BLE001 - a zip Python cannot read is no TorchScript to hand on
        return False


def _torch_only(path: str, map_location: MapLocation) -> bool:
    """Whether torch.load must run as is: nothing to read (meta, FakeTensorMode)
    or torch's legacy (non-zip) format. Other files that are no zip archive stay
    ckptio's to refuse (FormatError)."""
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "meta":
        return True
    if torch._guards.detect_fake_mode(None) is not None:
        return True
    with open(path, "rb") as fh:
        return _is_legacy(fh.read(14))


def _is_legacy(head: bytes) -> bool:
    """torch's legacy format starts with its magic number, pickled (protocol >= 2:
    PROTO n, LONG1 of 10 bytes)."""
    magic = int(torch.serialization.MAGIC_NUMBER).to_bytes(10, "little")
    return len(head) == 14 and head[0] == 0x80 and head[2:4] == b"\x8a\x0a" and head[4:] == magic


def _file_like(f: Any, what: str, method: str) -> None:
    """A save or load target that is neither a path nor a file object is a TypeError."""
    if not _is_path(f) and not callable(getattr(f, method, None)):
        raise TypeError(
            f"ckptio.{what} needs a file path (str or os.PathLike) or a file object, "
            f"not {type(f).__name__}"
        )


def _load_safetensors(
    path: str,
    map_location: MapLocation,
    threads: int | None,
    chunk_size: int | None,
    direct: bool | str | None,
    backend: str | None,
) -> Any:
    """torch.load of a ``.safetensors`` path: safetensors' load_file, to the device
    a str or torch.device map_location names (torch refuses dicts and callables)."""
    from ckptio import safetensors as cst

    if isinstance(map_location, dict) or (
        callable(map_location) and not isinstance(map_location, torch.device)
    ):
        kind = "dict" if isinstance(map_location, dict) else "callable"
        raise RuntimeError(
            f"Loading safetensors file with {kind} map_location is not supported. "
            "Use a device string or torch.device instead."
        )
    device = "cpu" if map_location is None else str(map_location)
    return cst.load_file(
        path,
        device,
        threads=threads,
        chunk_size=chunk_size,
        direct=direct,
        device_backend=backend,
    )


def _native_byteorder(reader: _native.Reader, path: str) -> bool:
    """Whether the storages are in this machine's byte order (no byteorder record:
    little-endian, as torch assumes)."""
    byteorder = f"{reader.prefix}/byteorder"
    if not any(name == byteorder for name, _, _ in reader.records()):
        return sys.byteorder == "little"
    raw = reader.read_record(byteorder)
    if raw not in (b"little", b"big"):
        raise _native.FormatError(
            f"{path}: record {byteorder} is {raw[:16]!r}, not b'little' or b'big'"
        )
    return raw.decode() == sys.byteorder


def _verify_all(
    path: str, threads: int | None, chunk_size: int | None, direct: bool | str | None
) -> None:
    d = _direct_arg(direct)
    _open(path, d, None).verify(_engine(threads, chunk_size, d), None, True)


def _open(path: str, direct: str | None, backend: str | None) -> _native.Reader:
    """Open and map a checkpoint; a zip without a pickle is no checkpoint, nor
    one that torch's own reader refuses (unsupported version, flags...)."""
    reader = _native.Reader(path, direct, backend)
    if not any(name == f"{reader.prefix}/data.pkl" for name, _, _ in reader.records()):
        raise _native.FormatError(f"{path}: no data.pkl record: not a torch.save checkpoint")
    _torch_reads(path, reader.fileno())
    return reader


def _torch_reads(path: str, fd: int | None = None) -> None:
    """FormatError naming ``path`` if torch's archive reader (which torch.load runs
    on it) refuses the file; it reads only the end records and the directory."""
    try:
        torch._C.PyTorchFileReader(path if fd is None else f"/proc/self/fd/{fd}")
    except Exception as e:  # RuntimeError; a message with raw bytes is a UnicodeDecodeError
        if isinstance(e, UnicodeDecodeError) and isinstance(e.object, bytes):
            msg = e.object.decode(errors="replace")
        else:
            msg = str(e)
        msg = msg.splitlines()[0] if msg else type(e).__name__
        raise _native.FormatError(f"{path}: torch's reader refuses the archive: {msg}") from e


def _tensors(obj: Any, name: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        yield name, obj
        return
    seen.add(id(obj))
    join = (lambda k: f"{name}.{k}") if name else str
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, join(k), seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, join(i), seen)
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from _tensors(v, join(k), seen)


def records(f: str | os.PathLike[str], *, weights_only: bool = True) -> list[RecordInfo]:
    """Every record of a checkpoint: name, data offset, size, and the tensors stored in it.

    Reads no tensor data: offsets come from the zip mapper, dtypes and shapes
    from a load onto the meta device.
    """
    path = _path(f, "records")
    reader = _open(path, "off", None)
    _native_byteorder(reader, path)  # torch.load would fail on a bad one, untyped
    with _unpickling(path):
        meta = torch.load(
            f"/proc/self/fd/{reader.fileno()}", map_location="meta", weights_only=weights_only
        )
    by_offset: dict[int, list[TensorInfo]] = {}
    sizes = {off: size for _, off, size in reader.records()}
    for name, t in _tensors(meta, "", set()):
        off = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if off is None:
            continue
        if sizes.get(off) != t.untyped_storage().nbytes():
            raise _native.FormatError(
                f"{path}: tensor {name or '<root>'!r} declares a storage of "
                f"{t.untyped_storage().nbytes()} bytes at offset {off}, where the archive "
                f"has {'no record' if off not in sizes else f'a record of {sizes[off]}'}"
            )
        by_offset.setdefault(off, []).append(
            TensorInfo(
                name or "<root>", t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()
            )
        )
    crcs = dict(reader.checksums())
    return [
        RecordInfo(
            name,
            off,
            size,
            tuple(by_offset.get(off, ())) if "/data/" in name else (),
            crcs.get(name),
        )
        for name, off, size in reader.records()
    ]
