"""The ``ckptio`` command: every subcommand on every format it reads, and its errors.

Exit status: 0 done, 1 failed (one line on stderr, nothing on stdout), 2 bad command line.
Formats are recognised from the content, so each checkpoint is also tried under a
misleading name.
"""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import ckptio
import ckptio.safetensors as cst
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemWriter, read_metadata
from ckptio.tools import describe
from ckptio.tools import progress as _progress
from ckptio.tools.cli import main

st = pytest.importorskip("safetensors.torch")


def state():
    return {
        "w": torch.randn(64, 32),
        "b": torch.arange(10),
        "h": torch.randn(33).bfloat16(),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One checkpoint of each format (and writer), by label."""
    root = tmp_path_factory.mktemp("formats")
    sd = state()
    out = {}
    out["torch.save by ckptio"] = root / "a.pt"
    ckptio.save(sd, out["torch.save by ckptio"])
    out["torch.save by torch"] = root / "t.pt"
    torch.save(sd, out["torch.save by torch"])
    out["safetensors by ckptio"] = root / "a.safetensors"
    cst.save_file(sd, out["safetensors by ckptio"], metadata={"format": "pt"})
    out["safetensors by safetensors"] = root / "h.safetensors"
    st.save_file(sd, out["safetensors by safetensors"])
    out["sharded folder"] = root / "sharded"
    cst.save_sharded(sd, out["sharded folder"], max_shard_size=5000)
    out["sharded index"] = out["sharded folder"] / "model.safetensors.index.json"
    out["DCP folder"] = root / "dcp"
    dcp.save(
        {"model": sd, "step": 7}, storage_writer=FileSystemWriter(out["DCP folder"]), no_dist=True
    )
    out["DCP .metadata"] = out["DCP folder"] / ".metadata"
    out["DCP by torch"] = root / "dcp_torch"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(out["DCP by torch"]), no_dist=True)
    return out


FORMAT = {
    "torch.save by ckptio": describe.TORCH,
    "torch.save by torch": describe.TORCH,
    "safetensors by ckptio": describe.SAFETENSORS,
    "safetensors by safetensors": describe.SAFETENSORS,
    "sharded folder": describe.SHARDED,
    "sharded index": describe.SHARDED,
    "DCP folder": describe.DCP,
    "DCP .metadata": describe.DCP,
    "DCP by torch": describe.DCP,
}


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def failed(capsys, *argv):
    """The command failed as every command fails: exit 1, nothing on stdout, one line."""
    rc, out, err = run(capsys, *argv)
    assert rc == 1, (argv, rc, out, err)
    assert out == "", (argv, out)
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"ckptio {argv[0]}: "), err
    return err


@pytest.mark.parametrize("label", list(FORMAT))
def test_ls_inspect_verify_read_every_format(ckpts, capsys, label):
    path = ckpts[label]
    assert describe.detect(path).format == FORMAT[label]
    names = ["w", "b", "h"]
    rc, out, err = run(capsys, "ls", path)
    assert rc == 0 and err == "", err
    assert out.startswith(f"{FORMAT[label]}: {path}\n")
    for n in names:
        assert any(f"{n}: " in line for line in out.splitlines()), (n, out)
    assert "w: float32 [64x32]" in out and "h: bfloat16 [33]" in out

    rc, out, err = run(capsys, "inspect", path)
    assert rc == 0 and err == "", err
    summary = {
        describe.TORCH: "CRC-32 stored for",
        describe.SAFETENSORS: "stores no CRC-32",
        describe.SHARDED: "stores no CRC-32",
        describe.DCP: "metadata: ",
    }[FORMAT[label]]
    assert summary in out, out

    rc, out, err = run(capsys, "verify", path)
    assert rc == 0 and err == "", err
    assert ": ok: " in out.splitlines()[-1]
    assert run(capsys, "verify", "-q", path) == (0, "", "")

    # ckptio.listing: the same listing from Python, for every format
    rc, out, _ = run(capsys, "ls", "--json", path)
    assert json.loads(json.dumps(ckptio.listing(path).to_json(), default=str)) == json.loads(out)

    for cmd in ("ls", "inspect"):
        rc, out, _ = run(capsys, cmd, "--json", path)
        doc = json.loads(out)
        assert rc == 0 and doc["format"] == FORMAT[label]
        tensors = {t["name"].split(".")[-1] for e in doc["entries"] for t in e["tensors"]}
        assert set(names) <= tensors, tensors
        assert all(e["offset"] >= 0 and e["nbytes"] >= 0 for e in doc["entries"])
    rc, out, _ = run(capsys, "verify", "--json", path)
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and doc["error"] is None and doc["format"] == FORMAT[label]


def test_formats_are_found_from_the_content_not_the_name(ckpts, tmp_path, capsys):
    swapped = {
        "model.safetensors": ckpts["torch.save by ckptio"],
        "model.pt": ckpts["safetensors by safetensors"],
        "weights.json": ckpts["sharded index"],
    }
    for name, src in swapped.items():
        dst = tmp_path / name
        shutil.copy(src, dst)
        if name == "weights.json":  # an index names its shards: they come along
            for f in os.listdir(src.parent):
                if f.endswith(".safetensors"):
                    shutil.copy(src.parent / f, tmp_path / f)
        assert describe.detect(dst).format == describe.detect(src).format
        for cmd in ("ls", "inspect", "verify"):
            rc, out, err = run(capsys, cmd, dst)
            assert rc == 0 and err == "", (name, cmd, err)
            assert cmd == "verify" or "w: float32 [64x32]" in out, (name, cmd, out)


def test_inspect_of_dcp_shows_items_per_rank_file_crc_and_shards(ckpts, capsys):
    folder = ckpts["DCP folder"]
    md = read_metadata(folder / ".metadata")
    rc, out, _ = run(capsys, "inspect", folder)
    assert rc == 0
    data_files = {i.relative_path for i in md.storage_data.values()}
    for f in data_files:
        assert any(line.startswith(f"== {f} (rank 0): ") for line in out.splitlines()), out
    for index, info in md.storage_data.items():
        lines = [x for x in out.splitlines() if x.split()[:1] == [str(info.offset)]]
        assert lines and index.fqn in lines[0], (index.fqn, out)
        if index.fqn != "step":  # tensor items carry the CRC-32 of their data
            assert "data at " in lines[0] and lines[0].split()[3] not in ("-", "unchecked")
    assert "  model.w: float32 [64x32], 1 shard" in out
    assert "  step: bytes " in out
    lst = describe.listing(folder)
    assert {s.name for s in lst.stored} == set(md.state_dict_metadata)


def test_verify_of_dcp_checks_every_item(ckpts, tmp_path, capsys):
    folder = tmp_path / "dcp"
    shutil.copytree(ckpts["DCP folder"], folder)
    rep = ckptio.verify(folder)
    tensors = [k for k, v in read_metadata(folder / ".metadata").storage_data.items()]
    checked = {r.name.split(" (")[0] for r in rep.records if r.state == "ok"}
    assert checked == {k.fqn for k in tensors}  # "step", a non-tensor value, too
    # A bit flipped inside the data of one item: that item is named, exit 1.
    lst = describe.listing(folder)
    entry = next(e for e in lst.entries if e.name == "model.h")
    data = folder / entry.file
    b = bytearray(data.read_bytes())
    b[entry.data_offset + 5] ^= 1
    data.write_bytes(bytes(b))
    rc, out, err = run(capsys, "verify", folder)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.split()[:1] == ["mismatch"]]
    assert len(bad) == 1 and "model.h (" in bad[0], out
    assert err.startswith("ckptio verify: ") and "BAD" in err and "model.h" in err
    assert "model.h" in failed(capsys, "verify", "-q", folder)
    rc, out, _ = run(capsys, "verify", "--json", folder)
    assert rc == 1 and not json.loads(out)["ok"]


def test_verify_names_a_bad_record_of_a_torch_file(ckpts, tmp_path, capsys):
    p = tmp_path / "a.pt"
    shutil.copy(ckpts["torch.save by ckptio"], p)
    rec = next(r for r in ckptio.records(p) if r.tensors and r.tensors[0].name == "w")
    b = bytearray(p.read_bytes())
    b[rec.offset + 100] ^= 8
    p.write_bytes(bytes(b))
    rc, out, err = run(capsys, "verify", p)
    assert rc == 1 and f"mismatch  {rec.name} (stored" in out and rec.name in err
    assert rec.name in failed(capsys, "verify", "--quiet", p)
    # ls reads no tensor bytes: the listing stands, the CRC-32 column still shows the stored one.
    rc, out, _ = run(capsys, "inspect", p)
    assert rc == 0 and f"{rec.crc32:08x}" in out


def test_missing_path_prints_nothing_but_the_error(tmp_path, capsys):
    missing = tmp_path / "nope.pt"
    for argv in (
        ["ls", missing],
        ["inspect", missing],
        ["verify", missing],
        ["ls", "--json", missing],
        ["verify", "--json", missing],
        ["convert", missing, tmp_path / "x.safetensors"],
        ["clean", tmp_path / "nope"],
    ):
        err = failed(capsys, *argv)
        assert "FileNotFoundError" in err and "nope" in err, err


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("junk.bin", b"\x93\x11 not any checkpoint format" * 3, "not a checkpoint ckptio reads"),
        ("empty.pt", b"", "an empty file"),
        ("bad.safetensors", b"\x05" + bytes(20), "not a usable safetensors file"),
        ("notes.json", b'{"weights": 1}', "not a checkpoint ckptio reads"),
        ("pickle.metadata", b"\x80\x04K\x01.", "not a checkpoint ckptio reads"),
    ],
)
def test_wrong_format_is_one_line(tmp_path, capsys, name, content, says):
    p = tmp_path / name
    p.write_bytes(content)
    for cmd in ("ls", "inspect", "verify"):
        assert says in failed(capsys, cmd, p)
    assert says in failed(capsys, "convert", p, tmp_path / "out.pt")


def test_legacy_torch_file_and_empty_folder_are_refused(tmp_path, capsys):
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    (tmp_path / "empty").mkdir()
    for cmd in ("ls", "inspect", "verify"):
        assert "legacy torch.save file" in failed(capsys, cmd, legacy)
        assert "no checkpoint ckptio reads" in failed(capsys, cmd, tmp_path / "empty")


def test_bad_records_of_each_format_are_named(ckpts, tmp_path, capsys):
    # safetensors: two tensors overlapping in the data section.
    p = tmp_path / "overlap.safetensors"
    header = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
    p.write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    for cmd in ("ls", "inspect", "verify"):
        assert "overlaps tensor" in failed(capsys, cmd, p)
    # sharded: the index puts a tensor in a shard that does not hold it.
    folder = tmp_path / "sharded"
    shutil.copytree(ckpts["sharded folder"], folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"]["w"])
    index["weight_map"]["w"] = wrong
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for cmd in ("ls", "inspect", "verify"):
        assert "'w'" in failed(capsys, cmd, folder)
    # DCP: .metadata names a data file that is gone.
    d = tmp_path / "dcp"
    shutil.copytree(ckpts["DCP folder"], d)
    for f in os.listdir(d):
        if f.endswith(".distcp"):
            os.remove(d / f)
    for cmd in ("ls", "inspect"):
        failed(capsys, cmd, d)
    assert "BAD" in failed(capsys, "verify", d)
    # torch.save: a record whose size runs past the end of the file (a torn tail).
    p = tmp_path / "torn.pt"
    p.write_bytes(ckpts["torch.save by ckptio"].read_bytes()[:6000])
    for cmd in ("ls", "inspect"):
        assert "torn.pt" in failed(capsys, cmd, p)
    assert "BAD" in failed(capsys, "verify", p)


def test_convert_both_ways_and_its_errors(ckpts, tmp_path, capsys):
    dst = tmp_path / "a.safetensors"
    rc, out, err = run(capsys, "convert", ckpts["torch.save by torch"], dst)
    assert rc == 0 and err == "" and "(torch) ->" in out
    back = tmp_path / "b.pt"
    rc, out, err = run(capsys, "convert", "--quiet", dst, back)
    assert rc == 0 and out == "" and err == ""
    assert torch.equal(torch.load(back)["w"], torch.load(ckpts["torch.save by torch"])["w"])
    assert "DCP checkpoint" in failed(capsys, "convert", ckpts["DCP folder"], tmp_path / "x.pt")
    assert "sharded safetensors" in failed(
        capsys, "convert", ckpts["sharded folder"], tmp_path / "x.pt"
    )
    p = tmp_path / "nested.pt"
    torch.save({"model": {"w": torch.ones(2)}}, p)
    assert "nested dict" in failed(capsys, "convert", p, tmp_path / "n.safetensors")


def test_clean_and_info(tmp_path, capsys):
    rc, out, err = run(capsys, "clean", "--json", tmp_path)
    assert rc == 0 and json.loads(out) == {"folder": str(tmp_path), "removed": []}
    rc, out, err = run(capsys, "clean", "-q", tmp_path)
    assert (rc, out, err) == (0, "", "")
    rc, out, _ = run(capsys, "info", "--json", tmp_path)
    assert rc == 0 and "cuda" in json.loads(out)


def test_info_says_what_auto_does_in_cufile_compat_mode(tmp_path):
    """Where cuFile registers the folder's files in compat mode (no nvidia-fs),
    `ckptio info` says that `auto` loads through the bounce pipeline; elsewhere
    it says nothing of it."""
    from ckptio.tools.sysinfo import format_info

    d = ckptio.info(tmp_path)
    line = "backend auto:  saves through cuFile, loads through the bounce pipeline"
    d["cufile"]["compat_mode"] = True
    d["folder"]["cufile_handle"] = True
    assert line in format_info(d)
    d["cufile"]["compat_mode"] = False
    assert line not in format_info(d)
    d["cufile"]["compat_mode"] = True
    d["folder"]["cufile_handle"] = False
    assert line not in format_info(d)


def test_bad_command_line_is_exit_2(capsys):
    for argv in (["ls"], ["frobnicate", "x"], ["verify", "--bogus", "x"], []):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2
    capsys.readouterr()


def test_bench_writes_json_and_a_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    rc, out, err = run(
        capsys, "bench", "--size", "4M", "--repeat", "2", "--dir", tmp_path, "--json", js,
        "--plot", png,
    )  # fmt: skip
    assert rc == 0 and err == "", err
    assert "ckptio.save (durable)" in out and "# ckptio.save" in out
    # Two rounds, each order of the saves and of the loads once, every time printed.
    by_round = [line for line in out.splitlines() if " by round (s): " in line]
    assert len(by_round) == 4 and all(len(line.split(": ")[1].split()) == 2 for line in by_round)
    rows = {r["name"]: r for r in json.loads(js.read_text())}
    assert rows["ckptio.load, cold"]["ratio"] > 0 and rows["ckptio.load, cold"]["gib_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    rc, out, err = run(capsys, "bench", "-q", "--size", "1M", "--repeat", "1", "--dir", tmp_path)
    assert rc == 0 and err == "" and "# " not in out and "ckptio.load, cold" in out


def test_bench_plot_without_matplotlib_fails_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    err = failed(capsys, "bench", "--size", "1M", "--dir", tmp_path, "--plot", tmp_path / "x.png")
    assert "pip install matplotlib" in err
    assert os.listdir(tmp_path) == []


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_draws_on_a_terminal_only():
    tty = Tty()
    with _progress.Progress("verifying x", 4 << 30, stream=tty, interval=0) as p:
        p.add(1 << 30)
        p._t0 -= 2  # as if two seconds had passed
        p.add(1 << 30)
        assert "2.00 GiB / 4.00 GiB (50%)" in p.line() and "GiB/s" in p.line()
        assert "left" in p.line()
    drawn = tty.getvalue()
    assert "verifying x: 1.00 GiB / 4.00 GiB (25%)" in drawn
    assert drawn.endswith("\r")  # the line is cleared at the end
    pipe = io.StringIO()
    with _progress.Progress("verifying x", 100, stream=pipe) as p:
        p.add(50)
        p.print("a result", file=pipe)
    assert pipe.getvalue() == "a result\n"
    with _progress.Progress("quiet", 100, stream=tty, enabled=False) as p:
        p.add(50)
    assert tty.getvalue() == drawn


def test_progress_follows_a_counter():
    tty = Tty()
    moved = [0]
    with _progress.Progress("converting", 1000, stream=tty, interval=0.01) as p:
        p.follow(lambda: moved[0])
        moved[0] = 600
        for _ in range(200):
            if p.done == 600:
                break
            time.sleep(0.01)
        assert p.done == 600
    assert "600 B / 1000 B (60%)" in tty.getvalue()
    assert _progress.io_bytes() > 0


def test_the_console_command_exits_with_the_status(ckpts, tmp_path):
    def cli(*argv):
        return subprocess.run(
            [sys.executable, "-m", "ckptio", *map(str, argv)], capture_output=True, text=True
        )

    r = cli("ls", ckpts["safetensors by safetensors"])
    assert r.returncode == 0 and "w: float32 [64x32]" in r.stdout and r.stderr == ""
    r = cli("ls", tmp_path / "missing.pt")
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    r = cli("verify")
    assert r.returncode == 2


def test_dcp_with_compressed_items(tmp_path, capsys):
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard

    folder = tmp_path / "zstd"
    writer = FileSystemWriter(folder, _extensions=[ZStandard()])
    dcp.save(state(), storage_writer=writer, no_dist=True)
    rc, out, _ = run(capsys, "inspect", folder)
    assert rc == 0 and "compressed" in out and "w: float32 [64x32]" in out, out
    rep = ckptio.verify(folder)
    assert rep.ok and {r.state for r in rep.records} == {"ok"}, rep  # decoded, then checked
    assert run(capsys, "verify", "-q", folder) == (0, "", "")


# --------------------------------------------------------------------------- review of 2026-12-06


def test_convert_keeps_a_safetensors_sources_metadata(tmp_path, capsys):
    cst.save_file({"w": torch.ones(2)}, tmp_path / "a.safetensors", metadata={"k": "v"})
    rc, _, _ = run(capsys, "convert", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert rc == 0 and cst.metadata(tmp_path / "b.safetensors") == {"format": "pt", "k": "v"}


def test_ls_writes_control_characters_in_names_as_escapes(tmp_path, capsys):
    names = {"a\nb\x1b[31m": torch.ones(2), "\u00fc": torch.ones(1)}
    cst.save_file(names, tmp_path / "e.safetensors")
    rc, out, _ = run(capsys, "ls", tmp_path / "e.safetensors")
    assert rc == 0 and "a\\nb\\x1b[31m: float32" in out and "\x1b" not in out
    assert "\u00fc: float32" in out


@pytest.mark.parametrize("args", [["--size", "4097"], ["--size", "1"], ["--repeat", "0"]])
def test_bench_refuses_sizes_and_rounds_it_cannot_run(tmp_path, capsys, args):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--dir", str(tmp_path), *args])
    assert e.value.code == 2 and "give" in capsys.readouterr().err


# --------------------------------------------------------------------------- review of the CLI


def test_clean_keeps_shards_and_data_files_of_other_writers(tmp_path, capsys):
    """Shards of the hub's names with no index (a save_pretrained before its index, a
    download in progress) and a live torch DCP writer's data files before its .metadata
    are no dead ckptio save's: clean leaves them; --unreferenced removes them."""
    hf = tmp_path / "hf"
    hf.mkdir()
    for i in (1, 2):
        st.save_file({f"t{i}": torch.ones(8)}, hf / f"model-0000{i}-of-00002.safetensors")
    (hf / "config.json").write_text("{}")
    before = sorted(os.listdir(hf))
    assert run(capsys, "clean", "-q", hf) == (0, "", "")
    assert ckptio.clean(hf) == [] and sorted(os.listdir(hf)) == before

    live = tmp_path / "live"
    seen = {}

    class Writer(dcp.FileSystemWriter):
        def finish(self, metadata, results):  # data files written, no .metadata yet
            seen["rc"] = run(capsys, "clean", "--json", live)
            return super().finish(metadata, results)

    sd = {"w": torch.randn(16, 16)}
    dcp.save(sd, storage_writer=Writer(live), no_dist=True)
    rc, out, _ = seen["rc"]
    assert rc == 0 and json.loads(out)["removed"] == []
    got = {"w": torch.empty(16, 16)}
    dcp.load(got, checkpoint_id=live, no_dist=True)
    assert torch.equal(got["w"], sd["w"])

    rc, out, _ = run(capsys, "clean", "--unreferenced", "--json", hf)
    assert rc == 0 and sorted(json.loads(out)["removed"]) == before[1:]
    assert os.listdir(hf) == ["config.json"]


