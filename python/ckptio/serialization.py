"""save / load / records: torch.save-compatible checkpoints through the ckptio engine.

The data path never detours through Python: ``save`` pickles the object as
torch.save does (natively for state dicts, byte for byte the same pickle,
else with torch's own reduce under a lean ``persistent_id``), then hands the
whole archive to the Rust core in one call: records laid out with an alignment
each (storages of ``PACK_BELOW`` bytes or more on 4 KiB boundaries, smaller
ones packed at torch's 64 bytes), headers and data written by the engine in
few large I/Os, CRC-32s stored as the bytes pass, committed atomically. (Into
a file object, or with torch.save's other pickle arguments, ``torch.save``
writes the metadata under ``skip_data``, storages at 4 KiB, and the engine
the storages.) ``load`` reads the pickle natively where it is a plain state
dict (else ``torch.load`` rebuilds the object over a lazy mapping of the file
that is never read), allocates each storage empty on its destination device,
has the engine read every record straight into it, and makes the object with
the calls torch's unpickler makes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import functools
import gc
import io
import os
import pickle
import re
import secrets
import stat
import sys
import threading
import time
import types
import warnings
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.serialization import config as _torch_config

from ckptio import _hostmem, _native, _transfer, _unpickled
from ckptio import group as _group
from ckptio._transfer import IOReport as IOReport
from ckptio._transfer import _last as _last
from ckptio._transfer import device_code as _device_code
from ckptio._transfer import last_report as last_report
from ckptio._transfer import report as _report
from ckptio.errors import corrupt

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
    old = _torch_config.save.storage_alignment
    _torch_config.save.storage_alignment = n
    try:
        yield
    finally:
        _torch_config.save.storage_alignment = old


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


@contextlib.contextmanager
def _torch_writing() -> Iterator[None]:
    """While torch.save writes into a file of ckptio's: storages at 4 KiB (or the
    user's larger ``storage_alignment``), and every record's CRC-32 computed."""
    with _CONFIG_LOCK:
        align = max(STORAGE_ALIGNMENT, asked_alignment())
        with _storage_alignment(align), _crc32_on():
            yield


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
    with _torch_writing(), torch.serialization.skip_data():
        torch.save(
            obj,
            fh,
            pickle_module=_capturing_pickle_module(found, pickle_module),
            pickle_protocol=pickle_protocol,
            _disable_byteorder_record=disable_byteorder,
        )


def _torch_writes(new_zip: bool) -> str | None:
    """Why torch.save itself must write the whole file, or None: torch's legacy
    format (no records to place), or the caller's ``torch.serialization.skip_data()``
    (no storage bytes to write: torch leaves their space empty)."""
    if not new_zip:
        return "legacy format: torch wrote it"
    if torch.serialization._serialization_tls.skip_data:
        return "skip_data: torch wrote the file without storage bytes"
    return None


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


class _StorageRef:
    """A storage as the pickle names it: ``pid`` makes what torch's
    ``persistent_id`` returns (a new tuple each time, as torch's)."""

    __slots__ = ("cls", "key", "location", "numel")

    def __init__(self, cls: Any, key: str, location: str, numel: int) -> None:
        self.cls, self.key, self.location, self.numel = cls, key, location, numel

    def pid(self) -> tuple[Any, ...]:
        return ("storage", self.cls, self.key, self.location, self.numel)


_STORAGE_TYPES: dict[type, bool] = {}


def _is_storage_type(t: type) -> bool:
    """Whether torch.save's ``persistent_id`` takes objects of type ``t`` (cached)."""
    r = _STORAGE_TYPES.get(t)
    if r is None:
        r = _STORAGE_TYPES[t] = (
            issubclass(t, (torch.storage.TypedStorage, torch.UntypedStorage))
            or t in torch._storage_classes
        )
    return r


@functools.cache
def _v2_storage_classes() -> dict[torch.dtype, Any]:
    """dtype -> the legacy storage class torch pickles its tensors' storages as,
    for dtypes saved with ``_rebuild_tensor_v2`` (torch's other dtypes take
    torch's own reduce)."""
    new = torch.storage._new_dtypes()
    return {
        dt: getattr(torch, name)
        for dt, name in torch.storage._dtype_to_storage_type_map().items()
        if dt not in new
    }


class _Pickler(pickle.Pickler):
    """torch.save's pickle, byte for byte, without torch's per-object Python work.

    torch.save calls a Python ``persistent_id`` for every pickled object (about
    20 per tensor) and ``Tensor.__reduce_ex__`` per tensor, and pickles every
    OrderedDict through copyreg (a Python call each). Here plain tensors,
    Parameters and OrderedDicts are reduced in ``reducer_override`` exactly as
    torch reduces them (same callables, same arguments), their storages named
    by a :class:`_StorageRef` that ``persistent_id`` answers with one type
    check; everything else takes torch's own ``__reduce_ex__`` and torch's
    storage naming (same keys, same dtype check). ``storages`` maps each
    storage key to its storage and device code, in key order, as torch writes
    its records.
    """

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        #: key -> (storage, device code or None where not known yet)
        self.storages: dict[str, tuple[torch.UntypedStorage, int | None]] = {}
        self._keys: dict[int, str] = {}  # storage _cdata -> key
        self._dtypes: dict[int, torch.dtype] = {}  # data_ptr -> dtype (torch's check)
        self._refs: dict[tuple[int, torch.dtype], _StorageRef] = {}
        self._locations: dict[int, str] = {}
        self._classes = _v2_storage_classes()

    def _key(self, storage: torch.UntypedStorage, dtype: torch.dtype, dev: int | None) -> str:
        """The storage's key (a new one on first sight), after torch's check that
        no two dtypes view the same data. ``dev``: its device code, None when
        not known yet (a storage met through torch's reduce: any device)."""
        ptr = storage.data_ptr()
        if ptr and (dev is not None or storage.device.type != "meta"):
            seen = self._dtypes.setdefault(ptr, dtype)
            if seen != dtype:
                raise RuntimeError(
                    "Cannot save multiple tensors or storages that view the same data as "
                    "different types"
                )
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = str(len(self._keys))
            self.storages[key] = (storage, dev)
        return key

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is _StorageRef:
            return obj.pid()
        is_storage = _STORAGE_TYPES.get(t)
        if is_storage is None:
            is_storage = _is_storage_type(t)
        return self._torch_pid(obj) if is_storage else None

    def _torch_pid(self, obj: Any) -> tuple[Any, ...]:
        """torch.save's persistent_id for a storage met through torch's reduce."""
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        else:
            storage = obj
            dtype = torch.uint8
            storage_type = torch.serialization.normalize_storage_type(type(obj))
            numel = storage.nbytes()
        key = self._key(storage, dtype, None)
        if getattr(obj, "_fake_device", None) is not None:
            location = str(obj._fake_device)
        else:
            location = torch.serialization.location_tag(storage)
        return ("storage", storage_type, key, location, numel)

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor:
            return self._tensor(obj)
        if t is collections.OrderedDict:
            # What OrderedDict.__reduce__ returns, without its copyreg call.
            return (t, (), obj.__dict__ or None, None, iter(obj.items()))
        if t is torch.nn.Parameter and not obj.__dict__:
            return (torch._utils._rebuild_parameter, (obj.data, obj.requires_grad, _OD()))
        return NotImplemented

    def _tensor(self, t: torch.Tensor) -> Any:
        """``Tensor.__reduce_ex__`` of a plain CPU or CUDA tensor (NotImplemented
        for anything torch reduces otherwise: hooks, Python state, sparse,
        quantized, nested, conjugate or negative views, torch's newer dtypes)."""
        cls = self._classes.get(t.dtype)
        if (
            cls is None
            or not (t.is_cpu or t.is_cuda)
            or t.layout is not torch.strided
            or t.is_quantized
            or t.is_nested
            or t._backward_hooks
            or t.__dict__
            or torch._C._get_tensor_metadata(t)
        ):
            return NotImplemented
        st = t.untyped_storage()
        dev = t.get_device()
        ref = self._refs.get((st._cdata, t.dtype))
        if ref is None:
            location = self._locations.get(dev)
            if location is None:
                location = self._locations[dev] = torch.serialization.location_tag(st)
            key = self._key(st, t.dtype, dev)
            ref = _StorageRef(cls, key, location, st.nbytes() // t.element_size())
            self._refs[(st._cdata, t.dtype)] = ref
        return (
            torch._utils._rebuild_tensor_v2,
            (ref, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad, _OD()),
        )


_OD = collections.OrderedDict


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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


@functools.cache
def _native_pickler() -> _native.StateDictPickler:
    return _native.StateDictPickler(
        torch.Tensor,
        torch.nn.Parameter,
        collections.OrderedDict,
        torch.strided,
        _v2_storage_classes(),
        torch._C._get_tensor_metadata,
        torch.serialization.location_tag,
        torch._utils._rebuild_tensor_v2,
        torch._utils._rebuild_parameter,
    )


#: (storage key, address, nbytes, device code, the storage: its memory's owner)
_Stored = tuple[str, int, int, int, Any]


def _pickle(obj: object) -> tuple[bytes, list[_Stored]]:
    """(data.pkl's bytes, the storages in key order) as torch.save makes them:
    natively for state dicts (plain tensors, Parameters, containers, str, int,
    float, bool, None), else by :class:`_Pickler`."""
    native = _native_pickler().dump(obj)
    if native is not None:
        return native
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    found = []
    for key, (st, dev) in pickler.storages.items():
        if dev is None:
            dev = _device_code(st, f"storage {key}")
        found.append((key, st.data_ptr(), st.nbytes(), dev, st))
    return buf.getvalue(), found


#: Storages of at least this many bytes start on a 4 KiB boundary of the file
#: (O_DIRECT and GPUDirect Storage move them in place, torch.load(mmap=True)
#: maps them page-aligned); smaller ones are packed at torch's 64 bytes, and
#: the padding adds at most 4 KiB / PACK_BELOW (0.4%) to a file. Below it the
#: engine moves storages through its staging buffers anyway (GATHER_BELOW in
#: src/engine) into memory torch allocates (_ALIGNED_ALLOC_MIN), so alignment
#: would buy nothing; see docs/many-tensors.md for the measurements.
PACK_BELOW = 1 << 20
#: torch's storage alignment, which small storages keep.
TORCH_ALIGNMENT = 64
_PREFIX = "archive"


def _serialization_id() -> bytes:
    """40 digits, as torch writes them (a checksum and a hash there; torch never checks)."""
    return f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}".encode()


def _archive_entries(
    pkl: bytes, storages: list[_Stored], floor: int = TORCH_ALIGNMENT
) -> list[tuple[str, Any, int]]:
    """The records of a torch.save archive, in torch's order: the pickle, the
    format records, each storage ((address, nbytes, device code)), the version.
    Every storage starts at a multiple of ``floor`` (the user's
    ``config.save.storage_alignment``, :func:`asked_alignment`) at least."""
    large = [n >= PACK_BELOW for _, _, n, _, _ in storages if n]
    small = max(TORCH_ALIGNMENT, floor)
    big = max(STORAGE_ALIGNMENT, floor) if any(large) else small
    uniform = big == small or all(large)
    p = _PREFIX
    entries: list[tuple[str, Any, int]] = [(f"{p}/data.pkl", pkl, TORCH_ALIGNMENT)]
    if uniform:
        # torch may then compute storage offsets from the alignment
        # (config.load.calculate_storage_offsets): it finds them where they are.
        entries.append((f"{p}/.format_version", b"1", TORCH_ALIGNMENT))
    entries.append((f"{p}/.storage_alignment", str(big if uniform else small).encode(), 64))
    entries.append((f"{p}/byteorder", sys.byteorder.encode(), TORCH_ALIGNMENT))
    entries += [
        (f"{p}/data/{key}", (ptr, n, dev), big if n == 0 or n >= PACK_BELOW else small)
        for key, ptr, n, dev, _ in storages
    ]
    entries.append((f"{p}/version", b"3\n", TORCH_ALIGNMENT))
    entries.append((f"{p}/.data/serialization_id", _serialization_id(), TORCH_ALIGNMENT))
    return entries


#: The largest ``config.save.storage_alignment`` ckptio writes: a zip local
#: header pads a record with at most 64 KiB (torch's writer breaks above it too).
MAX_ALIGNMENT = 32768


def asked_alignment() -> int:
    """``torch.utils.serialization.config.save.storage_alignment``, the alignment
    every storage of a torch.save file must start at (torch's default 64: ckptio
    packs small storages at 64 bytes and puts large ones on 4 KiB anyway). A
    value ckptio cannot honour is refused, naming the switch."""
    a = _torch_config.save.storage_alignment
    if type(a) is not int or not 1 <= a <= MAX_ALIGNMENT or a & (a - 1):
        raise ValueError(
            f"torch.utils.serialization.config.save.storage_alignment is {a!r}: ckptio.save "
            f"writes alignments that are powers of two from 1 to {MAX_ALIGNMENT} bytes"
        )
    return a


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
    torch.save zip archive (plain ``torch.load`` reads it, also with
    ``mmap=True``) whose storages of ``PACK_BELOW`` bytes or more start at
    multiples of 4096 bytes, smaller ones packed at torch's 64 bytes (with a
    ``pickle_module`` or ``pickle_protocol`` of the caller's, or
    ``_disable_byteorder_record``, torch pickles and every storage starts at
    4096). It is written to a temp file in the same folder
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
    CKPTIO_MEMORY_THREADS / CKPTIO_MEMORY_CHUNK_SIZE, else one per core within 8-32
    and 4 MiB, unless given here or by CKPTIO_THREADS / CKPTIO_CHUNK_SIZE: there
    I/O is memory copies, which scale with cores).
    direct: O_DIRECT "auto" (default: where the filesystem takes it), True/"on"
    (required) or False/"off". backend: how CUDA storages move, "auto" (default, or
    CKPTIO_BACKEND: cuFile where it can register the file, else pinned bounce
    buffers; loads take the bounce buffers where cuFile runs in compat mode),
    "cufile" (or an error) or "bounce" (pinned bounce buffers; "posix" is an
    older name for it). The report says which ran (``device_path``).
    Bytes are copied after the work queued on the current CUDA streams (the
    copies wait for it on the GPU; the host is not blocked for it).
    """
    _file_like(f, "save", "write")
    torch_args = (pickle_module, pickle_protocol, _disable_byteorder_record)
    d = _direct_arg(direct)
    t0 = time.perf_counter()
    engine = _engine(threads, chunk_size, d)
    by_torch = _torch_writes(_use_new_zipfile_serialization)
    if not _is_path(f):
        _save_object(obj, f, torch_args, _use_new_zipfile_serialization, engine, d, backend, t0)
        return
    path = _path(f, "save")
    if by_torch is None and _packs(*torch_args):
        _save_packed(obj, path, engine, d, backend, t0)
        return
    writer = _native.AtomicWriter(path, d, backend)
    try:
        found: dict[str, torch.UntypedStorage] = {}
        try:
            with os.fdopen(os.dup(writer.fileno()), "wb") as fh:
                if by_torch is not None:
                    zip_ = _use_new_zipfile_serialization
                    with _torch_writing():
                        torch.save(obj, fh, pickle_module, pickle_protocol, zip_, *torch_args[2:])
                else:
                    _write_metadata(obj, fh, found, *torch_args)
        except OSError as e:
            if e.errno is None or e.filename is not None:
                raise
            # torch wrote the metadata through a file object: name the file.
            raise OSError(
                e.errno, f"writing checkpoint metadata failed: {e.strerror}", writer.tmp_path
            ) from e
        if by_torch is None:
            storages = _storage_segments(found, None)
            stats = _transfer.write_storages(writer, engine, storages, list(found.values()))
        else:
            stats = _torch_stats(os.path.getsize(writer.tmp_path), by_torch)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    _report(path, t0, stats, len(found))


def _packs(pickle_module: Any, pickle_protocol: int, disable_byteorder: bool) -> bool:
    """Whether ckptio pickles and lays out the archive itself: torch.save's own
    pickle arguments (:class:`_Pickler` writes protocol 2 as torch's default
    pickler does)."""
    return pickle_module is pickle and pickle_protocol == 2 and not disable_byteorder


def _save_packed(
    obj: object,
    path: str,
    engine: _native.Engine,
    direct: str | None,
    backend: str | None,
    t0: float,
) -> None:
    """``save`` to a path, the archive laid out here (small storages packed) and
    written by the engine in one pass."""
    with _gc_paused():
        pkl, storages = _pickle(obj)
        entries = _archive_entries(pkl, storages, asked_alignment())
    writer = _native.AtomicWriter(path, direct, backend)
    try:
        owners = [s[4] for s in storages]
        stats = _transfer.write_archive(writer, engine, entries, _PREFIX, owners)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    _report(path, t0, stats, len(storages))


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
    by_torch = _torch_writes(new_zip)
    fd = _descriptor(f) if by_torch is None else None
    dev_file = None
    if fd is not None:
        try:  # a second open of the very file, for the engine
            dev_file = _native.DeviceFile(f"/proc/self/fd/{fd}", True, direct, backend)
        except OSError:  # e.g. the file's mode forbids a new open for writing
            dev_file = None
    name = _object_name(f, fd)
    if dev_file is None:
        start = f.tell() if hasattr(f, "tell") else 0
        with _torch_writing():
            torch.save(obj, f, torch_args[0], torch_args[1], new_zip, torch_args[2])
        n = f.tell() - start if hasattr(f, "tell") else 0
        why = by_torch or "a file object without a usable descriptor"
        _report(name, t0, _torch_stats(n, why), 0)
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
        return _mapped(self.map_location, location)

    def __call__(self, storage: torch.UntypedStorage, location: str) -> Any:
        if callable(self.map_location) and not isinstance(self.map_location, torch.device):
            # A user callable may do anything with the storage; the mapping
            # holds the real bytes, so its result is right as it is.
            result = self.map_location(storage, location)
            if result is None:
                result = torch.serialization.default_restore_location(storage, location)
            return result
        loc = self._mapped(location)
        dev = _fill_device(self.map_location, loc)
        if dev is None:  # not ours to fill: torch copies from the mapping (or raises)
            return torch.serialization.default_restore_location(storage, loc)
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
            _reserve_cuda(dev, self.sizes)
        dest = _empty_storage(storage.nbytes(), dev)
        self.pending.append((storage.data_ptr(), storage.nbytes(), dest))
        return dest


def _mapped(map_location: MapLocation, location: str) -> str:
    """The location string after a str / device / dict map_location."""
    if isinstance(map_location, dict):
        return map_location.get(location, location)
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return location


def _restorable(location: Any) -> bool:
    """Whether torch.load's default_restore_location knows storage location tag
    ``location`` (a string: "cpu" exactly, or a device of another type)."""
    if not isinstance(location, str):
        return False
    if location == "cpu":
        return True
    try:
        dev = torch.device(location)
    except (RuntimeError, ValueError):
        return False
    return dev.type != "cpu" and location.startswith(dev.type)


def _fill_device(map_location: MapLocation, loc: str) -> torch.device | None:
    """The device the engine fills for a storage whose location is ``loc`` once
    ``map_location`` applied; None where torch.load must restore it: not a device
    the engine fills, or a tag of the file's (no str or device map_location
    replaced it) that torch cannot restore, so that torch raises its own error."""
    tagged = not isinstance(map_location, (str, torch.device))
    return _engine_device(loc) if not tagged or _restorable(loc) else None


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
    raise corrupt(path, "storages in the pickle do not match the archive's records")


@_group.groupable("ckptio.load")
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

    ``group``: a ``torch.distributed`` process group whose ranks all call
    ``load`` of the same checkpoint together (with ``out=`` too): each byte is
    read from storage by one rank (the storages split between the ranks by
    bytes) and shared over the group's collectives (NCCL for CUDA memory,
    gloo for host memory), every rank getting the whole result. Ranks that
    see a different file raise ``ckptio.GroupMismatchError`` together; a rank
    whose load fails raises its error, every other rank
    ``ckptio.PeerLoadError``. ``last_report().bytes_read`` / ``bytes_received``
    say what came from storage and from the other ranks. See docs/group.md.
    """
    t0 = time.perf_counter()
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, not {type(verify).__name__}")
    _file_like(f, "load", "read")
    weights_only = resolve_weights_only(weights_only, pickle_module)
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
    why = _torch_loads(path, map_location, mmap)
    if why is not None:
        if verify:  # torch reads the bytes itself here: check the whole file first.
            _verify_all(path, threads, chunk_size, direct)
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
    fast = None
    if pickle_module is None and not pickle_load_args:
        fast = _plan_fast(path, reader, records_, prefix, map_location)
    if fast is not None:
        segments, owners, build = fast
    else:
        restorer = _Restorer(map_location, list(data.values()), shown)
        # /proc/self/fd/N: torch reads the very file we mapped, even if the path is
        # replaced meanwhile by a concurrent save.
        try:
            with _unpickling(shown):
                obj = torch.load(
                    f"/proc/self/fd/{reader.fileno()}",
                    map_location=restorer,
                    mmap=True,
                    **torch_kw,
                )
        except RuntimeError as e:
            if not str(e).startswith("Callable map_location not supported") or callable(
                map_location
            ):
                raise
            # A tensor subclass that torch rebuilds from map_location itself, which
            # must then be the caller's own (a str, device or dict): torch loads it.
            src = f"/proc/self/fd/{reader.fileno()}"
            return _by_torch(t0, src, "a tensor subclass", map_location, **torch_kw)
        segments, owners = _restored_segments(restorer, data, path)
    # Memory handed out by the caching allocator may still be in use by work
    # queued on the current stream: the engine's copies are ordered after it.
    shared = _group.current()
    if shared is not None:  # read once over the group
        from ckptio.inplace import IoOptions

        src = _group.Source(shown, reader, os.fstat(reader.fileno()).st_size)
        pieces = [
            _group.Piece(0, seg[0], seg[2], dest.device, _group.as_bytes(dest, seg[1], seg[2]))
            for seg, dest in zip(segments, owners, strict=True)
        ]
        for piece in pieces:
            piece.splittable = not verify  # a CRC-32 is checked over a whole record read
        stats = shared.read([src], pieces, IoOptions(threads, chunk_size, d, backend), verify)
        if fast is not None:
            obj = build()
    elif fast is not None:  # the tensors are made while the engine reads
        stats, obj = _transfer.read_while(reader, engine, segments, owners, build, verify=verify)
    else:
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


