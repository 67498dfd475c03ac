"""torch.save's zip archives: what ckptio knows of the format, in one place.

A torch.save file is a zip of stored records under one prefix: ``data.pkl``
(the pickle, naming each storage by key), ``data/<key>`` (each storage's
bytes), and small format records (``version``, ``byteorder``,
``.format_version``, ``.storage_alignment``, ``.data/serialization_id``).
The Rust core maps the records (``_native.Reader``: record name -> data offset)
and reads a plain state dict's pickle natively (``_native.unpickle``); this
module holds the rest:

- **writing**: the pickle torch.save writes, made natively for state dicts or
  by :class:`_Pickler` (torch's bytes, without its per-object Python work);
  the archive's records and their alignments (:func:`archive_entries`: storages
  of ``PACK_BELOW`` bytes or more on 4 KiB, smaller ones packed at torch's 64
  bytes, every one at ``config.save.storage_alignment`` where the user set it);
  torch.save itself writing the metadata of a file whose storages the engine
  writes (:func:`write_metadata`);
- **reading**: opening an archive as torch's reader would take it
  (:func:`open_archive`), its byte order, the pickle read natively
  (:func:`native_pickle`) and its storages' file offsets, and the one way to
  open a checkpoint as a mapped view (:func:`open_torch`) that loads in place,
  ``load_state_dict``, ``describe`` and ``verify`` use; the records and the
  tensors each holds (:func:`list_records`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import os
import pickle
import re
import secrets
import sys
import threading
import traceback
import types
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol, cast

import torch
from torch.utils.serialization import config as _torch_config

from ckptio import _native
from ckptio.errors import (
    CkptioError,
    FormatError,
    LocationError,
    PickleEndError,
    RecordValueError,
    corrupt,
)
from ckptio.formats import unpickled
from ckptio.formats.mapped import Mapped
from ckptio.io import devices, memory, remote

#: Storage alignment of files ckptio writes (what O_DIRECT and GPUDirect Storage want).
STORAGE_ALIGNMENT = 4096


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


#: The largest ``config.save.storage_alignment`` ckptio writes: a zip local
#: header pads a record with at most 64 KiB (torch's writer breaks above it too).
MAX_ALIGNMENT = 32768


PREFIX = "archive"


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


# torch's serialization config is process-global. Every ckptio save wants the same
# of it (see torch_writing), so saves share one setting, counted, and no lock is held
# while torch pickles: an object's __reduce__ may run a save, on this thread or on
# another it waits for. CONFIG_LOCK guards the count and a setting of another value
# (``exclusive_config``), which waits until no save is writing.
CONFIG_LOCK = threading.Condition(threading.RLock())
_writing = 0  # ckptio saves inside torch_writing, on any thread
_writing_here = threading.local()  # ... and on this one
_restore_to: tuple[int, bool | None] = (0, None)  # what the first of them found


@contextlib.contextmanager
def storage_alignment(n: int) -> Iterator[None]:
    old = _torch_config.save.storage_alignment
    _torch_config.save.storage_alignment = n
    try:
        yield
    finally:
        _torch_config.save.storage_alignment = old


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


@contextlib.contextmanager
def torch_writing() -> Iterator[None]:
    """While torch.save writes into a file of ckptio's: storages at 4 KiB (or the
    user's larger ``storage_alignment``), and every record's CRC-32 computed, also
    where ``torch.serialization.set_crc32_options(False)`` turned it off: ckptio's
    archives carry every CRC-32 (torch writes no data record here, so it costs
    nothing). Set by the first of the saves that run at once, restored by the last."""
    global _writing, _restore_to
    get_crc = getattr(torch.serialization, "get_crc32_options", None)
    set_crc = getattr(torch.serialization, "set_crc32_options", None)
    with CONFIG_LOCK:
        if _writing == 0:
            align = max(STORAGE_ALIGNMENT, asked_alignment())
            crc = get_crc() if get_crc is not None and set_crc is not None else None
            _restore_to = (_torch_config.save.storage_alignment, crc)
            _torch_config.save.storage_alignment = align
            if crc is False:
                set_crc(True)  # type: ignore[misc]
        _writing += 1
        _writing_here.n = getattr(_writing_here, "n", 0) + 1
    try:
        yield
    finally:
        with CONFIG_LOCK:
            _writing -= 1
            _writing_here.n -= 1
            if _writing == 0:
                old_align, crc = _restore_to
                _torch_config.save.storage_alignment = old_align
                if crc is False:
                    set_crc(False)  # type: ignore[misc]
                CONFIG_LOCK.notify_all()


@contextlib.contextmanager
def exclusive_config(align: int) -> Iterator[None]:
    """torch's config with storage alignment ``align`` for a torch.save that runs no
    user code (a shell tensor's archive), while no other thread's save is writing;
    one inside this thread's own save goes ahead: that save is paused meanwhile
    and finds its setting back."""
    with CONFIG_LOCK:
        CONFIG_LOCK.wait_for(lambda: _writing == getattr(_writing_here, "n", 0))
        with storage_alignment(align):
            yield


#: The caller's (skip_data, materialize_fake_tensors) under each of ckptio's own
#: skip_data() of this thread, innermost last.
_OWN_SKIPS = threading.local()


@contextlib.contextmanager
def own_skip_data() -> Iterator[None]:
    """torch.serialization.skip_data() for ckptio's own pickling (the engine writes
    the storages' bytes): a save or load that runs inside it (an object's
    ``__reduce__`` saving as it is pickled) is not the caller's to skip
    (:func:`callers_serialization`)."""
    tls = torch.serialization._serialization_tls
    stack = _OWN_SKIPS.__dict__.setdefault("stack", [])
    stack.append((tls.skip_data, tls.materialize_fake_tensors))
    try:
        with torch.serialization.skip_data():
            yield
    finally:
        stack.pop()


def callers_serialization(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a save or load) run with torch's skip_data state as its caller
    set it, also inside one of ckptio's own (:func:`own_skip_data`): there a
    nested save wrote its tensors without their bytes."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_OWN_SKIPS, "stack", None)
        if not stack:
            return fn(*args, **kwargs)
        tls = torch.serialization._serialization_tls
        now = (tls.skip_data, tls.materialize_fake_tensors)
        tls.skip_data, tls.materialize_fake_tensors = stack[-1]
        _OWN_SKIPS.stack = []
        try:
            return fn(*args, **kwargs)
        finally:
            _OWN_SKIPS.stack = stack
            tls.skip_data, tls.materialize_fake_tensors = now

    return wrapper


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


def write_metadata(
    obj: object,
    fh: Any,
    found: dict[str, torch.UntypedStorage],
    pickle_module: Any,
    pickle_protocol: int,
    disable_byteorder: bool,
) -> None:
    """torch.save of everything but the storages' bytes (skip_data), storages at
    4 KiB, into ``fh``; ``found`` learns which storage went to which record."""
    with torch_writing(), own_skip_data():
        torch.save(
            obj,
            fh,
            pickle_module=_capturing_pickle_module(found, pickle_module),
            pickle_protocol=pickle_protocol,
            _disable_byteorder_record=disable_byteorder,
        )


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
            # private torch API, absent from torch's stubs
            or torch._C._get_tensor_metadata(t)  # type: ignore[attr-defined]
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


@functools.cache
def native_pickler() -> _native.StateDictPickler:
    return _native.StateDictPickler(
        torch.Tensor,
        torch.nn.Parameter,
        collections.OrderedDict,
        torch.strided,
        _v2_storage_classes(),
        torch._C._get_tensor_metadata,  # type: ignore[attr-defined]  # private; not in the stubs
        torch.serialization.location_tag,
        torch._utils._rebuild_tensor_v2,
        torch._utils._rebuild_parameter,
    )


#: (storage key, address, nbytes, device code, the storage: its memory's owner)
Stored = tuple[str, int, int, int, Any]


def pickled(obj: object) -> tuple[bytes, list[Stored]]:
    """(data.pkl's bytes, the storages in key order) as torch.save makes them:
    natively for state dicts (plain tensors, Parameters, containers, str, int,
    float, bool, None), else by :class:`_Pickler`."""
    native = native_pickler().dump(obj)
    if native is not None:
        return native
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    found = []
    for key, (st, dev) in pickler.storages.items():
        if dev is None:
            dev = devices.device_code(st, f"storage {key}")
        found.append((key, st.data_ptr(), st.nbytes(), dev, st))
    return buf.getvalue(), found


def _serialization_id() -> bytes:
    """40 digits, as torch writes them (a checksum and a hash there; torch never checks)."""
    return f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}".encode()


def archive_entries(
    pkl: bytes, storages: list[Stored], floor: int = TORCH_ALIGNMENT
) -> list[tuple[str, Any, int]]:
    """The records of a torch.save archive, in torch's order: the pickle, the
    format records, each storage ((address, nbytes, device code)), the version.
    Every storage starts at a multiple of ``floor`` (the user's
    ``config.save.storage_alignment``, :func:`asked_alignment`) at least."""
    large = [n >= PACK_BELOW for _, _, n, _, _ in storages if n]
    small = max(TORCH_ALIGNMENT, floor)
    big = max(STORAGE_ALIGNMENT, floor) if any(large) else small
    uniform = big == small or all(large)
    p = PREFIX
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


#: :func:`read_by_torch` of a TorchScript archive.
TORCHSCRIPT = "a TorchScript archive"

#: :func:`read_by_torch` of an archive whose records a zip tool compressed.
DEFLATED = "records compressed by a zip tool (torch inflates them)"


def read_by_torch(path: str) -> str | None:
    """Why torch.load reads a zip archive that ckptio's mapper refuses, or None:
    a TorchScript archive (compressed code records; torch.load hands it to
    torch.jit), or a torch.save archive zipped again with deflate, which
    torch's reader inflates (ckptio reads stored records only)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except Exception:  # noqa: BLE001 - a zip Python cannot read is none torch reads either
        return None
    if any(i.filename.endswith("/constants.pkl") for i in infos):
        return TORCHSCRIPT
    methods = {i.compress_type for i in infos}
    if zipfile.ZIP_DEFLATED in methods and methods <= {zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED}:
        return DEFLATED
    return None


class ReadByTorch(FormatError):
    """An archive torch.load reads and ckptio's mapper does not (``why``:
    :func:`read_by_torch`): ``ckptio.load`` hands it to torch.load; loads in
    place, ``verify`` and the listings refuse it with this."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(
            f"{name}: {why}: torch.load reads it; ckptio maps zip archives of stored records"
        )
        self.why = why


def refuse_deflated_mmap(path: str, name: str) -> None:
    """FormatError naming ``name`` where ``path`` is an archive whose storage
    records a zip tool compressed: torch.load(mmap=True) maps their compressed
    bytes as the tensors' (wrong values, no error)."""
    try:
        _native.Reader(path, None, None)  # maps the directory only: a fraction of a ms
    except FormatError:
        if read_by_torch(path) == DEFLATED and any(
            i.compress_type != zipfile.ZIP_STORED for i in _storage_infos(path)
        ):
            raise FormatError(
                f"{name}: mmap=True cannot map storage records compressed by a zip tool "
                "(torch.load would hand their compressed bytes back as tensors); load it "
                "without mmap"
            ) from None


def _storage_infos(path: str) -> list[zipfile.ZipInfo]:
    """The ``<prefix>/data/<key>`` entries of a zip archive."""
    with zipfile.ZipFile(path) as z:
        return [i for i in z.infolist() if i.filename.partition("/")[2].startswith("data/")]


class InflatedRecords:
    """What reads the small records of an archive torch.load reads itself
    (:func:`read_by_torch`), through Python's zipfile (which inflates them):
    for :func:`check_pickle`, with :func:`inflated_archive`."""

    def __init__(self, path: str, prefix: str) -> None:
        self.path, self.prefix = path, prefix

    def read_record(self, name: str) -> bytes:
        with zipfile.ZipFile(self.path) as z:
            return z.read(name)


def inflated_archive(path: str, name: str | None = None) -> Records:
    """The records of an archive torch.load reads itself, by their inflated
    sizes (offsets: their local headers'), read through zipfile."""
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    prefix = infos[0].filename.split("/", 1)[0] if infos else ""
    rows = [(i.filename, i.header_offset, i.file_size) for i in infos if not i.is_dir()]
    return Records(name or path, InflatedRecords(path, prefix), rows)


def crc_rows(path: str, name: str | None = None) -> list[tuple[str, str, int, int | None]]:
    """(record, "ok" or "mismatch", stored CRC-32, CRC-32 of its bytes where
    known) for every record of a zip archive ckptio's mapper refuses
    (:func:`read_by_torch`), inflating what is compressed (Python's zipfile,
    which compares the CRC-32s as it reads); a FormatError naming the file
    (``name``, else ``path``) where the archive does not read back."""
    rows: list[tuple[str, str, int, int | None]] = []
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                with z.open(info) as f:
                    try:
                        while f.read(16 << 20):
                            pass
                    except (zipfile.BadZipFile, zlib.error, EOFError):  # its bytes, not the zip
                        rows.append((info.filename, "mismatch", info.CRC, None))
                        continue
                rows.append((info.filename, "ok", info.CRC, info.CRC))
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise corrupt(name or path, f"the archive does not read back: {e}") from e
    return rows


def check_crcs(path: str, name: str | None = None) -> None:
    """:func:`crc_rows`, a FormatError naming the file and the first record
    whose bytes do not have their CRC-32."""
    for record, state, stored, _ in crc_rows(path, name):
        if state != "ok":
            raise corrupt(
                name or path,
                f"record {record!r} is corrupt: its bytes do not inflate to the CRC-32 "
                f"the archive stores ({stored:#010x})",
            )


class RecordReader(Protocol):
    """What reads an archive's small records: the native reader of a file, or
    :class:`StoredRecords`."""

    @property
    def prefix(self) -> str: ...

    def read_record(self, name: str) -> bytes: ...


class StoredRecords:
    """The reader of an archive in an object store: the records read with its
    directory (``remote.map_torch``: all but the storages, whose bytes go
    straight into tensors)."""

    def __init__(self, url: str, prefix: str, small: dict[str, bytes]) -> None:
        self.url, self.prefix, self._small = url, prefix, small

    def read_record(self, name: str) -> bytes:
        try:
            return self._small[name]
        except KeyError:
            raise corrupt(self.url, f"record {name} was not read with the directory") from None


@dataclasses.dataclass
class Records:
    """A torch.save archive's records, what reads its small ones, and its name
    in messages (``path``: a ``/proc/self/fd/N`` for file objects is named by them)."""

    path: str
    reader: RecordReader
    #: (record name, data offset, size) in file order.
    records: list[tuple[str, int, int]]

    @property
    def prefix(self) -> str:
        return self.reader.prefix

    @functools.cached_property
    def where(self) -> dict[str, tuple[int, int]]:
        """Record name -> (data offset, size)."""
        return {name: (off, n) for name, off, n in self.records}

    @functools.cached_property
    def data(self) -> dict[int, int]:
        """Data offset -> size of each storage's record."""
        data_prefix = f"{self.prefix}/data/"
        return {off: n for name, off, n in self.records if name.startswith(data_prefix)}


@dataclasses.dataclass
class Archive(Records):
    """A torch.save file opened for reading: the native reader (the file
    mapped, its records found once)."""

    reader: _native.Reader

    def fileno(self) -> int:
        return self.reader.fileno()


@dataclasses.dataclass
class StoredArchive:
    """A torch.save archive in an object store, mapped in few requests
    (``remote.map_torch``): the object's size and version (``info``), its
    records (the small ones' bytes with them), each record's declared CRC-32
    (None: the archive says none was computed), and (storage record, local
    header offset, predicted data offset) for the reader to confirm."""

    info: dict[str, Any]
    archive: Records
    declared: dict[str, int | None]
    heads: list[tuple[str, int, int]]
    small: dict[str, bytes]


def map_stored(url: str, options: remote.StorageOptions = None) -> StoredArchive:
    """Map the torch.save archive at ``url`` (FormatError where it is none)."""
    info, prefix, records, small, heads = remote.map_torch(url, options)
    rows = [(name, off, n) for name, off, n, _ in records]
    archive = Records(url, StoredRecords(url, prefix, small), rows)
    require_pickle(archive)
    return StoredArchive(info, archive, {n: c for n, _, _, c in records}, heads, small)


def open_archive(
    path: str, direct: str | None, backend: str | None, name: str | None = None
) -> Archive:
    """Open and map a checkpoint, as torch.load would take it: a zip without a
    pickle is no checkpoint, nor one that torch's own reader refuses
    (unsupported version, flags...). ``name``: the file in messages."""
    try:
        reader = _native.Reader(path, direct, backend)
    except FormatError as e:
        why = read_by_torch(path)
        if why is None:
            raise
        if why == DEFLATED:
            # torch's reader inflates without checking CRC-32s: a record marked
            # compressed that is not (a damaged directory) loads as wrong values.
            check_crcs(path, name)
        raise ReadByTorch(name or path, why) from e
    archive = Archive(name or path, reader, reader.records())
    require_pickle(archive)
    torch_reads(archive.path, reader.fileno())
    return archive


def torch_reads(path: str, fd: int | None = None) -> None:
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


def native_byteorder(archive: Records) -> bool:
    """Whether the storages are in this machine's byte order. Without a byteorder
    record torch assumes what ``torch.serialization.get_default_load_endianness()``
    says: little-endian unless it was set to BIG or NATIVE."""
    byteorder = f"{archive.prefix}/byteorder"
    if byteorder not in archive.where:
        default = torch.serialization.get_default_load_endianness()
        if default == torch.serialization.LoadEndianness.NATIVE:
            return True
        big = default == torch.serialization.LoadEndianness.BIG
        return sys.byteorder == ("big" if big else "little")
    raw = archive.reader.read_record(byteorder)
    if raw not in (b"little", b"big"):
        # torch.load's ValueError ("Unknown endianness type"), naming the file too.
        shown = raw[:16].decode(errors="replace")
        where = f"{archive.path}, record {byteorder}"
        what = f"Unknown endianness type: {shown} (torch reads b'little' or b'big')"
        raise corrupt(where, what, RecordValueError)
    return raw.decode() == sys.byteorder


@functools.cache
def storage_dtype(name: str) -> torch.dtype | None:
    """The dtype of a storage class the pickle names (torch's StorageType)."""
    if name == "UntypedStorage":
        return torch.uint8
    try:
        return torch.serialization.StorageType(name).dtype
    except (KeyError, AttributeError, RuntimeError):
        return None


def _pid_storage(pid: object) -> tuple[str, Any, torch.dtype | None, Any] | None:
    """A persistent id of a pickle scanned with every global inert: (key,
    location tag, dtype of the storage class where torch names it, else None;
    numel as stored) of a ``("storage", ...)`` id; None for any other id."""
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        return None
    _, kind, key, location, numel = pid
    named = (getattr(kind, "module", ""), getattr(kind, "name", ""))
    torch_named = named[0] == "torch" or named == ("torch.storage", "UntypedStorage")
    return str(key), location, storage_dtype(named[1]) if torch_named else None, numel


def _v3_dtype(rest: tuple[object, ...]) -> torch.dtype | None:
    """The dtype a scanned ``_rebuild_tensor_v3`` call names after its first four
    arguments (torch.save's for dtypes without a typed storage: float8,
    uint16-64, complex32); None where it names none (a v2 call, or not a dtype)."""
    named = getattr(torch, getattr(rest[2], "name", ""), None) if len(rest) > 2 else None
    return named if isinstance(named, torch.dtype) else None


# torch's reader takes files of these format versions (caffe2/serialize/versions.h).
_MIN_VERSION, _MAX_VERSION = 1, 10


_VERSION = re.compile(rb"\s*(\d+)")


def _torch_opens(archive: Records) -> bool:
    """The checks torch.load makes of the records it reads besides the pickle
    and the storages: a version in the range it reads, a storage alignment
    that is an int, a serialization id in UTF-8. False where torch.load must
    decide (it may refuse)."""
    reader, prefix = archive.reader, archive.prefix
    names = {name: n for name, (_, n) in archive.where.items()}
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


def native_pickle(
    archive: Records,
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
    prefix, where = archive.prefix, archive.where
    pkl = f"{prefix}/data.pkl"
    size = where.get(pkl, (0, None))[1]
    if size is None or size > 64 << 20 or not _torch_opens(archive):
        return None
    parsed = _native.unpickle(archive.reader.read_record(pkl))
    if parsed is None:
        return None
    found = []
    for key, cls, location, numel in parsed.storages():
        dtype = storage_dtype(cls)
        rec = where.get(f"{prefix}/data/{key}")
        if dtype is None or rec is None or rec[1] != numel * dtype.itemsize:
            return None
        found.append((rec[0], rec[1], dtype, location))
    return parsed, found


def rebuild(
    parsed: _native.Unpickled,
    storages: list[torch.UntypedStorage],
    dtypes: list[torch.dtype],
    path: str,
    *,
    lazy: bool = False,
    devices: list[torch.device] | None = None,
) -> Any:
    """The object of a natively read pickle over its storages
    (``unpickled.build``; ``devices``: theirs, where the caller knows them),
    what it raises typed (:func:`unpickling`): a tensor per storage, the
    containers, no cycles, so no collections meanwhile (``memory.gc_paused``)."""
    with memory.gc_paused(), unpickling(path):
        return unpickled.build(parsed, storages, dtypes, path, lazy=lazy, devices=devices)


def file_offsets(
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
    bases = [
        p0 - off
        for off, size in sorted(data.items())
        if size == n0 and all(data.get(p - (p0 - off)) == n for p, n in sized)
    ]
    if len(bases) > 1:
        # Records of the same sizes at other offsets (extra records a writer
        # other than torch left): the mapping itself says where it starts.
        mapped = mapping_base(p0)
        bases = [b for b in bases if b == mapped]
    if not bases:
        raise corrupt(path, "storages in the pickle do not match the archive's records")
    return [p - bases[0] for p, _, _ in pending]


def mapping_base(address: int) -> int | None:
    """The address where file offset 0 of the file mapping holding ``address``
    would be (``memory.mappings``); None where it cannot be read. (A storage
    torch.load(mmap=True) hands its map_location lies at this base plus its
    record's data offset.)"""
    for lo, hi, _, offset in memory.mappings() or ():
        if lo <= address < hi:
            return lo - offset
    return None


#: Globals of torch's weights-only allow-list whose rebuild reads tensor values
#: while the pickle is decoded (torch.load validates sparse tensors, a nested
#: tensor reads its sizes): the storages must hold the bytes by then.
_READS_VALUES = frozenset(
    {
        "torch._utils._rebuild_sparse_tensor",
        "torch._utils._rebuild_nested_tensor",
    }
)


@functools.cache
def _inert_globals() -> frozenset[str]:
    """Globals that read no tensor value while a pickle is decoded: torch's own
    weights-only allow-list (the ``_rebuild_*`` functions, storages, dtypes,
    containers; not what a user registers, which may run anything), but the
    ones that read values. ckptio's native unpickler reads a subset of it."""
    try:  # torch's private list: where a torch lacks it, every file goes to torch.load
        from torch._weights_only_unpickler import _get_allowed_globals

        return frozenset(_get_allowed_globals()) - _READS_VALUES
    except (ImportError, AttributeError, TypeError):
        return frozenset()


class StorageMet(NamedTuple):
    """A storage as torch.load's ``persistent_load`` first meets it in a pickle:
    its key, location tag, dtype (None: a storage class torch does not name)
    and bytes (None: no dtype, or a count that is not an int of at least 0)."""

    key: str
    location: Any
    dtype: torch.dtype | None
    nbytes: int | None


@dataclasses.dataclass(frozen=True)
class PickleScan:
    """What a scan of an archive's pickle with every global inert found
    (:func:`scan_pickle`)."""

    #: What in the pickle may read tensor values as it is decoded, or None: a
    #: global outside :func:`_inert_globals` (a class's ``__setstate__`` or
    #: reduce callable may read the tensors it is given: a quantized Linear
    #: prepacks its weight, a Generator sets its state), or a pickle that does
    #: not scan. The storages torch.load is handed must then hold their bytes
    #: when torch hands them over.
    reads: str | None
    #: Each distinct storage the pickle declares (by key), in the order torch.load's
    #: ``persistent_load`` first meets them, which is the order it hands them to
    #: its ``map_location``; None where the pickle does not scan.
    storages: list[StorageMet] | None
    #: The first global torch's weights-only unpickler refuses (neither in its
    #: allow-list nor among the caller's safe globals): torch.load with
    #: ``weights_only=True`` raises there, before it needs any storage's bytes.
    #: None where it refuses none, or where this torch does not say.
    refused: str | None = None
    #: Every global the pickle names ("module.name").
    names: frozenset[str] = frozenset()

    @property
    def restores_itself(self) -> bool:
        """Whether the pickle rebuilds a tensor subclass from torch.load's
        ``map_location`` itself (``_rebuild_wrapper_subclass``), which torch
        refuses to do for a callable map_location (:func:`declines_restorer`)."""
        return "torch._utils._rebuild_wrapper_subclass" in self.names


def scan_pickle(archive: Records) -> PickleScan:
    """The archive's pickle scanned with every global inert (nothing of it
    runs, :func:`_inert_load`): what may read tensor values while it is decoded,
    and the storages it declares in torch.load's order (:class:`PickleScan`)."""
    pkl = f"{archive.prefix}/data.pkl"
    if pkl not in archive.where:
        return PickleScan(None, None)
    inert = _inert_globals()
    allowed = _weights_only_globals()
    reads: list[str] = []  # the first global outside the inert ones
    refused: list[str] = []  # the first one torch's weights-only unpickler refuses
    stand_ins: dict[tuple[str, str], type] = {}
    met: dict[str, StorageMet] = {}  # key -> storage, in first-met order

    def find_class(self: Any, module: str, name: str) -> Any:
        made = stand_ins.get((module, name))
        if made is None:
            full = _resolved(module, name)
            if not reads and full not in inert:
                reads.append(full)
            if not refused and allowed is not None and full not in allowed:
                refused.append(full)
            made = stand_ins[(module, name)] = type(
                name, (_Inert,), {"module": module, "name": name}
            )
        return made

    def persistent_load(self: Any, pid: object) -> object:
        got = _pid_storage(pid)
        if got is not None and got[0] not in met:
            key, location, dtype, numel = got
            ok = type(numel) is int and numel >= 0
            nbytes = numel * dtype.itemsize if dtype is not None and ok else None
            met[key] = StorageMet(key, location, dtype, nbytes)
        return _Inert()

    def again() -> None:
        reads.clear()
        refused.clear()
        stand_ins.clear()
        met.clear()

    try:
        with memory.gc_paused():  # many small objects, no cycles
            _inert_load(archive.reader.read_record(pkl), find_class, persistent_load, again)
    except Exception:  # noqa: BLE001 - a pickle that does not scan: torch.load decides
        return PickleScan("a pickle that does not scan", None)
    why = f"{reads[0]}: it may read tensor values while the pickle is decoded" if reads else None
    names = frozenset(_resolved(m, n) for m, n in stand_ins)
    return PickleScan(why, list(met.values()), refused[0] if refused else None, names)


def _resolved(module: str, name: str) -> str:
    """A global's "module.name" as torch's unpicklers resolve it: the Python 2
    names a protocol 2 pickle writes (``__builtin__.set``) mapped to Python 3's
    (``torch._utils``' mapping, which torch's weights-only unpickler applies)."""
    mapped = torch._utils.NAME_MAPPING.get((module, name))
    if mapped is not None:
        module, name = mapped
    else:
        module = torch._utils.IMPORT_MAPPING.get(module, module)
    return f"{module}.{name}"


def _weights_only_globals() -> frozenset[str] | None:
    """Every global torch's weights-only unpickler takes now: its allow-list and
    the caller's safe globals (``torch.serialization.add_safe_globals``,
    ``safe_globals``); None where this torch does not say (its private lists)."""
    try:
        from torch._weights_only_unpickler import (
            _get_allowed_globals,
            _get_user_allowed_globals,
        )

        return frozenset(_get_allowed_globals()) | frozenset(_get_user_allowed_globals())
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


@contextlib.contextmanager
def unpickling(path: str, *, caller_location: bool = False) -> Iterator[None]:
    """What decoding a checkpoint's pickle raises, typed. torch's refusal of a pickle
    keeps torch's type and whole message, unchanged at its start (code and users
    match it: "Weights only load failed", the global refused and how to allow it),
    the file after it; a device the file names that this machine lacks is a
    :class:`~ckptio.errors.LocationError` with torch's message; what the caller's
    code or arguments raise passes as torch.load raises it (:func:`_callers`;
    ``caller_location``: torch.load got the caller's own map_location); anything
    else the decoding raises (a damaged pickle: KeyError, TypeError, torch's
    RuntimeError for a record that is missing...) is a FormatError naming the
    file and the record, the cause chained. ckptio's own errors and the
    system's pass."""
    try:
        yield
    except pickle.UnpicklingError as e:
        raise type(e)(f"{e}\n\n(while loading {path}, record data.pkl)") from None
    except (CkptioError, OSError, MemoryError):
        raise
    except EOFError as e:
        where = f"{path}, record data.pkl"
        why = f"the pickle ends early ({str(e) or 'EOFError'})"
        raise corrupt(where, why, PickleEndError) from e
    except Exception as e:
        text = str(e).strip().splitlines()
        msg = text[0] if text else ""
        if isinstance(e, RuntimeError) and _NO_DEVICE.search(msg):
            raise LocationError(f"{' '.join(text)} (while loading {path})") from e
        if declines_restorer(e) or _callers(e, caller_location):
            raise
        what = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
        raise corrupt(f"{path}, record data.pkl", f"the pickle does not decode: {what}") from e


#: Where torch's, ckptio's and Python's own code lies: an error raised anywhere
#: else while a pickle is decoded comes from the caller's code.
_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (torch, _native, contextlib) if m.__file__
)
_TORCH_LOAD = torch.serialization.__file__


def _library(filename: str) -> bool:
    # Packages installed beside the standard library (no virtualenv) are not it.
    return filename.startswith(_LIBRARY_DIRS) and not re.search(
        r"[/\\](site|dist)-packages[/\\](?!(torch|ckptio)[/\\])", filename
    )


def _callers(e: BaseException, caller_location: bool) -> bool:
    """Whether ``e``, raised while torch.load decoded a pickle, is the caller's
    (torch.load raises it as is) rather than the file's, from where it was raised:
    the caller's code (a ``map_location`` callable, a class's ``__setstate__`` or
    reduce callable); a class the pickle names that cannot be imported (the
    class is gone, weights_only=False); torch.load's checks of its arguments (in
    its own body, or where it hands the caller's pickle_load_args on); torch
    restoring a storage to the caller's own map_location."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return False
    inner = frames[-1]
    if not _library(inner.filename):
        return True
    if inner.name == "find_class" and isinstance(e, (ImportError, AttributeError)):
        return True
    if inner.filename == _TORCH_LOAD and (
        inner.name == "load" or "pickle_load_args" in (inner.line or "")
    ):
        return True
    return caller_location and any(
        f.filename == _TORCH_LOAD and f.name == "restore_location" for f in frames
    )


def declines_restorer(e: BaseException) -> bool:
    """Whether torch.load refused a callable map_location (ckptio's restorer is
    one) for a tensor subclass it rebuilds from the map_location itself."""
    return isinstance(e, RuntimeError) and str(e).startswith("Callable map_location not supported")


#: torch.load's words for a storage saved on a device this machine lacks.
_NO_DEVICE = re.compile(r"Attempting to deserialize object on (a CUDA device|CUDA device \d+)")


def _keep_mapped(
    found: list[tuple[int, int, str]], holders: list[torch.UntypedStorage]
) -> Callable[[torch.UntypedStorage, str], Any]:
    def keep(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        found.append((storage.data_ptr(), storage.nbytes(), location))
        holders.append(storage)
        return storage

    return keep


def open_torch(
    path: str,
    *,
    name: str | None = None,
    direct: str | None = None,
    backend: str | None = None,
    verify_engine: _native.Engine | None = None,
    torch_kw: Mapping[str, Any] | None = None,
    lazy: bool = False,
) -> tuple[Any, Mapped]:
    """Decode a torch.save archive over a lazy mapping: (the object as torch.load
    returns it, with every tensor a view of the mapping; the mapping).
    ``name``: the file's name in messages and reports (default ``path``).
    ``verify_engine``: check the pickle's and the small records' CRC-32s first.
    ``torch_kw``: torch.load's own arguments (weights_only, pickle_module...).
    ``lazy``: where the pickle is read natively, an ``unpickled.Placeholder``
    in place of each tensor (made on demand: ``loading.inplace.materialize``). Refused under
    ``torch.serialization.skip_data()``, which would leave every destination unread."""
    if torch.serialization._serialization_tls.skip_data:
        raise CkptioError(
            f"{name or path}: a load in place under torch.serialization.skip_data() would "
            "read nothing into the destinations; load outside that context"
        )
    archive = open_archive(path, direct, backend, name)
    reader = archive.reader
    exact = native_byteorder(archive)
    if verify_engine is not None:
        data_prefix = f"{archive.prefix}/data/"
        small = [n for n, _, _ in archive.records if not n.startswith(data_prefix)]
        reader.verify(verify_engine, small, strict=True)
    size = os.fstat(reader.fileno()).st_size
    native = _native_open(archive, size, exact, torch_kw, lazy)
    if native is not None:
        return native
    found: list[tuple[int, int, str]] = []
    holders: list[torch.UntypedStorage] = []
    # /proc/self/fd/N: the very file the reader holds, even if the path is
    # replaced meanwhile by a concurrent save.
    with unpickling(archive.path):
        obj = torch.load(
            f"/proc/self/fd/{reader.fileno()}",
            # torch's stubs say the function gets a Storage: torch.load passes UntypedStorage
            map_location=_keep_mapped(found, holders),  # type: ignore[arg-type]
            mmap=True,
            **(torch_kw or {}),
        )
    pending = [(p, n, None) for p, n, _ in found]
    offsets = file_offsets(pending, archive.data, archive.path)  # type: ignore[arg-type]
    base = next((p - o for (p, n, _), o in zip(found, offsets, strict=True) if n), 0)
    locations = {p - base: loc for p, _, loc in found}
    check_locations(archive, locations)
    return obj, Mapped(archive.path, reader, base, size, exact, locations, tuple(holders))


def _native_open(
    archive: Archive,
    size: int,
    exact: bool,
    torch_kw: Mapping[str, Any] | None,
    lazy: bool = False,
) -> tuple[Any, Mapped] | None:
    """:func:`open_torch` without torch.load: the pickle read natively (the
    state-dict subset, as ``ckptio.load`` reads it) and the object made over
    views of one private mapping of the file, as torch.load(mmap=True) makes
    it. None where torch.load must decode it (another pickle, other torch.load
    arguments, byte-swapped storages). At 512 tensors torch's unpickler took
    a fifth of an in-place load from /dev/shm to the GPU."""
    kw = dict(torch_kw or {})
    kw.pop("weights_only", None)  # the native subset is what weights_only allows
    if not exact or any(kw.values()):  # a pickle_module, pickle arguments
        return None
    got = native_pickle(archive)
    if got is None:
        return None
    parsed, found = got
    name = archive.path
    whole = torch.UntypedStorage.from_file(f"/proc/self/fd/{archive.fileno()}", False, size)
    # StorageBase's own slicing: UntypedStorage's asks for the device first (1 us).
    # (a private torch class on purpose; mypy takes .__getitem__ for indexing the class)
    cut = torch._C.StorageBase.__getitem__  # type: ignore[misc]
    storages = [cut(whole, slice(off, off + n)) for off, n, _, _ in found]
    with unpickling(name):
        dtypes = [dtype for _, _, dtype, _ in found]
        obj = rebuild(parsed, storages, dtypes, name, lazy=lazy)
    locations = {off: loc for off, _, _, loc in found}
    check_locations(archive, locations)
    return obj, Mapped(name, archive.reader, whole.data_ptr(), size, exact, locations, (whole,))


def check_locations(archive: Archive, locations: Mapping[int, Any]) -> None:
    """A FormatError naming the record for a storage location (by the record's
    data offset) torch.load could not restore: a load in place does not move
    storages where they were saved, but a tag torch refuses is a damaged file.
    Each tag is checked once (a checkpoint of 512 storages has one or two)."""
    ok: set[str] = set()
    for off, loc in locations.items():
        if type(loc) is str and loc in ok:
            continue
        if not devices.restorable(loc):  # every tag that is not a str
            record = next((n for n, (o, _) in archive.where.items() if o == off), "data")
            where = f"{archive.path}, record {record}"
            raise corrupt(
                where, f"a storage's location is {loc!r}, which torch.load cannot restore"
            )
        ok.add(loc)


def require_pickle(archive: Records) -> None:
    """A zip archive without ``<prefix>/data.pkl`` is no torch.save checkpoint."""
    if f"{archive.prefix}/data.pkl" not in archive.where:
        raise corrupt(archive.path, "no data.pkl record: not a torch.save checkpoint")


def check_pickle(archive: Records) -> None:
    """What a load relies on in the pickle, checked without running any of it
    (``ckptio.verify``: if it says ok, the file loads): every storage it declares
    has a data record of exactly its size, under a key that names one, with a
    location tag torch.load can restore; every tensor's view (offset, sizes,
    strides) is one ``set_`` takes and lies inside its storage. FormatError
    naming the file and the record otherwise."""
    require_pickle(archive)
    prefix, path = archive.prefix, archive.path
    sizes = {name: size for name, (_, size) in archive.where.items()}
    pkl = f"{prefix}/data.pkl"
    if sizes[pkl] > 64 << 20:
        return  # one too large to read whole
    try:
        storages, views = _declared(archive.reader.read_record(pkl))
    except Exception as e:  # any failure of a pickle that runs nothing: it is malformed
        raise corrupt(f"{path}, record {pkl}", f"not a readable pickle: {e!r}") from e
    for st in storages:
        record = f"{prefix}/data/{st.key}"
        have = sizes.get(record)
        if have is None:
            raise corrupt(
                path, f"the pickle declares storage {st.key!r}, but there is no record {record}"
            )
        if st.nbytes is None or have != st.nbytes:
            declared = (
                "a storage of a type torch does not name"
                if st.nbytes is None
                else (f"a storage of {st.nbytes}")
            )
            raise corrupt(
                f"{path}, record {record}", f"it holds {have} bytes, the pickle declares {declared}"
            )
        if not devices.restorable(st.location):
            raise corrupt(
                f"{path}, record {record}",
                f"a storage's location is {st.location!r}, which torch.load cannot restore",
            )
    for st, offset, size, stride, itemsize in views:
        record = f"{path}, record {prefix}/data/{st.key}"
        try:
            need, _ = unpickled.view_layout(offset, size, stride)
        except ValueError as e:
            raise corrupt(record, f"a tensor's {e}") from None
        if st.nbytes is not None and need * itemsize > st.nbytes:
            raise corrupt(
                record,
                f"a tensor reaches past its storage's record ({need * itemsize} bytes "
                f"needed, the record holds {st.nbytes})",
            )


class _Inert:
    """What every global of a pickle becomes while it is only scanned: calls, state and
    items are accepted and ignored, so nothing of the pickle runs."""

    module = name = ""

    def __new__(cls, *args: object, **kwargs: object) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Inert:
        return _Inert()

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _Declared:
    """A storage as a pickle declares it: key, location tag, bytes (None: a
    storage type torch does not name, or a count that is not an int) and the
    size of its elements."""

    key: str
    location: Any
    nbytes: int | None
    itemsize: int


def _declared(
    pkl: bytes,
) -> tuple[list[_Declared], list[tuple[_Declared, Any, Any, Any, int]]]:
    """The storages a torch.save pickle declares, and the views its
    ``_rebuild_tensor_v2`` and ``_v3`` calls make of them (storage, offset,
    size, stride, element size), found by unpickling with every global inert
    but those, recorded."""
    storages: list[_Declared] = []
    views: list[tuple[_Declared, Any, Any, Any, int]] = []

    def rebuild(
        storage: object, offset: object, size: object, stride: object, *_: object
    ) -> _Inert:
        if isinstance(storage, _Declared):
            views.append((storage, offset, size, stride, storage.itemsize))
        return _Inert()

    def rebuild_v3(
        storage: object, offset: object, size: object, stride: object, *rest: object
    ) -> _Inert:
        # torch.save's for dtypes without a typed storage (float8, uint16-64,
        # complex32): an untyped storage, the dtype an argument.
        dtype = _v3_dtype(rest)
        if isinstance(storage, _Declared):
            itemsize = dtype.itemsize if dtype is not None else storage.itemsize
            views.append((storage, offset, size, stride, itemsize))
        return _Inert()

    def find_class(self: Any, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return rebuild
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return rebuild_v3
        return type(name, (_Inert,), {"module": module, "name": name})

    def persistent_load(self: Any, pid: object) -> object:
        got = _pid_storage(pid)
        if got is None:
            return _Inert()
        key, location, dtype, numel = got
        itemsize = dtype.itemsize if dtype is not None else 1
        ok = dtype is not None and type(numel) is int and numel >= 0
        st = _Declared(key, location, numel * itemsize if ok else None, itemsize)
        storages.append(st)
        return st

    def again() -> None:
        storages.clear()
        views.clear()

    _inert_load(pkl, find_class, persistent_load, again)
    return storages, views


def _inert_load(
    pkl: bytes,
    find_class: Callable[[Any, str, str], Any],
    persistent_load: Callable[[Any, object], object],
    again: Callable[[], object],
) -> Any:
    """Unpickle ``pkl`` with these ``find_class`` and ``persistent_load`` (which
    make every global inert, so that nothing of the pickle runs). The C
    unpickler sizes its memo table by the largest index a PUT names (a 5-byte
    op can ask for 2^32 entries: MemoryError); the Python one keeps a dict, as
    torch.load's unpickler does: tried then, after ``again()``."""
    for base in (pickle.Unpickler, pickle._Unpickler):
        scan = type("Scan", (base,), {"find_class": find_class, "persistent_load": persistent_load})
        try:
            return scan(io.BytesIO(pkl)).load()
        except MemoryError:
            if base is not pickle.Unpickler:
                raise
            again()
    raise AssertionError("unreachable")


class _Kept(_Inert):
    """An inert stand-in that keeps the attributes its state gives (so that the
    tensors of an ``argparse.Namespace`` are found, and named)."""

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, __slots__ values)
            parts = [x for x in state if isinstance(x, dict)]
            state = {k: v for x in parts for k, v in x.items()}
        if isinstance(state, dict):
            self.__dict__.update((str(k), v) for k, v in state.items())


