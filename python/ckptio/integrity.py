"""verify / inspect: check a checkpoint's records against their CRC-32s.

ckptio fills the zip CRC-32 field of every record it writes (computed by the
I/O threads as the bytes pass through host memory), so ``zipfile`` and
``unzip -t`` check its files too. Records written by cuFile never touched host
memory: their CRC-32 stays 0 and the archive comment lists them as unchecked
(``ckptio:crc32 unchecked=3,5-9``; torch and zip tools ignore comments).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

from ckptio import _native
from ckptio._paths import inside
from ckptio.errors import corrupt
from ckptio.serialization import (
    _direct_arg,
    _engine,
    _native_byteorder,
    _path,
    _torch_reads,
)


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
    #: The checkpoint's format (``ckptio.describe.FORMATS``).
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
            raise corrupt(self.path, self.summary().removeprefix(f"{self.path}: "))

    def summary(self) -> str:
        if self.error is not None:
            return f"{self.path}: BAD: {self.error.removeprefix(f'{self.path}: ')}"
        n, u = len(self.records), len(self.unchecked)
        if self.format in ("safetensors", "sharded safetensors"):
            return (
                f"{self.path}: ok: header and offsets of {n} tensors checked ({self.format}: "
                "the format stores no checksum, so their bytes are unchecked)"
            )
        if self.bad:
            names = ", ".join(r.name for r in self.bad)
            return f"{self.path}: BAD: {len(self.bad)} of {n} records do not match: {names}"
        return f"{self.path}: ok: {n - u} records checked" + (f", {u} unchecked" if u else "")


def verify(
    f: str | os.PathLike[str],
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
) -> VerifyReport:
    """Check a checkpoint of any format ckptio reads (found from its content, see
    ``ckptio.describe``): every record of a torch.save zip against its CRC-32, and
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
    byte items carry no CRC-32 and are "unchecked", and so are items with stream
    transforms (compressed; their decoder checks their frames).

    A safetensors file, or a sharded checkpoint (its index, or the folder), has
    no checksum to compare: its header is validated as ``load_file`` validates
    it (dtypes, shapes, offsets that tile the data section to the end of the
    file) and the index against its shards; every tensor is then "unchecked".
    """
    return _verify(f, threads, chunk_size, direct)


def _verify(
    f: str | os.PathLike[str],
    threads: int | None,
    chunk_size: int | None,
    direct: bool | str | None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """``verify``; ``progress(n)`` is called as each ``n`` bytes are checked."""
    from ckptio import describe

    path = _path(f, "verify")
    d = _direct_arg(direct)
    engine = _engine(threads, chunk_size, d)
    try:
        src = describe.detect(path)
        if src.format == describe.DCP:
            return _verify_dcp(src.root, engine, d, progress)
        if src.format != describe.TORCH:
            lst = describe.listing(path, src)
            checks = tuple(RecordCheck(e.name, "unchecked", None, None) for e in lst.entries)
            if progress is not None:
                progress(sum(n for _, n in lst.files))
            return VerifyReport(path, checks, None, src.format)
    except _native.FormatError as e:
        return VerifyReport(path, (), str(e))
    try:
        reader = _native.Reader(path, d, None)
        _torch_reads(path, reader.fileno())
        if progress is None:
            rows = reader.verify(engine, None, False)
        else:
            rows = []
            for names, nbytes in _batches(reader.records()):
                rows += reader.verify(engine, names, False)
                progress(nbytes)
        report = VerifyReport(path, tuple(RecordCheck(*row) for row in rows))
        if report.ok:  # what load decodes, once its bytes are known good
            _native_byteorder(reader, path)
            _check_declared_storages(reader, path)
    except _native.FormatError as e:  # e.g. the file shrank while being read
        return VerifyReport(path, (), str(e))
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


def _check_declared_storages(reader: _native.Reader, path: str) -> None:
    """Every storage the pickle declares has a data record of exactly its size (load
    refuses the file otherwise). The pickle is read without running any of it."""
    prefix = reader.prefix
    sizes = {name: size for name, _, size in reader.records()}
    pkl = f"{prefix}/data.pkl"
    if pkl not in sizes or sizes[pkl] > 64 << 20:
        return  # no pickle to read here (a plain zip), or one too large to read whole
    try:
        declared = _declared_storages(reader.read_record(pkl))
    except Exception as e:  # any failure of a pickle that runs nothing: it is malformed
        raise corrupt(f"{path}, record {pkl}", f"not a readable pickle: {e}") from e
    for key, nbytes in declared:
        have = sizes.get(f"{prefix}/data/{key}")
        if have is None:
            raise corrupt(
                path,
                f"the pickle declares storage {key!r}, but there is no record "
                f"{prefix}/data/{key}",
            )
        if nbytes is not None and have != nbytes:
            raise corrupt(
                f"{path}, record {prefix}/data/{key}",
                f"it holds {have} bytes, the pickle declares a storage of {nbytes}",
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


def _declared_storages(pkl: bytes) -> list[tuple[str, int | None]]:
    """(key, nbytes) of each storage a torch.save pickle declares (nbytes None where the
    storage type is not one torch names), found by unpickling with every global inert."""
    import io
    import pickle

    import torch

    found: list[tuple[str, int | None]] = []

    class Scan(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> type:
            return type(name, (_Inert,), {"module": module, "name": name})

        def persistent_load(self, pid: object) -> object:
            if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
                _, kind, key, _, numel = pid
                dtype = None
                if getattr(kind, "module", "") == "torch":
                    dtype = torch.storage._storage_type_to_dtype_map().get(kind.name)
                if isinstance(numel, int) and dtype is not None:
                    itemsize = dtype.itemsize
                    found.append((str(key), numel * itemsize))
                else:
                    found.append((str(key), None))
            return _Inert()

    Scan(io.BytesIO(pkl)).load()
    return found


def _verify_dcp(
    folder: str,
    engine: _native.Engine,
    direct: str | None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ckptio.dcp import _METADATA, read_metadata

    md_path = os.path.join(folder, _METADATA)
    out: list[RecordCheck] = []
    try:
        md = read_metadata(md_path)
        for index, info in sorted(
            md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
        ):
            name = f"{index.fqn} ({info.relative_path}@{info.offset})"
            if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata) or getattr(
                info, "transform_descriptors", None
            ):
                out.append(RecordCheck(name, "unchecked", None, None))
                if progress is not None:
                    progress(info.length)
                continue
            p = inside(folder, info.relative_path, md_path)
            try:
                item = _native.Reader(p, direct, None, info.offset, info.length)
            except OSError as e:
                return VerifyReport(folder, tuple(out), f"{name}: {e}", "DCP")
            for rec, state, stored, actual in item.verify(engine, None, False):
                out.append(RecordCheck(f"{name} {rec}", state, stored, actual))
            if progress is not None:
                progress(info.length)
    except _native.FormatError as e:
        return VerifyReport(folder, tuple(out), str(e), "DCP")
    return VerifyReport(folder, tuple(out), None, "DCP")


def inspect_lines(f: str | os.PathLike[str]) -> list[str]:
    """``ckptio inspect``: entries, offsets, alignment, sizes, CRC-32 state, dtypes,
    shapes, for a checkpoint of any format (``ckptio.describe``)."""
    from ckptio import describe

    return describe.lines(describe.listing(_path(f, "inspect")), crc=True)
