"""Nothing in a checkpoint is trusted: DCP metadata is unpickled with an allow-list, file names
inside checkpoints stay inside their folder, DCP reads check the CRC-32 the writer stores,
verify checks what load relies on, and every refusal is a typed error naming the file (the
CLI prints it on one line). The crafted files of tests/fixtures/hostile are run through every
reader by tests/test_fuzz_load.py."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import ckptio
import ckptio.safetensors as cst
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter, read_metadata

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
HOSTILE = Path(__file__).parent / "fixtures" / "hostile"


def tensors(seed: int = 0, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(1000 + 300 * i, generator=g) for i in range(n)}


def zeros(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def save_dcp(folder: Path, sd: dict) -> Path:
    dcp.save(sd, storage_writer=FileSystemWriter(folder), no_dist=True)
    (data,) = folder.glob("*.distcp")
    return data


def rewrite_metadata(folder: Path, change) -> None:
    md = read_metadata(folder / ".metadata")
    for info in md.storage_data.values():
        change(info)
    (folder / ".metadata").write_bytes(pickle.dumps(md))


# --------------------------------------------------------------------------- .metadata


def test_crafted_metadata_runs_no_code_unless_trusted(tmp_path, monkeypatch):
    """A .metadata whose pickle calls os.mkdir: ckptio's reader refuses it (FormatError naming
    the file and the global) and nothing runs; trusted_metadata=True is the explicit opt-out
    (then it runs, as with torch's reader)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes((HOSTILE / "rce_reduce.metadata").read_bytes())
    with pytest.raises(ckptio.FormatError, match=r"\.metadata: refers to posix\.mkdir"):
        FileSystemReader(folder).read_metadata()
    with pytest.raises(BaseException, match="posix.mkdir"):  # inside DCP's own errors
        dcp.load({"w": torch.zeros(3)}, storage_reader=FileSystemReader(folder), no_dist=True)
    assert not (tmp_path / "ckptio_pwned").exists()
    with pytest.raises(ckptio.FormatError):  # no Metadata, but the code did run
        FileSystemReader(folder, trusted_metadata=True).read_metadata()
    assert (tmp_path / "ckptio_pwned").is_dir()
    with pytest.raises(TypeError, match="trusted_metadata"):
        FileSystemReader(folder, trusted_metadata="yes")


def test_metadata_of_both_writers_passes_the_allow_list(tmp_path):
    sd = {"w": torch.randn(8, 4).t(), "b": torch.ones(3, dtype=torch.bfloat16), "n": {"s": 3}}
    for writer in (FileSystemWriter, dcp.FileSystemWriter):
        folder = tmp_path / writer.__module__
        dcp.save(sd, storage_writer=writer(folder), no_dist=True)
        md = read_metadata(folder / ".metadata")
        assert md == pickle.loads((folder / ".metadata").read_bytes())
        out = {"w": torch.zeros(4, 8), "b": torch.zeros(3, dtype=torch.bfloat16), "n": {"s": 0}}
        dcp.load(out, storage_reader=FileSystemReader(folder), no_dist=True)
        assert torch.equal(out["w"], sd["w"]) and out["n"]["s"] == 3


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(text: str) -> bytes:
    return b"X" + len(text.encode()).to_bytes(4, "little") + text.encode()


_MD = "torch.distributed.checkpoint.metadata"
# BUILD (None, {name: value}) with slot state: the C unpickler sets attributes on
# whatever it is given. None of these may change anything outside the unpickling.
_BUILDS = {
    "a metadata class": _g(_MD, "Metadata") + b"N}" + _u("__repr__") + _g("torch", "Size"),
    "the encoding enum's member": _g(_MD, "_MEM_FORMAT_ENCODING")
    + b"K\x00\x85RN}"
    + _u("value")
    + _u("pwned"),
    "a torch function": _g("torch.serialization", "_get_layout")
    + b"N}"
    + _u("__kwdefaults__")
    + b"}",
    "a path class": _g("pathlib", "PosixPath") + b"N}" + _u("__fspath__") + _g("torch", "Size"),
}


@pytest.mark.parametrize("target", list(_BUILDS))
def test_a_build_on_allowed_objects_changes_nothing_outside_the_read(tmp_path, target):
    import pathlib

    from torch.distributed.checkpoint import metadata as md

    before = (
        dict(vars(md.Metadata)),
        dict(vars(pathlib.PosixPath)),
        torch.serialization._get_layout.__kwdefaults__,
        [dict(vars(e)) for e in md._MEM_FORMAT_ENCODING],
    )
    (tmp_path / ".metadata").write_bytes(b"\x80\x02" + _BUILDS[target] + b"s\x86b.")
    with pytest.raises(ckptio.FormatError, match=r"\.metadata"):
        read_metadata(tmp_path / ".metadata")
    after = (
        dict(vars(md.Metadata)),
        dict(vars(pathlib.PosixPath)),
        torch.serialization._get_layout.__kwdefaults__,
        [dict(vars(e)) for e in md._MEM_FORMAT_ENCODING],
    )
    assert after == before


def _metadata_obj(planner_data: bytes = b"N") -> bytes:
    """A Metadata made by NEWOBJ + BUILD on the Metadata global memoized as 0."""
    return (
        b"h\x00)\x81}("
        + _u("state_dict_metadata")
        + b"}"
        + _u("planner_data")
        + planner_data
        + _u("storage_data")
        + b"}"
        + _u("storage_meta")
        + b"N"
        + _u("version")
        + b"Nub."
    )


# Found in review: a stand-in class given a __setattr__ of its own kept its instances
# from getting their real class back; a stand-in hidden in a slice; values of types
# no check expected.
_CRAFTED = {
    "a stand-in class's own __setattr__": b"\x80\x02"
    + _g(_MD, "Metadata")
    + b"q\x00N}("
    + _u("__setattr__")
    + _g("builtins", "slice")
    + b"u\x86b0"
    + _metadata_obj(),
    "a stand-in class hidden in a slice": b"\x80\x02"
    + _g(_MD, "Metadata")
    + b"q\x00"
    + _metadata_obj(b"}(" + _u("s") + _g("builtins", "slice") + b"h\x00\x85Ru"),
}


_ENC = _g(_MD, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R"


def _metadata_built(extra: bytes = b"", planner: bytes = b"N", then: bytes = b"") -> bytes:
    """The Metadata global memoized as 0, then a Metadata whose BUILD state has
    ``extra`` items more, with ``planner`` as its planner_data, ``then`` after."""
    return (
        b"\x80\x02"
        + _g(_MD, "Metadata")
        + b"q\x000h\x00)\x81}("
        + _u("state_dict_metadata")
        + b"}"
        + _u("planner_data")
        + planner
        + _u("storage_data")
        + b"}"
        + _u("storage_meta")
        + b"N"
        + _u("version")
        + b"N"
        + extra
        + b"ub"
        + then
        + b"."
    )


def _path_holding(value: bytes) -> bytes:
    """planner_data {"k": PurePosixPath("a")} whose slot _str a BUILD set to ``value``."""
    path = _g("pathlib", "PurePosixPath") + _u("a") + b"\x85RN}(" + _u("_str") + value + b"u\x86b"
    return b"}" + _u("k") + path + b"s"


# Found in review of d16ed8d (the first two slipped past its walk; the slots
# past the one before it too).
_CRAFTED.update(
    {
        "an instance given a stand-in's class": _metadata_built(
            then=b"N}(" + _u("__class__") + b"h\x00u\x86b"
        ),
        "a stand-in as an attribute name": _metadata_built(extra=b"h\x00N"),
        "an encoding as an attribute name": _metadata_built(extra=_ENC + b"N"),
        "a stand-in in a path's slot": _metadata_built(planner=_path_holding(b"h\x00")),
        "an encoding in a path's slot": _metadata_built(planner=_path_holding(_ENC)),
    }
)


@pytest.mark.parametrize("case", list(_CRAFTED))
def test_crafted_metadata_that_evades_the_class_restore_is_refused(tmp_path, case):
    (tmp_path / ".metadata").write_bytes(_CRAFTED[case])
    with pytest.raises(ckptio.FormatError, match=r"\.metadata.*refused"):
        read_metadata(tmp_path / ".metadata")


def test_a_stand_in_held_only_outside_the_metadata_refuses_nothing(tmp_path):
    """The reader counts the references to its stand-ins to know whether to look
    for one in what it read: one held only by garbage the read left (a list that
    holds itself and a metadata class, collected later) is not in the metadata."""
    garbage = b"]q\x01h\x01ah\x00a0"  # L = [L, Metadata], popped
    (tmp_path / ".metadata").write_bytes(
        b"\x80\x02" + _g(_MD, "Metadata") + b"q\x000" + garbage + _metadata_obj()
    )
    md = read_metadata(tmp_path / ".metadata")
    from torch.distributed.checkpoint.metadata import Metadata

    assert type(md) is Metadata and md.state_dict_metadata == {}


def _one_tensor_metadata(offsets, sizes, item_offsets=None, size=(4,)):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), [chunk])
    key = MetadataIndex("w", torch.Size(offsets if item_offsets is None else item_offsets))
    return Metadata({"w": entry}, None, {key: _StorageInfo("__0_0.distcp", 0, 16)})


