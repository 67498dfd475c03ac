"""Drop-in fidelity, round 2 (issue 34): torch's own messages, and every switch of
torch.save / torch.load / torch.serialization honoured, refused by name, or a
documented choice (the table "torch's switches" of docs/api-conventions.md)."""

import inspect
import mmap
import os
import pathlib
import pickle
import re
import zipfile

import ckptio
import pytest
import torch
from torch.utils.serialization import config

HERE = pathlib.Path(__file__).resolve().parent
DOCS = (HERE.parent / "docs" / "api-conventions.md").read_text()


class Point:
    """A class torch's weights_only unpickler refuses by default."""

    def __init__(self, x: int = 3) -> None:
        self.x = x


def sample():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(512, 600, generator=g),  # 1.2 MB: a large storage
        "small": torch.arange(100, dtype=torch.int64),
        "half": torch.ones(7).half(),
        "view": torch.arange(30.0)[5:],
    }


def same(a, b):
    """Same keys, dtypes, shapes and bytes (NaNs of byte-swapped floats included)."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k].contiguous(), b[k].contiguous()
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k


def data_offsets(path):
    # weights_only=False: some files here are pickled at protocol 4, which torch's
    # weights_only unpickler (and so ckptio's) refuses.
    records = ckptio.records(path, weights_only=False)
    return {r.name: r.offset for r in records if "/data/" in r.name}


@pytest.fixture
def switches():
    """Restore torch's serialization config after a test changed it."""
    saved = {
        "save": {k: getattr(config.save, k) for k in ("storage_alignment", "compute_crc32")},
        "load": {
            k: getattr(config.load, k)
            for k in ("mmap", "mmap_flags", "endianness", "calculate_storage_offsets")
        },
    }
    yield config
    for part, values in saved.items():
        for k, v in values.items():
            setattr(getattr(config, part), k, v)


# --------------------------------------------------------------------------- messages


def _refusal(fn, *args, **kw):
    with pytest.raises(pickle.UnpicklingError) as e:
        fn(*args, **kw)
    return e


def test_a_refused_pickle_keeps_torchs_whole_message_and_type(tmp_path):
    p = tmp_path / "obj.pt"
    torch.save({"p": Point(), "t": torch.ones(3)}, p)
    theirs = _refusal(torch.load, p)
    ours = _refusal(ckptio.load, p)
    assert type(ours.value) is type(theirs.value)
    # torch's message, whole and unchanged at its start; the file follows it.
    assert str(ours.value).startswith(str(theirs.value))
    assert str(p) in str(ours.value)
    msg = str(ours.value)
    assert msg.startswith("Weights only load failed")
    assert f"GLOBAL {__name__}.Point was not an allowed global by default" in msg
    assert "torch.serialization.add_safe_globals([" in msg
    # the advice works
    with torch.serialization.safe_globals([Point]):
        assert ckptio.load(p)["p"].x == 3
    # and the same through a file object, and in place
    with open(p, "rb") as f:
        assert str(_refusal(ckptio.load, f).value).startswith(str(theirs.value))
    out = {"p": None, "t": torch.zeros(3)}
    assert str(_refusal(ckptio.load, p, out=out).value).startswith(str(theirs.value))


