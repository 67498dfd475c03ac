"""What is inside a checkpoint of any format ckptio reads: ``ckptio ls``,
``ckptio inspect`` and the format dispatch of ``ckptio verify``.

The format is found from the content (``ckptio.formats.detect``).

:func:`listing` describes any of them the same way: the stretches of bytes
(records, tensors, DCP items) of each file with their offsets, sizes, stored
CRC-32 and the tensors they hold; for DCP also the metadata's tensors and their
shards. Nothing here reads tensor data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ckptio import _native
from ckptio.errors import FormatError
from ckptio.formats import dcp, torchzip
from ckptio.formats import safetensors as st_format
from ckptio.formats.detect import DCP, FORMATS, SAFETENSORS, SHARDED, TORCH, Detected, detect
from ckptio.io import paths, remote

__all__ = [
    "FORMATS",
    "Detected",
    "Entry",
    "Listing",
    "Shard",
    "Stored",
    "Tensor",
    "detect",
    "listing",
    "printable",
]


# --------------------------------------------------------------------------- listing


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor held in an entry: its name, dtype, shape, and where in the entry
    (``note``: an element offset, a DCP shard's place in the whole tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Entry:
    """A stretch of one file: a torch.save record, a safetensors tensor, a DCP item."""

    #: The file, relative to the checkpoint's folder ("" for a single-file checkpoint).
    file: str
    name: str
    offset: int
    nbytes: int
    #: Where the entry's tensor bytes start (a DCP item's data record; else ``offset``).
    data_offset: int
    #: "stored" (``crc32`` holds it), "unchecked" (the file has none for it),
    #: "none" (the format has no checksum), "compressed" (a DCP item with stream
    #: transforms: its frames are checked by whoever decodes them), "safetensors"
    #: (a DCP tensor item in torch's SerializationFormat.SAFETENSORS layout: no
    #: checksum, and not read here: ``formats.dcp.safetensors_item``).
    crc: str
    crc32: int | None = None
    tensors: tuple[Tensor, ...] = ()

    @property
    def alignment(self) -> int:
        """The largest power of two (up to 4096) dividing ``data_offset``."""
        a = 1
        while a < 4096 and self.data_offset % (a * 2) == 0:
            a *= 2
        return a


@dataclasses.dataclass(frozen=True)
class Shard:
    """Where one shard of a DCP tensor (or a bytes entry) is stored."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Stored:
    """A DCP metadata entry: a tensor (dtype, global shape) with its shards, or bytes."""

    name: str
    kind: str  # "tensor" | "bytes"
    dtype: str | None
    shape: tuple[int, ...] | None
    shards: tuple[Shard, ...]