@pytest.mark.parametrize(
    "case, want",
    [
        ((([0], [4]),), None),
        ((([1], [4]),), "lies outside its size"),
        ((([0], [2]),), "hold 2 of its 4 elements"),
        ((([0], [4], [1]),), "no item holds the chunk"),
        ((([0, 0], [4, 4]), {"size": (4, 4)}), None),
        ((([0], [3]),), "hold 3 of its 4 elements"),
        ((([0], [5]),), "lies outside its size"),
        ((([0], [4]), {"size": (4, 1)}), "has not its 2 dims"),
    ],
)
def test_a_tensor_of_one_chunk_must_be_covered_by_it(tmp_path, case, want):
    """The chunks of a tensor tile it (a chunk outside it, or one that leaves part
    of it, would leave zeros where data belongs): one chunk, most tensors'."""
    args, kw = (case[0], case[1]) if len(case) == 2 else (case[0], {})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_one_tensor_metadata(*args, **kw)))
    if want is None:
        assert read_metadata(tmp_path / ".metadata").state_dict_metadata["w"].size[0] == 4
    else:
        with pytest.raises(ckptio.FormatError, match=want):
            read_metadata(tmp_path / ".metadata")


def test_metadata_of_unexpected_value_types_is_a_formaterror(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    info = _StorageInfo("a", 0, 1)
    info.relative_path = ["x"]  # unhashable
    (tmp_path / ".metadata").write_bytes(
        pickle.dumps(Metadata({}, None, {MetadataIndex("w"): info}))
    )
    with pytest.raises(ckptio.FormatError, match="unhashable"):
        read_metadata(tmp_path / ".metadata")


def test_an_extension_code_for_an_allowed_global_is_refused(tmp_path):
    """copyreg's extension cache would hand EXT opcodes the real class, past the
    allow-list's stand-ins: no read while an allowed global has a code."""
    import copyreg

    save_dcp(tmp_path, tensors())
    copyreg.add_extension(_MD, "Metadata", 240)
    try:
        with pytest.raises(ckptio.FormatError, match="copyreg"):
            read_metadata(tmp_path / ".metadata")
    finally:
        copyreg.remove_extension(_MD, "Metadata", 240)
    read_metadata(tmp_path / ".metadata")


def test_metadata_read_is_the_trusted_read_for_every_dtype_and_format(tmp_path):
    """The allow-listed read gives what pickle gives (classes restored, encodings
    turned into memory formats by TensorProperties) for every dtype and a
    channels-last tensor."""
    sd = {
        f"t{i}": torch.ones(2, 3, dtype=dt)
        for i, dt in enumerate(
            [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex64]
        )
    }
    sd["cl"] = torch.ones(1, 3, 4, 4).to(memory_format=torch.channels_last)
    sd["extra"] = {"step": 7, "name": "x", "path": Path("/a/b")}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    raw = (tmp_path / ".metadata").read_bytes()
    got = read_metadata(tmp_path / ".metadata")
    assert got == pickle.loads(raw)
    assert {type(k).__name__ for k in got.storage_data} == {"MetadataIndex"}
    assert type(got) is type(pickle.loads(raw))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link_out", "dot"])
def test_dcp_paths_outside_the_folder_are_refused(tmp_path, how):
    """A .metadata naming a data file outside its folder (../, an absolute path, a link in
    the folder to a file outside) is refused, though that file is a valid data file; so
    is one naming the folder itself (".": it was an IsADirectoryError)."""
    folder = tmp_path / "ck"
    data = save_dcp(folder, tensors())
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(data, outside / data.name)
    if how == "dotdot":
        rewrite_metadata(folder, lambda i: setattr(i, "relative_path", f"../elsewhere/{data.name}"))
    elif how == "absolute":
        rewrite_metadata(folder, lambda i: setattr(i, "relative_path", str(outside / data.name)))
    elif how == "dot":
        rewrite_metadata(folder, lambda i: setattr(i, "relative_path", "."))
    else:
        data.unlink()
        data.symlink_to(outside / data.name)
    with pytest.raises(ckptio.FormatError, match="outside the checkpoint folder"):
        FileSystemReader(folder).read_metadata()
    with pytest.raises(BaseException, match="outside the checkpoint folder"):
        dcp.load(zeros(tensors()), storage_reader=FileSystemReader(folder), no_dist=True)
    rep = ckptio.verify(folder)
    assert not rep.ok and "outside the checkpoint folder" in rep.error


@pytest.mark.parametrize(
    ("field", "value"), [("offset", 2**64), ("length", 2**63), ("offset", 2**63 - 1)]
)
def test_dcp_items_past_any_file_end_are_refused_naming_the_item(tmp_path, field, value):
    """An item's offset or length that no file reaches (2^64 was a bare
    OverflowError from deep inside the read, naming nothing): a FormatError
    naming the metadata file and the item (a review of 2026-12-07)."""
    folder = tmp_path / "ck"
    save_dcp(folder, tensors())
    rewrite_metadata(folder, lambda i: setattr(i, field, value))
    with pytest.raises(ckptio.FormatError, match=r"\.metadata: .*item 't\d' at offset .* past any"):
        FileSystemReader(folder).read_metadata()
    with pytest.raises(BaseException, match="past any file's end"):
        dcp.load(zeros(tensors()), storage_reader=FileSystemReader(folder), no_dist=True)


def test_dcp_links_inside_the_folder_are_fine(tmp_path):
    folder = tmp_path / "ck"
    data = save_dcp(folder, tensors())
    (folder / "store").mkdir()
    data.rename(folder / "store" / data.name)
    data.symlink_to(Path("store") / data.name)
    out = zeros(tensors())
    dcp.load(out, storage_reader=FileSystemReader(folder, verify=True), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in tensors().items())


def test_sharded_index_naming_a_link_out_of_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ck"
    cst.save_sharded(tensors(), folder, max_shard_size=6000)
    shard = sorted(folder.glob("*.safetensors"))[0]
    shutil.move(shard, tmp_path / "outside.safetensors")
    shard.symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ckptio.FormatError, match="outside the checkpoint folder"):
        cst.load_sharded(folder)


