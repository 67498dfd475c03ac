"""``ckptio convert``: torch.save <-> safetensors, and what it refuses."""

import os
import subprocess
import sys

import ckptio
import ckptio.safetensors as cst
import pytest
import torch
from ckptio.tools.cli import main

st = pytest.importorskip("safetensors.torch")


def sd():
    return {"w": torch.randn(8, 4), "b": torch.arange(4), "h": torch.randn(3).bfloat16()}


def same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_torch_to_safetensors_and_back(tmp_path, capsys):
    src, mid, back = tmp_path / "a.pt", tmp_path / "a.safetensors", tmp_path / "b.pt"
    torch.save(sd(), src)
    want = torch.load(src)
    assert main(["convert", str(src), str(mid)]) == 0
    same(st.load_file(mid), want)
    assert cst.metadata(mid) == {"format": "pt"}
    assert main(["convert", str(mid), str(back)]) == 0
    same(torch.load(back, weights_only=True), want)
    out = capsys.readouterr().out
    assert "(torch) ->" in out and "(safetensors) ->" in out
    assert "metadata {'format': 'pt'} is not kept" in out


def test_direction_from_to_flag_and_from_source(tmp_path):
    src = tmp_path / "a.pt"
    ckptio.save(sd(), src)
    out = tmp_path / "weights.data"
    assert main(["convert", str(src), str(out)]) == 0  # unknown extension: the other format
    same(cst.load_file(out), torch.load(src))
    out2 = tmp_path / "x.pt"
    assert main(["convert", str(src), str(out2), "--to", "safetensors"]) == 0
    assert st.load_file(out2).keys() == sd().keys()


def run_err(capsys, *args):
    assert main(["convert", *map(str, args)]) == 1
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "obj, match",
    [
        ({"w": torch.zeros(2), "epoch": 3}, "'epoch' is a int, not a tensor"),
        ({"w": torch.zeros(2), "opt": [torch.zeros(1)]}, "'opt' is a list"),
        (
            {"model": {"w": torch.zeros(2)}},
            "'model' is a dict, not a tensor: safetensors holds only tensors (a nested",
        ),
        ([torch.zeros(2)], "holds a list, not a dict of tensors"),
        ({1: torch.zeros(2)}, "key 1 is a int, not a str"),
    ],
)
def test_what_safetensors_cannot_hold_is_refused_naming_the_key(tmp_path, capsys, obj, match):
    src, dst = tmp_path / "a.pt", tmp_path / "a.safetensors"
    torch.save(obj, src)
    err = run_err(capsys, src, dst)
    assert err.startswith("ckptio convert: ") and str(src) in err
    assert match in err
    assert not dst.exists()