_TRUE = ("1", "y", "yes", "true")


def resolve_weights_only(weights_only: bool | None, pickle_module: Any) -> bool:
    """``weights_only`` as torch.load resolves it, decided once per load: its
    default (True unless a ``pickle_module`` is given), then the environment
    (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` always wins; ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    only where the caller did not choose), with torch's errors and warning."""
    unset = weights_only is None
    if unset:
        weights_only = torch.serialization._default_to_weights_only(pickle_module)
    force = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    force_no = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    if force and force_no:
        raise RuntimeError(
            "Only one of `TORCH_FORCE_WEIGHTS_ONLY_LOAD` or `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` "
            "should be set, but both were set."
        )
    if force:
        weights_only = True
    elif force_no and unset:
        warnings.warn(
            "Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected, since the"
            "`weights_only` argument was not explicitly passed to `torch.load`, forcing "
            "weights_only=False.",
            UserWarning,
            stacklevel=4,  # the caller of ckptio.load (through its group wrapper)
        )
        weights_only = False
    if weights_only and pickle_module is not None:
        raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    return bool(weights_only)


def _restored_segments(
    restorer: _Restorer, data: dict[int, int], path: str
) -> tuple[list[tuple[int, int, int, int]], list[torch.UntypedStorage]]:
    """The engine's reads for the storages torch.load handed to the restorer,
    and their owners."""
    offsets = _file_offsets(restorer.pending, data, path)
    segments, owners = [], []
    for off, (_, n, dest) in zip(offsets, restorer.pending, strict=True):
        if dest.nbytes() != n:
            # The pickle grew a storage past its record (torch's own mmap load refuses).
            raise corrupt(path, f"a tensor needs {dest.nbytes()} bytes of a record that holds {n}")
        if n:
            segments.append((off, dest.data_ptr(), n, _device_code(dest, "destination")))
            owners.append(dest)
    return segments, owners