# --------------------------------------------------------------------------- DCP CRC-32


@pytest.mark.slow
def test_single_bit_flips_in_dcp_data_never_load_wrong_with_verify(tmp_path):
    """200 single bit flips anywhere in a data file of tensors: FileSystemReader(verify=True)
    returns the exact tensors (the bit was padding) or raises FormatError naming the file,
    and `ckptio.verify` on the folder agrees; unverified reads of the same files load wrong
    data without an error (how many is printed)."""
    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(1 << 15, generator=g) for i in range(4)}
    good = tmp_path / "good"
    data = save_dcp(good, sd)
    raw = data.read_bytes()
    rng = random.Random(7)
    silent = caught = exact = 0
    bad = tmp_path / "bad"
    for _ in range(200):
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(good, bad)
        b = bytearray(raw)
        at = rng.randrange(len(b))
        b[at] ^= 1 << rng.randrange(8)
        (bad / data.name).write_bytes(bytes(b))
        plain = zeros(sd)
        try:
            dcp.load(plain, storage_reader=FileSystemReader(bad), no_dist=True)
            silent += not all(torch.equal(plain[k], v) for k, v in sd.items())
        except BaseException:
            pass
        out = zeros(sd)
        try:
            dcp.load(out, storage_reader=FileSystemReader(bad, verify=True), no_dist=True)
        except BaseException as e:  # DCP's CheckpointException around ckptio's error
            cause = e.failures[0][0] if hasattr(e, "failures") else e
            assert isinstance(cause, ckptio.FormatError), repr(cause)
            assert data.name in str(cause)
            assert not ckptio.verify(bad).ok
            caught += 1
            continue
        assert all(torch.equal(out[k], v) for k, v in sd.items()), f"bit at {at} loaded wrong"
        assert ckptio.verify(bad).ok
        exact += 1
    print(
        f"\n200 flips: verify caught {caught}, {exact} exact; unverified: {silent} silently wrong"
    )
    assert caught >= 150 and silent >= 100


