"""``torch.distributed.checkpoint`` (DCP) files: the format, in one place.

A DCP checkpoint is a folder: data files (torch's ``__{rank}_{n}.distcp``,
ckptio's ``__{rank}_{token}_{n}.distcp``) of items, and ``.metadata``, a pickle
of DCP's ``Metadata`` that names every item (relative path, offset, length).
Each tensor item is a complete ``torch.save`` zip of that tensor; byte items
are raw bytes. (torch's ``SerializationFormat.SAFETENSORS`` writes a data
file's tensors as one safetensors blob after its byte items instead, each
tensor item pointing at the blob: :func:`safetensors_item`.)

- **writing**: :func:`item_zip`, the zip of a tensor of a dtype and shape, byte
  for byte what torch.save writes but for its data (cached: the same for every
  tensor of that dtype and shape); :class:`FileImage`, a data file laid out
  in memory so that the engine writes it in one pass;
- **reading**: :func:`read_metadata` (an allow-list unpickler: DCP's metadata
  classes and plain values; every relative path inside the folder),
  :func:`meta_of_pickle` (an item's tensor from its pickle, read natively),
  :func:`check_item` (an item's records against their CRC-32s).
"""

from __future__ import annotations

import bisect
import copyreg
import functools
import io
import os
import pathlib
import pickle
import re
import struct
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckptio import _native
from ckptio.errors import FormatError, corrupt
from ckptio.formats import torchzip
from ckptio.io import memory
from ckptio.io.paths import inside, left_by_dead_save, open_regular, sweep_unnamed

ALIGN = torchzip.STORAGE_ALIGNMENT


METADATA = ".metadata"


#: Data files of a DCP checkpoint: torch's ``__{rank}_{n}.distcp`` and ckptio's
#: ``__{rank}_{token}_{n}.distcp`` (the files a save may remove once it is published).
DATA_FILE = re.compile(r"__(?P<rank>\d+)_(?:[0-9a-f]{8}_)?\d+" + re.escape(DEFAULT_SUFFIX))
#: ckptio's data files alone (the token its coordinator picks): torch's writer never
#: makes these names, so one that no metadata names is a dead ckptio save's.
OWN_DATA_FILE = re.compile(r"__\d+_[0-9a-f]{8}_\d+" + re.escape(DEFAULT_SUFFIX))