def test_clean_removes_what_dead_ckptio_saves_left(tmp_path, capsys):
    """What carries the evidence of a dead ckptio save still goes: its own names (the
    token), and the generation a ckptio commit replaced (older than its index or
    .metadata); a torch writer's file newer than ckptio's .metadata stays."""
    d = tmp_path / "dcp"
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(d), no_dist=True)  # torch's names
    old = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))
    past = time.time() - 60
    for n in old:
        os.utime(d / n, (past, past))
    shutil.copytree(d, tmp_path / "keep")
    dcp.save(state(), storage_writer=FileSystemWriter(d), no_dist=True)
    for n in old:  # as if ckptio's save died between its commit and its sweep
        shutil.copy2(tmp_path / "keep" / n, d / n)
    (d / "__0_0123abcd_0.distcp").write_bytes(b"dead")  # a dead ckptio save's
    (d / "__1_0.distcp").write_bytes(b"live")  # a torch writer's, after the commit
    rc, out, _ = run(capsys, "clean", "--json", d)
    assert rc == 0 and sorted(json.loads(out)["removed"]) == sorted(["__0_0123abcd_0.distcp", *old])
    assert (d / "__1_0.distcp").exists()
    assert ckptio.verify(d).ok

    sh = tmp_path / "sharded"
    sd = {f"w{i}": torch.full((1024,), float(i)) for i in range(4)}
    cst.save_sharded(sd, sh, max_shard_size=8192)  # the hub's names
    hub = sorted(n for n in os.listdir(sh) if n.startswith("model-"))
    shutil.copytree(sh, tmp_path / "hub")
    for n in hub:
        os.utime(tmp_path / "hub" / n, (past, past))
    cst.save_sharded(sd, sh, max_shard_size=8192)  # names with a token: the hub's were taken
    assert not set(hub) & set(os.listdir(sh))
    for n in hub:  # the replaced generation, as if the save died before its sweep
        shutil.copy2(tmp_path / "hub" / n, sh / n)
    assert sorted(ckptio.clean(sh)) == hub
    assert set(cst.load_sharded(sh)) == set(sd)


