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

from ckptio import _native
from ckptio.serialization import _direct_arg, _engine, _path, records


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
            raise _native.FormatError(self.summary())

    def summary(self) -> str:
        if self.error is not None:
            return f"{self.path}: BAD: {self.error}"
        n, u = len(self.records), len(self.unchecked)
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
    """Check every record of a checkpoint (any torch.save zip) against its CRC-32.

    Detects flipped bits (a record's bytes no longer match), torn tails
    (truncation), records pointing outside the file or overlapping. Records
    without a CRC-32 (written by cuFile, or by torch.save without CRC) are
    reported "unchecked", not bad. A bad or torn file is the report's finding
    (``ok`` False; ``raise_if_bad()`` raises it); a missing or unreadable file
    raises OSError.
    """
    path = _path(f, "verify")
    d = _direct_arg(direct)
    engine = _engine(threads, chunk_size, d)
    try:
        reader = _native.Reader(path, d, None)
    except _native.FormatError as e:
        return VerifyReport(path, (), str(e))
    try:
        rows = reader.verify(engine, None, False)
    except _native.FormatError as e:  # e.g. the file shrank while being read
        return VerifyReport(path, (), str(e))
    return VerifyReport(path, tuple(RecordCheck(*row) for row in rows))


def inspect_lines(f: str | os.PathLike[str]) -> list[str]:
    """``ckptio inspect``: records, offsets, alignment, sizes, CRC-32 state, dtypes, shapes."""
    out = [f"{'offset':>12} {'bytes':>12} {'align':>5} {'crc32':>10}  record / tensors"]
    recs = records(f)
    for r in recs:
        crc = "unchecked" if r.crc32 is None else f"{r.crc32:08x}"
        out.append(f"{r.offset:>12} {r.nbytes:>12} {r.alignment:>5} {crc:>10}  {r.name}")
        for t in r.tensors:
            shape = "x".join(map(str, t.shape)) or "scalar"
            out.append(
                f"{'':>44}  - {t.name}: {str(t.dtype).removeprefix('torch.')} [{shape}]"
                + (f" at element {t.storage_offset}" if t.storage_offset else "")
            )
    unchecked = sum(r.crc32 is None for r in recs)
    out.append(
        f"{len(recs)} records, {sum(r.nbytes for r in recs)} bytes; "
        f"CRC-32 stored for {len(recs) - unchecked}, unchecked {unchecked}"
    )
    return out
