"""Loads in place from an object store with no local copy: ``ckptio.load(url,
out=...)``, ``ckptio.load_state_dict(module, url)`` and the safetensors loads
with ``out=``.

The checkpoint is described without its bytes: each tensor on the meta
device, its storage carrying where its bytes lie (:func:`meta_tensor`: the
object, by index into the load's :class:`StoredFile` list, and the offset in
it; torch.save archives: ``torchzip.meta_object``). The caller pairs those
tensors with destinations as a local load in place does, and
:func:`read_pairs` reads each pair's bytes by ranged GETs straight into its
destination, for the usual case only: same dtype and shape, contiguous
plain CPU or CUDA memory. Anything else is ``None`` (nothing written, or,
after a torch.save header says the layout is not torch.save's, every
destination to be written again): the caller then loads a local scratch copy
with the full in-place machinery, its checks and its errors.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from ckptio import _native
from ckptio.errors import FormatError, check_crc
from ckptio.formats import safetensors as st_format
from ckptio.formats import torchzip
from ckptio.io import devices, remote, reports, transfer
from ckptio.io.engines import IoOptions
from ckptio.loading import inplace, sharing


@dataclasses.dataclass
class StoredFile:
    """One object a load in place reads: its URL, the version every read pins
    and, for a torch.save archive, what confirms the layout and the bytes."""

    url: str
    e_tag: str | None
    #: The object's size, and its records (name, data offset, size): what the
    #: ranks of a group compare before they share a read.
    size: int
    rows: list[tuple[str, int, int]]
    #: (record name, local header offset, data offset) of each storage: the
    #: header rides in the GET of its bytes and is checked once they are in.
    heads: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    #: Data offset -> (record name, size, declared CRC-32 or None).
    records: dict[int, tuple[str, int, int | None]] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_archive(cls, stored: torchzip.StoredArchive) -> StoredFile:
        info, archive = stored.info, stored.archive
        return cls(archive.path, info["e_tag"], info["size"], list(archive.records),
                   list(stored.heads), storage_records(stored))  # fmt: skip


def storage_records(stored: torchzip.StoredArchive) -> dict[int, tuple[str, int, int | None]]:
    """Each storage record of a stored archive by data offset: (name, size,
    declared CRC-32 or None)."""
    archive, declared = stored.archive, stored.declared
    data = archive.data
    return {off: (name, n, declared.get(name)) for name, off, n in archive.records if off in data}


def check_small_records(url: str, stored: torchzip.StoredArchive) -> list[str]:
    """The CRC-32s of the records read with the directory (the pickle and the
    small ones), checked before anything is decoded; the names of those the
    archive declares no CRC-32 for."""
    unchecked = []
    for name, data in stored.small.items():
        declared = stored.declared.get(name)
        if declared is None:
            unchecked.append(name)
        check_crc(url, name, declared, zlib.crc32(data))
    return unchecked


def meta_tensor(
    file: int, offset: int, dtype: torch.dtype, shape: Iterable[int], nbytes: int
) -> torch.Tensor:
    """A tensor on the meta device whose bytes are ``nbytes`` at ``offset`` of the
    load's object ``file``."""
    st = torch.UntypedStorage(nbytes, device="meta")
    st._checkpoint_offset = offset
    # an attribute of ckptio's own on the storage (torch's stubs declare none)
    setattr(st, "_checkpoint_file", file)  # noqa: B010
    # torch's stubs lack set_(source, offset, size) (the stride is optional)
    return torch.empty(0, dtype=dtype, device="meta").set_(st, 0, tuple(shape))  # type: ignore[call-overload]


def open_archive(
    url: str, options: remote.StorageOptions, verify: bool
) -> tuple[Any, list[StoredFile], list[str]] | None:
    """The torch.save archive at ``url`` as a meta object (every storage a meta
    one placed by ``torchzip.meta_object``), its one :class:`StoredFile` and the
    small records without a declared CRC-32 (``verify``: the others checked);
    None where it is not an archive ckptio reads natively."""
    try:
        stored = torchzip.map_stored(url, options)
    except FormatError:
        return None  # the scratch copy reads it, or names what is wrong
    archive = stored.archive
    if f"{archive.prefix}/constants.pkl" in archive.where or not torchzip.native_byteorder(archive):
        return None
    unchecked = check_small_records(url, stored) if verify else []
    meta = torchzip.meta_object(archive)
    if meta is None:
        return None
    return meta, [StoredFile.of_archive(stored)], unchecked