@functools.cache
def _storage_dtype(name: str) -> torch.dtype | None:
    """The dtype of a storage class the pickle names (torch's StorageType)."""
    if name == "UntypedStorage":
        return torch.uint8
    try:
        return torch.serialization.StorageType(name).dtype
    except (KeyError, AttributeError, RuntimeError):
        return None


# torch's reader takes files of these format versions (caffe2/serialize/versions.h).
_MIN_VERSION, _MAX_VERSION = 1, 10
_VERSION = re.compile(rb"\s*(\d+)")


def _torch_opens(reader: _native.Reader, records_: list[tuple[str, int, int]], prefix: str) -> bool:
    """The checks torch.load makes of the records it reads besides the pickle
    and the storages: a version in the range it reads, a storage alignment
    that is an int, a serialization id in UTF-8. False where torch.load must
    decide (it may refuse)."""
    names = {name: n for name, _, n in records_}
    version = f"{prefix}/.data/version"
    if version not in names:
        version = f"{prefix}/version"
    align = f"{prefix}/.storage_alignment"
    sid = f"{prefix}/.data/serialization_id"
    if names.get(version, 1 << 20) > 64 or names.get(align, 0) > 64 or names.get(sid, 0) > 4096:
        return False
    if sid in names:
        try:
            reader.read_record(sid).decode()
        except UnicodeDecodeError:
            return False
    m = _VERSION.match(reader.read_record(version))
    if not m or not _MIN_VERSION <= int(m.group(1)) <= _MAX_VERSION:
        return False
    if align in names:
        try:
            int(reader.read_record(align))
        except ValueError:
            return False
    return True