def test_verify_into_a_closed_pipe_exits_with_its_verdict(tmp_path):
    """`ckptio verify BAD | head -n 2` exited 0: a broken pipe ended every command as
    done. The verdict now decides (1 for a damaged checkpoint, 0 for a sound one),
    however little of the report the reader took."""
    sd = {f"t{i}": torch.full((4,), float(i)) for i in range(3000)}  # 3006 lines: > a pipe
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    torch.save(sd, good)
    rec = next(r for r in ckptio.records(good) if r.name.endswith("/data/2999"))
    b = bytearray(good.read_bytes())
    b[rec.offset] ^= 0xFF
    bad.write_bytes(bytes(b))
    for path, rc in ((bad, 1), (good, 0)):
        for argv in (["verify"], ["verify", "--json"]):
            p = subprocess.Popen(
                [sys.executable, "-m", "ckptio", *argv, str(path)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert p.stdout.readline()  # the reader takes one line and goes
            p.stdout.close()
            err = p.stderr.read()
            assert p.wait(timeout=120) == rc, (argv, path, err)
            assert "Traceback" not in err and "Exception ignored" not in err, err
            assert (rec.name in err) == (rc == 1 and "--json" not in argv), err
    r = subprocess.run(
        f"{sys.executable} -m ckptio ls {good} | head -n 1; exit ${{PIPESTATUS[0]}}",
        shell=True, executable="/bin/bash", capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_verify_json_reports_a_damaged_dcp_metadata(ckpts, tmp_path, capsys):
    """verify --json printed no JSON for a DCP folder whose .metadata is damaged (the
    progress line's size pass raised first); now the report, ok false, exit 1."""
    d = tmp_path / "dcp"
    shutil.copytree(ckpts["DCP folder"], d)
    md = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(md[: len(md) // 2])
    rc, out, err = run(capsys, "verify", "--json", d)
    doc = json.loads(out)
    assert rc == 1 and err == "" and doc["ok"] is False and doc["format"] == describe.DCP
    assert ".metadata" in doc["error"] and "truncated" in doc["error"], doc
    assert "BAD" in failed(capsys, "verify", d)


def test_info_of_a_missing_folder_fails(tmp_path, capsys):
    """`ckptio info /no/such/folder` exited 0 (its probes said "no"); a folder that is
    not there, or a file, is now an error: one line, exit 1."""
    for argv in (["info"], ["info", "--json"]):
        err = failed(capsys, *argv, tmp_path / "nope")
        assert "FileNotFoundError" in err and "nope" in err, err
    (tmp_path / "f").write_text("x")
    assert "NotADirectoryError" in failed(capsys, "info", tmp_path / "f")
    rc, out, _ = run(capsys, "info", tmp_path)
    assert rc == 0 and f"folder {tmp_path}:" in out


class _Runs:
    """Pickled as a call of os.mkdir: whoever unpickles it makes the folder."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_ls_lists_a_checkpoint_torch_loads_only_without_weights_only(tmp_path, capsys):
    """ls and inspect refused a sound checkpoint holding an argparse.Namespace (torch's
    weights_only refusal) that verify accepts; now its records and tensors are listed
    from a scan of the pickle that runs none of it (a global that would run is not run)."""
    import argparse

    p = tmp_path / "ns.pt"
    ran = tmp_path / "ran"
    model = torch.nn.Linear(2, 3)
    obj = {
        "hparams": argparse.Namespace(lr=0.1, t=torch.ones(2)),
        "model": model.state_dict(),
        "p": torch.nn.Parameter(torch.zeros(4)),
        "view": torch.arange(10.0)[2:5],
        "hook": _Runs(str(ran)),
    }
    torch.save(obj, p)
    assert run(capsys, "verify", "-q", p) == (0, "", "")
    for cmd in ("ls", "inspect"):
        rc, out, err = run(capsys, cmd, p)
        assert rc == 0 and err == "", err
        for line in (
            "- hparams.t: float32 [2]",
            "- model.weight: float32 [3x2]",
            "- p: float32 [4]",
        ):
            assert line in out, (line, out)
        assert "- view: float32 [3] at element 2" in out, out
    rc, out, _ = run(capsys, "ls", "--json", p)
    names = {t["name"] for e in json.loads(out)["entries"] for t in e["tensors"]}
    assert rc == 0 and names == {"hparams.t", "model.weight", "model.bias", "p", "view"}
    assert not ran.exists()


# ------------------------------------------------------------------- review of the tools layer

EVIL = "w\x1b[2J\x1b[32mALL GOOD\x1b[0m\nfake"  # clears the screen, prints green, splits a line


def test_names_from_a_checkpoint_are_printed_as_escapes_by_every_command(tmp_path, capsys):
    """verify printed record and item names as the checkpoint holds them (a DCP item
    named EVIL cleared the screen and split its line), in its lines and in the
    summary on stderr, and inspect in its metadata list; ls escaped them. Every
    command now writes such a name as ls does, and so do error lines."""
    d = tmp_path / "d"
    sd = {EVIL: torch.randn(1000), "ok": torch.ones(3), "cfg": {EVIL: "x"}}
    dcp.save(sd, storage_writer=FileSystemWriter(d), no_dist=True)
    shown = "w\\x1b[2J\\x1b[32mALL GOOD\\x1b[0m\\nfake"
    n = len(ckptio.verify(d).records)
    for cmd in ("verify", "ls", "inspect"):
        rc, out, err = run(capsys, cmd, d)
        assert rc == 0 and err == "" and "\x1b" not in out and shown in out, (cmd, out)
        assert all(shown in line for line in out.splitlines() if "fake" in line), out
    assert len(run(capsys, "verify", d)[1].splitlines()) == n + 1

    data = next(d.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[800] ^= 1  # inside EVIL's tensor bytes (its data record starts at 704)
    data.write_bytes(bytes(raw))
    rc, out, err = run(capsys, "verify", d)
    assert rc == 1 and "\x1b" not in out + err and err.count("\n") == 1, err
    assert f"do not match: {shown} (" in err, err
    with pytest.raises(ckptio.FormatError) as ei:
        ckptio.verify(d).raise_if_bad()
    assert shown in str(ei.value) and "\x1b" not in str(ei.value)

    junk = tmp_path / f"{EVIL}.bin"  # a path in an error line: colours dropped, the rest escaped
    junk.write_bytes(b"not a checkpoint at all")
    for cmd in ("ls", "verify"):
        err = failed(capsys, cmd, junk)
        assert "\x1b" not in err and "w\\x1b[2J" in err and ".bin: " in err, err


def test_names_that_are_no_utf8_are_printed_escaped(tmp_path):
    """clean removed a dead save's temp file whose name is no UTF-8, then failed to
    print it (UnicodeEncodeError on a strict stdout, exit 1); ls and convert of such a
    path failed the same way. The bytes are now printed as \\xNN, exit 0."""
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    folder = os.fsencode(tmp_path)
    temp = folder + b"/.\xff.ckptio-1-0123456789abcdef.tmp"
    with open(temp, "wb") as f:
        f.write(b"left by a dead save")
    model = folder + b"/m\xff.pt"
    torch.save({"w": torch.ones(2)}, os.fsdecode(model))

    def cli(*argv):
        r = subprocess.run(
            [sys.executable, "-m", "ckptio", *argv], env=env, capture_output=True, timeout=120
        )
        assert r.returncode == 0 and r.stderr == b"", (argv, r.stderr)
        return r.stdout.decode()

    out = cli("clean", folder)
    assert ".\\xff.ckptio-1-0123456789abcdef.tmp\n" in out and "1 files" in out, out
    assert not os.path.exists(temp)
    for cmd in ("ls", "verify"):  # the path in the listing's header, in the summary
        assert "m\\xff.pt" in cli(cmd, model)
    out = cli("convert", model, folder + b"/\xfe.safetensors")
    assert "m\\xff.pt (torch) -> " in out and "\\xfe.safetensors (safetensors)" in out, out
    sub = folder + b"/d\xff"
    os.mkdir(sub)
    assert "d\\xff:" in cli("info", sub)  # the folder it probes, in its line


@pytest.mark.parametrize(
    "writer", [FileSystemWriter, dcp.FileSystemWriter], ids=["ckptio", "torch"]
)
@pytest.mark.parametrize("values", [True, False], ids=["with-values", "tensors-only"])
def test_safetensors_format_dcp_items_are_unchecked_not_corrupted(tmp_path, capsys, writer, values):
    """A DCP folder written with SerializationFormat.SAFETENSORS (its tensors one
    safetensors blob per data file, no torch.save zips) was called corrupted by verify,
    ls and inspect ("no end-of-central-directory record"). Its tensor items are now
    "unchecked" (no CRC-32; no DCP reader reads them as items), its values checked as
    any, exit 0; a damaged torch.save item is still damage."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    d = tmp_path / "st"
    sd = {"w": torch.randn(100), "b": torch.arange(6)} | ({"cfg": {"lr": 0.5}} if values else {})
    w = writer(d, serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(sd, storage_writer=w, no_dist=True)
    rep = ckptio.verify(d)
    assert rep.ok and rep.error is None, rep.summary()
    assert sorted(r.name.split(" ")[0] for r in rep.unchecked) == ["b", "w"], rep.records
    assert all(r.state == "ok" for r in rep.records if r.name.startswith("cfg.lr"))
    assert any(r.name.startswith("cfg.lr") for r in rep.records) == values
    rc, out, err = run(capsys, "verify", d)
    assert rc == 0 and err == "" and "unchecked  w (" in out and ", 2 unchecked" in out, out
    rc, out, err = run(capsys, "ls", d)
    assert rc == 0 and err == "" and "w: float32 [100]" in out and "b: int64 [6]" in out, out
    rc, out, err = run(capsys, "inspect", d)
    assert rc == 0 and "safetensors-format items 2 (not read here)" in out, out
    crcs = {e.name: e.crc for e in ckptio.listing(d).entries}
    assert crcs == {"w": "safetensors", "b": "safetensors"} | ({"cfg.lr": "none"} if values else {})

    d2 = tmp_path / "zip"  # a torch.save item whose zip lost its end: damage
    dcp.save({"w": torch.randn(100)}, storage_writer=FileSystemWriter(d2), no_dist=True)
    data = next(d2.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-30])
    assert "BAD" in failed(capsys, "verify", d2)
    assert "corrupted" in failed(capsys, "ls", d2)


def test_listing_takes_the_paths_verify_and_records_take(ckpts):
    """ckptio.listing(b"x.pt") raised the core's TypeError ('bytes' object is not an
    instance of 'str') where verify and records take bytes; it now takes str, bytes and
    os.PathLike alike, and anything else is a TypeError naming ckptio.listing."""
    for label in ("torch.save by ckptio", "safetensors by ckptio", "DCP folder"):
        p = ckpts[label]
        want = ckptio.listing(str(p))
        assert ckptio.listing(os.fsencode(p)) == want == ckptio.listing(p)
        assert ckptio.verify(os.fsencode(p)).ok
    with pytest.raises(TypeError, match="ckptio.listing needs a file path"):
        ckptio.listing(3)


def test_a_safetensors_file_cut_inside_its_header_is_named_so(tmp_path, capsys):
    """A safetensors file truncated inside its header was "not a checkpoint ckptio reads
    (it starts with b'...')": its header length runs past the end, so detection took it
    for nothing known. A plausible header length with the header's '{' after it is now a
    SafetensorError saying the header is truncated (its length, the file's)."""
    whole = tmp_path / "whole.safetensors"
    cst.save_file({"w": torch.ones(4)}, whole)
    data = whole.read_bytes()
    n = int.from_bytes(data[:8], "little")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:40])
    says = f"header length {n} runs past the end of the file (40 bytes): the header is truncated"
    for cmd in ("ls", "verify"):
        err = failed(capsys, cmd, cut)
        assert says in err and "not a checkpoint ckptio reads" not in err, err
    with pytest.raises(ckptio.safetensors.SafetensorError, match=re.escape(says)):
        describe.detect(cut)
    cut.write_bytes(data[:8] + b"[" + data[9:40])  # no '{': nothing ckptio knows, as before
    assert "not a checkpoint ckptio reads" in failed(capsys, "ls", cut)