def open_safetensors(
    name: str,
    urls: list[str],
    options: remote.StorageOptions,
    wm: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], list[StoredFile]]:
    """The safetensors objects ``urls`` (the shards of ``name``, as the index's
    weight_map ``wm`` places them) as one dict of meta tensors (their headers
    read, one GET each), and their :class:`StoredFile` list."""
    files, metas = [], []
    for i, url in enumerate(urls):
        size, e_tag, _, entries, base = st_format.read_stored_header(url, options)
        rows = [(key, base + begin, end - begin) for key, _, _, begin, end in entries]
        files.append(StoredFile(url, e_tag, size, rows))
        metas.append(
            {
                key: meta_tensor(i, base + begin, dtype, shape, end - begin)
                for key, dtype, shape, begin, end in entries
            }
        )
    shards = [u.rsplit("/", 1)[1] for u in urls]
    return st_format.gather(name, shards, metas, dict(wm) if wm else None), files


def open_source(
    url: str, options: remote.StorageOptions, verify: bool
) -> tuple[Any, list[StoredFile], list[str]] | None:
    """The checkpoint at ``url`` as ``load_state_dict`` takes it: a torch.save
    archive, a safetensors object (by its name) or a sharded safetensors
    checkpoint (its index, or the folder holding it, or a single
    model.safetensors): (the object of meta tensors, its files, small records
    not checked). None where the scratch copy must read it (or find what is
    wrong: a missing object, another format, verify=True of safetensors)."""
    name = url.rstrip("/")
    if name.endswith(".safetensors") or name.endswith(".json"):
        sharded = name.endswith(".json")
    else:
        try:
            remote.head(name, options)
        except FileNotFoundError:
            sharded = True  # a folder
        else:
            return open_archive(name, options, verify)
    if verify:
        return None  # safetensors hold no CRC-32: the scratch copy says so
    try:
        if not sharded:
            tensors, files = open_safetensors(name, [name], options)
            return tensors, files, []
        base, _, _, wm, shards = st_format.stored_shards(name, options)
        tensors, files = open_safetensors(name, [remote.join(base, s) for s in shards], options, wm)
    except (FormatError, FileNotFoundError):
        return None
    return tensors, files, []


def _source_of(src: torch.Tensor) -> tuple[int, int]:
    """(file index, offset of its first byte) of a tensor made by
    :func:`meta_tensor` or ``torchzip.meta_object``."""
    st = src.untyped_storage()
    # (torch types the offset int | None: these tensors' storages all have one)
    return getattr(st, "_checkpoint_file", 0), cast(int, st._checkpoint_offset) + (
        cast(int, src.storage_offset()) * src.element_size()
    )