def _native_pickle(
    reader: _native.Reader, records_: list[tuple[str, int, int]], prefix: str
) -> tuple[_native.Unpickled, list[tuple[int, int, torch.dtype, str]]] | None:
    """The pickle read natively (``_native.unpickle``: plain tensors, Parameters
    and containers, see src/format/pickle.rs) and its storages as (file offset,
    nbytes, dtype, location); None where torch.load must read the file:
    another pickle, a file torch would refuse to open, a storage whose record
    is missing or of another size, a fake or skip_data mode."""
    if torch.serialization._serialization_tls.skip_data:
        return None
    if torch._guards.detect_fake_mode(None) is not None:
        return None
    pkl = f"{prefix}/data.pkl"
    size = next((n for name, _, n in records_ if name == pkl), None)
    if size is None or size > 64 << 20 or not _torch_opens(reader, records_, prefix):
        return None
    parsed = _native.unpickle(reader.read_record(pkl))
    if parsed is None:
        return None
    where = {name: (off, n) for name, off, n in records_}
    found = []
    for key, cls, location, numel in parsed.storages():
        dtype = _storage_dtype(cls)
        rec = where.get(f"{prefix}/data/{key}")
        if dtype is None or rec is None or rec[1] != numel * dtype.itemsize:
            return None
        found.append((rec[0], rec[1], dtype, location))
    return parsed, found


