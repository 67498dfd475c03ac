"""verify / inspect: check a checkpoint's records against their CRC-32s.

ckptio fills the zip CRC-32 field of every record it writes (computed by the
I/O threads as the bytes pass through host memory), so ``zipfile`` and
``unzip -t`` check its files too. Records written by cuFile never touched host
memory: their CRC-32 stays 0 and the archive comment lists them as unchecked
(``ckptio:crc32 unchecked=3,5-9``; torch and zip tools ignore comments).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ckptio import _native
from ckptio.errors import FormatError, corrupt
from ckptio.formats import dcp, detect, torchzip
from ckptio.io import paths, remote
from ckptio.io.engines import IoOptions
from ckptio.tools import describe


@dataclasses.dataclass(frozen=True)
class RecordCheck:
    """One record's check: "ok", "mismatch" (its bytes changed) or "unchecked" (no CRC-32)."""

    name: str
    state: str
    stored_crc32: int | None
    actual_crc32: int | None


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The outcome of ``ckptio.verify``: ``ok`` unless a record is bad or the file is torn.

    verify judges a file, so a bad file is its finding, not an exception (as
    ``zipfile.ZipFile.testzip`` returns the bad member); ``raise_if_bad()`` turns
    the finding into the ``ckptio.FormatError`` that ``load(verify=True)`` raises.
    """

    path: str
    records: tuple[RecordCheck, ...]
    #: Why the file is not a usable archive (truncated, records outside the file or
    #: overlapping...), when it is not; the records were then not checked.
    error: str | None = None
    #: The checkpoint's format (``ckptio.formats.detect.FORMATS``).
    format: str = "torch.save"

    @property
    def ok(self) -> bool:
        return self.error is None and not self.bad

    @property
    def bad(self) -> tuple[RecordCheck, ...]:
        return tuple(r for r in self.records if r.state == "mismatch")

    @property
    def unchecked(self) -> tuple[RecordCheck, ...]:
        return tuple(r for r in self.records if r.state == "unchecked")

    def raise_if_bad(self) -> None:
        """Raise ``ckptio.FormatError`` (the error ``load(verify=True)`` raises) unless ok."""
        if not self.ok:
            raise corrupt(self.path, self._finding())

    def summary(self) -> str:
        """The finding on one line, the path first; names taken from the checkpoint
        (records, items) and the path written as ``describe.printable`` writes
        them: a terminal escape in an item's name shows as text."""
        return f"{describe.printable(self.path)}: {self._finding()}"

    def _finding(self) -> str:
        if self.error is not None:
            return f"BAD: {describe.printable(self.error.removeprefix(f'{self.path}: '))}"
        n, u = len(self.records), len(self.unchecked)
        if self.format in ("safetensors", "sharded safetensors"):
            return (
                f"ok: header and offsets of {n} tensors checked ({self.format}: "
                "the format stores no checksum, so their bytes are unchecked)"
            )
        if self.bad:
            names = ", ".join(describe.printable(r.name) for r in self.bad)
            return f"BAD: {len(self.bad)} of {n} records do not match: {names}"
        return f"ok: {n - u} records checked" + (f", {u} unchecked" if u else "")