@pytest.mark.parametrize(
    "env", ["TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]
)
def test_the_environment_resolves_weights_only_as_for_torch(tmp_path, monkeypatch, env):
    p = tmp_path / "obj.pt"
    torch.save({"p": Point(), "t": torch.ones(3)}, p)
    monkeypatch.setenv(env, "1")
    for kw in ({}, {"weights_only": False}, {"weights_only": True}):
        try:
            want = torch.load(p, **kw)
        except pickle.UnpicklingError as e:
            got = _refusal(ckptio.load, p, **kw)
            assert str(got.value).startswith(str(e)), kw
            continue
        got = ckptio.load(p, **kw)
        assert got["p"].x == want["p"].x and torch.equal(got["t"], want["t"]), kw


def test_the_weights_only_warning_points_at_the_caller(tmp_path, monkeypatch):
    p = tmp_path / "t.pt"
    torch.save({"t": torch.ones(3)}, p)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") as got:
        ckptio.load(p)
    assert got[0].filename == __file__, got[0].filename


def test_both_environment_switches_at_once_is_torchs_error(tmp_path, monkeypatch):
    p = tmp_path / "t.pt"
    torch.save({"t": torch.ones(3)}, p)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(RuntimeError) as theirs:
        torch.load(p)
    with pytest.raises(RuntimeError) as ours:
        ckptio.load(p)
    assert str(ours.value) == str(theirs.value)


def test_a_corrupt_archive_says_what_torch_says_and_where(tmp_path):
    p = tmp_path / "t.pt"
    ckptio.save(sample(), p)
    raw = p.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(raw[: len(raw) // 2])
    hint = "high likelihood that your checkpoint file is corrupted"
    with pytest.raises(RuntimeError, match=hint):
        torch.load(cut)
    with pytest.raises(ckptio.FormatError) as e:
        ckptio.load(cut)
    msg = str(e.value)
    assert isinstance(e.value, RuntimeError)
    assert str(cut) in msg and "end-of-central-directory" in msg  # ckptio's precision
    assert "there is a high likelihood that your checkpoint file is corrupted" in msg
    # a record's bytes flipped: verify names the record, in the same words
    flipped = bytearray(raw)
    off = data_offsets(p)["archive/data/0"]
    flipped[off + 10] ^= 0xFF
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ckptio.FormatError) as e:
        ckptio.load(bad, verify=True)
    assert "archive/data/0" in str(e.value) and "high likelihood" in str(e.value)
    report = ckptio.verify(bad)
    assert not report.ok and [r.name for r in report.bad] == ["archive/data/0"]
    with pytest.raises(ckptio.FormatError, match="high likelihood"):
        report.raise_if_bad()


# --------------------------------------------------------------------------- save switches


def test_storage_alignment_set_by_the_user_aligns_every_storage(tmp_path, switches):
    sd = sample()
    p = tmp_path / "a.pt"
    ckptio.save(sd, p)
    offs = data_offsets(p)
    # torch's default: small storages packed at 64 bytes, large ones at 4 KiB
    assert all(o % 64 == 0 for o in offs.values())
    assert any(o % 4096 for o in offs.values())
    for align in (128, 512, 4096, 32768):
        switches.save.storage_alignment = align  # the GDS tutorial's first step, at 4096
        ckptio.save(sd, p)
        offs = data_offsets(p)
        assert all(o % align == 0 for o in offs.values()), (align, offs)
        assert all(o % 4096 == 0 for n, o in offs.items() if n.endswith("/0")), offs
        same(torch.load(p), sd)
        same(ckptio.load(p), sd)
        with zipfile.ZipFile(p) as z:
            assert z.testzip() is None
            uniform = align >= 4096
            assert (f"{z.namelist()[0].split('/')[0]}/.format_version" in z.namelist()) == uniform
        # torch's offset calculation finds the storages where they are
        switches.load.calculate_storage_offsets = True
        same(torch.load(p, mmap=True), sd)
        switches.load.calculate_storage_offsets = False


def test_storage_alignment_reaches_file_objects_and_torchs_pickle(tmp_path, switches):
    switches.save.storage_alignment = 4096
    sd = sample()
    p = tmp_path / "f.pt"
    with open(p, "wb") as f:  # a regular file: metadata by torch, storages by the engine
        ckptio.save(sd, f)
    assert all(o % 4096 == 0 for o in data_offsets(p).values())
    q = tmp_path / "proto.pt"
    ckptio.save(sd, q, pickle_protocol=4)  # torch pickles; ckptio moves the storages
    assert all(o % 4096 == 0 for o in data_offsets(q).values())
    switches.save.storage_alignment = 1 << 14
    ckptio.save(sd, q, pickle_protocol=4)
    assert all(o % (1 << 14) == 0 for o in data_offsets(q).values())
    # protocol 4 (FRAME, MEMOIZE...): beyond torch's weights_only unpickler, so beyond ckptio.load's
    same(ckptio.load(q, weights_only=False), sd)


@pytest.mark.parametrize("bad", [100, 3, 0, -4096, 65536, 4096.0, "4096"])
def test_storage_alignment_ckptio_cannot_write_is_refused_by_name(tmp_path, switches, bad):
    switches.save.storage_alignment = bad
    p = tmp_path / "a.pt"
    for kw in ({}, {"pickle_protocol": 4}):
        with pytest.raises(ValueError, match=r"config\.save\.storage_alignment is"):
            ckptio.save(sample(), p, **kw)
        assert not p.exists()  # refused before anything was written
    with open(tmp_path / "f.pt", "wb") as f, pytest.raises(ValueError, match="storage_alignment"):
        ckptio.save(sample(), f)


def test_compute_crc32_off_still_stores_real_crcs(tmp_path, switches):
    """ckptio's documented choice (docs/api-conventions.md): every record keeps a
    real CRC-32, where torch writes 0 and Python's zipfile refuses its file."""
    sd = sample()
    torch_file, ours = tmp_path / "torch.pt", tmp_path / "ours.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(sd, torch_file)
        ckptio.save(sd, ours)
        ckptio.save(sd, tmp_path / "proto.pt", pickle_protocol=4)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(torch_file) as z, pytest.raises(zipfile.BadZipFile, match="Bad CRC-32"):
        z.read(z.namelist()[0])
    for p in (ours, tmp_path / "proto.pt"):
        with zipfile.ZipFile(p) as z:
            assert z.testzip() is None
        assert ckptio.verify(p).ok and not ckptio.verify(p).unchecked
        same(torch.load(p, weights_only=False), sd)


@pytest.mark.parametrize("pinned", [False, True])
def test_use_pinned_memory_for_d2h_makes_the_same_file(tmp_path, switches, pinned):
    switches.save.use_pinned_memory_for_d2h = pinned
    try:
        sd = sample()
        if torch.cuda.is_available():
            sd = {k: v.cuda() for k, v in sd.items()}
        ckptio.save(sd, tmp_path / "a.pt")
        same(torch.load(tmp_path / "a.pt", map_location="cpu"), {k: v.cpu() for k, v in sd.items()})
    finally:
        switches.save.use_pinned_memory_for_d2h = False


def test_skip_data_saves_no_storage_bytes_as_torch(tmp_path):
    sd = sample()
    with torch.serialization.skip_data():
        torch.save(sd, tmp_path / "torch.pt")
        ckptio.save(sd, tmp_path / "ours.pt")
        with open(tmp_path / "obj.pt", "wb") as f:
            ckptio.save(sd, f)
    assert "skip_data" in ckptio.last_report().direct_reason
    want = torch.load(tmp_path / "torch.pt")
    for name in ("ours.pt", "obj.pt"):
        got = torch.load(tmp_path / name)
        same(got, want)  # the storages' space left empty
        assert not torch.equal(got["big"], sd["big"])


def test_skip_data_loads_read_nothing_as_torch_and_in_place_refuses(tmp_path):
    p = tmp_path / "t.pt"
    sd = sample()
    ckptio.save(sd, p)
    with torch.serialization.skip_data():
        got = ckptio.load(p)
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in sd.items()}
        assert "skip_data" in ckptio.last_report().direct_reason
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        with pytest.raises(ckptio.CkptioError, match="skip_data"):
            ckptio.load(p, out=out)
        model = torch.nn.Linear(600, 512)
        ckptio.save(model.state_dict(), tmp_path / "m.pt")
        with pytest.raises(ckptio.CkptioError, match="skip_data"):
            ckptio.load_state_dict(model, tmp_path / "m.pt")
    assert all(not v.any() for v in out.values())  # untouched


# --------------------------------------------------------------------------- load switches


def test_config_load_mmap_decides_when_mmap_is_none(tmp_path, switches):
    p = tmp_path / "t.pt"
    sd = sample()
    ckptio.save(sd, p)
    switches.load.mmap = True
    same(ckptio.load(p), sd)
    assert "mmap" in ckptio.last_report().direct_reason
    same(ckptio.load(p, mmap=False), sd)  # the argument wins, as in torch
    assert "mmap" not in (ckptio.last_report().direct_reason or "")


@pytest.mark.parametrize("flags", [mmap.MAP_PRIVATE, mmap.MAP_SHARED])
def test_mmap_flags_are_torchs(tmp_path, flags):
    p = tmp_path / "t.pt"
    ckptio.save({"w": torch.zeros(4096)}, p)
    before = p.read_bytes()
    with torch.serialization.set_default_mmap_options(flags):
        t = ckptio.load(p, mmap=True)["w"]
        t += 1
        del t
    changed = p.read_bytes() != before
    assert changed == (flags == mmap.MAP_SHARED)


def _without_byteorder(src, dst):
    """A copy of a torch.save archive without its byteorder record (as files from
    torch before 2.1 are; torch now writes the record even with
    _disable_byteorder_record=True)."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as out:
        for name in z.namelist():
            if not name.endswith("/byteorder"):
                out.writestr(name, z.read(name))


@pytest.mark.parametrize("endianness", ["LITTLE", "BIG", "NATIVE", None])
def test_load_endianness_of_files_without_a_byteorder_record(tmp_path, endianness):
    p = tmp_path / "t.pt"
    sd = sample()
    ckptio.save(sd, tmp_path / "with.pt")
    _without_byteorder(tmp_path / "with.pt", p)
    old = torch.serialization.get_default_load_endianness()
    value = None if endianness is None else torch.serialization.LoadEndianness[endianness]
    torch.serialization.set_default_load_endianness(value)
    try:
        want = torch.load(p)
        same(ckptio.load(p), want)
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        ckptio.load(p, out=out)
        same(out, want)
    finally:
        torch.serialization.set_default_load_endianness(old)
    swapped = endianness == "BIG"
    assert torch.equal(want["big"], sd["big"]) != swapped


def test_calculate_storage_offsets_reads_ckptios_files_right(tmp_path, switches):
    sd = sample()
    p = tmp_path / "t.pt"
    ckptio.save(sd, p)  # small storages packed: torch must not compute offsets here
    switches.load.calculate_storage_offsets = True
    same(torch.load(p, mmap=True), sd)
    same(torch.load(p), sd)
    same(ckptio.load(p), sd)
    same(ckptio.load(p, mmap=True), sd)


# --------------------------------------------------------------------------- every switch


def _torch_names():
    """Every switch the installed torch has: torch.save's and torch.load's
    parameters, torch.utils.serialization.config's fields, torch.serialization's
    setters and context managers, and the environment variables it reads."""
    names = set()
    for fn in (torch.save, torch.load):
        for p in inspect.signature(fn).parameters.values():
            star = "**" if p.kind == inspect.Parameter.VAR_KEYWORD else ""
            names.add(f"{fn.__name__}({star}{p.name})")
    for part in ("save", "load"):
        for field in vars(getattr(config, part)):
            if not field.startswith("_"):
                names.add(f"config.{part}.{field}")
    setters = ("set_", "add_", "clear_", "register_", "enable_", "disable_", "use_")
    for n in torch.serialization.__all__:
        obj = getattr(torch.serialization, n)
        if n.startswith(setters) or (isinstance(obj, type) and hasattr(obj, "__enter__")):
            names.add(f"torch.serialization.{n}")
    src = inspect.getsource(torch.serialization)
    names |= set(re.findall(r"""(?:getenv|environ\.get)\(\s*["']([A-Z0-9_]+)["']""", src))
    return names


VERDICTS = ("honoured", "refused", "no effect", "differs")


def _decided():
    """switch -> verdict, from the table of docs/api-conventions.md."""
    section = DOCS.split("## torch's switches", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in re.findall(r"^\| (`.*?) \| (.*?) \|$", section, re.M):
        for name in re.findall(r"`([^`]+)`", row[0]):
            if name.isidentifier() and name.islower():  # `safe_globals` after its module
                name = f"torch.serialization.{name}"
            out[name] = row[1]
    return out


def test_every_torch_switch_is_decided():
    """A switch that a new torch adds fails here until ckptio honours it, refuses
    it by name, or says its choice in docs/api-conventions.md."""
    names = _torch_names()
    assert len(names) > 20  # the enumeration found torch's switches
    decided = _decided()
    missing = sorted(names - decided.keys())
    assert not missing, f"torch switches docs/api-conventions.md does not decide: {missing}"
    for name, verdict in decided.items():
        assert verdict.startswith(VERDICTS), (name, verdict)


def test_the_readme_states_the_alignment_that_is_true():
    readme = (HERE.parent / "README.md").read_text()
    assert "storages 4 KiB-aligned" not in readme
    assert "storage_alignment" in readme


def test_no_warning_on_import(tmp_path):
    """A user's first command prints nothing that looks broken (torch warns when
    numpy is missing: ckptio depends on it)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import ckptio.tools.cli, numpy"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "default"},
        check=False,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    pyproject = (HERE.parent / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    assert '"numpy"' in deps
