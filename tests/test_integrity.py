"""Integrity: real CRC-32s in every file ckptio writes, ``verify``, ``load(verify=True)``, inspect.

Standard zip tools check ckptio files; a flipped bit, a torn tail, a record pointing outside
the file and overlapping records are each reported, naming the record; records without a
CRC-32 are "unchecked", never "bad".
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import ckptio
import pytest
import torch
from ckptio.tools.cli import main as cli
from test_faults import assert_same, central_entries, end_records, sample_state, temps


def records_of(path: Path) -> dict[str, tuple[int, int, int]]:
    """name -> (data offset, size, stored CRC-32 from the central directory)."""
    with zipfile.ZipFile(path) as z:
        crc = {i.filename: i.CRC for i in z.infolist()}
    return {r.name: (r.offset, r.nbytes, crc[r.name]) for r in ckptio.records(path)}


def flip(path: Path, at: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))


def big_state() -> dict[str, torch.Tensor]:
    """Storages that span many chunks at chunk_size=4096, odd sizes, an empty one, a view."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300_001, generator=g)
    return {
        "w": w,
        "view": w[5:100],
        "odd": torch.randint(0, 255, (12_345,), dtype=torch.uint8, generator=g),
        "bf16": torch.randn(777, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "i64": torch.arange(70_000),
    }


# --------------------------------------------------------------------------- CRC-32 fields


@pytest.mark.parametrize(
    "kw",
    [{}, {"chunk_size": 4096, "threads": 3}, {"direct": "off", "chunk_size": 8192}],
    ids=["default", "4k-chunks", "buffered"],
)
def test_zip_tools_check_every_record(tmp_path, kw):
    """Every record's CRC-32 (central directory and data descriptor) is the zlib CRC-32 of its
    bytes, however the engine cut the storages into chunks; zipfile.testzip, python -m zipfile
    -t and ckptio.verify pass; the comment marks the file."""
    p = tmp_path / "c.pt"
    obj = big_state()
    ckptio.save(obj, p, **kw)
    data = p.read_bytes()
    for name, (off, size, crc) in records_of(p).items():
        assert crc == zlib.crc32(data[off : off + size]), name
        if size:  # the data descriptor after the bytes carries the same value
            sig, dcrc = struct.unpack_from("<II", data, off + size)
            assert (sig, dcrc) == (0x08074B50, crc), name
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
        assert z.comment == b"ckptio:crc32"
    r = subprocess.run([sys.executable, "-m", "zipfile", "-t", str(p)], capture_output=True)
    assert r.returncode == 0, r.stderr
    rep = ckptio.verify(p)
    assert rep.ok and not rep.unchecked and len(rep.records) == len(records_of(p)), rep
    assert_same(torch.load(p, weights_only=True), obj)
    assert_same(ckptio.load(p, verify=True), obj)
    assert ckptio.last_report().verified and ckptio.last_report().unchecked == ()


def test_plain_torch_files_verify_and_crc_off_is_unchecked(tmp_path):
    """torch.save files verify (their CRC-32s are real); with compute_crc32 off they are
    reported unchecked, not bad, and load(verify=True) lists them."""
    from torch.utils.serialization import config

    p = tmp_path / "t.pt"
    obj = sample_state(2)
    torch.save(obj, p)
    assert ckptio.verify(p).ok and not ckptio.verify(p).unchecked
    old = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        torch.save(obj, p)
    finally:
        config.save.compute_crc32 = old
    rep = ckptio.verify(p)
    assert rep.ok and rep.unchecked, rep
    assert_same(ckptio.load(p, verify=True), obj)
    assert set(ckptio.last_report().unchecked) == {r.name for r in rep.unchecked}


def test_records_listed_in_the_comment_are_unchecked(tmp_path):
    """What a cuFile save leaves (CRC-32 0, record named in the comment) verifies as unchecked;
    a 0 not named there is a real value and a mismatch."""
    p = tmp_path / "c.pt"
    obj = {"a": torch.ones(1000), "b": torch.arange(100)}
    ckptio.save(obj, p)
    data = bytearray(p.read_bytes())
    entries = central_entries(bytes(data))
    name_b = next(n for n in entries if n.endswith("/data/1"))
    struct.pack_into("<I", data, entries[name_b] + 16, 0)
    p.write_bytes(data)
    rep = ckptio.verify(p)
    assert not rep.ok and [r.name for r in rep.bad] == [name_b], rep
    comment = b"ckptio:crc32 unchecked=1"
    e = end_records(bytes(data))["eocd"]
    struct.pack_into("<H", data, e + 20, len(comment))
    p.write_bytes(bytes(data[: e + 22]) + comment)
    rep = ckptio.verify(p)
    assert rep.ok and [r.name for r in rep.unchecked] == [name_b], rep
    assert_same(ckptio.load(p, verify=True), obj)
    assert ckptio.last_report().unchecked == (name_b,)
    assert_same(torch.load(p, weights_only=True), obj)
    assert [r.crc32 is None for r in ckptio.records(p)].count(True) == 1


# --------------------------------------------------------------------------- damage


@pytest.fixture
def saved(tmp_path):
    p = tmp_path / "c.pt"
    obj = big_state()
    ckptio.save(obj, p, chunk_size=4096)
    return p, obj


def test_flipped_bit_in_any_record_is_named(saved, capsys):
    """A bit flipped inside any record (pickle, small records, data at its start, middle and
    end) is caught by verify, the CLI (exit 1) and load(verify=True), each naming the record;
    load without verify gives torch's view of the bytes."""
    p, obj = saved
    good = p.read_bytes()
    recs = records_of(p)
    for name, (off, size, _) in recs.items():
        for at in sorted({off, off + size // 2, off + size - 1}) if size else []:
            p.write_bytes(good)
            flip(p, at, bit=at % 8)
            rep = ckptio.verify(p)
            assert not rep.ok and [r.name for r in rep.bad] == [name], (name, at, rep)
            assert cli(["verify", "-q", str(p)]) == 1
            assert name in capsys.readouterr().err
            with pytest.raises(ckptio.FormatError, match=rf"{name}.*corrupt"):
                ckptio.load(p, verify=True)
            with pytest.raises(ckptio.FormatError, match=name):
                ckptio.load(p, verify=True, mmap=True)
    p.write_bytes(good)
    assert cli(["verify", str(p)]) == 0
    assert_same(ckptio.load(p, verify=True), obj)


def test_flipped_bit_caught_when_torch_fills_the_storage(saved):
    """Storages ckptio does not read itself (map_location to meta / a callable) are still
    checked by load(verify=True)."""
    p, _ = saved
    off, size, _ = next(v for k, v in records_of(p).items() if k.endswith("/data/0"))
    flip(p, off + size // 3)
    for ml in ("meta", lambda s, loc: s):
        with pytest.raises(ckptio.FormatError, match="data/0"):
            ckptio.load(p, map_location=ml, verify=True)


def test_torn_tail_is_reported(saved, capsys):
    """A file cut anywhere (inside data, the central directory, the end records) is not ok, the
    CLI says BAD and exits 1, load(verify=True) raises FormatError."""
    p, _ = saved
    good = p.read_bytes()
    e = end_records(good)
    for n in (100, 4096 * 3 + 7, len(good) // 2, e["cd"] + 10, e["eocd"] + 5, len(good) - 1):
        p.write_bytes(good[:n])
        rep = ckptio.verify(p)
        assert not rep.ok and rep.error, (n, rep)
        assert cli(["verify", str(p)]) == 1
        assert "BAD" in capsys.readouterr().err
        with pytest.raises(ckptio.FormatError):
            ckptio.load(p, verify=True)
    assert temps(p.parent) == []


def test_record_outside_the_file_and_overlapping_records_are_named(saved):
    """A central directory entry whose size or offset points past the end of the file, or onto
    another record, is reported naming the record(s)."""
    p, _ = saved
    good = p.read_bytes()
    entries = central_entries(good)
    name = next(n for n in entries if n.endswith("/data/0"))
    size = struct.unpack_from("<I", good, entries[name] + 24)[0]
    cases = {
        "size": (entries[name] + 20, struct.pack("<II", 2**31, 2**31), name),
        "offset": (entries[name] + 42, struct.pack("<I", len(good) + 4096), name),
        "overlap": (entries[name] + 20, struct.pack("<II", size + 8192, size + 8192), "overlap"),
    }
    for label, (at, patch, who) in cases.items():
        b = bytearray(good)
        b[at : at + len(patch)] = patch
        p.write_bytes(b)
        rep = ckptio.verify(p)
        assert not rep.ok and rep.error and who in rep.error and name in rep.error, (label, rep)
        with pytest.raises(ckptio.FormatError, match=who):
            ckptio.load(p, verify=True)


def test_verify_of_a_missing_file_is_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        ckptio.verify(tmp_path / "nope.pt")
    with pytest.raises(TypeError, match="path"):
        ckptio.verify(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="verify"):
        ckptio.load(tmp_path / "nope.pt", verify="yes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- inspect


def test_inspect_lists_offsets_alignment_crc_dtypes_shapes(saved, capsys):
    p, _ = saved
    assert cli(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    for name, (off, size, crc) in records_of(p).items():
        line = next(x for x in out.splitlines() if x.endswith(name))
        align = str(min(4096, off & -off))
        assert line.split()[:4] == [str(off), str(size), align, f"{crc:08x}"], line
    assert "w: float32 [300001]" in out and "bf16: bfloat16 [777]" in out
    assert "unchecked 0" in out


# --------------------------------------------------------------------------- GPU paths


def gpu_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {
        "big": torch.randn(3 * 2**20 + 5, generator=g).cuda(),  # several chunks
        "bf16": torch.randn(1000, generator=g).to(torch.bfloat16).cuda(),
        "host": torch.arange(5000),
    }


@pytest.mark.gpu
def test_bounce_path_fills_and_checks_crcs(tmp_path):
    """CUDA storages saved through the pinned bounce pipeline get real CRC-32s (computed on the
    pinned slot); load(verify=True) into CUDA checks them on the slot and catches a flipped bit."""
    p = tmp_path / "g.pt"
    obj = gpu_state()
    ckptio.save(obj, p, backend="bounce", chunk_size=2**20)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None and z.comment == b"ckptio:crc32"
    assert ckptio.verify(p).ok and not ckptio.verify(p).unchecked
    got = ckptio.load(p, map_location="cuda", verify=True, backend="posix", chunk_size=2**20)
    rep = ckptio.last_report()
    assert (rep.backend, rep.device_path, rep.unchecked) == ("bounce", "bounce", ())
    assert_same(got, {k: v.cuda() for k, v in obj.items()})
    off, size, _ = next(v for k, v in records_of(p).items() if k.endswith("/data/0"))
    flip(p, off + size - 3)
    with pytest.raises(ckptio.FormatError, match="data/0.*corrupt"):
        ckptio.load(p, map_location="cuda", verify=True, backend="posix")


@pytest.mark.gpu
def test_cufile_records_are_marked_unchecked_not_wrong(tmp_path):
    """Records cuFile wrote straight from device memory keep CRC-32 0 and are named in the
    archive comment; verify calls them unchecked (not bad); host records are checked, and so
    are small device records (under 1 MiB: gathered through a pinned slot with their
    neighbours, where the CRC-32 is computed)."""
    p = tmp_path / "g.pt"
    obj = gpu_state()
    try:
        assert ckptio.save(obj, p, backend="cufile") is None
        rep = ckptio.last_report()
    except (ckptio.BackendUnavailableError, ckptio.CuFileError) as e:
        pytest.skip(f"cuFile unavailable: {e}")
    assert rep.device_path == "cufile"
    with zipfile.ZipFile(p) as z:
        assert z.comment.startswith(b"ckptio:crc32 unchecked=")
    v = ckptio.verify(p)
    assert v.ok and {r.name.rsplit("/", 1)[1] for r in v.unchecked} == {"0"}, v
    got = ckptio.load(p, map_location="cuda", verify=True, backend="cufile")
    # Every record loaded to the GPU by cuFile skips the host, so the load cannot
    # check it: the ones cuFile wrote, and the host-saved one mapped to cuda here.
    rep = ckptio.last_report()
    assert (rep.backend, rep.device_path) == ("cufile", "cufile")
    assert {r.name for r in v.unchecked} <= set(rep.unchecked) <= set(records_of(p))
    assert_same(got, {k: v.cuda() for k, v in obj.items()})
    assert_same(torch.load(p, weights_only=True, map_location="cuda"), got)


def test_storages_written_in_two_calls_get_all_their_crcs(tmp_path):
    """A writer may fill the storages in several calls: records not written yet are listed as
    unchecked in between, and all are checked once every storage is written."""
    from ckptio import _native

    p = tmp_path / "two.pt"
    a, b = torch.arange(1000), torch.ones(3000)
    w = _native.AtomicWriter(str(p))
    with (
        torch.serialization.skip_data(),
        os.fdopen(os.dup(w.fileno()), "wb") as fh,
    ):
        torch.save({"a": a, "b": b}, fh)
    engine = _native.Engine()
    w.write_storages(engine, [("0", a.data_ptr(), a.nbytes, -1)], [a], [])
    with zipfile.ZipFile(w.tmp_path) as z:
        assert z.comment == b"ckptio:crc32 unchecked=1"
    w.write_storages(engine, [("1", b.data_ptr(), b.nbytes, -1)], [b], [])
    w.commit()
    with zipfile.ZipFile(p) as z:
        assert z.comment == b"ckptio:crc32" and z.testzip() is None
    assert ckptio.verify(p).ok and not ckptio.verify(p).unchecked


def test_cli_on_a_missing_or_broken_file_says_so(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a zip" * 10)
    for cmd in ("inspect", "verify", "ls"):
        assert cli([cmd, str(tmp_path / "nope.pt")]) == 1
        assert "nope.pt" in capsys.readouterr().err
        assert cli([cmd, str(bad)]) == 1
        assert "bad.pt" in capsys.readouterr().err


def test_a_save_into_a_file_object_carries_every_crc32(tmp_path):
    """The bytes of a save into a regular file object pass through the process: every
    record gets its CRC-32, and verify and load(verify=True) protect the file as a path's."""
    import zipfile

    sd = {"w": torch.randn(300, 200), "b": torch.arange(7)}
    p = tmp_path / "obj.pt"
    with open(p, "wb") as f:
        ckptio.save(sd, f)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None
    rep = ckptio.verify(p)
    assert rep.ok and not rep.unchecked, rep.summary()
    with open(p, "rb") as f:
        got = ckptio.load(f, verify=True)
    assert torch.equal(got["w"], sd["w"]) and not ckptio.last_report().unchecked
    raw = bytearray(p.read_bytes())
    off = next(r.offset for r in ckptio.records(p) if r.name.endswith("/data/0"))
    raw[off + 100] ^= 0x01
    p.write_bytes(bytes(raw))
    bad = ckptio.verify(p).bad
    assert len(bad) == 1 and bad[0].name.endswith("/data/0"), bad
    with open(p, "rb") as f, pytest.raises(ckptio.FormatError, match="data/0"):
        ckptio.load(f, verify=True)


def test_a_load_reads_every_storage_in_one_engine_call(tmp_path, monkeypatch):
    """ckptio.load hands every storage but the empty ones to the engine in one
    call (in batches, one call each, loads of 4 GiB in 1,995 storages ran 6-20%
    slower on an H100: docs/benchmarks.md), checked with verify=True, a flipped
    byte named."""
    from ckptio.io import transfer

    sd = {f"t{i}": torch.randn(i + 100 * (i % 3)) for i in range(60)}
    sd["t0"] = torch.zeros(0, 4)  # no bytes: nothing to read
    sd["tied"] = sd["t5"]
    p = tmp_path / "m.pt"
    ckptio.save(sd, p)
    calls: list[int] = []
    real = transfer.read_after
    monkeypatch.setattr(
        transfer, "read_after", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k)
    )
    got = ckptio.load(p, verify=True)
    rep = ckptio.last_report()
    assert calls == [59], calls
    assert rep.verified and rep.unchecked == ()
    assert_same(sd, got)
    assert got["tied"].data_ptr() == got["t5"].data_ptr()
    rec = next(r for r in ckptio.records(p) if any(t.name == "t57" for t in r.tensors))
    data = bytearray(p.read_bytes())
    data[rec.offset + 3] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(ckptio.FormatError, match=rec.name):
        ckptio.load(p, verify=True)


# ------------------------------------------------------------------- review of 2026-12-06, later


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["payload", "magic"])
def test_verify_checks_a_dcp_folders_non_tensor_values(tmp_path, where):
    """A DCP folder's non-tensor values are torch.save archives (CRC-32s) that
    verify called "unchecked": a flipped byte in one passed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = tmp_path / "c"
    name = "run-A" * 20
    dcp.save({"w": torch.randn(8), "cfg": {"lr": 0.125, "name": name}}, checkpoint_id=folder)
    ok = ckptio.verify(folder)
    assert ok.ok and not [c for c in ok.records if c.state == "unchecked"], ok
    with open(folder / ".metadata", "rb") as fh:
        md = pickle.load(fh)
    (idx, info) = next(
        (k, v)
        for k, v in md.storage_data.items()
        if isinstance(md.state_dict_metadata[k.fqn], BytesStorageMetadata) and k.fqn == "cfg.name"
    )
    data = bytearray((folder / info.relative_path).read_bytes())
    item = data[info.offset : info.offset + info.length]
    at = info.offset + (item.find(b"run-A") + 2 if where == "payload" else 2)
    data[at] ^= 1
    (folder / info.relative_path).write_bytes(bytes(data))
    bad = ckptio.verify(folder)
    assert not bad.ok, bad


def _zstd_folder(folder: Path, sd: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    dcp.save(sd, storage_writer=FileSystemWriter(folder, _extensions=[ZStandard()]), no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_verify_checks_the_records_inside_compressed_dcp_items(tmp_path):
    """Items of torch's ZStandard transform are zstd frames of torch.save zips
    (a BytesIO value too: the planner torch.saves it): verify decodes each in
    memory and checks its records (they were "unchecked"); a damaged frame is a
    finding."""
    import io

    folder = tmp_path / "z"
    sd = {"w": torch.randn(64, 32), "b": torch.arange(10), "raw": io.BytesIO(b"x" * 100)}
    _zstd_folder(folder, sd)
    rep = ckptio.verify(folder)
    assert rep.ok, rep
    states = {(r.name.split(" ")[0], r.state) for r in rep.records}
    assert states == {("w", "ok"), ("b", "ok"), ("raw", "ok")}, rep
    assert any(r.name.endswith("archive/data/0") for r in rep.records if r.name.startswith("w "))
    (data_file,) = folder.glob("*.distcp")
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 4] ^= 0x40  # inside the first (largest) item's frame
    data_file.write_bytes(bytes(raw))
    bad = ckptio.verify(folder)
    assert not bad.ok, bad


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_compressed_item_decoding_past_its_tensor_is_not_decoded_further(tmp_path):
    """A zstd frame may decode to any size: no more than the item's tensor (and 1
    MiB of zip) is decoded, the rest is not judged."""
    from ckptio.dcp import read_metadata

    folder = tmp_path / "z"
    _zstd_folder(folder, {"w": torch.zeros(1 << 20)})  # 4 MiB, a frame of a few KiB
    md = read_metadata(folder / ".metadata")
    entry = md.state_dict_metadata["w"]
    entry.size = torch.Size([1])  # the metadata says 4 bytes
    entry.chunks[0].sizes = torch.Size([1])
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    rep = ckptio.verify(folder)
    assert rep.ok and [r.state for r in rep.records] == ["unchecked"], rep


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_compressed_item_past_the_end_of_its_file_is_a_finding(tmp_path):
    """A .metadata giving a zstd item more bytes than its file holds: a finding
    naming the item, nothing allocated for the bytes it claims."""
    from ckptio.dcp import read_metadata

    folder = tmp_path / "z"
    _zstd_folder(folder, {"w": torch.randn(100)})
    md = read_metadata(folder / ".metadata")
    (info,) = md.storage_data.values()
    info.length = 1 << 40
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    rep = ckptio.verify(folder)
    assert not rep.ok and "past the end of the file" in rep.error, rep


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("value", ["tensor", "bytes"])
def test_a_compressed_item_holding_no_zip_is_a_finding_for_a_tensor(tmp_path, value):
    """Frames without a checksum (torch's writer) can decode cleanly after a bit
    flips: a tensor item that decodes to no zip is damaged, a non-tensor value
    that does (raw bytes) is not judged."""
    import io

    zstandard = pytest.importorskip("zstandard")
    from ckptio.dcp import read_metadata

    folder = tmp_path / "z"
    _zstd_folder(folder, {"w": torch.randn(100)} if value == "tensor" else {"w": io.BytesIO(b"x")})
    md = read_metadata(folder / ".metadata")
    (info,) = md.storage_data.values()
    frame = zstandard.ZstdCompressor().compress(b"no zip here" * 50)
    (folder / info.relative_path).write_bytes(frame)
    info.offset, info.length = 0, len(frame)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    rep = ckptio.verify(folder)
    if value == "tensor":
        assert not rep.ok and "holds no torch.save zip" in rep.error, rep
    else:
        assert rep.ok and [r.state for r in rep.records] == ["unchecked"], rep


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_missing_data_file_of_compressed_items_is_a_finding(tmp_path):
    folder = tmp_path / "z"
    _zstd_folder(folder, {"w": torch.randn(100)})
    (data_file,) = folder.glob("*.distcp")
    data_file.unlink()
    rep = ckptio.verify(folder)
    assert not rep.ok and "No such file" in rep.error and rep.error.startswith("w ("), rep


# ------------------------------------------------------------------- archives held in memory


def test_check_archive_judges_an_archive_held_in_memory(tmp_path):
    """_native.check_archive, what the DCP reader runs on a non-tensor value fetched
    from a store: a flipped byte is a FormatError naming where and the record; a record
    the comment lists as unchecked is not judged; bytes that are no zip of stored
    records are a FormatError naming where."""
    import io
    import re

    from ckptio import _native

    where = "s3://bucket/c/__0_0.distcp, item 'cfg'"
    p = tmp_path / "c.pt"
    ckptio.save({"a": torch.ones(1000), "b": torch.arange(100)}, p)
    data = bytearray(p.read_bytes())
    assert _native.check_archive(bytes(data), where) is None
    [(name_b, (off, n, _))] = [(k, v) for k, v in records_of(p).items() if k.endswith("/data/1")]
    data[off + n // 2] ^= 1
    with pytest.raises(ckptio.FormatError, match=re.escape(f"{where}: ")) as ei:
        _native.check_archive(bytes(data), where)
    assert name_b in str(ei.value) and "CRC-32" in str(ei.value), str(ei.value)

    def commented(comment: bytes) -> bytes:
        e = end_records(bytes(data))["eocd"]
        out = bytearray(data[: e + 22])
        struct.pack_into("<H", out, e + 20, len(comment))
        return bytes(out) + comment

    _native.check_archive(commented(b"ckptio:crc32 unchecked=1"), where)
    _native.check_archive(commented(b"ckptio:crc32 unchecked=*"), where)
    with pytest.raises(ckptio.FormatError, match=re.escape(name_b)):
        _native.check_archive(commented(b"ckptio:crc32 unchecked=0,2-5"), where)

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"x" * 100)
    for junk, says in [
        (b"PK\x03\x04" + bytes(100), "not a usable checkpoint"),
        (b"", "not a usable checkpoint"),
        (bytes(data[: len(data) // 2]), "not a usable checkpoint"),
        (buf.getvalue(), "is compressed"),
    ]:
        with pytest.raises(ckptio.FormatError, match=re.escape(f"{where}: ")) as ei:
            _native.check_archive(junk, where)
        assert says in str(ei.value), str(ei.value)


# ------------------------------------------------------------------- review of the tools layer


@pytest.mark.parametrize(
    "obj",
    [{"epoch": 3}, {}, [1, 2], {"e": torch.empty(0)}],
    ids=["int", "empty-dict", "list", "empty-tensor"],
)
@pytest.mark.parametrize("save", ["ckptio", "torch"])
def test_verify_of_a_checkpoint_without_tensor_bytes(tmp_path, obj, save):
    """load(verify=True) of a checkpoint that holds no tensor byte raised
    KeyError: 'verified' (a read of no segments carried no "verified" /
    "unchecked"); its records are checked as any others, from a path or a
    file object."""
    p = tmp_path / "m.pt"
    (ckptio.save if save == "ckptio" else torch.save)(obj, p)
    want = torch.load(p, weights_only=True)
    assert_same(ckptio.load(p, verify=True), want)
    assert ckptio.last_report().verified
    with open(p, "rb") as f:
        assert_same(ckptio.load(f, verify=True), want)
    assert ckptio.last_report().verified