#: Make the object of a natively read pickle over its storages (see
#: :func:`ckptio._unpickled.build`): a tensor per storage, the containers, no
#: cycles, so no collections meanwhile (see _gc_paused).
_rebuild = _gc_paused()(_unpickled.build)


@_gc_paused()  # a storage and a tensor per record: see _gc_paused
def _plan_fast(
    path: str,
    reader: _native.Reader,
    records_: list[tuple[str, int, int]],
    prefix: str,
    map_location: MapLocation,
) -> tuple[list[tuple[int, int, int, int]], list[torch.UntypedStorage], Callable[[], Any]] | None:
    """Load without torch.load: the pickle read natively (:func:`_native_pickle`),
    each storage allocated on its destination, the object made once the engine
    has read the bytes (:func:`_rebuild`). Returns (the engine's reads, their
    owners, the builder), or None where torch.load must run: see
    :func:`_native_pickle`, and a callable map_location, a location the engine
    does not fill.
    """
    if callable(map_location) and not isinstance(map_location, torch.device):
        return None
    got = _native_pickle(reader, records_, prefix)
    if got is None:
        return None
    parsed, found = got
    devices: dict[str, torch.device | None] = {}
    dests = []
    for _, _, _, location in found:
        dev = devices.get(location, ...)
        if dev is ...:
            loc = _mapped(map_location, location)
            dev = devices[location] = _fill_device(map_location, loc)
        if dev is None:
            return None
        dests.append(dev)
    if isinstance(map_location, (str, torch.device)):
        for dev in {d for d in dests if d.type == "cuda"}:
            _reserve_cuda(dev, [f[1] for f in found])
    storages: list[torch.UntypedStorage] = []
    segments = []
    for (off, n, _, _), dev in zip(found, dests, strict=True):
        st = _empty_storage(n, dev, off % STORAGE_ALIGNMENT)
        storages.append(st)
        if n:
            segments.append((off, st.data_ptr(), n, -1 if dev.type == "cpu" else dev.index))
    dtypes = [f[2] for f in found]
    return segments, storages, lambda: _rebuild(parsed, storages, dtypes, path)


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
    """torch's refusal of a pickle keeps torch's type and whole message, unchanged
    at its start (code and users match it: "Weights only load failed", the global
    refused and how to allow it); the file follows."""
    try:
        yield
    except pickle.UnpicklingError as e:
        raise type(e)(f"{e}\n\n(while loading {path}, record data.pkl)") from None


