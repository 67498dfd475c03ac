"""safetensors files and the Hugging Face hub's sharded layout: the format, in one place.

A file is an 8-byte little-endian header length N, N bytes of JSON
(``__metadata__``: str -> str, then per tensor ``dtype``, ``shape``,
``data_offsets`` [begin, end) relative to the data section), then the tensors'
bytes packed back to back, sorted by dtype (widest first) then name, as
safetensors lays them out. Files ckptio writes pad the JSON with spaces so that
the data section starts on a 4 KiB boundary (O_DIRECT and cuFile reads of it
need no shifting); the ``safetensors`` package reads them. Bytes made in memory
keep safetensors' own 8-byte alignment.

A sharded checkpoint is ``model.safetensors.index.json`` (``weight_map``: tensor
name -> shard file) and ``model-0000k-of-0000n.safetensors`` shards in one
folder (or a single ``model.safetensors``). A folder is read through those, or
where neither is there, through its one other ``*.safetensors.index.json``
(:func:`read_through`); the shards other indexes name are theirs: a save
gives its shards other names (but a single ``model.safetensors``) and its
clean-ups leave them.

Nothing is trusted: a header that is not what safetensors writes (bad JSON,
nesting, sizes or offsets that do not add up, dimensions past int64) is a
:class:`~ckptio.errors.SafetensorError` naming the file and the tensor, and an
index may only name shards inside its folder. :func:`open_file` opens a file as
a mapped view (its tensors over a lazy mapping of it).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import json
import math
import os
import re
import secrets
import shutil
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, TypeGuard, TypeVar

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ckptio import _native
from ckptio.errors import FormatError, SafetensorError
from ckptio.formats.mapped import Mapped
from ckptio.io import memory, remote
from ckptio.io.paths import inside, left_by_dead_save, open_regular, sweep_unnamed

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


#: Bits per value of every dtype safetensors names (the header counts values),
#: in its Dtype enum's order: its files sort tensors by it, descending, then by
#: name. F6 are known names that no torch dtype here maps to.
_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}  # fmt: skip


#: Header values per torch element (packed dtypes).
_PACKED = {"F4": 2}


#: Bytes per element of each dtype the native header reader takes (packed and
#: sub-byte dtypes go to the Python reader).
_ITEMSIZES = {name: dt.itemsize for name, dt in DTYPES.items() if _BITS[name] == 8 * dt.itemsize}


_RANK = {name: i for i, name in enumerate(_BITS)}


#: The safetensors package refuses headers larger than this.
MAX_HEADER = 100_000_000


INDEX_NAME = "model.safetensors.index.json"


#: Files ``save_sharded`` writes (and so may remove once a later save no longer
#: names them): ``model.safetensors``, ``model-0000k-of-0000n.safetensors`` and,
#: while those names are in use, ``model-<token>-0000k-of-0000n.safetensors``.
SHARD_FILE = re.compile(r"model(-([0-9a-f]{8}-)?\d{5}-of-\d{5})?\.safetensors")
#: The shard names only ckptio gives (with its token): the hub's writers never do.
OWN_SHARD_FILE = re.compile(r"model-[0-9a-f]{8}-\d{5}-of-\d{5}\.safetensors")


#: Largest dimension, element count and byte count a tensor may have (int64).
_MAX_DIM = 2**63 - 1


#: Largest dimension, element count and bit count safetensors reads (usize).
_MAX_USIZE = 2**64 - 1


class Entry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # in the data section
    end: int


def fail(where: str, what: str) -> SafetensorError:
    return SafetensorError(f"{where}: not a usable safetensors file: {what}")


def parse_header(
    raw: bytes, data_len: int, where: str, *, tensors: bool = True
) -> tuple[dict[str, str] | None, list[Entry]]:
    """Validate a header as the safetensors package does; entries in file order.
    ``tensors=False``: only what reading the header needs (safetensors'
    checks; ``metadata()``), not that torch here can hold each tensor (its
    dtype, int64 sizes, packed pairs), and no entries."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(where, f"header is not UTF-8 ({e.reason} at byte {8 + e.start})") from None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise ValueError(f"duplicate key {dup!r}")
        return d

    try:
        head = json.loads(
            text,
            object_pairs_hook=no_duplicates,
            parse_constant=_json_constant,
            parse_float=_json_float,
            # An int of 309+ digits may be past f64 (read with a check, where one may be).
            parse_int=_json_int if _LONG_DIGITS.search(text) else None,
        )
        if _too_deep(raw):
            raise RecursionError
        if _SURROGATE_ESCAPE.search(text):
            # A pair decodes to one character; a lone surrogate stays one, which UTF-8 refuses.
            try:
                json.dumps(head, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(
                    f"a string holds a lone surrogate escape (\\u{ord(e.object[e.start]):04x})"
                ) from None
    except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise fail(where, f"header is not valid JSON: {e}") from None
    except RecursionError:
        raise fail(
            where, f"header JSON is nested too deeply (safetensors reads {_MAX_NESTING} levels)"
        ) from None
    if not isinstance(head, dict):
        raise fail(where, f"header is a JSON {type(head).__name__}, not an object")
    meta = head.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise fail(where, "__metadata__ is not an object of strings")
    entries, spans = [], []
    for name, info in head.items():
        tensor = f"tensor {name!r}"
        if not isinstance(info, dict):
            raise fail(where, f"{tensor}: entry is not an object")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_name, str):
            raise fail(where, f"{tensor}: no dtype")
        if dtype_name not in (DTYPES if tensors else _BITS):
            known = (
                "known to safetensors but not readable here" if dtype_name in _BITS else "unknown"
            )
            raise fail(where, f"{tensor}: dtype {dtype_name!r} is {known}")
        if not _int_list(shape):
            raise fail(where, f"{tensor}: shape {_short(shape)} is not a list of non-negative ints")
        if not (_int_list(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise fail(where, f"{tensor}: data_offsets {_short(offsets)} are not [begin, end]")
        # torch: dimensions, elements and bytes in int64; safetensors: dimensions,
        # elements and bits in usize.
        if tensors:
            top, width, limit = _MAX_DIM, DTYPES[dtype_name].itemsize, "int64"
        else:
            top, width, limit = _MAX_USIZE, 1, "usize"
        numel = 1
        for d in shape:  # as they are multiplied: in order, checked
            numel *= d
            if d > top or numel * width > top:
                raise fail(where, f"{tensor}: shape {_short(shape)} overflows {limit}")
        bits = numel * _BITS[dtype_name]
        if not tensors and bits > top:
            raise fail(where, f"{tensor}: shape {_short(shape)} overflows {limit}")
        if bits % 8:
            raise fail(where, f"{tensor}: shape {shape} of {dtype_name} does not fill whole bytes")
        need = bits // 8
        per = _PACKED.get(dtype_name, 1) if tensors else 1
        if per > 1:  # torch counts packed elements: the last dimension shrinks
            if not shape or shape[-1] % per:
                raise fail(
                    where,
                    f"{tensor}: the last dimension of shape {shape} of {dtype_name} is not a "
                    f"multiple of {per}, which torch's {DTYPES[dtype_name]} needs",
                )
            shape = [*shape[:-1], shape[-1] // per]
        begin, end = offsets
        if end - begin != need:
            raise fail(
                where,
                f"{tensor}: data_offsets [{begin}, {end}] hold {end - begin} bytes but shape "
                f"{shape} of {dtype_name} needs {need}",
            )
        if end > data_len:
            raise fail(
                where,
                f"{tensor}: data_offsets [{begin}, {end}] run past the end of the file "
                f"(the data section holds {data_len} bytes)",
            )
        spans.append((begin, end, name))
        if tensors:
            entries.append(Entry(name, DTYPES[dtype_name], tuple(shape), begin, end))
    spans.sort(key=lambda e: (e[0], e[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    at, prev = 0, None
    for begin, end, name in spans:
        if begin < at and prev is not None:
            raise fail(
                where,
                f"tensor {name!r} (bytes {begin}..{end}) overlaps tensor {prev[2]!r} "
                f"(bytes {prev[0]}..{prev[1]}) in the data section",
            )
        if begin > at:
            raise fail(where, f"bytes {at}..{begin} of the data section belong to no tensor")
        at, prev = end, (begin, end, name)
    if at != data_len:
        raise fail(
            where, f"the tensors end at byte {at} of the data section, the file at {data_len}"
        )
    return meta, entries


# What serde_json (which safetensors reads headers with) refuses and Python's json
# takes: NaN and Infinity, numbers past f64, lone surrogate escapes, and
# nesting of 128 or more arrays and objects.


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _json_float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise ValueError(f"number {_short(text)} is out of range")
    return v


def _json_int(text: str) -> int:
    v = int(text)
    try:
        float(v)
    except OverflowError:
        raise ValueError(f"number {_short(text)} is out of range") from None
    return v


_LONG_DIGITS = re.compile(r"\d{309}")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


#: Arrays and objects nested deeper than this are refused, as serde_json refuses them.
_MAX_NESTING = 127


#: Bytes that say where strings and containers are: quotes, brackets,
#: backslashes and the characters an escape may start with.
_STRUCTURE = b'[]{}"\\/bfnrtu'


_DROP_BUT_STRUCTURE = bytes(c for c in range(256) if c not in _STRUCTURE)


_ESCAPE = re.compile(rb"\\.")


_DROP_BUT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _too_deep(raw: bytes) -> bool:
    """Whether the valid JSON ``raw`` nests arrays and objects past ``_MAX_NESTING``."""
    if raw.count(b"[") + raw.count(b"{") <= _MAX_NESTING:
        return False
    # Escapes out, then every other part between quotes is outside the strings.
    bare = _ESCAPE.sub(b"", raw.translate(None, _DROP_BUT_STRUCTURE))
    brackets = b"".join(bare.split(b'"')[::2]).translate(None, _DROP_BUT_BRACKETS)
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets))) > _MAX_NESTING


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 200 else s[:200] + "..."


def _int_list(x: Any) -> TypeGuard[list[int]]:
    # type() is int: not bool; the set and min run in C (one call per entry here).
    return type(x) is list and (not x or ({type(v) for v in x} == {int} and min(x) >= 0))


def holds(dtype: torch.dtype) -> bool:
    """Whether safetensors has a dtype name for ``dtype``."""
    return dtype in _NAMES


def check_tensors(tensors: Any) -> None:
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
        if not holds(v.dtype):
            raise ValueError(
                f"tensor {k!r} has dtype {v.dtype}, which safetensors cannot hold "
                f"(it holds {', '.join(str(d) for d in _NAMES)})"
            )
        if isinstance(v, FakeTensor) and v.nbytes:
            # No memory behind it (safetensors refuses it too, less clearly).
            raise SafetensorError(
                f"tensor {k!r} is a FakeTensor (made under FakeTensorMode): it has no data to save"
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
        areas = sorted((memory.extent(tensors[n]), n) for n in names)
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


def check_metadata(metadata: Any) -> dict[str, str] | None:
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
class Layout:
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


@memory.gc_paused()  # many small objects, no cycles: see memory.gc_paused
def layout(tensors: Mapping[str, torch.Tensor], metadata: Any, align: int = memory.PAGE) -> Layout:
    """Header and data offsets; the data section starts at a multiple of ``align``
    (4 KiB for files, for O_DIRECT; safetensors' own 8 for bytes in memory)."""
    check_tensors(tensors)
    meta = check_metadata(metadata)
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
        if t.is_conj() or t.is_neg():  # its storage holds the values unconjugated, unnegated
            t = t.resolve_conj().resolve_neg()
        items.append((k, t, at, at + n))
        at += n
    js = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    n = len(js) + (-(8 + len(js)) % align)
    if n > MAX_HEADER:
        raise ValueError(f"the header would be {n} bytes, over safetensors' limit of {MAX_HEADER}")
    return Layout(n.to_bytes(8, "little") + js + b" " * (n - len(js)), items)


def _pread_exact(fd: int, n: int, off: int, where: str) -> bytes:
    out = b""
    while len(out) < n:
        b = os.pread(fd, n - len(out), off + len(out))
        if not b:
            raise fail(where, f"file ends at byte {off + len(out)}, inside the header")
        out += b
    return out


def read_header(
    fd: int, where: str, *, tensors: bool = True
) -> tuple[dict[str, str] | None, list[Entry], int]:
    """(metadata, entries in file order, data section offset) of an open file
    (``tensors``: :func:`parse_header`'s)."""
    size = os.fstat(fd).st_size
    first8 = _pread_exact(fd, 8, 0, where) if size >= 8 else b""
    n = header_length(first8, size, where)
    return header_of(_pread_exact(fd, n, 8, where), size, where, tensors=tensors)


#: What the first GET of a stored object's header asks for.
FIRST_READ = 1 << 20


def read_stored_header(
    url: str, options: remote.StorageOptions = None, *, tensors: bool = True
) -> tuple[int, str | None, dict[str, str] | None, list[Entry], int]:
    """(size, version, metadata, entries in file order, data section offset)
    of the safetensors object ``url``: its header in one ranged GET (a second
    where it is longer than 1 MiB), of the version later reads pin
    (``tensors``: :func:`parse_header`'s)."""
    head, info = remote.read(url, 0, FIRST_READ, options)
    size, e_tag = info["size"], info["e_tag"]
    n = header_length(head, size, url)
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += remote.read(url, 8 + len(raw), n - len(raw), options, e_tag)[0]
    meta, entries, base = header_of(raw, size, url, tensors=tensors)
    return size, e_tag, meta, entries, base


def stored_shards(
    url: str, options: remote.StorageOptions = None
) -> tuple[str, str, bytes | None, dict[str, str] | None, list[str]]:
    """The sharded checkpoint at ``url`` in a store (its folder or its index):
    the folder's URL, the index's name, its bytes and weight_map (None: no
    index, a single model.safetensors) and the shard files it names, in
    first-named order."""
    base, named = _index_named(url)
    index_name = named or INDEX_NAME
    try:
        index, _ = remote.get_bytes(remote.join(base, index_name), options)
    except FileNotFoundError:
        if named is not None:  # an index's URL: that index, as a local path is read
            raise
        # A folder without read_through's first choice (asked in one GET): its names decide.
        found = read_through(stored_names(base, options), url)
        if found is None:
            return base, INDEX_NAME, None, None, ["model.safetensors"]
        index_name = found
        index, _ = remote.get_bytes(remote.join(base, index_name), options)
    wm = weight_map_of(index, remote.join(base, index_name))
    return base, index_name, index, wm, list(dict.fromkeys(wm.values()))


def _index_named(url: str) -> tuple[str, str | None]:
    """(the folder's URL, the index's name) where ``url`` names an index (a
    ``.json`` object), else (``url``, None): a folder or a single file."""
    base = url.rstrip("/")
    if base.endswith(".json"):
        folder, name = base.rsplit("/", 1)
        return folder, name
    return base, None


@contextlib.contextmanager
def stored_copy(url: str, options: remote.StorageOptions = None) -> Iterator[str]:
    """A local scratch folder holding the sharded checkpoint at ``url`` (its
    folder or index, :func:`stored_shards`): the index and the shards it
    names, or a single model.safetensors; removed after the block. Errors
    raised on the copy name the store's URLs."""
    base, index_name, index, _, files = stored_shards(url, options)
    folder = remote.scratch_folder()
    try:
        if index is not None:
            with open(os.path.join(folder, index_name), "wb") as fh:
                fh.write(index)
        for name in files:
            remote.download(remote.join(base, name), os.path.join(folder, name), options)
        with remote.named_for(folder, base):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def local_copy(f: Any, options: remote.StorageOptions = None) -> Iterator[str]:
    """``remote.local_tree(f)`` (``f`` itself where local), but an index's URL
    brings the shards it names: the copy of the index, beside theirs (an index
    alone names files that are not there)."""
    remote.check_options(f, options)
    named = remote.is_url(f) and _index_named(os.fsdecode(os.fspath(f)))[1]
    if not named:
        with remote.local_tree(f, options) as local:
            yield local
        return
    with stored_copy(os.fsdecode(os.fspath(f)), options) as folder:
        yield os.path.join(folder, named)


def stored_foreign_shards(url: str, options: remote.StorageOptions = None) -> set[str] | None:
    """:func:`foreign_shards` of the folder ``url`` in a store: the objects its
    other indexes name (None: one that cannot be read, which may name any)."""
    named: set[str] = set()
    for index in other_indexes(stored_names(url, options)):
        try:
            data, _ = remote.get_bytes(remote.join(url, index), options)
            named |= set(weight_map_of(data, remote.join(url, index)).values())
        except (OSError, FormatError):
            return None
    return named


def header_length(first8: bytes, size: int, where: str) -> int:
    """The header's length from a file's first 8 bytes, checked against its size."""
    if size < 8:
        raise fail(where, f"the file is {size} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(first8[:8], "little")
    if n > MAX_HEADER:
        raise fail(where, f"header length {n} is over safetensors' limit of {MAX_HEADER} bytes")
    if 8 + n > size:
        raise fail(
            where,
            f"header length {n} runs past the end of the file ({size} bytes): the header "
            "is truncated",
        )
    return n


def header_of(
    raw: bytes, size: int, where: str, *, tensors: bool = True
) -> tuple[dict[str, str] | None, list[Entry], int]:
    """(metadata, entries in file order, data section offset) from the header's
    bytes ``raw`` of a file of ``size`` bytes (``tensors``: :func:`parse_header`'s)."""
    n = len(raw)
    fast = _native.safetensors_header(raw, size - 8 - n, _ITEMSIZES)
    if fast is None:  # the Python validator says what is wrong (or reads the unusual)
        meta, entries = parse_header(raw, size - 8 - n, where, tensors=tensors)
        return meta, entries, 8 + n
    pairs, rows = fast
    if not tensors:  # what the native reader takes, parse_header's tensors=False takes
        return (None if pairs is None else dict(pairs)), [], 8 + n
    dtypes = DTYPES
    # Entry's made as tuples are (its __new__ takes keywords: 5x the time).
    new = tuple.__new__
    made: list[Entry] = [
        new(Entry, (name, dtypes[dt], shape, b, e)) for name, dt, shape, b, e in rows
    ]
    return (None if pairs is None else dict(pairs)), made, 8 + n


def shard_files(index_path_or_folder: str) -> tuple[str, dict[str, str] | None]:
    """(folder, weight_map or None for a single model.safetensors)."""
    p = index_path_or_folder
    if os.path.isdir(p):
        found = read_through(os.listdir(p), p)
        if found is None:
            return p, None
        p = os.path.join(p, found)
    with open_regular(p) as f:
        wm = weight_map_of(f.read(), p)
    folder = os.path.dirname(p) or "."
    for v in set(wm.values()):
        inside(folder, v, f"{p}: shard", blobs=True, error=SafetensorError)
    return folder, wm


def other_indexes(names: Iterable[str]) -> list[str]:
    """The ``*.safetensors.index.json`` among a folder's file ``names`` but its
    ``model.safetensors.index.json`` (another writer's: consolidated.safetensors.index.json)."""
    return sorted(n for n in names if n.endswith(".safetensors.index.json") and n != INDEX_NAME)


def read_through(names: Collection[str], where: str) -> str | None:
    """The file a folder of sharded safetensors (its file ``names``) is read
    through: its model.safetensors.index.json, else its model.safetensors
    (None), else its one other index. ``save_sharded`` writes and removes the
    first two only: a folder it saved into is never read through another
    index. FileNotFoundError naming ``where`` otherwise."""
    if INDEX_NAME in names:
        return INDEX_NAME
    if "model.safetensors" in names:
        return None
    others = other_indexes(names)
    if len(others) == 1:
        return others[0]
    raise FileNotFoundError(
        2,
        f"no {INDEX_NAME} nor model.safetensors, nor a single other *.safetensors.index.json"
        + (f" (there are {len(others)}: {', '.join(others)})" if others else ""),
        where,
    )


def stored_names(url: str, options: remote.StorageOptions = None) -> list[str]:
    """The names of the objects right in the folder ``url`` of a store."""
    prefix = url.rstrip("/") + "/"
    listed = (obj[len(prefix) :] for obj, _, _, _ in remote.listing(url, options))
    return [n for n in listed if n and "/" not in n]


def weight_map_of(data: bytes, where: str) -> dict[str, str]:
    """The weight_map (tensor name -> shard file name) of the index ``data``
    read from ``where`` (named in errors); each shard a plain file name of the
    index's folder."""
    try:
        index = json.loads(data)
    except ValueError as e:
        raise SafetensorError(f"{where}: not a safetensors index: invalid JSON: {e}") from None
    except RecursionError:
        raise SafetensorError(f"{where}: not a safetensors index: nested too deeply") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise SafetensorError(
            f"{where}: not a safetensors index: no weight_map of tensor name -> shard file name"
        )
    for name, v in wm.items():
        # A shard is a file of this folder (or, in a hub cache snapshot, a link to its
        # blobs): "", "." and ".." name none.
        if os.path.basename(v) != v or v in ("", ".", ".."):
            raise SafetensorError(
                f"{where}: weight_map puts tensor {name!r} in {v!r}, not a file name of the "
                "index's folder"
            )
    return wm


#: Set (by :func:`own_shard_names`) while a save's shards must have names no
#: other save can pick: a store's folder, where a racing save would pick the
#: same free hub names and upload over this one's.
_OWN_NAMES: contextvars.ContextVar[bool] = contextvars.ContextVar("own_names", default=False)


@contextlib.contextmanager
def own_shard_names() -> Iterator[None]:
    """Within it, :func:`shard_names` gives every save a token of its own."""
    reset = _OWN_NAMES.set(True)
    try:
        yield
    finally:
        _OWN_NAMES.reset(reset)


def shard_names(folder: str, k: int) -> list[str]:
    """Names for ``k`` shards that no file of the folder's current checkpoint has:
    the hub's when they are free, else (and under :func:`own_shard_names`)
    with a token of their own."""
    if k == 1:
        return ["model.safetensors"]  # replaced atomically in one step
    hub = [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    present = set(os.listdir(folder))
    live = current_shards(folder)
    if live is not None and not live & set(hub) and not _OWN_NAMES.get():
        return hub
    while True:
        token = secrets.token_hex(4)
        if not any(token in n for n in present):
            return [f"model-{token}-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]


def current_shards(folder: str) -> set[str] | None:
    """The files the folder's checkpoints use: ``save_sharded``'s (its
    :func:`generation`) and those another index of the folder names
    (:func:`foreign_shards`), which no save may write over or remove. None:
    an index that cannot be read, so any name may be in use."""
    own, foreign = generation(folder), foreign_shards(folder)
    return None if own is None or foreign is None else own | foreign


def generation(folder: str) -> set[str] | None:
    """The files of the checkpoint ``save_sharded`` keeps in the folder:
    model.safetensors and those model.safetensors.index.json names (None: an
    index that cannot be read)."""
    if not os.path.exists(os.path.join(folder, INDEX_NAME)):
        return {"model.safetensors"}
    return _named_by(os.path.join(folder, INDEX_NAME), {"model.safetensors"})


def foreign_shards(folder: str) -> set[str] | None:
    """The files the folder's other indexes (:func:`other_indexes`) name: another
    writer's checkpoint (None: one that cannot be read, which may name any)."""
    named: set[str] = set()
    for index in other_indexes(os.listdir(folder)):
        got = _named_by(os.path.join(folder, index), named)
        if got is None:
            return None
        named = got
    return named


def _named_by(index: str, named: set[str]) -> set[str] | None:
    """``named`` and the files the index ``index`` names (None: it cannot be read)."""
    try:
        _, wm = shard_files(index)
    except (OSError, FormatError):
        return None
    return named | set((wm or {}).values())


def sweep(folder: str, own: str | None = None, *, unreferenced: bool = True) -> list[str]:
    """Remove what dead saves left in a sharded checkpoint's folder: their temp
    files, and shard files (``SHARD_FILE``) that no index of the folder names
    (:func:`current_shards`: a ``save_sharded`` that died before its index
    left them). Nothing of the shards while a save may be in flight: a temp
    file some writer holds (but ``own``, the caller's guard) or an index that
    cannot be read. The names removed.

    ``unreferenced=False`` (``ckptio clean``, which no save of this folder runs):
    only shards that carry the evidence of a dead ckptio save go: ckptio's own
    names (``OWN_SHARD_FILE``), and the hub's names older than an index that
    names ckptio's (a save picks those only while the hub's names are the
    current checkpoint's: that index replaced them). Shards of the hub's names
    without an index (another writer's save before its index, a download in
    progress, or a ckptio save killed in a fresh folder) stay."""
    commit: list[int] = []  # the mtime of an index that names ckptio's shards

    def in_use() -> set[str] | None:
        own, foreign = generation(folder), foreign_shards(folder)
        if own is None or foreign is None:
            return None
        if any(OWN_SHARD_FILE.fullmatch(n) for n in own):
            try:
                commit.append(os.stat(os.path.join(folder, INDEX_NAME)).st_mtime_ns)
            except OSError:
                return None  # the index went meanwhile: which files are in use is not known
        return own | foreign

    dead = None if unreferenced else left_by_dead_save(folder, OWN_SHARD_FILE, commit)
    return sweep_unnamed(folder, SHARD_FILE, own, in_use, dead)


_T = TypeVar("_T")  # what gather's dicts hold: tensors, or describe's entries


def gather(
    src: str, files: list[str], tensors: list[dict[str, _T]], wm: dict[str, str] | None
) -> dict[str, _T]:
    """The shards' tensors in one dict; a name in two shards, or a tensor not in
    the shard the index's weight_map names, is a SafetensorError."""
    out: dict[str, _T] = {}
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


def open_file(
    path: str, *, direct: str | None = None, backend: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None, Mapped]:
    """A safetensors file's tensors as views of a lazy mapping of it, in file
    order (an entry whose offset its dtype's size does not divide is read into
    a tensor of its own), its metadata, and the mapping."""
    f = _native.DeviceFile(path, False, direct, backend)
    fd = f.fileno()
    meta, entries, start = read_header(fd, path)
    size = os.fstat(fd).st_size
    mapping = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", False, size)
    tensors: dict[str, torch.Tensor] = {}
    for e in entries:
        off = start + e.begin
        isz = e.dtype.itemsize
        if off % isz == 0:
            # torch's stubs lack set_(source, offset, size) (the stride is optional)
            t = torch.empty(0, dtype=e.dtype).set_(mapping, off // isz, e.shape)  # type: ignore[call-overload]
        else:  # a view would need an aligned offset: copy these bytes
            raw = mapping[off : off + e.end - e.begin]
            t = torch.empty(e.shape, dtype=e.dtype)
            t.view(-1).view(torch.uint8).copy_(torch.empty(0, dtype=torch.uint8).set_(raw))
        tensors[e.name] = t
    return tensors, meta, Mapped(path, f, mapping.data_ptr(), size, holders=(mapping,))