def read_pairs(
    what: str,
    files: list[StoredFile],
    pairs: Iterable[tuple[str, torch.Tensor, Any]],
    options: remote.StorageOptions,
    verify: bool = False,
) -> tuple[dict[str, Any], tuple[str, ...], int] | None:
    """Read each (key, meta source, destination) pair's bytes straight into its
    destination: (the merged stats, the records ``verify`` could not check,
    the destinations written). Where two pairs fill the very same destination
    (tied weights) the later one is read, as torch's copies leave it.

    None, nothing written, where a pair is not the usual case, destinations
    overlap otherwise, ``verify`` asks for a CRC-32 of part of a record, or
    torch.serialization.skip_data() is on; None after the reads where a
    torch.save header says its layout is not torch.save's (the caller loads
    the scratch copy, which writes every destination again). A failure once
    reading began is a PartialLoadError."""
    if torch.serialization._serialization_tls.skip_data:
        return None  # a load in place refuses it: the scratch copy says so
    chosen: dict[tuple[int, int, int], tuple[int, int, torch.Tensor]] = {}
    for key, src, dest in pairs:
        if not (
            inplace.direct_destination(dest)
            and src.dtype == dest.dtype
            and src.shape == dest.shape
            and src.is_contiguous()
        ):
            return None
        n = dest.numel() * dest.element_size()
        if not n:
            continue
        fi, off = _source_of(src)
        if verify and (src.storage_offset() or off not in files[fi].records
                       or files[fi].records[off][1] != n):  # fmt: skip
            return None  # a CRC-32 covers a whole record only
        code = devices.device_code(dest, key)
        chosen[(code, dest.data_ptr(), n)] = (fi, off, dest)  # the later pair wins
    segments = [(off, ptr, n, code) for (code, ptr, n), (_, off, _) in chosen.items()]
    if transfer.destinations_overlap(segments):
        return None  # destinations that share memory otherwise (views of one tensor)
    per_file: dict[int, list[tuple[tuple[int, int, int, int], torch.Tensor]]] = {}
    for seg, (fi, _, dest) in zip(segments, chosen.values(), strict=True):
        per_file.setdefault(fi, []).append((seg, dest))
    plans = [Reads(files[fi], reads) for fi, reads in per_file.items()]
    try:
        stats = read_all(plans, options, verify)
    except Exception as e:
        raise inplace.partial_error(f"reading {what} into the destinations failed midway", e) from e
    if any(p.moved() for p in plans):
        return None  # not torch.save's layout
    unchecked = tuple(n for st in stats for n in st.get("unchecked", ()))
    dests = [d for _, _, d in chosen.values() if not d.is_inference()]
    torch.autograd.graph.increment_version(dests)  # written through their pointers
    return reports.merged(stats, "store"), unchecked, len(chosen)


class Reads:
    """The reads of one object into memory (a load's new storages, a load in
    place's destinations): each storage's local header in
    the GET of its bytes (a pass of its own costs a request per large tensor),
    checked once they are in (:meth:`moved`)."""

    def __init__(
        self,
        f: StoredFile,
        reads: Sequence[tuple[tuple[int, int, int, int], torch.Tensor | torch.UntypedStorage]],
    ) -> None:
        used = {seg[0] for seg, _ in reads}
        self.f = f
        self.spans = [(name, lh, off) for name, lh, off in f.heads if off in used]
        self.head_bytes = torch.empty(sum(off - lh for _, lh, off in self.spans), dtype=torch.uint8)
        heads, ptr = [], self.head_bytes.data_ptr()
        for _, lh, off in self.spans:
            heads.append((lh, ptr, off - lh, -1))
            ptr += off - lh
        self.segments = heads + [seg for seg, _ in reads]
        #: One owner per segment (a tensor or a storage: what holds its memory).
        owners: list[torch.Tensor | torch.UntypedStorage] = [self.head_bytes] * len(heads)
        self.owners = owners + [d for _, d in reads]

    def read(self, options: remote.StorageOptions, verify: bool) -> dict[str, Any]:
        """Read alone (``verify``: each whole record's CRC-32 checked)."""
        f = self.f
        stats = transfer.read_from_store(
            f.url, self.segments, self.owners, options, f.e_tag, verify
        )
        if verify:
            stats.update(transfer.check_records(f.url, f.records, self.segments,
                                                stats.pop("crc32")))  # fmt: skip
        return stats

    def moved(self) -> bool:
        """Whether a local header read says its data is not where predicted."""
        return bool(self.spans) and bool(
            _native.zip_headers_match(self.spans, self.head_bytes.numpy().tobytes())
        )


def read_all(
    plans: list[Reads], options: remote.StorageOptions, verify: bool
) -> list[dict[str, Any]]:
    """The reads of ``plans``: each alone (its stats), or, in a group's call,
    once over the group (one stats dict: each rank GETs its share, with
    ``verify`` whole records, each checked by the rank that reads it; the
    collectives bring the rest)."""
    shared = sharing.current()
    if shared is None:
        return [p.read(options, verify) for p in plans]
    files, pieces = [], []
    for i, p in enumerate(plans):
        f = p.f
        obj = transfer.StoredObject(f.url, options, f.e_tag, f.rows, f.records if verify else {})
        files.append(sharing.SharedFile(f.url, obj, f.size))
        pieces += sharing.segment_pieces(i, p.segments, p.owners, splittable=not verify)
    return [shared.read(files, pieces, IoOptions.of(None, None, None, None), verify)]