class _SparseSink(io.RawIOBase):
    """A write-only stream that keeps what is written and skips what is seeked
    over: torch.save under skip_data seeks over each record's data, which a
    BytesIO would fill with zeros (GiBs of them for a large item)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.parts: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.parts.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


class SparseSource(io.RawIOBase):
    """A read-only stream over ranges of a file fetched into memory (file
    offset -> bytes): torch's DCP reader seeks to each item and reads it. A
    read outside the ranges is an OSError (what was fetched is wrong), never zeros."""

    def __init__(self, name: str, ranges: dict[int, memoryview]) -> None:
        super().__init__()
        self.name = name
        self._ranges = ranges
        self._starts = sorted(ranges)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence not in (io.SEEK_SET, io.SEEK_CUR):
            raise io.UnsupportedOperation(f"{self.name}: a fetched range seeks from its start")
        self._pos = offset if whence == io.SEEK_SET else self._pos + offset
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        if not len(out):
            return 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        data = self._ranges[self._starts[i]] if i >= 0 else memoryview(b"")
        at = self._pos - self._starts[i] if i >= 0 else 0
        if at >= len(data):
            raise OSError(f"{self.name}: bytes at {self._pos} were not fetched")
        n = min(len(out), len(data) - at)
        out[:n] = data[at : at + n]
        self._pos += n
        return n


def transformed(info: Any) -> bool:
    """Whether a DCP item (its ``_StorageInfo``) went through stream transforms
    (torch's ZStandard, ...): its bytes are a torch.save zip only once decoded."""
    return bool(getattr(info, "transform_descriptors", None))


#: torch's ZStandard stream transform as a DCP item names it.
ZSTD_DESCRIPTOR = "stream.zstd/1"


def zstd_framed(info: Any) -> bool:
    """Whether a DCP item went through torch's ZStandard transform alone: zstd
    frames of a torch.save zip (what ``_native.verify_zstd_item`` reads)."""
    return list(getattr(info, "transform_descriptors", None) or ()) == [ZSTD_DESCRIPTOR]


def safetensors_item(path: str, info: Any) -> bool:
    """Whether the tensor item ``info`` (its ``_StorageInfo``) of the data file
    ``path`` is in the layout torch's ``SerializationFormat.SAFETENSORS`` writes:
    where the item starts, a safetensors blob (an 8-byte little-endian header
    length that fits in the file, then the header's ``{``) rather than a
    torch.save zip. Such bytes carry no CRC-32, and no DCP reader (torch's
    FileSystemReader nor ckptio's) reads them as an item: they are neither
    judged nor read here. False where the file cannot be read (the caller's
    own read says why)."""
    try:
        with open_regular(path) as f:
            head = os.pread(f.fileno(), 9, info.offset)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    return safetensors_head(head, size - info.offset - 8)


def safetensors_head(head: bytes, room: int | None = None) -> bool:
    """Whether bytes start as a safetensors blob: an 8-byte little-endian header
    length (of 2 to ``room`` bytes, where the room after it is known), then ``{``."""
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and (room is None or 2 <= n <= room)


class ItemZip(NamedTuple):
    head: bytes  # the zip up to the data
    data_off: int
    tail: bytes  # the zip after the data
    length: int
    crc_at: tuple[int, ...]  # offsets in ``tail`` of the data record's CRC-32 fields
    #: (offset, length) in ``tail`` of what differs from one save to the next:
    #: the serialization id record's 40 digits and its CRC-32 fields.
    volatile: tuple[tuple[int, int], ...] = ()


def _crc_fields(tail: bytes, name: bytes) -> tuple[int, ...]:
    """Where the CRC-32 of record ``name`` sits in a record's tail: its data
    descriptor (first) and its central-directory entry."""
    at = []
    if tail[:4] == b"PK\x07\x08":
        at.append(4)
    i = tail.find(b"PK\x01\x02")
    while i >= 0:
        n, x, c = struct.unpack_from("<HHH", tail, i + 28)
        if tail[i + 46 : i + 46 + n] == name:
            at.append(i + 16)
            break
        i = tail.find(b"PK\x01\x02", i + 46 + n + x + c)
    return tuple(at)


@functools.lru_cache(maxsize=4096)
def item_zip(dtype: torch.dtype, shape: tuple[int, ...], align: int = ALIGN) -> ItemZip:
    """The torch.save zip of a contiguous CPU tensor of this dtype and shape, at
    ``align`` storage alignment: byte for byte what torch.save writes, but for
    the data and its CRC-32 (filled in by the writer). The same for every
    tensor of that dtype and shape, hence the cache."""
    shell = torch.empty(shape, dtype=dtype)  # untouched pages: costs nothing
    sink = _SparseSink()
    with torchzip.exclusive_config(align), torch.serialization.skip_data():
        torch.save(shell, sink)  # type: ignore[arg-type]  # torch's stubs: IO only; any stream does
    nbytes = shell.numel() * shell.element_size()
    head, tail = bytearray(), bytearray()
    for pos, data in sink.parts:
        if pos == len(head):
            head += data
        else:
            tail += data
    data_off = len(head)
    if nbytes == 0:
        return ItemZip(bytes(head + tail), data_off, b"", len(head) + len(tail), ())
    if sink.parts and sink.parts[-1][0] + len(sink.parts[-1][1]) != data_off + nbytes + len(tail):
        raise AssertionError("unexpected torch.save layout under skip_data")
    crc_at = _crc_fields(bytes(tail), b"archive/data/0")
    # The serialization id: its 40 digits, its data descriptor's CRC-32 and its
    # directory entry's (the last field _crc_fields finds).
    sid = b"archive/.data/serialization_id"
    volatile = [(at, 4) for at in _crc_fields(bytes(tail), sid)[-1:]]
    i = tail.find(b"PK\x03\x04")
    while i >= 0:
        n, x = struct.unpack_from("<HH", tail, i + 26)
        if tail[i + 30 : i + 30 + n] == sid:
            d = i + 30 + n + x
            volatile.append((d, 40))
            if tail[d + 40 : d + 44] == b"PK\x07\x08":
                volatile.append((d + 44, 4))
            break
        i = tail.find(b"PK\x03\x04", i + 30 + n + x)
    return ItemZip(
        bytes(head), data_off, bytes(tail), data_off + nbytes + len(tail), crc_at, tuple(volatile)
    )


#: Items of this many bytes or more start on a 4 KiB boundary of their file,
#: their data too (O_DIRECT and cuFile move them in place); smaller ones are
#: packed 64 bytes apart with torch's 64-byte alignment inside, as
#: ckptio.save packs small storages.
PACK_ITEMS = torchzip.PACK_BELOW


#: Items read whole into one host buffer (then copied into their tensors),
#: parsed natively: up to this size. Larger ones are read straight into the
#: destination tensors.
SMALL_ITEM = 1 << 20


class FileImage:
    """A DCP data file laid out in memory: items' zip headers and tails, BYTE_IO
    items and padding in one buffer, tensor data as segments of its own memory,
    so that the engine writes the whole file in one pass (neighbouring small
    items share I/Os) and stores each item's CRC-32s where its zip wants them."""

    def __init__(self) -> None:
        self.blob = bytearray()
        # (file offset, offset in blob or -1, address, nbytes, device)
        self.parts: list[tuple[int, int, int, int, int]] = []
        self.patches: list[tuple[int, int]] = []  # (index in parts, file offset)
        self.end = 0

    def bytes_at(self, offset: int, data: bytes) -> None:
        if offset > self.end:  # padding before an aligned item
            self._blob(self.end, b"\0" * (offset - self.end))
        self._blob(offset, data)

    def _blob(self, offset: int, data: bytes) -> None:
        if not data:
            return
        last = self.parts[-1] if self.parts else None
        if last is not None and last[1] >= 0 and last[0] + last[3] == offset:
            # Extend the previous blob part: one segment for consecutive header bytes.
            self.parts[-1] = (last[0], last[1], 0, last[3] + len(data), -1)
        else:
            self.parts.append((offset, len(self.blob), 0, len(data), -1))
        self.blob += data
        self.end = offset + len(data)

    def memory_at(self, offset: int, addr: int, n: int, dev: int, crc_at: list[int]) -> None:
        self.parts.append((offset, -1, addr, n, dev))
        self.patches += [(len(self.parts) - 1, at) for at in crc_at]
        self.end = offset + n

    def segments(self, base: int) -> list[tuple[int, int, int, int]]:
        """The engine's segments, blob parts at ``base`` (the blob's address)."""
        return [
            (off, base + pos if pos >= 0 else addr, n, dev) for off, pos, addr, n, dev in self.parts
        ]


def meta_of_pickle(path: str, pkl: bytes) -> tuple[torch.Tensor | None, str | None]:
    """(the meta tensor of an item's pickle, its storage key), read natively;
    (None, None) where the pickle is not one plain tensor over one storage."""
    parsed = _native.unpickle(pkl)
    if parsed is None or len(parsed.storages()) != 1:
        return None, None
    key, cls, _, numel = parsed.storages()[0]
    dtype = torchzip.storage_dtype(cls)
    if dtype is None:
        return None, None
    storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
    meta = torchzip.rebuild(parsed, [storage], [dtype], path)
    if type(meta) is not torch.Tensor:
        return None, None
    return meta, key


def check_item(path: str, info: _StorageInfo, engine: _native.Engine) -> int | None:
    """Map the item's zip (bytes ``[offset, offset + length)``), check every record
    but the tensor data against its CRC-32 (FormatError naming the file and the
    record), and return the data record's stored CRC-32 (None: none stored)."""
    r = _native.Reader(path, "off", None, info.offset, info.length)
    names = [n for n, _, _ in r.records()]
    data = [n for n in names if n.startswith(f"{r.prefix}/data/")]
    r.verify(engine, [n for n in names if n not in data], True)
    if len(data) != 1:
        return None
    return dict(r.checksums()).get(data[0])


# DCP's metadata classes: what a .metadata pickle may build, and set the state of.
_METADATA_CLASSES = (
    _md.Metadata,
    _md.MetadataIndex,
    _md.StorageMeta,
    _md.TensorProperties,
    _md.TensorStorageMetadata,
    _md.BytesStorageMetadata,
    _md.ChunkStorageMetadata,
    _StorageInfo,
)


# Objects BUILD may set the state of: instances of those, never a class.
_BUILDABLE = (*_METADATA_CLASSES, OrderedDict)


#: Per-rank metadata of a save without collectives.
METADATA_OF_RANK = re.compile(r"__\d+" + re.escape(METADATA))


def sweep(
    folder: str,
    own: str | None = None,
    *,
    unreferenced: bool = True,
    written: tuple[bytes, set[str]] | None = None,
) -> list[str]:
    """Remove what dead saves left in a DCP folder: their temp files, and the data
    files that no metadata file names (a save that died, or failed on a rank that
    could not clean up, before its ``.metadata``). Nothing of the data files while
    a save may be in flight: a temp file some writer holds (but ``own``, the
    caller's, see ``ckptio.dcp``) or a metadata file that cannot be read. The
    names removed.

    ``unreferenced=False`` (``ckptio clean``, which no save of this folder runs):
    only data files that carry the evidence of a dead ckptio save go: ckptio's
    own names (``OWN_DATA_FILE``), and torch's names older than a metadata file
    ckptio committed (one naming ckptio's files): the generation that commit
    replaced. A torch writer's files before its ``.metadata`` stay.

    ``written``: (the bytes of a metadata file the caller has just committed, the
    data files it names): a metadata file holding exactly those bytes is not
    unpickled again (20-25 ms for 1,995 items on the dev VM)."""
    commits: list[int] = []  # mtimes of the metadata files ckptio committed

    def in_use() -> set[str] | None:
        named: set[str] = set()
        for n in os.listdir(folder):
            if n == METADATA or METADATA_OF_RANK.fullmatch(n):
                path = os.path.join(folder, n)
                try:
                    with open_regular(path) as f:
                        raw = f.read()
                    mtime = os.stat(path).st_mtime_ns
                except OSError:
                    return None  # which files it names is not known: none is surely dead
                if written is not None and raw == written[0]:
                    files: set[str] | None = written[1]
                else:
                    files = files_named(raw, path)
                if files is None:
                    return None
                named |= files
                if any(OWN_DATA_FILE.fullmatch(f) for f in files):
                    commits.append(mtime)
        return named

    dead = None if unreferenced else left_by_dead_save(folder, OWN_DATA_FILE, commits)
    return sweep_unnamed(folder, DATA_FILE, own, in_use, dead)


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What a ``.metadata`` pickle may name: DCP's metadata classes, torch sizes,
    dtypes, layouts and devices, paths, plain containers and values."""
    objs: list[Any] = [
        *_BUILDABLE,
        _md._MEM_FORMAT_ENCODING,
        torch.Size,
        torch.device,
        torch.serialization._get_layout,
        pathlib.PurePosixPath,
        pathlib.PosixPath,
        pathlib.PureWindowsPath,
        pathlib.WindowsPath,
    ]
    out = {(o.__module__, o.__qualname__): o for o in objs}
    for o in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath):
        out[("pathlib", o.__name__)] = o  # as older Pythons name them
    for b in (set, frozenset, complex, bytearray, slice, range):
        out[("builtins", b.__name__)] = b
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            out[("torch", name)] = getattr(torch, name)
    return out


_ALLOWED: dict[tuple[str, str], Any] | None = None


class _EncodingRef:
    """A memory format encoding while a ``.metadata`` is unpickled, in place of the
    enum member (a process-wide object that a BUILD must never change): equal to
    the member of its value, which is all ``TensorProperties.__setstate__`` asks."""

    __slots__ = ("value", "__weakref__")

    def __init__(self, value: Any) -> None:
        self.value = _md._MEM_FORMAT_ENCODING(value).value  # ValueError: not an encoding

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _md._MEM_FORMAT_ENCODING) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


class _StandInType(type):
    """The type of a metadata class's stand-in: calling it (REDUCE) makes an
    instance of the real class, as NEWOBJ does through its ``__new__``."""

    _real: type

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return cls._real(*args, **kwargs)


class _StandIns(dict[Any, Any]):
    """What the allow-list's mutable objects are replaced by in one unpickling, so
    that a BUILD on them (the C unpickler sets attributes on whatever it is
    given) changes objects of that unpickling only: a fresh subclass of each
    metadata class whose instances are the real class's (NEWOBJ calls its
    ``__new__``: no walk gives them their class back once read; it took 10 of
    the 20 ms of a 1,995-item ``.metadata`` on the dev VM), a fresh function
    calling each other Python class or function, :class:`_EncodingRef` for the
    encoding enum. torch's C types and the builtins are immutable.

    :meth:`left` says what the read left behind: a stand-in changed by a BUILD,
    or one that the result holds (the references it holds beyond this map's),
    or an encoding outside the state of ``TensorProperties`` (where no writer
    puts one)."""

    def __init__(self) -> None:
        super().__init__()
        for cls in _METADATA_CLASSES:
            ns = {"__slots__": (), "__module__": cls.__module__, "__new__": _new_of(cls)}
            self[cls] = _StandInType(cls.__name__, (cls,), ns | {"_real": cls})
        self.encodings: list[weakref.ref[_EncodingRef]] = []

        def encoding(value: Any) -> _EncodingRef:
            e = _EncodingRef(value)
            self.encodings.append(weakref.ref(e))
            return e

        self[_md._MEM_FORMAT_ENCODING] = encoding
        del encoding  # (its reference would count as the result's below)
        for f in (
            torch.serialization._get_layout,
            pathlib.PurePosixPath,
            pathlib.PosixPath,
            pathlib.PureWindowsPath,
            pathlib.WindowsPath,
        ):
            self[f] = lambda *a, _f=f: _f(*a)
        self._before = self._fingerprint()
        self._held = [sys.getrefcount(x) for x in self.values()]

    def _fingerprint(self) -> list[Any]:
        """What a BUILD on a stand-in would change: each class's own attributes
        and bases, each function's attributes and keyword defaults."""
        out = []
        for x in self.values():
            if isinstance(x, type):
                out.append((dict(vars(x)), x.__bases__))
            else:
                out.append((dict(vars(x)), x.__kwdefaults__))
        return out

    def left(self, root: Any) -> str | None:
        """What the read of ``root`` left (see the class), once the unpickler is
        gone; None where nothing. The counts only say where to look: a stand-in
        or an encoding still alive is looked for under ``root`` (a count that
        an interpreter keeps otherwise refuses nothing)."""
        if self._fingerprint() != self._before:
            return "sets attributes of a class or function"
        # Counted as in __init__ (a loop variable or zip's tuple would add one).
        held = [sys.getrefcount(x) for x in self.values()]
        alive = [e for e in (ref() for ref in self.encodings) if e is not None]
        if held == self._held and not alive:
            return None
        found = _find(root, {id(x): x for x in [*self.values(), *alive]})
        if found is None:
            return None
        if isinstance(found, _EncodingRef):
            return f"holds a memory format encoding ({found.value}) outside a TensorProperties"
        if isinstance(type(found), _StandInType):  # an instance given a stand-in's class
            return f"holds a {type(found).__name__} that is not one"
        return f"holds {found!r} where DCP metadata holds none"


def _new_of(cls: Any) -> staticmethod[..., Any]:
    """A stand-in's ``__new__``: an instance of ``cls`` (bound here, first, where no
    keyword argument of NEWOBJ_EX can pass another class in). The stand-in it is
    called with comes after ``cls``, an argument ``object.__new__`` lets by for a
    class with an ``__init__``, as DCP's metadata classes have; a partial, not a
    Python function: no frame per object (9,977 of a 1,995-item ``.metadata``)."""
    if cls.__new__ is object.__new__ and cls.__init__ is not object.__init__:
        return staticmethod(functools.partial(object.__new__, cls))

    def new(sub: type, *args: Any, **kwargs: Any) -> Any:  # (any other class)
        return cls.__new__(cls, *args, **kwargs)

    return staticmethod(new)


_NO_SLOT = object()


def _find(root: Any, targets: dict[int, Any]) -> Any:
    """The first object under ``root`` that is one of ``targets`` (by id) or an
    instance of one, through containers, slices, and the keys and values of
    instance dicts and slots; None where none is."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if id(obj) in targets or id(type(obj)) in targets:
            return obj
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif type(obj) is slice:
            todo.extend((obj.start, obj.stop, obj.step))
        attrs = getattr(obj, "__dict__", None)
        if attrs is not None:  # a BUILD writes keys of any type there
            todo.extend(attrs.keys())
            todo.extend(attrs.values())
        for cls in type(obj).__mro__:  # slots (pathlib's objects have no __dict__)
            names = cls.__dict__.get("__slots__", ())
            for name in (names,) if isinstance(names, str) else names:
                if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                    value = getattr(obj, name, _NO_SLOT)
                    if value is not _NO_SLOT:
                        todo.append(value)
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """The C unpickler with an allow-list, and stand-ins (:class:`_StandIns`) for
    the allowed objects a BUILD could change. (Before, the pure-Python unpickler
    checked each BUILD: 5-10x slower, 0.5-0.9 s for 1,995 items on the dev VM.)"""

    def __init__(self, file: Any, path: str, stand_ins: _StandIns) -> None:
        super().__init__(file)
        self.path = path
        self.stand_ins = stand_ins

    def find_class(self, module: str, name: str) -> Any:
        global _ALLOWED
        if _ALLOWED is None:
            _ALLOWED = _allowed_globals()
        obj = _ALLOWED.get((module, name))
        if obj is None:
            raise _RefusedGlobal(
                f"{self.path}: refers to {module}.{name}, which is not a DCP metadata class "
                "nor a plain value; refused (FileSystemReader(..., trusted_metadata=True) "
                "unpickles it, for folders you trust)"
            )
        return self.stand_ins.get(obj, obj)

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedGlobal(f"{self.path}: holds a persistent id {pid!r}; refused")


class _RefusedGlobal(Exception):
    """Raised inside the unpickler; becomes a FormatError naming the file."""


def read_metadata(path: str | os.PathLike[str], *, trusted: bool = False) -> Metadata:
    """A DCP checkpoint's ``.metadata`` file, unpickled with the allow-list (``trusted``:
    without it) and checked: a ``Metadata`` whose storage entries are items
    (relative path, offset, length) inside the file's folder. ``FormatError``
    naming the file (and the global, entry or path) otherwise."""
    p = os.fspath(path)
    with open_regular(p) as f:
        raw = f.read()
    return parse_metadata(raw, p, trusted=trusted)


def parse_metadata(raw: bytes, p: str, *, trusted: bool = False) -> Metadata:
    """:func:`read_metadata` of bytes (``p`` names where they come from)."""
    try:
        with memory.gc_paused():  # many objects, no cycles: see memory.gc_paused
            md = _unpickle(raw, p, trusted)
    except _RefusedGlobal as e:
        raise FormatError(str(e)) from None
    except FormatError:
        raise
    except Exception as e:
        raise FormatError(f"{p}: not a DCP metadata file: {type(e).__name__}: {e}") from e
    try:
        with memory.gc_paused():
            _check_metadata(md, p)
    except FormatError:
        raise
    except Exception as e:  # a value of a type no check expected (unhashable, not iterable)
        raise FormatError(f"{p}: not DCP metadata: {type(e).__name__}: {e}") from e
    return md


def files_named(raw: bytes, where: str) -> set[str] | None:
    """The data files a ``.metadata`` (its bytes) names; None where it cannot be
    read (then no file may be taken as unnamed)."""
    try:
        md = parse_metadata(raw, where)
    except FormatError:
        return None
    return {info.relative_path for info in (md.storage_data or {}).values()}


def _unpickle(raw: bytes, path: str, trusted: bool) -> Any:
    if trusted:
        return pickle.loads(raw)
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = _allowed_globals()
    # EXT1/2/4 reach registered globals through copyreg's process-wide cache,
    # past find_class: none of the allowed ones may be registered.
    if any(k in copyreg._extension_registry for k in _ALLOWED):  # type: ignore[attr-defined]
        raise FormatError(
            f"{path}: not read: copyreg registers an extension code for a global the "
            "allow-list names (its cache would bypass the allow-list)"
        )
    stand_ins = _StandIns()
    unpickler = _MetadataUnpickler(io.BytesIO(raw), path, stand_ins)
    md = unpickler.load()
    del unpickler  # its memo: the references the result holds are what is left
    left = stand_ins.left(md)
    if left is not None:
        raise corrupt(path, f"{left}; refused")
    return md


def _check_metadata(md: Any, path: str) -> None:
    """What DCP's planners and this reader rely on, with types: FormatError otherwise."""

    def bad(what: str) -> FormatError:
        return corrupt(path, what)

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(md, Metadata):
        raise bad(f"holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise bad("state_dict_metadata is not a dict")
    for fqn, entry in sdm.items():
        if isinstance(entry, _md.BytesStorageMetadata):
            continue
        chunks = getattr(entry, "chunks", None)
        if not (
            isinstance(entry, _md.TensorStorageMetadata)
            and isinstance(getattr(entry, "properties", None), _md.TensorProperties)
            and isinstance(getattr(entry.properties, "dtype", None), torch.dtype)
            and isinstance(getattr(entry, "size", None), torch.Size)
            and isinstance(chunks, list)
            and all(
                isinstance(c, _md.ChunkStorageMetadata)
                and isinstance(getattr(c, "offsets", None), torch.Size)
                and isinstance(getattr(c, "sizes", None), torch.Size)
                for c in chunks
            )
        ):
            raise bad(f"entry {fqn!r} is not tensor or bytes metadata DCP can use")
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        raise bad("planner_data is not a dict")
    if not isinstance(getattr(md, "storage_meta", None), (_md.StorageMeta, type(None))):
        raise bad("storage_meta is not DCP StorageMeta")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        raise bad("storage_data is not a dict of items")
    folder = os.path.dirname(path) or "."
    seen: set[str] = set()
    for key, info in sd.items():
        fqn = getattr(key, "fqn", key)
        if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage entry {fqn!r} is a {type(info).__name__}, not an item")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(fqn, str) and is_int(offset) and is_int(length)):
            raise bad(f"item {fqn!r} has offset {offset!r} and length {length!r}")
        if info.offset + info.length >= 1 << 63:  # no file reaches there (the reader's i64s)
            raise bad(f"item {fqn!r} at offset {offset} (+{length}) lies past any file's end")
        rel = getattr(info, "relative_path", None)
        if rel not in seen:
            inside(folder, rel, f"{path}: item {fqn!r}")
            seen.add(cast(str, rel))  # inside() raised unless it is a str
    items = {(k.fqn, None if k.offset is None else tuple(k.offset)) for k in sd}
    for fqn, entry in sdm.items():
        if isinstance(entry, _md.TensorStorageMetadata):
            _check_chunks(fqn, entry, items, bad)


def _check_chunks(
    fqn: str,
    entry: _md.TensorStorageMetadata,
    items: set[tuple[str, tuple[int, ...] | None]],
    bad: Callable[[str], FormatError],
) -> None:
    """A tensor's chunks tile it: each inside the tensor, none overlapping another,
    their elements adding up to the tensor's, each with an item to read it from.
    DCP's planner reads what the chunks cover and leaves the rest of a destination
    unread: a chunk outside its tensor would leave zeros where data belongs."""
    size = tuple(entry.size)
    if not all(type(d) is int and d >= 0 for d in size):
        raise bad(f"tensor {fqn!r} has size {size}")
    if len(entry.chunks) == 1:  # most tensors: one chunk, the whole tensor
        c = entry.chunks[0]
        off, n = tuple(c.offsets), tuple(c.sizes)
        if n == size and off == (0,) * len(size) and all(type(v) is int for v in (*off, *n)):
            if (fqn, off) not in items:
                raise bad(f"no item holds the chunk of {fqn!r} at offsets {off}")
            return
    boxes = []
    total = 0
    for c in entry.chunks:
        off, n = tuple(c.offsets), tuple(c.sizes)
        if len(off) != len(size) or len(n) != len(size):
            raise bad(f"a chunk of {fqn!r} (offsets {off}, sizes {n}) has not its {len(size)} dims")
        if not all(type(v) is int and v >= 0 for v in (*off, *n)):
            raise bad(f"a chunk of {fqn!r} has offsets {off} and sizes {n}")
        if any(o + m > d for o, m, d in zip(off, n, size, strict=True)):
            raise bad(f"a chunk of {fqn!r} (offsets {off}, sizes {n}) lies outside its size {size}")
        if (fqn, off) not in items:
            raise bad(f"no item holds the chunk of {fqn!r} at offsets {off}")
        vol = 1
        for m in n:
            vol *= m
        total += vol
        if vol:
            boxes.append((off, n))
    numel = 1
    for d in size:
        numel *= d
    if total != numel:
        raise bad(f"the chunks of {fqn!r} hold {total} of its {numel} elements")
    # Boxes sorted by their start in the first dim; each is compared only with
    # those whose first-dim span it meets (slabs and grids: a few each).
    boxes.sort()
    for i, (off, n) in enumerate(boxes):
        for o2, n2 in boxes[i + 1 :]:
            if size and o2[0] >= off[0] + n[0]:
                break
            if all(a < b + m2 and b < a + m for a, m, b, m2 in zip(off, n, o2, n2, strict=True)):
                raise bad(f"the chunks of {fqn!r} at offsets {off} and {o2} overlap")