class _Scanned(NamedTuple):
    """A storage a pickle declares, on the meta device over its record (a
    tuple: a BUILD of the pickle cannot change it)."""

    storage: torch.UntypedStorage
    dtype: torch.dtype


#: The globals a scan builds for real: containers (a state dict is an
#: OrderedDict), and a Parameter is its tensor.
def _parameter(data: object, *_: object) -> object:
    return data if isinstance(data, torch.Tensor) else _Kept()


_SCAN_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
}


def scanned_records(path: str) -> list[RecordInfo]:
    """:func:`list_records` of an archive whose pickle torch.load refuses with
    ``weights_only`` (it names classes outside torch's allow-list: an
    ``argparse.Namespace`` of hyperparameters, numpy values), found without
    running any of it: every global inert as :func:`check_pickle` scans it (but
    OrderedDict, and Parameters as their tensors), each tensor made on the meta
    device over its record. Tensors in containers and in the attributes of
    other objects are named as list_records names them; other objects' tensors
    (a class's own ``__reduce__``) are not found: their records list no tensor."""
    archive = open_archive(path, "off", None)
    prefix = archive.prefix
    storages: dict[str, _Scanned] = {}

    def persistent_load(self: Any, pid: object) -> object:
        got = _pid_storage(pid)
        if got is None:
            return _Kept()
        key, _, dtype, numel = got
        where = archive.where.get(f"{prefix}/data/{key}")
        if dtype is None or where is None or type(numel) is not int or numel < 0:
            return _Kept()
        found = storages.get(key)
        if found is None:
            st = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
            st._checkpoint_offset = where[0]  # type: ignore[attr-defined]
            found = storages[key] = _Scanned(st, dtype)
        return found

    def rebuild(
        storage: object, offset: object, size: object, stride: object, *rest: object
    ) -> object:
        if not isinstance(storage, _Scanned):
            return _Kept()
        dtype = storage.dtype
        if len(rest) > 2:  # _rebuild_tensor_v3: an untyped storage, the dtype an argument
            named = _v3_dtype(rest)
            if named is None:
                return _Kept()
            dtype = named
        try:
            t = torch.empty(0, dtype=dtype, device="meta")
            return t.set_(storage.storage, offset, size, stride)  # type: ignore[call-overload]
        except Exception:  # a view set_ refuses: check_pickle names what is wrong
            return _Kept()

    def find_class(self: Any, module: str, name: str) -> Any:
        if (module, name) in (
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_tensor_v3"),
        ):
            return rebuild
        if (module, name) in _SCAN_GLOBALS:
            return _SCAN_GLOBALS[(module, name)]
        return type(name, (_Kept,), {"module": module, "name": name})

    pkl = archive.reader.read_record(f"{prefix}/data.pkl")
    try:
        obj = _inert_load(pkl, find_class, persistent_load, storages.clear)
    except Exception as e:  # a pickle that runs nothing and still fails: it is malformed
        raise corrupt(f"{path}, record {prefix}/data.pkl", f"not a readable pickle: {e!r}") from e
    return _record_infos(archive, obj, dict(archive.reader.checksums()))