def _by_torch(t0: float, src: Any, why: str, *args: Any, **kwargs: Any) -> Any:
    """torch.load as is; the report says so."""
    name = os.fsdecode(src) if _is_path(src) else _object_name(src)
    with _unpickling(name):
        obj = torch.load(src, *args, **kwargs)
    try:
        n = os.path.getsize(src) if _is_path(src) else 0
    except OSError:
        n = 0
    _report(name, t0, dict(_torch_stats(n, f"torch.load read it: {why}"), bytes_read=n), 0)
    return obj


def _is_torchscript(path: str) -> bool:
    """A TorchScript zip (compressed code records, which torch.load hands to torch.jit)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("/constants.pkl") for n in z.namelist())
    except Exception:  # noqa: BLE001 - a zip Python cannot read is no TorchScript to hand on
        return False


def _torch_loads(path: str, map_location: MapLocation, mmap: bool | None) -> str | None:
    """Why torch.load must read ``path`` as is, or None: ``mmap`` (the argument,
    else torch's ``config.load.mmap``), nothing to read (``skip_data``, meta,
    FakeTensorMode) or torch's legacy (non-zip) format. Other files that are no
    zip archive stay ckptio's to refuse (FormatError)."""
    if mmap or (mmap is None and _torch_config.load.mmap):
        return "mmap"
    if torch.serialization._serialization_tls.skip_data:
        return "skip_data: nothing to read"
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "meta":
        return "map_location meta: nothing to read"
    if torch._guards.detect_fake_mode(None) is not None:
        return "FakeTensorMode: nothing to read"
    with open(path, "rb") as fh:
        return "torch's legacy format" if _is_legacy(fh.read(14)) else None


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
    """Whether the storages are in this machine's byte order. Without a byteorder
    record torch assumes what ``torch.serialization.get_default_load_endianness()``
    says: little-endian unless it was set to BIG or NATIVE."""
    byteorder = f"{reader.prefix}/byteorder"
    if not any(name == byteorder for name, _, _ in reader.records()):
        default = torch.serialization.get_default_load_endianness()
        if default == torch.serialization.LoadEndianness.NATIVE:
            return True
        big = default == torch.serialization.LoadEndianness.BIG
        return sys.byteorder == ("big" if big else "little")
    raw = reader.read_record(byteorder)
    if raw not in (b"little", b"big"):
        raise corrupt(f"{path}, record {byteorder}", f"{raw[:16]!r} is not b'little' or b'big'")
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
        raise corrupt(path, "no data.pkl record: not a torch.save checkpoint")
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
        raise corrupt(path, f"torch's reader refuses the archive: {msg}") from e


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
    records_ = reader.records()
    _native_byteorder(reader, path)  # torch.load would fail on a bad one, untyped
    native = _native_pickle(reader, records_, reader.prefix)
    if native is not None:
        parsed, found = native
        storages = []
        for off, n, _, _ in found:
            st = torch.UntypedStorage(n, device="meta")
            st._checkpoint_offset = off
            storages.append(st)
        meta = _rebuild(parsed, storages, [x[2] for x in found], path)
    else:
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
            raise corrupt(
                path,
                f"tensor {name or '<root>'!r} declares a storage of "
                f"{t.untyped_storage().nbytes()} bytes at offset {off}, where the archive "
                f"has {'no record' if off not in sizes else f'a record of {sizes[off]}'}",
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
        for name, off, size in records_
    ]