def verify(
    f: str | os.PathLike[str],
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    progress: Callable[[int], None] | None = None,
    storage_options: remote.StorageOptions = None,
) -> VerifyReport:
    """Check a checkpoint of any format ckptio reads (found from its content, see
    ``ckptio.formats.detect``): every record of a torch.save zip against its CRC-32, and
    that the archive is one torch's reader takes (what ``load`` relies on).

    Detects flipped bits (a record's bytes no longer match), torn tails
    (truncation), records pointing outside the file or overlapping, zip
    features or versions torch refuses, a byteorder record that is neither
    "little" nor "big", storages the pickle declares that no record holds.
    Records without a CRC-32 (written by cuFile, or by torch.save without CRC)
    are reported "unchecked", not bad. A bad or torn file is the report's
    finding (``ok`` False; ``raise_if_bad()`` raises it); a missing or
    unreadable file raises OSError.

    A DCP checkpoint folder (one holding ``.metadata``) is checked whole: its
    metadata (allow-list, paths inside the folder), then every record of every
    tensor item of every data file, named ``<fqn> (<file>@<offset>) <record>``;
    non-tensor values, torch.save archives too, are checked the same way (other
    bytes items carry no CRC-32 and are "unchecked"); items of torch's ZStandard
    transform are decoded in memory (at most their tensor's bytes and 1 MiB, and
    ``ZSTD_DECODED_MAX``; a frame that decodes to more is "unchecked", a tensor
    item that decodes to no zip damaged) and checked as the others, items
    with other stream transforms are "unchecked", as are tensor items in the
    layout torch's ``SerializationFormat.SAFETENSORS`` writes (a safetensors blob:
    no CRC-32; ``formats.dcp.safetensors_item``).

    A safetensors file, or a sharded checkpoint (its index, or the folder), has
    no checksum to compare: its header is validated as ``load_file`` validates
    it (dtypes, shapes, offsets that tile the data section to the end of the
    file) and the index against its shards; every tensor is then "unchecked".

    ``progress(n)``, where given, is called as each ``n`` bytes are checked.

    ``f`` may be an object URL (of a file, or of a folder checkpoint; with
    ``storage_options``): a torch.save object is checked by ranged GETs, its
    records hashed as they arrive (memory bounded by ``concurrency`` x
    ``part_size``, nothing kept; torch's own zip reader is not asked); a
    safetensors object or sharded checkpoint by its headers and index; DCP
    folders on a scratch copy.
    """
    if remote.is_url(f):
        rep = _verify_stored(os.fsdecode(os.fspath(f)), storage_options, progress)
        if rep is not None:
            return rep
    if remote.is_url(f) or storage_options is not None:
        with remote.local_tree(f, storage_options) as local:
            rep = verify(local, threads=threads, chunk_size=chunk_size, direct=direct,
                         progress=progress)  # fmt: skip
        # Named by what was asked for, not by the scratch copy.
        url = os.fsdecode(os.fspath(f))
        error = None if rep.error is None else rep.error.replace(local, url.rstrip("/"))
        return dataclasses.replace(rep, path=url, error=error)
    path = paths.path(f, "verify")
    io = IoOptions.of(threads, chunk_size, direct, None)
    engine = io.engine()
    try:
        src = detect.detect(path)
        if src.format == detect.DCP:
            return _verify_dcp(src.root, engine, io.direct, progress)
        if src.format != detect.TORCH:
            lst = describe.listing(path, src)
            checks = tuple(RecordCheck(e.name, "unchecked", None, None) for e in lst.entries)
            if progress is not None:
                progress(sum(n for _, n in lst.files))
            return VerifyReport(path, checks, None, src.format)
    except FormatError as e:
        return VerifyReport(path, (), str(e))
    try:
        reader = _native.Reader(path, io.direct, None)
    except FormatError as e:
        if torchzip.read_by_torch(path) is None:
            return VerifyReport(path, (), str(e))
        # torch.load's to read (records a zip tool compressed, TorchScript):
        # their CRC-32s through Python's zipfile, which inflates them.
        try:
            inflated = tuple(RecordCheck(*row) for row in torchzip.crc_rows(path))
            if progress is not None:
                progress(os.path.getsize(path))
            rep = VerifyReport(path, inflated)
            if rep.ok:  # what load decodes, as for any archive
                torchzip.check_pickle(torchzip.inflated_archive(path))
        except FormatError as e2:
            return VerifyReport(path, (), str(e2))
        return rep
    try:
        torchzip.torch_reads(path, reader.fileno())
        if progress is None:
            rows = reader.verify(engine, None, False)
        else:
            rows = []
            for names, nbytes in _batches(reader.records()):
                rows += reader.verify(engine, names, False)
                progress(nbytes)
        report = VerifyReport(path, tuple(RecordCheck(*row) for row in rows))
        if report.ok:  # what load decodes, once its bytes are known good
            archive = torchzip.Archive(path, reader, reader.records())
            torchzip.native_byteorder(archive)
            torchzip.check_pickle(archive)
    except FormatError as e:  # e.g. the file shrank while being read
        return VerifyReport(path, (), str(e))
    return report


def _verify_stored(
    url: str, options: remote.StorageOptions, progress: Callable[[int], None] | None
) -> VerifyReport | None:
    """``verify`` of a checkpoint in a store that :func:`describe.stored_listing`
    reads (a torch.save object: every record hashed by ranged GETs; safetensors:
    headers and index); None for anything else: the scratch copy decides."""
    try:
        stored = None if url.endswith(".json") else torchzip.map_stored(url, options)
    except (FormatError, FileNotFoundError):
        stored = None
    if stored is None:  # safetensors: no checksums; its header(s) and index checked
        lst = describe.stored_listing(url, options)
        if lst is None or lst.format == detect.TORCH:
            return None
        if progress is not None:
            progress(sum(n for _, n in lst.files))
        unchecked = tuple(RecordCheck(e.name, "unchecked", None, None) for e in lst.entries)
        return VerifyReport(url, unchecked, None, lst.format)
    archive, declared = stored.archive, stored.declared
    checks: dict[str, RecordCheck] = {}

    def judge(name: str, actual: int | None) -> None:
        want = declared.get(name)
        if want is None or actual is None:
            checks[name] = RecordCheck(name, "unchecked", None, None)
        else:
            checks[name] = RecordCheck(name, "ok" if want == actual else "mismatch", want, actual)

    for name, data in stored.small.items():
        judge(name, zlib.crc32(data))
    rest = [r for r in archive.records if r[0] not in stored.small]
    for name, _, _ in rest:
        if declared.get(name) is None:
            judge(name, None)
    hashed = [r for r in rest if declared.get(r[0]) is not None]
    try:
        for names, nbytes in _batches(hashed):
            batch = [archive.where[n] for n in names]
            for name, crc in zip(
                names, remote.crc32_ranges(url, batch, options, stored.info["e_tag"]), strict=True
            ):
                judge(name, crc)
            if progress is not None:
                progress(nbytes)
        report = VerifyReport(url, tuple(checks[n] for n, _, _ in archive.records))
        if report.ok:  # what load decodes, once its bytes are known good
            torchzip.native_byteorder(archive)
            torchzip.check_pickle(archive)
    except FormatError as e:
        return VerifyReport(url, (), str(e))
    return report


