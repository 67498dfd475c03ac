"""safetensors files through the ckptio engine.

``save_file`` / ``load_file`` / ``save`` / ``load`` have the signatures and
semantics of ``safetensors.torch`` and read and write the same format: an
8-byte little-endian header length N, N bytes of JSON (``__metadata__``: str ->
str, then per tensor ``dtype``, ``shape``, ``data_offsets`` [begin, end)
relative to the data section), then the tensors' bytes packed back to back,
sorted by dtype (widest first) then name, as safetensors lays them out. Files
written here pad the JSON with spaces so that the data section starts on a
4 KiB boundary (O_DIRECT and cuFile reads of it need no shifting); the
``safetensors`` package reads them, and this module reads its files. Bytes
made in memory (``save``) keep safetensors' own 8-byte alignment: they are
byte for byte what ``safetensors.torch.save`` returns.

Arguments mean what they mean in safetensors (``load_file``'s ``backend`` is
safetensors' "mmap" | "pread"; ckptio reads through its engine either way).
ckptio's own knobs are keyword-only: ``threads``, ``chunk_size``, ``direct``
and ``device_backend`` (how CUDA memory moves: "auto", "cufile", "posix"; the
old spelling ``backend="cufile"`` etc. still works where it cannot be taken
for safetensors' values). Errors about a file's content are
:class:`SafetensorError`, a ``ckptio.FormatError`` (so a RuntimeError) that is
also ``safetensors.SafetensorError`` where that package is installed.

Saves write the header, then each tensor's bytes straight from its data
pointer (host or CUDA memory) with the engine's threads, into a temp file that
replaces the target atomically (fsync, rename, fsync of the folder). Loads
allocate one empty tensor per entry on the target device and read the data
section into them in one parallel engine pass (O_DIRECT; cuFile or the pinned
bounce pipeline for CUDA). Sharded checkpoints as the Hugging Face hub lays them
out (``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``):
``save_sharded`` / ``load_sharded``; a sharded save is published by one atomic
step (the index replaced last), see ``save_sharded``.

Files are not trusted: a header that is not what safetensors writes (bad JSON,
nesting, sizes or offsets that do not add up, dimensions past int64) is a
``FormatError`` naming the file and the tensor, and an index may only name
shards inside its folder.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import secrets
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ckptio import _native, _transfer
from ckptio import group as _group
from ckptio._paths import inside
from ckptio.serialization import (
    STORAGE_ALIGNMENT,
    IOReport,
    _direct_arg,
    _empty_storage,
    _engine,
    _engine_device,
    _gc_paused,
    _last,
    _path,
    _report,
    _reserve_cuda,
)

__all__ = [
    "SafetensorError",
    "save_file",
    "load_file",
    "save",
    "load",
    "metadata",
    "save_sharded",
    "load_sharded",
    "find_shared",
    "DTYPES",
]

#: safetensors dtype name -> torch dtype (those this torch has).
DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name, dt in (
        ("F64", torch.float64),
        ("F32", torch.float32),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("C64", torch.complex64),
        ("I64", torch.int64),
        ("I32", torch.int32),
        ("I16", torch.int16),
        ("I8", torch.int8),
        ("U64", getattr(torch, "uint64", None)),
        ("U32", getattr(torch, "uint32", None)),
        ("U16", getattr(torch, "uint16", None)),
        ("U8", torch.uint8),
        ("BOOL", torch.bool),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
        ("F8_E4M3FNUZ", getattr(torch, "float8_e4m3fnuz", None)),
        ("F8_E5M2FNUZ", getattr(torch, "float8_e5m2fnuz", None)),
        ("F8_E8M0", getattr(torch, "float8_e8m0fnu", None)),
        # Two 4-bit values per byte: the header counts values, torch counts bytes
        # (the last dimension is doubled in the header, as safetensors does).
        ("F4", getattr(torch, "float4_e2m1fn_x2", None)),
    )
    if dt is not None
}
_NAMES = {dt: name for name, dt in DTYPES.items()}
#: Bits per value in the header's count, where it is not the torch element size.
_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
#: Header values per torch element (packed dtypes).
_PACKED = {"F4": 2}
#: Bytes per element of each dtype the native header reader takes (packed and
#: sub-byte dtypes go to the Python reader).
_ITEMSIZES = {name: dt.itemsize for name, dt in DTYPES.items() if name not in _BITS}
# safetensors' Dtype enum order (its files sort tensors by it, descending, then by
# name). F6 are known names that no torch dtype here maps to.
_ENUM = (
    "BOOL F4 F6_E2M3 F6_E3M2 U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ "
    "I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"
).split()
_RANK = {name: i for i, name in enumerate(_ENUM)}
#: The safetensors package refuses headers larger than this.
MAX_HEADER = 100_000_000
INDEX_NAME = "model.safetensors.index.json"
#: Files ``save_sharded`` writes (and so may remove once a later save no longer
#: names them): ``model.safetensors``, ``model-0000k-of-0000n.safetensors`` and,
#: while those names are in use, ``model-<token>-0000k-of-0000n.safetensors``.
SHARD_FILE = re.compile(r"model(-([0-9a-f]{8}-)?\d{5}-of-\d{5})?\.safetensors")
#: Largest dimension, element count and byte count a tensor may have (int64).
_MAX_DIM = 2**63 - 1

Device = str | int | torch.device

try:  # where the safetensors package is installed, its error class is a base of ours
    from safetensors import SafetensorError as _PeerError

    _ERROR_BASES: tuple[type[BaseException], ...] = (_native.FormatError, _PeerError)
except ImportError:  # pragma: no cover - safetensors is a test dependency
    _ERROR_BASES = (_native.FormatError,)


class SafetensorError(*_ERROR_BASES):  # type: ignore[misc]
    """A file or argument safetensors would refuse with its ``SafetensorError``.

    A ``ckptio.FormatError`` (so a ``ckptio.CkptioError`` and a ``RuntimeError``)
    and, where the ``safetensors`` package is installed, a
    ``safetensors.SafetensorError``: code written for either catches it.
    """


SafetensorError.__module__ = "ckptio.safetensors"

#: safetensors' own values of load_file's ``backend``.
_PEER_BACKENDS = ("mmap", "pread")
#: ckptio's device paths (``device_backend``), once spelled ``backend``.
_DEVICE_BACKENDS = ("auto", "cufile", "posix", "bounce")


def _device_backend(backend: str | None, device_backend: str | None, what: str) -> str | None:
    """ckptio's device path from ``device_backend`` or the old spelling ``backend=``
    (accepted where it cannot be taken for safetensors' "mmap" / "pread")."""
    if backend is None or backend in _PEER_BACKENDS:
        return device_backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, not {type(backend).__name__}")
    if backend in _DEVICE_BACKENDS:
        if device_backend is not None:
            raise TypeError(
                f"{what}: backend={backend!r} (ckptio's old spelling of device_backend) and "
                f"device_backend={device_backend!r} given together; pass device_backend only"
            )
        warnings.warn(
            f"{what}(backend={backend!r}): ckptio's device path is now device_backend=; "
            "backend= is safetensors' 'mmap' | 'pread'",
            DeprecationWarning,
            stacklevel=3,
        )
        return backend
    raise SafetensorError(
        f'backend "{backend}" is invalid (expected one of: "mmap", "pread"; ckptio\'s '
        "device path for CUDA memory is device_backend='auto' | 'cufile' | 'bounce')"
    )


class _Entry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # in the data section
    end: int


# --------------------------------------------------------------------------- header


def _fail(where: str, what: str) -> SafetensorError:
    return SafetensorError(f"{where}: not a usable safetensors file: {what}")


def _parse_header(
    raw: bytes, data_len: int, where: str
) -> tuple[dict[str, str] | None, list[_Entry]]:
    """Validate a header as the safetensors package does; entries in file order."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(where, f"header is not UTF-8 ({e.reason} at byte {8 + e.start})") from None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise ValueError(f"duplicate key {dup!r}")
        return d

    try:
        head = json.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise _fail(where, f"header is not valid JSON: {e}") from None
    except RecursionError:
        raise _fail(where, "header JSON is nested too deeply") from None
    if not isinstance(head, dict):
        raise _fail(where, f"header is a JSON {type(head).__name__}, not an object")
    meta = head.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _fail(where, "__metadata__ is not an object of strings")
    entries = []
    for name, info in head.items():
        tensor = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise _fail(where, f"{tensor}: entry is not an object")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_name, str):
            raise _fail(where, f"{tensor}: no dtype")
        if dtype_name not in DTYPES:
            known = (
                "known to safetensors but not readable here" if dtype_name in _RANK else "unknown"
            )
            raise _fail(where, f"{tensor}: dtype {dtype_name!r} is {known}")
        if not _int_list(shape):
            raise _fail(
                where, f"{tensor}: shape {_short(shape)} is not a list of non-negative ints"
            )
        if not (_int_list(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise _fail(where, f"{tensor}: data_offsets {_short(offsets)} are not [begin, end]")
        dtype = DTYPES[dtype_name]
        numel = 1
        for d in shape:  # as safetensors multiplies them: in order, checked
            numel *= d
            if d > _MAX_DIM or numel * dtype.itemsize > _MAX_DIM:
                raise _fail(where, f"{tensor}: shape {_short(shape)} overflows int64")
        bits = numel * _BITS.get(dtype_name, dtype.itemsize * 8)
        if bits % 8:
            raise _fail(where, f"{tensor}: shape {shape} of {dtype_name} does not fill whole bytes")
        need = bits // 8
        per = _PACKED.get(dtype_name, 1)
        if per > 1:  # torch counts packed elements: the last dimension shrinks
            if not shape or shape[-1] % per:
                raise _fail(
                    where,
                    f"{tensor}: the last dimension of shape {shape} of {dtype_name} is not a "
                    f"multiple of {per}, which torch's {dtype} needs",
                )
            shape = [*shape[:-1], shape[-1] // per]
        begin, end = offsets
        if end - begin != need:
            raise _fail(
                where,
                f"{tensor}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape "
                f"{shape} of {dtype_name} needs {need}",
            )
        if end > data_len:
            raise _fail(
                where,
                f"{tensor}: data_offsets [{begin}, {end}] run past the end of the file "
                f"(the data section holds {data_len} bytes)",
            )
        entries.append(_Entry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    at, prev = 0, None
    for e in entries:
        if e.begin < at and prev is not None:
            raise _fail(
                where,
                f"tensor {e.name!r} (bytes {e.begin}..{e.end}) overlaps tensor {prev.name!r} "
                f"(bytes {prev.begin}..{prev.end}) in the data section",
            )
        if e.begin > at:
            raise _fail(where, f"bytes {at}..{e.begin} of the data section belong to no tensor")
        at, prev = e.end, e
    if at != data_len:
        raise _fail(
            where, f"the tensors end at byte {at} of the data section, the file at {data_len}"
        )
    return meta, entries


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 200 else s[:200] + "..."


def _int_list(x: Any) -> bool:
    # type() is int: not bool; the set and min run in C (one call per entry here).
    return type(x) is list and (not x or ({type(v) for v in x} == {int} and min(x) >= 0))


def _check_tensors(tensors: Any) -> None:
    """Refuse what safetensors refuses, with its exception types."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    for k, v in tensors.items():
        if not isinstance(k, str):
            raise TypeError(f"tensor names must be str, not {type(k).__name__} ({k!r})")
        if k == "__metadata__":
            raise ValueError("'__metadata__' is reserved for the header's metadata")
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"Key `{k}` is invalid, expected torch.Tensor but received {type(v)}")
        if v.dtype not in _NAMES:
            raise ValueError(
                f"tensor {k!r} has dtype {v.dtype}, which safetensors cannot hold "
                f"(it holds {', '.join(str(d) for d in _NAMES)})"
            )
        if _PACKED.get(_NAMES[v.dtype], 1) > 1 and v.dim() == 0:
            raise SafetensorError(
                f"tensor {k!r}: a 0-dimensional {v.dtype} is half a byte in safetensors' "
                "header count; give it a dimension"
            )
    sparse = [k for k, v in tensors.items() if v.layout != torch.strided]
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            "support. You can make it a dense tensor before saving with `.to_dense()` but be "
            "aware this might make a much larger file than needed."
        )
    shared = find_shared(tensors)
    if shared:
        raise RuntimeError(
            f"Some tensors share memory, this would duplicate them on disk and break the sharing "
            f"when loading: {shared}. Save only one of each (or clones)."
        )
    for k, v in tensors.items():
        if not v.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{k}` which is not allowed. "
                "Call `.contiguous()` on it first."
            )


def find_shared(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Groups of names whose tensors overlap in memory (safetensors' definition:
    same storage and overlapping byte ranges), each sorted, groups of two or more."""
    by_storage: dict[tuple[Any, ...], list[str]] = defaultdict(list)
    for k, v in tensors.items():
        if v.is_meta:
            continue
        st = v.untyped_storage()
        ptr = st.data_ptr()
        if ptr != 0 and st.nbytes() != 0:
            # get_device() names CPU and CUDA devices without making a device object.
            dev = v.get_device() if (v.is_cpu or v.is_cuda) else v.device
            by_storage[(dev, ptr, st.nbytes())].append(k)
    groups = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        areas = sorted((_extent(tensors[n]), n) for n in names)
        cur = [areas[0][1]]
        stop = areas[0][0][1]
        for (start, end), n in areas[1:]:
            if start < stop:
                cur.append(n)
                stop = max(stop, end)
            else:
                if len(cur) > 1:
                    groups.append(sorted(cur))
                cur, stop = [n], end
        if len(cur) > 1:
            groups.append(sorted(cur))
    return sorted(groups)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of a strided tensor's elements."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, not {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"metadata must be a dict of str to str: {k!r} maps to a {type(v).__name__}"
            )
    return dict(metadata)


@dataclasses.dataclass
class _Layout:
    header: bytes  # length prefix + JSON + padding: the data section starts after it
    items: list[tuple[str, torch.Tensor, int, int]]  # name, tensor, begin, end

    @property
    def file_len(self) -> int:
        return len(self.header) + (self.items[-1][3] if self.items else 0)


def _header_shape(t: torch.Tensor) -> list[int]:
    """The shape the header records: values, not torch's packed elements."""
    shape = list(t.shape)
    per = _PACKED.get(_NAMES[t.dtype], 1)
    if per > 1:
        shape[-1] *= per
    return shape


@_gc_paused()  # many small objects, no cycles: see _gc_paused
def _layout(
    tensors: Mapping[str, torch.Tensor], metadata: Any, align: int = STORAGE_ALIGNMENT
) -> _Layout:
    """Header and data offsets; the data section starts at a multiple of ``align``
    (4 KiB for files, for O_DIRECT; safetensors' own 8 for bytes in memory)."""
    _check_tensors(tensors)
    meta = _check_metadata(metadata)
    # (rank of the dtype, name, tensor, dtype name, nbytes): one pass over the tensors.
    info = []
    for k, t in tensors.items():
        name = _NAMES[t.dtype]
        info.append((-_RANK[name], k, t, name, t.nbytes))
    info.sort(key=lambda x: (x[0], x[1]))
    head: dict[str, Any] = {}
    if meta is not None:
        head["__metadata__"] = meta
    items, at = [], 0
    for _, k, t, name, n in info:
        shape = _header_shape(t) if name in _PACKED else list(t.shape)
        head[k] = {"dtype": name, "shape": shape, "data_offsets": [at, at + n]}
        items.append((k, t, at, at + n))
        at += n
    js = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    n = len(js) + (-(8 + len(js)) % align)
    if n > MAX_HEADER:
        raise ValueError(f"the header would be {n} bytes, over safetensors' limit of {MAX_HEADER}")
    return _Layout(n.to_bytes(8, "little") + js + b" " * (n - len(js)), items)


# --------------------------------------------------------------------------- save


def save_file(
    tensors: Mapping[str, torch.Tensor],
    filename: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    backend: str | None = None,
) -> None:
    """Save ``tensors`` to ``filename`` in safetensors format, like
    ``safetensors.torch.save_file``, crash-safe (temp file, fsync, rename, fsync
    of the folder) and with the bytes written straight from each tensor's memory
    (host or CUDA) by the engine. Tensors must be contiguous and must not share
    memory (RuntimeError / ValueError as safetensors raises). Bytes are copied
    after the work queued on the current CUDA streams. The keyword options are
    ``ckptio.save``'s (``device_backend`` is its ``backend``; the old spelling
    ``backend=`` still works here). Returns None, as safetensors does;
    ``ckptio.last_report()`` says how it ran.
    """
    dev_backend = _device_backend(backend, device_backend, "save_file")
    _save_file(tensors, filename, metadata, threads, chunk_size, direct, dev_backend)


def _save_file(
    tensors: Mapping[str, torch.Tensor],
    filename: str | os.PathLike[str],
    metadata: Mapping[str, str] | None,
    threads: int | None,
    chunk_size: int | None,
    direct: bool | str | None,
    backend: str | None,
    sweep: bool = True,
) -> IOReport:
    t0 = time.perf_counter()
    path = _path(filename, "safetensors.save_file")
    lay = _layout(tensors, metadata)
    base = len(lay.header)
    keep, segments = [], []
    for _, t, begin, end in lay.items:
        if end == begin:
            continue
        if not (t.is_cpu or t.is_cuda):
            t = t.to("cpu")  # as safetensors does for other devices
        keep.append(t)
        # get_device(): -1 for host memory, the CUDA ordinal otherwise (device codes)
        segments.append((base + begin, t.data_ptr(), end - begin, t.get_device()))
    d = _direct_arg(direct)
    engine = _engine(threads, chunk_size, d)
    writer = _native.AtomicWriter(path, d, backend, sweep)
    try:
        writer.write_bytes(0, lay.header)
        stats = _transfer.write(writer, engine, segments, keep, file_len=lay.file_len)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    del keep
    return _report(path, t0, stats, len(lay.items))


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (``safetensors.torch.save``):
    byte for byte what safetensors makes (its 8-byte alignment, not the 4 KiB of files)."""
    lay = _layout(tensors, metadata, 8)
    buf = bytearray(lay.file_len)
    buf[: len(lay.header)] = lay.header
    for _, t, begin, end in lay.items:
        if end > begin:
            dst = torch.frombuffer(
                buf, dtype=torch.uint8, count=end - begin, offset=len(lay.header) + begin
            )
            dst.copy_(t.detach().to("cpu").reshape(-1).view(torch.uint8))
    return bytes(buf)


# --------------------------------------------------------------------------- load


def _devices(device: Device) -> tuple[torch.device, torch.device | None]:
    """(the requested device, the device the engine fills: it, or cpu to copy from)."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a str, int or torch.device, not {type(device).__name__}")
    want = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    fill = _engine_device(str(want))
    return want, fill


@dataclasses.dataclass
class _Plan:
    """One file's tensors allocated empty and the reads that fill them."""

    path: str
    file: _native.DeviceFile
    metadata: dict[str, str] | None
    tensors: dict[str, torch.Tensor]
    segments: list[tuple[int, int, int, int]]
    #: What owns the memory of each segment.
    owners: list[torch.Tensor]


def _pread_exact(fd: int, n: int, off: int, where: str) -> bytes:
    out = b""
    while len(out) < n:
        b = os.pread(fd, n - len(out), off + len(out))
        if not b:
            raise _fail(where, f"file ends at byte {off + len(out)}, inside the header")
        out += b
    return out


def _header(fd: int, where: str) -> tuple[dict[str, str] | None, list[_Entry], int]:
    """(metadata, entries in file order, data section offset) of an open file."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise _fail(where, f"the file is {size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(_pread_exact(fd, 8, 0, where), "little")
    if n > MAX_HEADER:
        raise _fail(where, f"header length {n} is over safetensors' limit of {MAX_HEADER} bytes")
    if 8 + n > size:
        raise _fail(where, f"header length {n} runs past the end of the file ({size} bytes)")
    raw = _pread_exact(fd, n, 8, where)
    fast = _native.safetensors_header(raw, size - 8 - n, _ITEMSIZES)
    if fast is None:  # the Python validator says what is wrong (or reads the unusual)
        meta, entries = _parse_header(raw, size - 8 - n, where)
        return meta, entries, 8 + n
    pairs, rows = fast
    dtypes = DTYPES
    # _Entry's made as tuples are (its __new__ takes keywords: 5x the time).
    new = tuple.__new__
    entries: list[_Entry] = [
        new(_Entry, (name, dtypes[dt], shape, b, e)) for name, dt, shape, b, e in rows
    ]
    return (None if pairs is None else dict(pairs)), entries, 8 + n


def metadata(filename: str | os.PathLike[str]) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file (the header is validated, no data is read)."""
    path = _path(filename, "safetensors.metadata")
    with open(path, "rb") as f:
        return _header(f.fileno(), path)[0]


@_gc_paused()
def _plan(path: str, fill: torch.device, direct: str | None, backend: str | None) -> _Plan:
    f = _native.DeviceFile(path, False, direct, backend)
    meta, entries, base = _header(f.fileno(), path)
    tensors, segments, owners = {}, [], []
    dev = -1 if fill.type == "cpu" else fill.index if fill.index is not None else 0
    if fill.type == "cuda":
        _reserve_cuda(fill, [e[4] - e[3] for e in entries])
    # An empty tensor per dtype: ``proto.new()`` makes another (as torch.empty(0)
    # does, in a third of the time).
    protos: dict[torch.dtype, torch.Tensor] = {}
    for name, dtype, shape, begin, end in entries:
        nbytes = end - begin
        off = base + begin
        # Host memory starts where the file offset does relative to 4 KiB (when
        # the dtype's alignment allows it): O_DIRECT lands straight in it.
        phase = off % STORAGE_ALIGNMENT if off % max(dtype.itemsize, 1) == 0 else 0
        st = _empty_storage(nbytes, fill, phase)
        proto = protos.get(dtype)
        if proto is None:
            proto = protos[dtype] = torch.empty(0, dtype=dtype, device=fill)
        t = proto.new().set_(st, 0, shape)
        tensors[name] = t
        if nbytes:
            segments.append((off, st.data_ptr(), nbytes, dev))
            owners.append(t)
    return _Plan(path, f, meta, tensors, segments, owners)


def _read(plan: _Plan, engine: _native.Engine) -> dict[str, Any]:
    # Memory handed out by the caching allocator may still be in use by work
    # queued on the current stream: the engine's copies are ordered after it.
    return _transfer.read(plan.file, engine, plan.segments, plan.owners)


def _finish(
    tensors: dict[str, torch.Tensor], want: torch.device, fill: torch.device | None
) -> dict[str, torch.Tensor]:
    if fill is None:
        return {k: v.to(want) for k, v in tensors.items()}
    return tensors


@_group.groupable("ckptio.safetensors.load_file")
def load_file(
    filename: str | os.PathLike[str],
    device: Device = "cpu",
    *,
    backend: str = "mmap",
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    strict: bool = True,
    cast: bool = False,
    group: Any = None,
) -> dict[str, torch.Tensor]:
    """Load a safetensors file like ``safetensors.torch.load_file(filename, device,
    backend=...)``: a dict of tensors in file order, each with its own storage on
    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int for a CUDA index), read
    in parallel straight into that memory (cuFile or pinned bounce buffers for
    CUDA). Other devices are filled through host memory.

    ``backend``: safetensors' "mmap" (default) or "pread"; both read through the
    engine here, into tensors with memory of their own. ckptio's knobs: ``threads``,
    ``chunk_size``, ``direct``, ``device_backend`` ("auto" | "cufile" | "posix",
    see ``ckptio.save``; the old spelling ``backend="cufile"`` still works).
    ``ckptio.last_report()`` says how it ran; a malformed file is a
    :class:`SafetensorError` naming the file and tensor.

    ``out``: load in place, into the tensors of this dict (name -> tensor, on
    the host or any CUDA device, ``device`` not given), as ``ckptio.load``'s
    ``out`` does (``strict``, ``cast``, errors): returns {name: the filled
    tensor of ``out``} in file order.

    ``group``: a ``torch.distributed`` process group whose ranks all load the
    file together, each byte read by one rank and shared (``ckptio.load``'s
    ``group``).
    """
    dev_backend = _device_backend(backend, device_backend, "load_file")
    t0 = time.perf_counter()
    path = _path(filename, "safetensors.load_file")
    if out is not None:
        return _load_into(
            [path], out, device, t0, threads, chunk_size, direct, dev_backend, strict, cast
        )
    want, fill = _devices(device)
    d = _direct_arg(direct)
    plan = _plan(path, fill or torch.device("cpu"), d, dev_backend)
    shared = _group.current()
    if shared is not None:
        _read_shared(shared, path, t0, [plan], threads, chunk_size, d, dev_backend)
        return _finish(plan.tensors, want, fill)
    stats = _read(plan, _engine(threads, chunk_size, d))
    _report(path, t0, stats, len(plan.tensors))
    return _finish(plan.tensors, want, fill)


def load(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors (on cpu) from the bytes of a safetensors file (``safetensors.torch.load``)."""
    mv = memoryview(data).cast("B")
    where = "<bytes>"
    if len(mv) < 8:
        raise _fail(where, f"{len(mv)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(mv[:8], "little")
    if n > MAX_HEADER:
        raise _fail(where, f"header length {n} is over safetensors' limit of {MAX_HEADER} bytes")
    if 8 + n > len(mv):
        raise _fail(where, f"header length {n} runs past the end of the data ({len(mv)} bytes)")
    _, entries = _parse_header(bytes(mv[8 : 8 + n]), len(mv) - 8 - n, where)
    out = {}
    with warnings.catch_warnings():
        # frombuffer warns that the buffer is read-only: it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        for e in entries:
            t = torch.empty(e.shape, dtype=e.dtype)
            if e.end > e.begin:
                src = torch.frombuffer(
                    mv, dtype=torch.uint8, count=e.end - e.begin, offset=8 + n + e.begin
                )
                t.view(-1).view(torch.uint8).copy_(src)
            out[e.name] = t
    return out


# --------------------------------------------------------------------------- sharded


def _parse_size(size: int | str) -> int:
    """An int, or "5GB" / "500MB" (powers of 10, as the hub counts) / "4GiB" (powers of 2)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"max_shard_size must be positive, not {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(f"max_shard_size must be an int or a str, not {type(size).__name__}")
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", size.upper())
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or 4GiB")
    num, unit, binary = m.groups()
    power = " KMGT".index(unit or " ")
    n = int(float(num) * (1024 if binary else 1000) ** power)
    if n < 1:
        raise ValueError(f"max_shard_size must be positive, not {size!r}")
    return n


def save_sharded(
    tensors: Mapping[str, torch.Tensor],
    folder: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    backend: str | None = None,
) -> None:
    """Save ``tensors`` into ``folder`` as the Hugging Face hub lays checkpoints out.

    Tensors go to shards in dict order, a new shard when the next tensor would
    push the current one past ``max_shard_size`` (a larger tensor gets a shard of
    its own), as ``huggingface_hub.split_torch_state_dict_into_shards`` splits.
    One shard: ``model.safetensors``, no index. Several:
    ``model-00001-of-0000n.safetensors`` ... and ``model.safetensors.index.json``
    (``{"metadata": {"total_size": ..., **metadata}, "weight_map": {name: shard}}``).
    Each shard carries ``{"format": "pt", **metadata}`` as its header metadata.

    The folder switches from the previous checkpoint to this one in one atomic
    step: every shard is written crash-safely (temp file, fsync, rename, fsync
    of the folder) under a name the previous checkpoint does not use (the hub's
    names when they are free, else ``model-<token>-0000k-of-0000n.safetensors``),
    then the index is replaced the same way; only then are the previous
    checkpoint's files (``model*.safetensors`` that the new index does not name,
    or the index when there is now a single ``model.safetensors``) removed. A
    save that fails or is killed leaves the previous checkpoint loadable and
    unchanged; its leftovers go with the next save. (Between the single-file and
    sharded layouts, a reader that prefers ``model.safetensors`` to the index, as
    transformers does, switches when the other layout's files are removed.)
    Returns None like ``save_file``; ``ckptio.last_report()`` sums the shards.
    """
    dev_backend = _device_backend(backend, device_backend, "save_sharded")
    t0 = time.perf_counter()
    out = _path(folder, "safetensors.save_sharded")
    limit = _parse_size(max_shard_size)
    meta = _check_metadata(metadata) or {}
    _check_tensors(tensors)
    shards: list[dict[str, torch.Tensor]] = []
    cur: dict[str, torch.Tensor] = {}
    cur_size = total = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        total += n
        if n > limit:
            shards.append({k: t})
            continue
        if cur and cur_size + n > limit:
            shards.append(cur)
            cur, cur_size = {}, 0
        cur[k] = t
        cur_size += n
    if cur or not shards:
        shards.append(cur)
    os.makedirs(out, exist_ok=True)
    names = _shard_names(out, len(shards))
    stats = []
    for i, (name, shard) in enumerate(zip(names, shards, strict=True)):
        rep = _save_file(
            shard,
            os.path.join(out, name),
            {"format": "pt", **meta},
            threads,
            chunk_size,
            direct,
            dev_backend,
            sweep=i == 0,  # temp files of dead saves go once, before the first shard
        )
        stats.append(rep)
    keep = set(names)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total, **meta},
            "weight_map": {t: n for n, shard in zip(names, shards, strict=True) for t in shard},
        }
        # The commit point: every shard above is durable.
        _write_text(os.path.join(out, INDEX_NAME), json.dumps(index, indent=2) + "\n")
        keep.add(INDEX_NAME)
    else:
        # model.safetensors is in place: the old index (if any) goes first, so
        # that an index-first reader never pairs it with removed shards.
        _remove(os.path.join(out, INDEX_NAME))
    for f in os.listdir(out):
        if f not in keep and SHARD_FILE.fullmatch(f):
            _remove(os.path.join(out, f))
    _last.report = _merge(out, t0, stats)


def _shard_names(folder: str, k: int) -> list[str]:
    """Names for ``k`` shards that no file of the folder's current checkpoint has:
    the hub's when they are free, else with a token of their own."""
    if k == 1:
        return ["model.safetensors"]  # replaced atomically in one step
    hub = [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    present = set(os.listdir(folder))
    live = _current_shards(folder)
    if live is not None and not live & set(hub):
        return hub
    while True:
        token = secrets.token_hex(4)
        if not any(token in n for n in present):
            return [f"model-{token}-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]


def _current_shards(folder: str) -> set[str] | None:
    """The files the folder's current checkpoint uses (None: an index that cannot
    be read, so any name may be in use)."""
    if not os.path.exists(os.path.join(folder, INDEX_NAME)):
        return {"model.safetensors"}
    try:
        _, wm = _shard_files(os.path.join(folder, INDEX_NAME))
    except (OSError, _native.FormatError):
        return None
    return set((wm or {}).values()) | {"model.safetensors"}


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_text(path: str, text: str) -> None:
    """A small file replaced atomically (temp file, fsync, rename, fsync of the folder)."""
    w = _native.AtomicWriter(path, "off", None, False)
    try:
        w.write_bytes(0, text.encode())
        w.commit()
    except BaseException:
        w.abort()
        raise


def _merge(path: str, t0: float, reps: list[IOReport]) -> IOReport:
    dev = [r for r in reps if r.device_path is not None]
    first = (dev or reps)[0]
    return dataclasses.replace(
        first,
        path=path,
        nbytes=sum(r.nbytes for r in reps),
        seconds=time.perf_counter() - t0,
        direct=all(r.direct for r in reps),
        direct_reason=next((r.direct_reason for r in reps if r.direct_reason), None),
        threads=max(r.threads for r in reps),
        storages=sum(r.storages for r in reps),
        pinned_bytes=reps[-1].pinned_bytes,
        bytes_read=sum(r.bytes_read for r in reps),
        bytes_received=sum(r.bytes_received for r in reps),
    )


def _shard_files(index_path_or_folder: str) -> tuple[str, dict[str, str] | None]:
    """(folder, weight_map or None for a single model.safetensors)."""
    p = index_path_or_folder
    if os.path.isdir(p):
        if os.path.exists(os.path.join(p, INDEX_NAME)):
            p = os.path.join(p, INDEX_NAME)
        else:
            found = sorted(f for f in os.listdir(p) if f.endswith(".safetensors.index.json"))
            if len(found) == 1:
                p = os.path.join(p, found[0])
            elif os.path.exists(os.path.join(p, "model.safetensors")):
                return p, None
            else:
                raise FileNotFoundError(
                    2,
                    f"no {INDEX_NAME} (nor a single *.safetensors.index.json or model.safetensors)",
                    p,
                )
    with open(p, "rb") as f:
        try:
            index = json.loads(f.read())
        except ValueError as e:
            raise SafetensorError(f"{p}: not a safetensors index: invalid JSON: {e}") from None
        except RecursionError:
            raise SafetensorError(f"{p}: not a safetensors index: nested too deeply") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise SafetensorError(
            f"{p}: not a safetensors index: no weight_map of tensor name -> shard file name"
        )
    folder = os.path.dirname(p) or "."
    for name, v in wm.items():
        # A shard is a file of this folder (or, in a hub cache snapshot, a link to its blobs).
        if os.path.basename(v) != v:
            raise SafetensorError(
                f"{p}: weight_map puts tensor {name!r} in {v!r}, not a file name of the "
                "index's folder"
            )
    for v in set(wm.values()):
        inside(folder, v, f"{p}: shard", blobs=True, error=SafetensorError)
    return folder, wm


def _shared_engine(
    threads: int | None, chunk_size: int | None, d: str | None, files: int
) -> tuple[_native.Engine, int]:
    """(engine, workers) to read ``files`` files at once: up to 4 workers, which
    share the engine's threads, for disk and tmpfs files alike."""
    base = _engine(threads, chunk_size, d)
    workers = max(1, min(files, base.threads, 4))
    if workers == 1:
        return base, 1
    per_worker = (max(1, base.threads // workers), max(1, base.memory_threads // workers))
    return _engine(per_worker[0], chunk_size, d, per_worker[1]), workers


@_group.groupable("ckptio.safetensors.load_sharded")
def load_sharded(
    index_path_or_folder: str | os.PathLike[str],
    device: Device = "cpu",
    *,
    backend: str = "mmap",
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    strict: bool = True,
    cast: bool = False,
    group: Any = None,
) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint (``*.safetensors.index.json`` + shards, or a folder
    holding one, or a folder with a single ``model.safetensors``) to ``device``
    in one call: every shard's tensors allocated first, then the shards read in
    parallel (the engine's threads split among them). Every tensor the index's
    weight_map names must be in the shard it names (FormatError otherwise); a
    tensor name in two shards is a FormatError. Returns all tensors of the
    shards, shard by shard in file order. The keywords are ``load_file``'s
    (``out``, ``strict``, ``cast``: load in place; ``group``: read once, share
    over a process group).
    """
    dev_backend = _device_backend(backend, device_backend, "load_sharded")
    t0 = time.perf_counter()
    src = _path(index_path_or_folder, "safetensors.load_sharded")
    folder, wm = _shard_files(src)
    files = ["model.safetensors"] if wm is None else list(dict.fromkeys(wm.values()))
    if out is not None:
        paths = [os.path.join(folder, f) for f in files]
        return _load_into(
            paths, out, device, t0, threads, chunk_size, direct, dev_backend, strict, cast, src, wm
        )
    want, fill = _devices(device)
    d = _direct_arg(direct)
    plans = [
        _plan(os.path.join(folder, f), fill or torch.device("cpu"), d, dev_backend) for f in files
    ]
    tensors = _gather(src, files, [p.tensors for p in plans], wm)
    shared = _group.current()
    if shared is not None:
        _read_shared(shared, src, t0, plans, threads, chunk_size, d, dev_backend)
        return _finish(tensors, want, fill)
    engine, workers = _shared_engine(threads, chunk_size, d, len(plans))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        stats = list(pool.map(lambda p: _read(p, engine), plans))
    reps = [_report(p.path, t0, s, len(p.tensors)) for p, s in zip(plans, stats, strict=True)]
    _last.report = _merge(src, t0, reps)
    return _finish(tensors, want, fill)


def _read_shared(
    shared: _group.Session,
    name: str,
    t0: float,
    plans: list[_Plan],
    threads: int | None,
    chunk_size: int | None,
    direct: str | None,
    backend: str | None,
) -> None:
    """The reads of ``plans`` (their files' data), once over the group."""
    from ckptio.inplace import IoOptions

    files = [_group.Source(p.path, p.file, os.fstat(p.file.fileno()).st_size) for p in plans]
    pieces = [
        _group.Piece(i, seg[0], seg[2], t.device, _group.as_bytes(t, seg[1], seg[2]))
        for i, p in enumerate(plans)
        for seg, t in zip(p.segments, p.owners, strict=True)
    ]
    stats = shared.read(files, pieces, IoOptions(threads, chunk_size, direct, backend))
    _report(name, t0, stats, sum(len(p.tensors) for p in plans))


def _gather(
    src: str, files: list[str], tensors: list[dict[str, torch.Tensor]], wm: dict[str, str] | None
) -> dict[str, torch.Tensor]:
    """The shards' tensors in one dict; a name in two shards, or a tensor not in
    the shard the index's weight_map names, is a SafetensorError."""
    out: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f, ts in zip(files, tensors, strict=True):
        for name, t in ts.items():
            if name in out:
                raise SafetensorError(f"{src}: tensor {name!r} is in both {where[name]} and {f}")
            out[name], where[name] = t, f
    for name, f in (wm or {}).items():
        if where.get(name) != f:
            raise SafetensorError(
                f"{src}: the index puts tensor {name!r} in {f}, "
                + (f"but it is in {where[name]}" if name in where else "but no shard holds it")
            )
    return out


def _load_into(
    paths: list[str],
    out: Any,
    device: Device,
    t0: float,
    threads: int | None,
    chunk_size: int | None,
    direct: bool | str | None,
    device_backend: str | None,
    strict: bool,
    cast: bool,
    src: str | None = None,
    wm: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """load_file / load_sharded with ``out``: the files' tensors read into ``out``'s."""
    from ckptio import inplace

    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a dict of name -> tensor, not {type(out).__name__}")
    if device != "cpu":
        raise TypeError("out= and device= cannot be combined: the destinations decide")
    inplace._check_flags(strict=strict, cast=cast)
    io = inplace.IoOptions.of(threads, chunk_size, direct, device_backend)
    opened = [inplace.open_safetensors(p, direct=io.direct, backend=io.backend) for p in paths]
    names = [os.path.basename(p) for p in paths]
    tensors = _gather(src or paths[0], names, [o[0] for o in opened], wm)
    what = f"ckptio.safetensors.{'load_sharded' if src else 'load_file'}(out=): {src or paths[0]}"
    result: dict[str, torch.Tensor] = inplace.fill_structure(
        what, tensors, out, [o[2] for o in opened], io, strict=strict, cast=cast, t0=t0
    )
    return result