def test_dcp_crc_mismatch_names_the_file_and_item_and_partial_reads_check_too(tmp_path):
    sd = {"m": torch.randn(64, 32)}
    folder = tmp_path / "ck"
    data = save_dcp(folder, sd)
    info = next(iter(read_metadata(folder / ".metadata").storage_data.values()))
    item = ckptio._native.Reader(data, "off", None, info.offset, info.length)
    at, size = next((o, n) for name, o, n in item.records() if name.endswith("/data/0"))
    assert size == 64 * 32 * 4
    b = bytearray(data.read_bytes())
    b[at + 1000] ^= 4  # inside the tensor's bytes
    data.write_bytes(bytes(b))
    with pytest.raises(BaseException) as ei:
        dcp.load(zeros(sd), storage_reader=FileSystemReader(folder, verify=True), no_dist=True)
    cause = ei.value.failures[0][0]
    assert isinstance(cause, ckptio.FormatError) and "'m'" in str(cause), cause
    assert str(data) in str(cause) and "CRC-32" in str(cause)
    # A request for part of the tensor (a column-major destination reads it strided) too.
    out = {"m": torch.zeros(32, 64).t()}
    with pytest.raises(BaseException, match="CRC-32"):
        dcp.load(out, storage_reader=FileSystemReader(folder, verify=True), no_dist=True)
    r = subprocess.run(
        [sys.executable, "-m", "ckptio", "verify", "-q", str(folder)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "m (" in r.stdout + r.stderr, r


def test_verify_takes_a_dcp_folder_of_either_writer(tmp_path, capsys):
    from ckptio.tools.cli import main

    sd = {"w": torch.randn(100), "step": 3}
    for writer in (FileSystemWriter, dcp.FileSystemWriter):
        folder = tmp_path / writer.__module__
        dcp.save(sd, storage_writer=writer(folder), no_dist=True)
        rep = ckptio.verify(folder)
        assert rep.ok, rep.summary()
        # The non-tensor value, a torch.save archive in the item: its records checked too.
        step = [r.state for r in rep.records if r.name.startswith("step")]
        assert step and set(step) == {"ok"}, step
        assert any(r.name.startswith("w (") and r.state == "ok" for r in rep.records)
        assert main(["verify", str(folder)]) == 0
    assert "records checked" in capsys.readouterr().out


def test_dcp_errors_reach_the_caller_typed_with_the_path(tmp_path):
    """DCP wraps a rank's error in CheckpointException: ckptio's OSError / FormatError is its
    failures[rank][0], naming the file."""
    sd = tensors()
    folder = tmp_path / "ck"
    data = save_dcp(folder, sd)
    data.rename(tmp_path / "moved")
    with pytest.raises(dcp.api.CheckpointException) as ei:
        dcp.load(zeros(sd), storage_reader=FileSystemReader(folder), no_dist=True)
    cause = ei.value.failures[0][0]
    assert isinstance(cause, FileNotFoundError) and cause.filename == str(data), cause
    (tmp_path / "moved").rename(data)
    data.write_bytes(data.read_bytes()[:5000])
    with pytest.raises(dcp.api.CheckpointException) as ei:
        dcp.load(zeros(sd), storage_reader=FileSystemReader(folder), no_dist=True)
    cause = ei.value.failures[0][0]
    assert isinstance(cause, ckptio.FormatError) and str(data) in str(cause), cause


# --------------------------------------------------------------------------- torch.save files


def test_verify_with_load_checks_the_crc_before_decoding(tmp_path):
    """load(verify=True) checks the byteorder record's CRC-32 before decoding it: a flipped
    byte there is a CRC mismatch (FormatError naming the record), not a UnicodeDecodeError."""
    p = tmp_path / "b.pt"
    p.write_bytes((HOSTILE / "byteorder_not_utf8_bad_crc.pt").read_bytes())
    with pytest.raises(ckptio.FormatError, match="byteorder"):
        ckptio.load(p, verify=True)
    assert not ckptio.verify(p).ok


def test_a_declared_storage_is_checked_before_memory_is_taken(tmp_path, monkeypatch):
    """A pickle declaring a 40 GB storage over an 800-byte record: FormatError before any
    allocation larger than the file's records (torch cuts the mapped slice at the file end)."""
    from ckptio.io import memory

    asked: list[int] = []
    real = memory.empty_storage
    monkeypatch.setattr(memory, "empty_storage", lambda n, *a: asked.append(n) or real(n, *a))
    p = tmp_path / "huge.pt"
    p.write_bytes((HOSTILE / "storage_declared_40gb.pt").read_bytes())
    with pytest.raises(ckptio.FormatError, match="declares a storage"):
        ckptio.load(p)
    assert all(n <= 800 for n in asked), asked
    rep = ckptio.verify(p)
    assert not rep.ok and "40000000000" in rep.error


@pytest.mark.parametrize("name", ["flag_bit5.pt", "flag_bit13.pt", "zip64_end_record_size_0.pt"])
def test_verify_refuses_what_torch_refuses(tmp_path, name):
    """Zips torch's reader refuses (flag bits, a ZIP64 end record with a bad size): verify says
    so, load raises FormatError; torch.load itself fails on them (RuntimeError)."""
    p = tmp_path / name
    p.write_bytes((HOSTILE / name).read_bytes())
    with pytest.raises(RuntimeError):
        torch.load(p, weights_only=True)
    rep = ckptio.verify(p)
    assert not rep.ok and "torch's reader refuses" in rep.error, rep
    with pytest.raises(ckptio.FormatError, match=name):
        ckptio.load(p, verify=True)


@pytest.mark.parametrize("cmd", ["inspect", "ls", "verify"])
def test_cli_prints_one_line_for_a_refused_file(tmp_path, capsys, cmd):
    from ckptio.tools.cli import main

    for name in ("pickle_runs_code.pt", "version_99.pt"):
        p = tmp_path / name
        p.write_bytes((HOSTILE / name).read_bytes())
        rc = main([cmd, str(p)])
        err = capsys.readouterr().err
        if name == "pickle_runs_code.pt":
            # A sound archive: only loading it is refused; ls and inspect list it
            # by a scan that runs nothing of the pickle (torchzip.scanned_records).
            assert rc == 0, err
            continue
        assert rc == 1 and len(err.strip().splitlines()) == 1, err
        assert str(p) in err, err
    if cmd != "inspect":
        return
    # The command itself: one line on stderr, no traceback.
    r = subprocess.run(
        [sys.executable, "-m", "ckptio", cmd, str(tmp_path / "version_99.pt")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_safetensors_header_refusals_name_the_tensor(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes((HOSTILE / "huge_dim_times_zero.safetensors").read_bytes())
    with pytest.raises(ckptio.FormatError, match=r"x\.safetensors.*tensor 't'.*int64"):
        cst.load_file(p)
    p.write_bytes((HOSTILE / "deep_json.safetensors").read_bytes())
    with pytest.raises(ckptio.FormatError, match="nested too deeply"):
        cst.load_file(p)
    os.remove(p)


def test_an_empty_record_of_torch_save_is_checked(tmp_path):
    """An empty storage's record holds CRC-32 0, its true CRC: verify named it
    "unchecked" (0 is also what a writer that computed none leaves)."""
    p = tmp_path / "e.pt"
    torch.save({"e": torch.empty(0), "x": torch.ones(3)}, p)
    report = ckptio.verify(p)
    assert report.ok and report.unchecked == (), report.summary()


@pytest.mark.parametrize("saver", ["ckptio", "torch"])
def test_verify_takes_the_storages_of_newer_dtypes(tmp_path, saver):
    """float8, uint16-64 and complex32 tensors are saved over untyped storages
    (_rebuild_tensor_v3, the dtype an argument), as is an UntypedStorage saved
    itself: verify called such valid files corrupt."""
    obj = {
        "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "u16": torch.tensor([1, 2, 3, 4, 5, 6], dtype=torch.uint16)[1:],
        "u64": torch.zeros(3, dtype=torch.uint64),
        "raw": torch.ones(3).untyped_storage(),
    }
    p = tmp_path / "c.pt"
    (ckptio.save if saver == "ckptio" else torch.save)(obj, p)
    report = ckptio.verify(p)
    assert report.ok, report
    assert torch.equal(ckptio.load(p, verify=True)["u16"], obj["u16"])