def test_flatten_joins_nested_keys_and_refuses_collisions(tmp_path, capsys):
    src, dst = tmp_path / "a.pt", tmp_path / "a.safetensors"
    torch.save(
        {"model": {"w": torch.ones(2), "sub": {"b": torch.zeros(1)}}, "x": torch.ones(1)}, src
    )
    assert main(["convert", str(src), str(dst), "--flatten"]) == 0
    assert list(st.load_file(dst)) and set(st.load_file(dst)) == {"model.w", "model.sub.b", "x"}
    torch.save({"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}, src)
    assert "'a.b' is there twice" in run_err(capsys, src, dst, "--flatten", "--force")


def test_shared_storages_refused_unless_duplicated(tmp_path, capsys):
    w = torch.randn(4, 4)
    src, dst = tmp_path / "a.pt", tmp_path / "a.safetensors"
    torch.save({"emb": w, "head": w, "row": w[1], "other": torch.ones(2)}, src)
    err = run_err(capsys, src, dst)
    assert "share memory ('emb', 'head', 'row')" in err and "--duplicate-shared" in err
    assert main(["convert", str(src), str(dst), "--duplicate-shared"]) == 0
    out = st.load_file(dst)
    assert (
        torch.equal(out["emb"], w) and torch.equal(out["head"], w) and torch.equal(out["row"], w[1])
    )


def test_non_contiguous_view_refused_unless_duplicated(tmp_path, capsys):
    src, dst = tmp_path / "a.pt", tmp_path / "a.safetensors"
    w = torch.randn(4, 6)
    torch.save({"wt": w.t()}, src)
    assert "'wt' is a non-contiguous view" in run_err(capsys, src, dst)
    assert main(["convert", str(src), str(dst), "--duplicate-shared"]) == 0
    assert torch.equal(st.load_file(dst)["wt"], w.t())


def test_bad_or_missing_source(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05" + bytes(20))
    assert "not a usable safetensors file" in run_err(capsys, bad, tmp_path / "o.pt")
    assert "No such file" in run_err(capsys, tmp_path / "missing.pt", tmp_path / "o.safetensors")


def test_console_entry_point(tmp_path):
    src, dst = tmp_path / "a.pt", tmp_path / "a.safetensors"
    torch.save(sd(), src)
    r = subprocess.run(
        [sys.executable, "-m", "ckptio", "convert", str(src), str(dst)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    same(st.load_file(dst), torch.load(src))


# ------------------------------------------------------------------- review of 2026-12-06, later


@pytest.mark.parametrize(
    "value, match",
    [
        (torch.eye(3).to_sparse(), "sparse_coo tensor"),
        (torch.zeros(3, device="meta"), "meta device"),
        (torch.zeros(3, dtype=torch.complex128), "safetensors lacks"),
    ],
    ids=["sparse", "meta", "complex128"],
)
def test_what_safetensors_cannot_hold_is_a_conversion_error(tmp_path, value, match):
    """Sparse and meta tensors failed with a NotImplementedError of torch's, a dtype
    safetensors lacks with a ValueError: not the ConversionError convert raises."""
    from ckptio.errors import ConversionError
    from ckptio.tools.convert import convert

    src = tmp_path / "c.pt"
    torch.save({"w": value}, src)
    with pytest.raises(ConversionError, match=match):
        convert(str(src), str(tmp_path / "c.safetensors"), log=lambda _: None)
    assert not (tmp_path / "c.safetensors").exists()


def test_flatten_refuses_an_empty_dict_instead_of_dropping_it(tmp_path):
    from ckptio.errors import ConversionError
    from ckptio.tools.convert import convert

    src = tmp_path / "c.pt"
    torch.save({"w": torch.ones(2), "opt": {}}, src)
    with pytest.raises(ConversionError, match="'opt' is an empty dict"):
        convert(str(src), str(tmp_path / "c.safetensors"), flatten=True, log=lambda _: None)


# --------------------------------------------------------------------------- review of the CLI


def test_an_existing_destination_is_replaced_only_with_force(tmp_path, capsys):
    """convert replaced any DST without a word: notes, the source itself, the file a link
    points to. An existing DST is now refused (one line, exit 1, nothing written) unless
    --force; the source itself and a symbolic link are refused even then."""
    src = tmp_path / "model.pt"
    torch.save({"w": torch.ones(4)}, src)
    src_bytes = src.read_bytes()
    notes = tmp_path / "notes.txt"
    notes.write_text("three weeks of notes\n")
    err = run_err(capsys, src, notes)
    assert err.count("\n") == 1 and "notes.txt exists" in err and "--force" in err
    assert notes.read_text() == "three weeks of notes\n"
    assert main(["convert", "-q", "--force", str(src), str(notes)]) == 0
    same(st.load_file(notes), {"w": torch.ones(4)})

    for force in ([], ["--force"]):
        err = run_err(capsys, src, src, "--to", "safetensors", *force)
        assert "the source itself" in err
        os.link(src, tmp_path / "hard.pt")
        assert "the source itself" in run_err(capsys, src, tmp_path / "hard.pt", *force)
        os.unlink(tmp_path / "hard.pt")
        assert src.read_bytes() == src_bytes

    blob = tmp_path / "blob"
    st.save_file({"other_model": torch.zeros(2)}, blob)
    blob_bytes = blob.read_bytes()
    link = tmp_path / "link.safetensors"
    link.symlink_to(blob)
    (tmp_path / "to-src.safetensors").symlink_to(src)
    for force in ([], ["--force"]):
        assert "symbolic link" in run_err(capsys, src, link, *force)
        assert "symbolic link" in run_err(capsys, src, tmp_path / "to-src.safetensors", *force)
    assert blob.read_bytes() == blob_bytes and link.is_symlink()
    assert src.read_bytes() == src_bytes


@pytest.mark.parametrize("dst", ["copy.pt", "copy.safetensors"])
def test_a_damaged_source_fails_convert(tmp_path, capsys, dst):
    """convert loaded a torch.save source without its CRC-32s and wrote the rotten bytes
    into a file whose fresh CRC-32s vouched for them; now the source is verified as it is
    read: one line naming the bad record, exit 1, nothing written."""
    src = tmp_path / "rotted.pt"
    torch.save({"w": torch.zeros(1024)}, src)
    rec = next(r for r in ckptio.records(src) if r.name.endswith("/data/0"))
    b = bytearray(src.read_bytes())
    b[rec.offset + 2] ^= 0x40
    src.write_bytes(bytes(b))
    err = run_err(capsys, src, tmp_path / dst)
    assert err.count("\n") == 1 and "FormatError" in err and rec.name in err and "CRC-32" in err
    assert not (tmp_path / dst).exists()


# ------------------------------------------------------------------- review of the tools layer


def test_a_source_without_tensor_bytes_is_refused_as_any_other(tmp_path, capsys):
    """A torch.save source holding no tensor byte failed with "KeyError: 'verified'"
    (its verifying load); it now gets the usual ConversionError, or converts."""
    src, dst = tmp_path / "n.pt", tmp_path / "n.safetensors"
    ckptio.save({"step": 3}, src)
    err = run_err(capsys, src, dst)
    assert "ConversionError" in err and "'step' is a int, not a tensor" in err, err
    torch.save({"e": torch.empty(0)}, src)
    assert main(["convert", "-q", str(src), str(dst)]) == 0
    same(st.load_file(dst), {"e": torch.empty(0)})


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
def test_a_folder_destination_is_refused_up_front(tmp_path, capsys, force):
    """convert a.pt FOLDER --force read the source, then failed with "IsADirectoryError:
    [Errno 21] save to failed: Is a directory" (without --force: "exists ... only with
    --force", which --force did not mend). A folder (or a path ending in /) is now refused
    before anything is read: one line naming it, exit 1."""
    src = tmp_path / "a.pt"
    torch.save(sd(), src)
    folder = tmp_path / "out"
    folder.mkdir()
    for dst in (str(folder), str(tmp_path / "new") + "/"):
        err = run_err(capsys, src, dst, *force)
        assert err.count("\n") == 1 and "IsADirectoryError" in err, err
        assert f"{dst} is a folder: convert writes one file" in err, err
    assert os.listdir(folder) == [] and not (tmp_path / "new").exists()


def test_torch_to_torch_keeps_ties_and_views(tmp_path, capsys):
    """convert a.pt b.pt refused tied tensors with safetensors' rule ("safetensors
    stores each tensor on its own") though torch.save keeps ties: a torch.save
    destination now keeps them, and views, as torch.save does (copies with
    --duplicate-shared); what it refuses says convert's own reason."""
    w = torch.randn(4, 6)
    src, dst = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"emb": w, "head": w, "row": w[1], "wt": w.t()}, src)
    assert main(["convert", "-q", str(src), str(dst)]) == 0
    got = torch.load(dst, weights_only=True)
    assert got["head"].data_ptr() == got["emb"].data_ptr()
    assert got["row"].untyped_storage().data_ptr() == got["emb"].untyped_storage().data_ptr()
    assert got["wt"].stride() == w.t().stride() and torch.equal(got["wt"], w.t())
    assert torch.equal(got["row"], w[1])
    assert main(["convert", "-q", "--force", "--duplicate-shared", str(src), str(dst)]) == 0
    got = torch.load(dst, weights_only=True)
    assert got["head"].data_ptr() != got["emb"].data_ptr() and torch.equal(got["head"], w)
    assert "share memory" in run_err(capsys, src, tmp_path / "c.safetensors")
    torch.save({"w": w, "step": 3}, src)
    err = run_err(capsys, src, tmp_path / "d.pt")
    assert "'step' is a int, not a tensor: convert moves only tensors" in err, err


def test_file_urls_are_the_paths_they_name_for_every_check(tmp_path, capsys, monkeypatch):
    """A file:// destination is the local file it names for the checks too (a
    review of 2026-12-07: the existence check looked for ./file:/..., passed, and
    the save, which reads file:// as its path, replaced the file without --force;
    `convert x.pt file://$PWD/x.pt --force` converted a file over itself); a
    file:// source is read."""
    src = tmp_path / "model.pt"
    torch.save({"w": torch.ones(4)}, src)
    dst = tmp_path / "dst.pt"
    torch.save({"w": torch.zeros(4)}, dst)
    monkeypatch.chdir(tmp_path)
    err = run_err(capsys, f"file://{src}", f"file://{dst}")
    assert "dst.pt exists" in err and "--force" in err
    assert torch.equal(torch.load(dst)["w"], torch.zeros(4))
    assert "the source itself" in run_err(capsys, src, f"file://{src}", "--force")
    out = tmp_path / "out.safetensors"
    assert main(["convert", "-q", f"file://{src}", f"file://{out}"]) == 0
    same(st.load_file(out), {"w": torch.ones(4)})
    assert not (tmp_path / "file:").exists()