def _tensors(obj: Any, name: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of each tensor under ``obj``, depth first in order;
    a stack of its own, not recursion (a pickle nested 5,000 deep, which
    torch.load reads, raised RecursionError here)."""
    todo: list[tuple[Any, str]] = [(obj, name)]
    while todo:
        obj, name = todo.pop()
        if id(obj) in seen:
            continue
        if isinstance(obj, torch.Tensor):
            yield name, obj
            continue
        seen.add(id(obj))
        prefix = f"{name}." if name else ""
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
        elif hasattr(obj, "__dict__"):
            items = list(vars(obj).items())
        else:
            continue
        todo.extend((v, f"{prefix}{k}") for k, v in reversed(items))


def list_records(path: str, *, weights_only: bool = True) -> list[RecordInfo]:
    """Every record of a checkpoint: name, data offset, size, and the tensors stored in it.

    Reads no tensor data: offsets come from the zip mapper, dtypes and shapes
    from a load onto the meta device.
    """
    archive = open_archive(path, "off", None)
    reader = archive.reader
    meta = meta_object(archive)
    if meta is None:
        try:
            with unpickling(path):
                meta = torch.load(
                    f"/proc/self/fd/{reader.fileno()}",
                    map_location="meta",
                    weights_only=weights_only,
                )
        except FormatError as e:
            if not isinstance(e.__cause__, (NotImplementedError, RuntimeError)):
                raise
            # Sparse, quantized, nested tensors are not made on the meta device
            # (a damaged pickle fails this way too, and again below).
            meta = _mapped_object(archive, weights_only)
    return _record_infos(archive, meta, dict(reader.checksums()))


def _mapped_object(archive: Archive, weights_only: bool) -> Any:
    """The archive's object as torch.load(mmap=True) makes it over a mapping
    that nothing reads, each storage carrying its ``_checkpoint_offset`` (as
    the meta device's do)."""
    found: list[tuple[int, int, str]] = []
    holders: list[torch.UntypedStorage] = []
    with unpickling(archive.path):
        obj = torch.load(
            f"/proc/self/fd/{archive.reader.fileno()}",
            map_location=_keep_mapped(found, holders),  # type: ignore[arg-type]
            mmap=True,
            weights_only=weights_only,
        )
    pending = [(p, n, None) for p, n, _ in found]
    offsets = file_offsets(pending, archive.data, archive.path)  # type: ignore[arg-type]
    for st, off in zip(holders, offsets, strict=True):
        st._checkpoint_offset = off
    return obj


def list_stored_records(stored: StoredArchive) -> list[RecordInfo] | None:
    """``list_records`` of an archive in a store, from its mapping alone (no
    tensor bytes read); None where only torch.load reads its pickle."""
    meta = meta_object(stored.archive)
    return None if meta is None else _record_infos(stored.archive, meta, stored.declared)


def meta_object(archive: Records) -> Any:
    """The archive's object with every storage on the meta device (each
    carrying its ``_checkpoint_offset``), its pickle read natively; None
    where torch.load must read it."""
    native_byteorder(archive)  # torch.load would fail on a bad one, untyped
    native = native_pickle(archive)
    if native is None:
        return None
    parsed, found = native
    storages = []
    for off, n, _, _ in found:
        st = torch.UntypedStorage(n, device="meta")
        st._checkpoint_offset = off
        storages.append(st)
    return rebuild(parsed, storages, [x[2] for x in found], archive.path)


def _record_infos(archive: Records, meta: Any, crcs: dict[str, int | None]) -> list[RecordInfo]:
    path = archive.path
    by_offset: dict[int, list[TensorInfo]] = {}
    sizes = {off: size for _, off, size in archive.records}
    for name, t in _tensors(meta, "", set()):
        if t.layout != torch.strided:  # sparse: no storage of its own (its parts are listed)
            continue
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
                name or "<root>",
                t.dtype,
                tuple(t.shape),
                tuple(t.stride()),
                cast(int, t.storage_offset()),
            )
        )
    return [
        RecordInfo(
            name,
            off,
            size,
            tuple(by_offset.get(off, ())) if "/data/" in name else (),
            crcs.get(name),
        )
        for name, off, size in archive.records
    ]


_TRUE = ("1", "y", "yes", "true")


def resolve_weights_only(
    weights_only: bool | None, pickle_module: Any, stacklevel: int = 5
) -> bool:
    """``weights_only`` as torch.load resolves it, decided once per load: its
    default (True unless a ``pickle_module`` is given), then the environment
    (``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` always wins; ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
    only where the caller did not choose), with torch's errors and warning
    (``stacklevel``: the warning's, pointing at the caller of the public call)."""
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
            stacklevel=stacklevel,  # the caller of ckptio.load (through its two wrappers)
        )
        weights_only = False
    if weights_only and pickle_module is not None:
        raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    return bool(weights_only)
