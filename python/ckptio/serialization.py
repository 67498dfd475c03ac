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
import functools
import os
import pickle
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckptio import _native, _transfer
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


def _path(f: Any, what: str) -> str:
    if isinstance(f, (str, bytes, os.PathLike)):
        return os.fsdecode(f)
    raise TypeError(
        f"ckptio.{what} needs a file path (str or os.PathLike), not {type(f).__name__}; "
        "file objects cannot be replaced atomically"
    )


# torch's serialization config is process-global: set and restore it under a lock.
_CONFIG_LOCK = threading.Lock()


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


def _capturing_pickle_module(found: dict[str, torch.UntypedStorage]) -> types.ModuleType:
    """A pickle module whose Pickler records which storage torch.save files under which key.

    torch.save subclasses ``pickle_module.Pickler`` to add its ``persistent_id``;
    ``__init_subclass__`` wraps that method, so the C pickler stays in use.
    """

    class Pickler(pickle.Pickler):
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
        setattr(mod, name, getattr(pickle, name))
    mod.Pickler = Pickler  # type: ignore[attr-defined]
    return mod


def save(
    obj: object,
    f: str | os.PathLike[str],
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    backend: str | None = None,
) -> IOReport:
    """Save ``obj`` like ``torch.save(obj, f)``, fast and crash-safe.

    The file is a regular torch.save zip archive (plain ``torch.load`` reads it)
    whose storages start at multiples of 4096 bytes. It is written to a temp
    file in the same folder and renamed over ``f`` only once complete and
    fsynced: a failed or killed save leaves the previous file untouched.

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
    path = _path(f, "save")
    d = _direct_arg(direct)
    t0 = time.perf_counter()
    engine = _engine(threads, chunk_size, d)
    writer = _native.AtomicWriter(path, d, backend)
    try:
        found: dict[str, torch.UntypedStorage] = {}
        try:
            with _CONFIG_LOCK, _storage_alignment(STORAGE_ALIGNMENT):
                with (
                    torch.serialization.skip_data(),
                    os.fdopen(os.dup(writer.fileno()), "wb") as fh,
                ):
                    torch.save(obj, fh, pickle_module=_capturing_pickle_module(found))
        except OSError as e:
            if e.errno is None or e.filename is not None:
                raise
            # torch wrote the metadata through a file object: name the file.
            raise OSError(
                e.errno, f"writing checkpoint metadata failed: {e.strerror}", writer.tmp_path
            ) from e
        storages = []
        for key, st in found.items():
            dev = _device_code(st, f"storage {key}")
            storages.append((key, st.data_ptr(), st.nbytes(), dev))
        stats = _transfer.write_storages(writer, engine, storages, list(found.values()))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return _report(path, t0, stats, len(storages))


class _Restorer:
    """torch.load's map_location: allocates every storage empty on its destination.

    torch.load runs with ``mmap=True``, so each storage it hands over is a slice
    of a lazy mapping of the file (never touched here); its address tells the
    record it came from. The bytes are read later by the engine.
    """

    def __init__(self, map_location: MapLocation, sizes: list[int]) -> None:
        self.map_location = map_location
        # (address in the file mapping, nbytes, destination storage)
        self.pending: list[tuple[int, int, torch.UntypedStorage]] = []
        # Every data record's size, where they all go to one device (a str or
        # torch.device map_location); else no reservation (see _reserve_cuda).
        one_device = isinstance(map_location, (str, torch.device))
        self.sizes = sizes if one_device else None
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
    """An uninitialised storage; large host ones start ``phase`` bytes past a 4 KiB
    boundary (a file offset's distance from one) so that O_DIRECT reads land in
    them without a staging copy. (The aligned slice keeps its allocation alive,
    as torch.load's mmap slices do; like those, it cannot be resized.)"""
    if device.type != "cpu" or nbytes < _ALIGNED_ALLOC_MIN:
        return torch.UntypedStorage(nbytes, device=device)
    raw = torch.UntypedStorage(nbytes + STORAGE_ALIGNMENT)
    skip = (phase - raw.data_ptr()) % STORAGE_ALIGNMENT
    return raw[skip : skip + nbytes]


_ALIGNED_ALLOC_MIN = 1 << 20


def _reserve_cuda(device: torch.device, sizes: list[int]) -> None:
    """Leave one free segment in torch's CUDA cache that storages of ``sizes``
    (all bound for ``device``) are then carved from, instead of a cudaMalloc each.

    A load into a fresh process (resuming a run) otherwise makes hundreds of
    segments, and filling them costs more than the cudaMallocs: 8 GiB in 512
    storages from /dev/shm loaded in 0.21-0.24 s against 0.24-0.36 s
    (``benches/probe_hostreg.py alloc``). Each storage is still its own block:
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
    f: str | os.PathLike[str],
    map_location: MapLocation = None,
    weights_only: bool = True,
    *,
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

    Reads any torch.save zip file (also 64-byte-aligned ones from plain
    torch.save). ``map_location`` and ``weights_only`` mean what they mean for
    torch.load (``weights_only`` defaults to True: a pickle that is not plain
    tensors and containers is refused). Views and shared storages stay shared.
    ``mmap=True`` is handed to torch.load as is (a lazy, mapped load).
    Storages mapped to a CUDA device are read straight into device memory
    (cuFile or pinned bounce buffers, see ``save``'s ``backend``) and are ready
    for kernels on any stream when load returns. ``ckptio.last_report()`` says
    which path ran.

    ``verify=True`` checks every record against its CRC-32 before returning:
    the pickle before it is unpickled, each storage over the bytes read (in
    the I/O threads), and raises ``ckptio.FormatError`` naming the first bad
    record. Records without a stored CRC-32, and those read by cuFile, are
    listed in ``last_report().unchecked``.

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
    ``map_location`` and ``mmap`` do not apply (the destinations decide).
    """
    t0 = time.perf_counter()
    path = _path(f, "load")
    if out is not None:
        if map_location is not None or mmap:
            raise TypeError("load(out=...) takes no map_location or mmap: the destinations decide")
        from ckptio import inplace

        return inplace.load_into(
            path,
            out,
            strict=strict,
            cast=cast,
            weights_only=weights_only,
            verify=verify,
            io=inplace.IoOptions.of(threads, chunk_size, direct, backend),
            pickle_load_args=pickle_load_args,
        )
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, not {type(verify).__name__}")
    if verify and (mmap or not _reads_natively(path)):
        # torch reads the bytes itself here: check the whole file first.
        _verify_all(path, threads, chunk_size, direct)
    if mmap:
        return torch.load(
            path,
            map_location=map_location,
            weights_only=weights_only,
            mmap=True,
            **pickle_load_args,
        )
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
    reader = _open(path, d, backend)
    records_ = reader.records()
    prefix = reader.prefix
    names = {name for name, _, _ in records_}
    byteorder = f"{prefix}/byteorder"
    if byteorder in names and reader.read_record(byteorder).decode() != sys.byteorder:
        # Byte-swapped storages are rare: let torch swap them.
        return torch.load(
            path, map_location=map_location, weights_only=weights_only, **pickle_load_args
        )
    data_prefix = f"{prefix}/data/"
    data = {off: size for name, off, size in records_ if name.startswith(data_prefix)}
    unchecked: list[str] = []
    if verify:  # the pickle and the small records, before torch unpickles anything
        small = [name for name, _, _ in records_ if not name.startswith(data_prefix)]
        rows = reader.verify(engine, small, strict=True)
        unchecked += [n for n, state, _, _ in rows if state == "unchecked"]
    restorer = _Restorer(map_location, list(data.values()))
    # /proc/self/fd/N: torch reads the very file we mapped, even if the path is
    # replaced meanwhile by a concurrent save.
    obj = torch.load(
        f"/proc/self/fd/{reader.fileno()}",
        map_location=restorer,
        weights_only=weights_only,
        mmap=True,
        **pickle_load_args,
    )
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
        _report(path, t0, stats, len(segments), True, tuple(unchecked))
    else:
        _report(path, t0, stats, len(segments))
    return obj


def _reads_natively(path: str) -> bool:
    """Whether load moves the storages itself (not the byte-swapped torch.load path)."""
    reader = _open(path, "off", None)
    byteorder = f"{reader.prefix}/byteorder"
    if any(name == byteorder for name, _, _ in reader.records()):
        return bool(reader.read_record(byteorder).decode() == sys.byteorder)
    return True


def _verify_all(
    path: str, threads: int | None, chunk_size: int | None, direct: bool | str | None
) -> None:
    d = _direct_arg(direct)
    _open(path, d, None).verify(_engine(threads, chunk_size, d), None, True)


def _open(path: str, direct: str | None, backend: str | None) -> _native.Reader:
    """Open and map a checkpoint; a zip without a pickle is no checkpoint."""
    reader = _native.Reader(path, direct, backend)
    if not any(name == f"{reader.prefix}/data.pkl" for name, _, _ in reader.records()):
        raise _native.FormatError(f"{path}: no data.pkl record: not a torch.save checkpoint")
    return reader


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
    meta = torch.load(
        f"/proc/self/fd/{reader.fileno()}", map_location="meta", weights_only=weights_only
    )
    by_offset: dict[int, list[TensorInfo]] = {}
    for name, t in _tensors(meta, "", set()):
        off = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if off is None:
            continue
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