def _batches(
    records: list[tuple[str, int, int]], nbytes: int = 256 << 20
) -> Iterator[tuple[list[str], int]]:
    """Records in archive order, in batches of about ``nbytes`` (each batch is read in
    parallel; a batch per progress step)."""
    names: list[str] = []
    size = 0
    for name, _, n in records:
        names.append(name)
        size += n
        if size >= nbytes:
            yield names, size
            names, size = [], 0
    if names:
        yield names, size


def _verify_dcp(
    folder: str,
    engine: _native.Engine,
    direct: str | None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    md_path = os.path.join(folder, dcp.METADATA)
    out: list[RecordCheck] = []
    try:
        md = dcp.read_metadata(md_path)
        for index, info in sorted(
            md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
        ):
            name = f"{index.fqn} ({info.relative_path}@{info.offset})"
            bytes_item = isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
            p = paths.inside(folder, info.relative_path, md_path)
            if dcp.zstd_framed(info):  # decoded in memory, then checked as any item
                limit = min(_decoded_limit(md, index), ZSTD_DECODED_MAX)
                try:
                    got, rows, head = _native.verify_zstd_item(p, info.offset, info.length, limit)
                except OSError as e:
                    return VerifyReport(folder, tuple(out), f"{name}: {e}", "DCP")
                # torch's SAFETENSORS layout inside: no CRC-32 to check
                blob = dcp.safetensors_head(bytes(head or ()))
                if got == "other" and not bytes_item and not blob:
                    raise corrupt(
                        f"{p}@{info.offset}", f"item {index.fqn!r} holds no torch.save zip"
                    )
                for rec, state, stored, actual in rows or [("", "unchecked", None, None)]:
                    out.append(RecordCheck(f"{name} {rec}".rstrip(), state, stored, actual))
                if progress is not None:
                    progress(info.length)
                continue
            # A non-tensor value is a torch.save archive (its CRC-32s checked as a
            # tensor's); other bytes (a BytesIO saved as it is), other transforms: none.
            if (bytes_item and not _is_zip(p, info.offset, info.length)) or dcp.transformed(info):
                out.append(RecordCheck(name, "unchecked", None, None))
                if progress is not None:
                    progress(info.length)
                continue
            try:
                item = _native.Reader(p, direct, None, info.offset, info.length)
            except OSError as e:
                return VerifyReport(folder, tuple(out), f"{name}: {e}", "DCP")
            except FormatError:
                # No zip there: torch's safetensors layout (no CRC-32, read by no
                # DCP reader) is unchecked, as other items without one; else damage.
                if bytes_item or not dcp.safetensors_item(p, info):
                    raise
                out.append(RecordCheck(name, "unchecked", None, None))
                if progress is not None:
                    progress(info.length)
                continue
            for rec, state, stored, actual in item.verify(engine, None, False):
                out.append(RecordCheck(f"{name} {rec}", state, stored, actual))
            if progress is not None:
                progress(info.length)
    except FormatError as e:
        return VerifyReport(folder, tuple(out), str(e), "DCP")
    return VerifyReport(folder, tuple(out), None, "DCP")


#: The most bytes one compressed DCP item is decoded to in memory by verify; a
#: larger item is "unchecked" (its decoded bytes are held whole to be checked).
ZSTD_DECODED_MAX = 1 << 30


def _decoded_limit(md: Any, index: Any) -> int:
    """The most bytes a compressed item may decode to: its tensor chunk's bytes and
    1 MiB of zip around them; 256 MiB for a non-tensor value (larger ones go
    unchecked: a hostile frame may decode to any size)."""
    entry = md.state_dict_metadata.get(index.fqn)
    if isinstance(entry, TensorStorageMetadata):
        want = tuple(index.offset or ())
        for c in entry.chunks:
            if tuple(c.offsets) == want:
                return math.prod(c.sizes) * entry.properties.dtype.itemsize + (1 << 20)
    return 256 << 20


def _is_zip(path: str, offset: int, length: int) -> bool:
    """Whether the item ``[offset, offset + length)`` of ``path`` is a zip archive
    (torch's planners save every non-tensor value with torch.save): it starts
    or ends as one does (a damaged one still does at one end)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            head = fh.read(4)
            fh.seek(offset + max(0, length - 22))
            tail = fh.read(4)
    except OSError:
        return False  # (the item's own check reports a file that cannot be read)
    return head == b"PK\x03\x04" or tail == b"PK\x05\x06"


def inspect_lines(f: str | os.PathLike[str]) -> list[str]:
    """``ckptio inspect``: entries, offsets, alignment, sizes, CRC-32 state, dtypes,
    shapes, for a checkpoint of any format (``ckptio.tools.describe``)."""
    return describe.lines(describe.listing(paths.path(f, "inspect")), crc=True)