@dataclasses.dataclass(frozen=True)
class Listing:
    path: str
    format: str
    #: Data files (relative to the checkpoint's folder, "" for a single file) and sizes.
    files: tuple[tuple[str, int], ...]
    entries: tuple[Entry, ...]
    #: safetensors ``__metadata__`` (of the first shard for sharded checkpoints).
    metadata: dict[str, str] | None = None
    #: DCP: the metadata's tensors and bytes entries, with their shards.
    stored: tuple[Stored, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["files"] = [{"file": f, "bytes": n} for f, n in self.files]
        for e, de in zip(self.entries, d["entries"], strict=True):
            de["alignment"] = e.alignment
        return d


def listing(
    path: str | os.PathLike[str],
    source: Detected | None = None,
    *,
    storage_options: remote.StorageOptions = None,
) -> Listing:
    """Describe the checkpoint at ``path`` (any format :func:`detect` knows; an
    object URL: see :func:`stored_listing`, else from a scratch copy)."""
    if remote.is_url(path):
        stored = stored_listing(os.fsdecode(os.fspath(path)), storage_options)
        if stored is not None:
            return stored
    if remote.is_url(path) or storage_options is not None:
        url = os.fsdecode(os.fspath(path))
        with remote.local_tree(path, storage_options) as local:
            # Named by what was asked for, not by the scratch copy (as an error
            # raised on the copy is, by local_tree).
            return dataclasses.replace(listing(local), path=url)
    # bytes and PathLike taken as verify and records take them; anything else a TypeError.
    src = source or detect(paths.path(path, "listing"))
    if src.format == TORCH:
        return _torch(src)
    if src.format == SAFETENSORS:
        return _safetensors(src)
    if src.format == SHARDED:
        return _sharded(src)
    return _dcp(src)


def _dtype(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _torch(src: Detected) -> Listing:
    try:
        records = torchzip.list_records(src.root)
    except pickle.UnpicklingError:  # torch's weights_only refusal: what the pickle
        records = torchzip.scanned_records(src.root)  # holds, found running none of it
    entries = _torch_entries(records)
    return Listing(src.path, TORCH, (("", os.path.getsize(src.root)),), entries)


def stored_listing(url: str, options: remote.StorageOptions = None) -> Listing | None:
    """A checkpoint in a store described from a few small GETs, no tensor byte
    read: a torch.save object from its directory and small records, a
    safetensors object from its header, a sharded one (its folder or index)
    from the index and each shard's header. None for anything else (a DCP
    folder, a damaged object, a pickle only torch.load reads): a scratch copy
    decides."""
    if url.endswith(".json"):
        return _stored_sharded(url, options)
    try:
        stored = torchzip.map_stored(url, options)
    except FileNotFoundError:  # a folder
        return _stored_sharded(url, options)
    except FormatError:
        return _stored_safetensors(url, options)
    records = torchzip.list_stored_records(stored)
    if records is None:
        return None
    return Listing(url, TORCH, (("", stored.info["size"]),), _torch_entries(records))


def _stored_safetensors(url: str, options: remote.StorageOptions) -> Listing | None:
    try:
        size, _, meta, entries, base = st_format.read_stored_header(url, options)
    except FormatError:
        return None
    return Listing(url, SAFETENSORS, (("", size),), tuple(_st_entries("", entries, base)), meta)


def _stored_sharded(url: str, options: remote.StorageOptions) -> Listing | None:
    try:
        folder, index_name, index, wm, files = st_format.stored_shards(url, options)
    except (FileNotFoundError, FormatError):
        return None
    if index is None:  # no index: the folder may hold anything (a copy decides)
        return None
    try:
        # A shard the index names and the store lacks is the answer (its URL in a
        # FileNotFoundError, as a local folder's is): no copy of the others first.
        heads = [st_format.read_stored_header(remote.join(folder, f), options) for f in files]
    except FormatError:
        return None
    per_file = [_st_entries(f, h[3], h[4]) for f, h in zip(files, heads, strict=True)]
    index_url = remote.join(folder, index_name)
    st_format.gather(index_url, files, [{e.name: e for e in es} for es in per_file], wm)
    sizes = tuple((f, h[0]) for f, h in zip(files, heads, strict=True))
    entries = tuple(e for es in per_file for e in es)
    return Listing(url, SHARDED, sizes, entries, heads[0][2] if heads else None)


def _torch_entries(records: list[torchzip.RecordInfo]) -> tuple[Entry, ...]:
    entries = []
    for r in records:
        tensors = tuple(
            Tensor(
                t.name,
                _dtype(t.dtype),
                t.shape,
                f"at element {t.storage_offset}" if t.storage_offset else "",
            )
            for t in r.tensors
        )
        state = "unchecked" if r.crc32 is None else "stored"
        entries.append(Entry("", r.name, r.offset, r.nbytes, r.offset, state, r.crc32, tensors))
    return tuple(entries)


def _safetensors_file(path: str, rel: str) -> tuple[dict[str, str] | None, list[Entry]]:
    with paths.open_regular(path) as f:
        meta, entries, base = st_format.read_header(f.fileno(), path)
    return meta, _st_entries(rel, entries, base)


def _st_entries(rel: str, entries: list[st_format.Entry], base: int) -> list[Entry]:
    return [
        Entry(
            rel,
            e.name,
            base + e.begin,
            e.end - e.begin,
            base + e.begin,
            "none",
            None,
            (Tensor(e.name, _dtype(e.dtype), e.shape),),
        )
        for e in entries
    ]


def _safetensors(src: Detected) -> Listing:
    meta, entries = _safetensors_file(src.root, "")
    size = os.path.getsize(src.root)
    return Listing(src.path, SAFETENSORS, (("", size),), tuple(entries), meta)


def sharded_files(root: str) -> tuple[str, list[str], dict[str, str] | None]:
    """(folder, shard file names, weight_map or None) of a sharded checkpoint, as
    ``ckptio.safetensors.load_sharded`` finds them."""
    folder, wm = st_format.shard_files(root)
    files = ["model.safetensors"] if wm is None else list(dict.fromkeys(wm.values()))
    return folder, files, wm


def _sharded(src: Detected) -> Listing:
    folder, files, wm = sharded_files(src.root)
    metas, per_file = [], []
    for name in files:
        meta, found = _safetensors_file(os.path.join(folder, name), name)
        metas.append(meta)
        per_file.append(found)
    # The index's weight_map must agree with the shards (load_sharded's check).
    st_format.gather(src.root, files, [{e.name: e for e in es} for es in per_file], wm)
    sizes = tuple((f, os.path.getsize(os.path.join(folder, f))) for f in files)
    entries = tuple(e for es in per_file for e in es)
    return Listing(src.path, SHARDED, sizes, entries, metas[0] if metas else None)


def _dcp(src: Detected) -> Listing:
    folder = src.root
    md_path = os.path.join(folder, dcp.METADATA)
    md = dcp.read_metadata(md_path)
    sdm = md.state_dict_metadata
    entries: list[Entry] = []
    at: dict[str, str] = {}  # each data file's path, checked inside the folder once
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, info in sorted(
        md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
    ):
        fqn = index.fqn
        offsets = None if index.offset is None else tuple(index.offset)
        where[(fqn, offsets)] = info
        meta = sdm.get(fqn)
        rel = info.relative_path
        if isinstance(meta, BytesStorageMetadata) or meta is None:
            entries.append(Entry(rel, fqn, info.offset, info.length, info.offset, "none"))
            continue
        chunk = next((c for c in meta.chunks if tuple(c.offsets) == offsets), None)
        sizes = tuple(chunk.sizes) if chunk is not None else tuple(meta.size)
        whole = offsets is None or (not any(offsets) and sizes == tuple(meta.size))
        note = "" if whole else f"shard at {list(offsets or ())} of {list(meta.size)}"
        tensor = Tensor(fqn, _dtype(meta.properties.dtype), sizes, note)
        name = fqn if whole else f"{fqn} {list(offsets or ())}"
        if dcp.transformed(info):
            entries.append(
                Entry(
                    rel, name, info.offset, info.length, info.offset, "compressed", None, (tensor,)
                )
            )
            continue
        path = at.get(rel) or at.setdefault(rel, paths.inside(folder, rel, md_path))
        try:
            item = _native.Reader(path, "off", None, info.offset, info.length)
        except FormatError as e:
            if dcp.safetensors_item(path, info):  # torch's safetensors layout: not read here
                entries.append(
                    Entry(rel, name, info.offset, info.length, info.offset, "safetensors",
                          None, (tensor,))
                )  # fmt: skip
                continue
            raise FormatError(
                f"{path}: item {name!r} at bytes {info.offset}..+{info.length}: {e}"
            ) from e
        data = [(n, off) for n, off, _ in item.records() if n.startswith(f"{item.prefix}/data/")]
        data_offset = data[0][1] if len(data) == 1 else info.offset
        crc = dict(item.checksums()).get(data[0][0]) if len(data) == 1 else None
        entries.append(
            Entry(
                rel,
                name,
                info.offset,
                info.length,
                data_offset,
                "unchecked" if crc is None else "stored",
                crc,
                (tensor,),
            )
        )
    stored = []
    for fqn, meta in sdm.items():
        if isinstance(meta, BytesStorageMetadata):
            info = where.get((fqn, None))
            held = (
                ()
                if info is None
                else (Shard((), (), info.relative_path, info.offset, info.length),)
            )
            stored.append(Stored(fqn, "bytes", None, None, held))
            continue
        shards = []
        for c in meta.chunks:
            info = where.get((fqn, tuple(c.offsets)))
            if info is not None:
                shards.append(
                    Shard(
                        tuple(c.offsets),
                        tuple(c.sizes),
                        info.relative_path,
                        info.offset,
                        info.length,
                    )
                )
        stored.append(
            Stored(fqn, "tensor", _dtype(meta.properties.dtype), tuple(meta.size), tuple(shards))
        )
    files = sorted({e.file for e in entries})
    file_sizes = tuple((f, os.path.getsize(os.path.join(folder, f))) for f in files)
    return Listing(src.path, DCP, file_sizes, tuple(entries), None, tuple(stored))


# --------------------------------------------------------------------------- text


def _shape(shape: tuple[int, ...] | None) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def printable(name: str) -> str:
    """A name (from a checkpoint, a folder's listing, a path) as one line of
    text that a terminal shows as it is: control and other non-printing
    characters (a newline, a terminal escape, a right-to-left override)
    written as repr() writes them; the bytes of a file name that are not UTF-8
    (lone surrogates from ``os.fsdecode``, which a strict encoder refuses) as
    ``\\xNN``. Every name the commands print goes through it."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else _escaped(c) for c in name)


def _escaped(c: str) -> str:
    if "\udc80" <= c <= "\udcff":  # the byte os.fsdecode could not decode
        return f"\\x{ord(c) - 0xDC00:02x}"
    return repr(c)[1:-1]


def _tensor_text(t: Tensor) -> str:
    text = f"{printable(t.name)}: {t.dtype} [{_shape(t.shape)}]"
    return text + (f" {t.note}" if t.note else "")


def _file_title(lst: Listing, rel: str, size: int, entries: list[Entry]) -> str:
    kind = {DCP: "item", SHARDED: "tensor"}.get(lst.format, "entry")
    m = dcp.DATA_FILE.fullmatch(rel) if lst.format == DCP else None
    rank = f" (rank {m['rank']})" if m else ""
    n = len(entries)
    return f"== {printable(rel)}{rank}: {n} {kind}{'s' if n != 1 else ''}, {size} bytes"


def lines(lst: Listing, *, crc: bool = False) -> list[str]:
    """The text of ``ckptio ls`` (``crc=False``) or ``ckptio inspect`` (``crc=True``:
    the CRC-32 column, a summary, and the metadata: safetensors ``__metadata__``,
    DCP tensors and shards)."""
    pad = 44 if crc else 33
    head = f"{'offset':>12} {'bytes':>12} {'align':>5}" + (f" {'crc32':>10}" if crc else "")
    what = {TORCH: "record / tensors", DCP: "item / tensor"}.get(lst.format, "tensor")
    out = [f"{lst.format}: {printable(lst.path)}", f"{head}  {what}"]
    for rel, size in lst.files:
        es = [e for e in lst.entries if e.file == rel]
        if rel:
            out.append(_file_title(lst, rel, size, es))
        for e in es:
            row = f"{e.offset:>12} {e.nbytes:>12} {e.alignment:>5}"
            if crc:
                no_crc = {"none": "-", "safetensors": "-"}  # the summary counts them apart
                state = {"stored": f"{e.crc32 or 0:08x}", **no_crc}.get(e.crc, e.crc)
                row += f" {state:>10}"
            single = len(e.tensors) == 1 and e.tensors[0].name == e.name.split(" [")[0]
            if single and lst.format != TORCH:
                data = f", data at {e.data_offset}" if crc and e.data_offset != e.offset else ""
                out.append(f"{row}  {_tensor_text(e.tensors[0])}{data}")
                continue
            out.append(f"{row}  {printable(e.name)}")
            out.extend(f"{'':>{pad}}  - {_tensor_text(t)}" for t in e.tensors)
    if not crc:
        return out
    out.extend(_summary(lst))
    return out


def _summary(lst: Listing) -> list[str]:
    n, total = len(lst.entries), sum(e.nbytes for e in lst.entries)
    states = [e.crc for e in lst.entries]
    if lst.format == TORCH:
        unchecked = states.count("unchecked")
        return [
            f"{n} records, {total} bytes; CRC-32 stored for {n - unchecked}, unchecked {unchecked}"
        ]
    files = f"{len(lst.files)} file" + ("s" if len(lst.files) != 1 else "")
    if lst.format in (SAFETENSORS, SHARDED):
        out = [f"{n} tensors, {total} bytes in {files}; the safetensors format stores no CRC-32"]
        if lst.metadata:
            out.append(f"__metadata__: {json.dumps(lst.metadata, sort_keys=True)}")
        return out
    out = [
        f"{n} items, {total} bytes in {files}; CRC-32 stored for {states.count('stored')}, "
        f"unchecked {states.count('unchecked')}, bytes items {states.count('none')}"
        + (f", compressed {states.count('compressed')}" if "compressed" in states else "")
        + (
            f", safetensors-format items {states.count('safetensors')} (not read here)"
            if "safetensors" in states
            else ""
        )
    ]
    tensors = sum(s.kind == "tensor" for s in lst.stored)
    out.append(
        f"metadata: {tensors} tensors, {len(lst.stored) - tensors} bytes entries "
        "(name: dtype [shape]; shards: [offsets] +[sizes] file@offset)"
    )
    for s in lst.stored:
        name = printable(s.name)
        if s.kind == "bytes":
            at = ", ".join(f"{printable(h.file)}@{h.offset} ({h.nbytes} bytes)" for h in s.shards)
            out.append(f"  {name}: bytes {at}")
            continue
        n = len(s.shards)
        out.append(f"  {name}: {s.dtype} [{_shape(s.shape)}], {n} shard{'s' if n != 1 else ''}")
        out.extend(
            f"    {list(h.offsets)} +{list(h.sizes)} {printable(h.file)}@{h.offset}"
            for h in s.shards
        )
    return out


def checkpoint_bytes(src: Detected) -> int:
    """The bytes of the checkpoint's data files (what a full check reads at most)."""
    if src.format in (TORCH, SAFETENSORS):
        return os.path.getsize(src.root)
    if src.format == SHARDED:
        folder, files, _ = sharded_files(src.root)
        return sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    md = dcp.read_metadata(os.path.join(src.root, dcp.METADATA))
    return sum(info.length for info in md.storage_data.values())
