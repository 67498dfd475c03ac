"""Bad input and faults: every failure is a clear exception, never a crash or wrong data.

Each test checks (a) the exception type (for OSError: errno, subclass and the
path in ``.filename`` or the message), (b) that a checkpoint saved earlier at
the same path still loads bit-exact with ``ckptio.load`` and ``torch.load``,
and (c) that no temp file ``.<name>.ckptio-<pid>-<nonce>.tmp`` is left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import faulthandler
import hashlib
import io
import json
import os
import pickle
import pickletools
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ckptio
import ckptio.safetensors as cst
import pytest
import torch

TEMP_RE = re.compile(r"^\.(?P<target>.+)\.ckptio-(?P<pid>\d+)-[0-9a-f]{16}\.tmp$")
MIB = 2**20
IS_ROOT = os.geteuid() == 0


# --------------------------------------------------------------------------- helpers


def temps(folder: Path) -> list[str]:
    """ckptio temp files in ``folder``."""
    return sorted(n for n in os.listdir(folder) if TEMP_RE.match(n))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: Any, want: Any, where: str = "obj") -> None:
    """Bit-exact equality of nested containers of tensors (dtype, shape, stride, bytes)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        meta = (got.dtype, got.shape, got.stride())
        assert meta == (want.dtype, want.shape, want.stride()), where
        assert tensor_bytes(got) == tensor_bytes(want), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def sample_state(seed: int = 0, n: int = 4096) -> dict[str, Any]:
    """A small state dict with NaN / -0.0 floats, bf16, ints and a view sharing a storage."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g)
    w[0], w[1] = float("nan"), -0.0
    return {
        "w": w,
        "w_view": w[10:20],
        "i": torch.arange(1000, dtype=torch.int64) * (seed + 1),
        "h": torch.randn(300, generator=g).to(torch.bfloat16),
        "step": 7 + seed,
    }


@dataclasses.dataclass
class Prev:
    """A checkpoint saved before the fault, and what it must still hold afterwards."""

    path: Path
    obj: Any
    digest: str

    def assert_intact(self) -> None:
        """Same bytes on disk, loads bit-exact with ckptio and torch, no temp file left."""
        assert self.path.is_file(), f"{self.path} is gone"
        assert sha256(self.path) == self.digest, f"{self.path} was modified"
        assert_same(ckptio.load(self.path), self.obj)
        assert_same(torch.load(self.path, weights_only=True), self.obj)
        assert temps(self.path.parent) == []


def make_prev(path: Path, obj: Any = None, **kw: Any) -> Prev:
    obj = sample_state() if obj is None else obj
    ckptio.save(obj, path, **kw)
    return Prev(path, obj, sha256(path))


def refers_to(filename: str | None, message: str, target: Path, folder_ok: bool = False) -> bool:
    """The error names the target, a temp file beside it, or (folder_ok) its folder."""
    if str(target) in message or filename == str(target):
        return True
    parent = str(target.parent)
    if folder_ok and filename == parent:
        return True
    for name in [filename] + re.findall(r"[^\s'\"()]+", message):
        if name and os.path.dirname(name) == parent:
            m = TEMP_RE.match(os.path.basename(name))
            if m and m["target"] == target.name:
                return True
    return False


def assert_os_error(
    exc: BaseException, cls: type[OSError], err: int, target: Path, folder_ok: bool = False
) -> None:
    assert isinstance(exc, cls), f"{type(exc).__name__}: {exc}"
    assert exc.errno == err, f"errno {exc.errno}, not {err}: {exc}"
    fname = None if exc.filename is None else os.fsdecode(os.fspath(exc.filename))
    assert refers_to(fname, str(exc), target, folder_ok), (
        f"neither .filename ({exc.filename!r}) nor the message ({exc}) names {target}"
    )


CHILD_PRELUDE = """
import json, os, sys
import torch, ckptio

def attempt(fn):
    try:
        fn()
    except BaseException as e:
        fname = getattr(e, "filename", None)
        return {"type": type(e).__name__, "errno": getattr(e, "errno", None),
                "filename": None if fname is None else os.fsdecode(os.fspath(fname)),
                "message": str(e)}
    return {"type": None}

def fork_kill(delay, work):
    # work() in a forked child (a warm process: a trial costs the work, not an interpreter
    # start), SIGKILLed after delay seconds (None: it runs to its end).
    import signal, time
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            work()
            os._exit(0)
        except BaseException:
            os._exit(3)
    if delay is not None:
        # The child is not reaped yet (at worst a zombie): its pid cannot name another process.
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return {"pid": pid, "status": status, "seconds": time.perf_counter() - t0,
            "killed": os.WIFSIGNALED(status)}
"""


def fork_trial(server: subprocess.Popen, args: str, killed: set[int]) -> dict:
    """One trial of a fork server (a child looping over stdin, running fork_kill): send
    ``go <args>``, read its result; the pid goes into ``killed`` if it was SIGKILLed."""
    server.stdin.write(f"go {args}\n")
    server.stdin.flush()
    r = json.loads(server.stdout.readline())
    if r["killed"]:
        killed.add(r["pid"])
    return r


@contextlib.contextmanager
def ready_children(script: str, n: int, *args: Any) -> Iterator[list[subprocess.Popen]]:
    """``n`` interpreters running CHILD_PRELUDE + ``script`` with ``args``, each
    started and waiting (it printed "ready") for :func:`go`; any still alive at
    the end is killed."""
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + script, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "ready"
        yield children
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def go(child: subprocess.Popen) -> None:
    child.stdin.write("go\n")
    child.stdin.flush()


def sigkill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL


def run_child(script: str, *args: Any, timeout: float = 120) -> Any:
    """Run CHILD_PRELUDE + script in a fresh interpreter; its last stdout line is JSON."""
    r = subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"child exited with {r.returncode}:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_child_os_error(res: dict, cls: type[OSError], err: int, target: Path, **kw: Any) -> None:
    assert res["type"] == cls.__name__, res
    assert res["errno"] == err, res
    assert refers_to(res["filename"], res["message"], target, **kw), (
        f"neither .filename ({res['filename']!r}) nor the message ({res['message']!r}) "
        f"names {target}"
    )


# --------------------------------------------------------------------------- 1. paths


def test_save_to_a_folder_is_isadirectoryerror(tmp_path):
    """Saving onto an existing folder raises IsADirectoryError naming it and leaves no temp."""
    target = tmp_path / "ckpt.pt"
    target.mkdir()
    with pytest.raises(OSError) as ei:
        ckptio.save(sample_state(), target)
    assert_os_error(ei.value, IsADirectoryError, errno.EISDIR, target)
    assert ei.value.strerror.startswith("save failed: "), ei.value.strerror  # was "save to failed"
    assert target.is_dir() and list(target.iterdir()) == []
    assert temps(tmp_path) == []


@pytest.mark.parametrize("fn", ["load", "records"])
def test_load_of_a_folder_is_isadirectoryerror(tmp_path, fn):
    """load/records of a folder raise IsADirectoryError naming it."""
    with pytest.raises(OSError) as ei:
        getattr(ckptio, fn)(tmp_path)
    assert_os_error(ei.value, IsADirectoryError, errno.EISDIR, tmp_path)


def test_save_into_missing_folder_is_filenotfounderror(tmp_path):
    """Saving under a folder that does not exist raises FileNotFoundError and creates nothing."""
    target = tmp_path / "no" / "such" / "ckpt.pt"
    with pytest.raises(OSError) as ei:
        ckptio.save(sample_state(), target)
    assert_os_error(ei.value, FileNotFoundError, errno.ENOENT, target, folder_ok=True)
    assert os.listdir(tmp_path) == []


def test_save_under_a_file_is_notadirectoryerror(tmp_path):
    """Saving to a path whose 'folder' is a regular file raises NotADirectoryError."""
    prev = make_prev(tmp_path / "ckpt.pt")
    target = prev.path / "inner.pt"
    with pytest.raises(OSError) as ei:
        ckptio.save(sample_state(1), target)
    assert_os_error(ei.value, NotADirectoryError, errno.ENOTDIR, target, folder_ok=True)
    prev.assert_intact()


@pytest.mark.parametrize("fn", ["load", "records"])
@pytest.mark.parametrize("where", ["missing_file", "missing_folder"])
def test_load_of_missing_file_is_filenotfounderror(tmp_path, fn, where):
    """load/records of a path that does not exist raise FileNotFoundError naming it."""
    target = tmp_path / "ckpt.pt" if where == "missing_file" else tmp_path / "no" / "ckpt.pt"
    with pytest.raises(OSError) as ei:
        getattr(ckptio, fn)(target)
    assert_os_error(ei.value, FileNotFoundError, errno.ENOENT, target, folder_ok=True)


def test_oserror_filename_is_a_plain_str(tmp_path):
    """OSError.filename is the str path (as open() gives it), not a PosixPath repr in the text."""
    target = tmp_path / "missing.pt"
    with pytest.raises(FileNotFoundError) as ei:
        ckptio.load(str(target))
    assert ei.value.filename == str(target)
    assert type(ei.value.filename) is str, type(ei.value.filename)
    assert "PosixPath(" not in str(ei.value), str(ei.value)


NOBODY = 65534

NOBODY_SCRIPT = """
import ctypes
ro_ckpt, secret, rw_new, warm = map(str, sys.argv[1:5])
# Import everything torch and ckptio load lazily while still root (the interpreter
# lives where nobody may not read), then drop to nobody for good.
ckptio.save({"x": torch.ones(4)}, warm)
ckptio.load(warm)
ckptio.records(warm)
torch.load(warm)
os.remove(warm)
os.setgroups([])
os.setgid(NOBODY)
os.setuid(NOBODY)
# setuid makes the process non-dumpable, which hides /proc/self/fd from it; an
# ordinary unprivileged process has it.
ctypes.CDLL(None, use_errno=True).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
out = {"uid": os.geteuid()}
out["load_ro"] = attempt(lambda: ckptio.load(ro_ckpt))
out["save_ro"] = attempt(lambda: ckptio.save({"y": torch.zeros(1024)}, ro_ckpt))
out["load_secret"] = attempt(lambda: ckptio.load(secret))
out["records_secret"] = attempt(lambda: ckptio.records(secret))
out["save_rw"] = attempt(lambda: ckptio.save({"y": torch.zeros(1024)}, rw_new))
print(json.dumps(out))
""".replace("NOBODY", str(NOBODY))


@pytest.fixture(scope="module")
def nobody_run():
    """As nobody: load/save in a read-only folder, load a 0600 root file, save where allowed."""
    if not IS_ROOT:
        pytest.skip("needs root to drop privileges to nobody")
    # pytest's tmp_path lies under a 0700 folder that nobody cannot enter at all.
    base = Path(tempfile.mkdtemp(prefix="ckptio-faults-perm-"))
    try:
        base.chmod(0o755)
        ro, rw = base / "ro", base / "rw"
        ro.mkdir()
        rw.mkdir()
        rw.chmod(0o777)
        prev = make_prev(ro / "ckpt.pt")
        prev.path.chmod(0o644)
        secret = make_prev(ro / "secret.pt", sample_state(3))
        secret.path.chmod(0o600)
        ro.chmod(0o555)
        res = run_child(NOBODY_SCRIPT, prev.path, secret.path, rw / "new.pt", base / "warm.pt")
        yield res, prev, secret, rw / "new.pt"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_nobody_can_load_readable_checkpoint(nobody_run):
    """Control: the dropped-privilege child really is nobody and can load a readable file."""
    res, prev, _, new = nobody_run
    assert res["uid"] == NOBODY
    assert res["load_ro"] == {"type": None}
    assert res["save_rw"] == {"type": None}
    assert_same(ckptio.load(new), {"y": torch.zeros(1024)})


def test_save_without_write_permission_is_permissionerror(nobody_run):
    """Saving into a folder nobody may not write raises PermissionError; the old file stays."""
    res, prev, _, _ = nobody_run
    assert_child_os_error(res["save_ro"], PermissionError, errno.EACCES, prev.path, folder_ok=True)
    prev.assert_intact()


@pytest.mark.parametrize("op", ["load_secret", "records_secret"])
def test_load_without_read_permission_is_permissionerror(nobody_run, op):
    """Loading a 0600 file of another user raises PermissionError naming it."""
    res, _, secret, _ = nobody_run
    assert_child_os_error(res[op], PermissionError, errno.EACCES, secret.path)
    secret.assert_intact()


# --------------------------------------------------------------------------- 2. bad files


def assert_format_error(path: Path) -> None:
    """ckptio.load and ckptio.records refuse ``path`` with FormatError."""
    for fn in (ckptio.load, ckptio.records):
        with pytest.raises(ckptio.FormatError):
            fn(path)
    assert temps(path.parent) == []


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, tuple[bytes, Any]]:
    """The bytes of a ckptio checkpoint (4 KiB-aligned) and a plain torch.save one (64-aligned)."""
    d = tmp_path_factory.mktemp("good")
    obj = sample_state(5)
    ckptio.save(obj, d / "ckptio.pt")
    torch.save(obj, d / "torch.pt")
    return {w: ((d / f"{w}.pt").read_bytes(), obj) for w in ("ckptio", "torch")}


@pytest.fixture(params=["ckptio", "torch"])
def writer(request) -> str:
    return request.param


def end_records(data: bytes) -> dict[str, int]:
    """Offsets of the zip structures (the central directory and the end records)."""
    eocd = data.rfind(b"PK\x05\x06")
    cd_size, cd_off = struct.unpack_from("<II", data, eocd + 12)
    out = {"eocd": eocd, "cd": cd_off, "cd_size": cd_size}
    loc = data.rfind(b"PK\x06\x07", 0, eocd)
    if loc >= 0 and eocd - loc == 20:
        out["locator"] = loc
        out["zip64_eocd"] = struct.unpack_from("<Q", data, loc + 8)[0]
        out["cd_size"], out["cd"] = struct.unpack_from("<QQ", data, out["zip64_eocd"] + 40)
    return out


def central_entries(data: bytes) -> dict[str, int]:
    """Central directory entry offset of each record name."""
    pos, out = end_records(data)["cd"], {}
    while data[pos : pos + 4] == b"PK\x01\x02":
        n, e, c = struct.unpack_from("<HHH", data, pos + 28)
        out[data[pos + 46 : pos + 46 + n].decode()] = pos
        pos += 46 + n + e + c
    return out


def local_header(data: bytes, name_suffix: str) -> tuple[str, int]:
    for name, cd in central_entries(data).items():
        if name.endswith(name_suffix):
            return name, struct.unpack_from("<I", data, cd + 42)[0]
    raise KeyError(name_suffix)


@pytest.mark.parametrize(
    "content",
    [
        random.Random(0).randbytes(100_000),
        b"this is a text file, not a checkpoint\n" * 200,
        b"",
        b"PK",
    ],
    ids=["random_bytes", "text", "empty", "two_bytes"],
)
def test_not_a_checkpoint_is_formaterror(tmp_path, content):
    """Random bytes, a text file, an empty file and a two-byte file are refused (FormatError)."""
    p = tmp_path / "bad.pt"
    p.write_bytes(content)
    assert_format_error(p)


def not_formaterror(p, label: str) -> list[str]:
    """What ckptio.load and ckptio.records did with ``p`` other than raise FormatError."""
    bad = []
    for fn in (ckptio.load, ckptio.records):
        try:
            fn(p)
        except ckptio.FormatError:
            continue
        except Exception as e:  # noqa: BLE001 - report every wrong outcome at once
            bad.append(f"{label}: {fn.__name__} raised {e!r}")
        else:
            bad.append(f"{label}: {fn.__name__} returned data")
    return bad


def cut_points(data: bytes) -> list[int]:
    """~20 truncation lengths: inside records' data, the central directory and the end records."""
    e = end_records(data)
    n, cd, eocd = len(data), e["cd"], e["eocd"]
    pts = [
        1,
        21,
        22,
        29,
        64,
        4096,
        4097,
        n // 4,
        n // 2,
        (3 * n) // 4,
        cd - 1,
        cd,
        cd + 1,
        cd + 46,
        cd + e["cd_size"] // 2,
        eocd - 1,
        eocd,
        eocd + 4,
        eocd + 16,
        n - 2,
        n - 1,
    ]
    if "zip64_eocd" in e:
        z = e["zip64_eocd"]
        pts += [z, z + 4, z + 30, e["locator"], e["locator"] + 10]
    return sorted({p for p in pts if 0 < p < n})


def test_truncated_checkpoint_is_formaterror(tmp_path, good, writer):
    """A checkpoint cut anywhere (data, central directory, end records) is refused, never read."""
    data, _ = good[writer]
    p = tmp_path / "cut.pt"
    bad = []
    points = cut_points(data)
    assert len(points) >= 20
    for cut in points:
        p.write_bytes(data[:cut])
        bad += not_formaterror(p, f"cut at {cut}/{len(data)}")
    assert bad == []
    assert temps(tmp_path) == []


def test_middle_cut_out_is_formaterror(tmp_path, good, writer):
    """Bytes missing from the middle (end records intact but shifted) are refused."""
    data, _ = good[writer]
    p = tmp_path / "hole.pt"
    for start, length in [(100, 4096), (len(data) // 2, 64), (end_records(data)["cd"] - 8, 8)]:
        p.write_bytes(data[:start] + data[start + length :])
        assert_format_error(p)


def test_appended_garbage_loads_the_same_data(tmp_path, good, writer):
    """Bytes after the end record (as torch accepts them) change nothing that is read."""
    data, obj = good[writer]
    p = tmp_path / "tail.pt"
    for tail in [b"garbage" * 10, random.Random(1).randbytes(5000)]:
        p.write_bytes(data + tail)
        assert_same(torch.load(p, weights_only=True), obj)
        assert_same(ckptio.load(p), obj)
        assert [r.name for r in ckptio.records(p)] == [n for n in central_entries(data)]


def patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def header_patches(data: bytes) -> dict[str, bytes]:
    """Corruptions of signatures, lengths and offsets in the zip structures."""
    e = end_records(data)
    n = len(data)
    name0, lh0 = local_header(data, "/data/0")
    cd0 = central_entries(data)[name0]
    out = {
        "local_header_signature": patched(data, lh0, "<I", 0x58585858),
        "local_header_name_length": patched(data, lh0 + 26, "<H", len(name0) + 3),
        "local_header_name": patched(data, lh0 + 30, "<B", ord("X")),
        "central_entry_signature": patched(data, cd0, "<I", 0x58585858),
        "eocd_signature": patched(data, e["eocd"], "<I", 0x58585858),
        "eocd_entry_count": patched(data, e["eocd"] + 10, "<H", 60000),
        "eocd_cd_offset_past_eof": patched(data, e["eocd"] + 16, "<I", n + 5),
        "eocd_cd_size_past_eof": patched(data, e["eocd"] + 12, "<I", 2**31),
        "record_header_offset_past_eof": patched(data, cd0 + 42, "<I", n + 100),
        "record_header_offset_into_data": patched(data, cd0 + 42, "<I", lh0 + 200),
        "record_size_past_eof": patched(patched(data, cd0 + 20, "<I", n), cd0 + 24, "<I", n),
        "record_sizes_disagree": patched(data, cd0 + 20, "<I", 1),
        "record_encrypted_flag": patched(data, cd0 + 8, "<H", 1),
        "record_method_deflate": patched(data, cd0 + 10, "<H", 8),
    }
    if "zip64_eocd" in e:
        z = e["zip64_eocd"]
        out |= {
            "zip64_eocd_signature": patched(data, z, "<I", 0x58585858),
            "zip64_cd_offset_past_eof": patched(data, z + 48, "<Q", n + 100),
            "zip64_cd_size_huge": patched(data, z + 40, "<Q", 2**40),
            "zip64_entry_count_huge": patched(data, z + 32, "<Q", 2**40),
            "zip64_locator_offset_past_eof": patched(data, e["locator"] + 8, "<Q", 2**40),
        }
    return out


def test_overwritten_headers_and_offsets_outside_the_file_are_formaterror(tmp_path, good, writer):
    """Bad signatures, lengths, flags and offsets pointing outside the file raise FormatError."""
    data, _ = good[writer]
    p = tmp_path / "patched.pt"
    bad = []
    for what, content in header_patches(data).items():
        p.write_bytes(content)
        bad += not_formaterror(p, what)
    assert bad == []


def test_shifted_local_header_is_formaterror_not_shifted_data(tmp_path, good, writer):
    """A local header whose extra length moves a record's data is refused.

    torch.load itself reads such a file and returns shifted (wrong) bytes; ckptio
    sees the record overlap its neighbour and refuses instead.
    """
    data, obj = good[writer]
    _, lh0 = local_header(data, "/data/0")
    extra = struct.unpack_from("<H", data, lh0 + 28)[0]
    p = tmp_path / "shifted.pt"
    for shift in [64, 4096]:
        p.write_bytes(patched(data, lh0 + 28, "<H", extra + shift))
        assert_format_error(p)


def test_zip64_locator_damage_falls_back_or_refuses(tmp_path, good, writer):
    """A garbled ZIP64 locator (the classic end record is complete): right data or FormatError."""
    data, obj = good[writer]
    e = end_records(data)
    if "locator" not in e:
        pytest.skip("archive without ZIP64 end records")
    p = tmp_path / "loc.pt"
    p.write_bytes(patched(data, e["locator"], "<I", 0x58585858))
    try:
        got = ckptio.load(p)
    except ckptio.FormatError:
        return
    assert_same(got, obj)


def stored_records(data: bytes) -> dict[str, bytes]:
    """Name -> bytes of each stored record, found through the central directory.

    (Not through zipfile.read: it checks CRC-32s, which ckptio leaves at 0.)
    """
    out = {}
    for name, cd in central_entries(data).items():
        size = struct.unpack_from("<I", data, cd + 24)[0]
        lh = struct.unpack_from("<I", data, cd + 42)[0]
        n, e = struct.unpack_from("<HH", data, lh + 26)
        out[name] = data[lh + 30 + n + e : lh + 30 + n + e + size]
    return out


def rewrite_zip(src: bytes, dst: Path, compression: int = zipfile.ZIP_STORED, change=None) -> None:
    """Write the records of ``src`` into a new zip with Python's zipfile."""
    with zipfile.ZipFile(dst, "w", compression) as zout:
        for name, content in stored_records(src).items():
            if change is not None:
                content = change(name, content)
            if content is not None:
                zout.writestr(name, content)


def test_deflated_records_load_through_torch_and_the_listing_says_why_it_refuses(
    tmp_path, good, writer
):
    """A checkpoint with deflated records (which plain torch.load reads) loads as
    torch.load loads it; what ckptio maps itself (the listing) refuses it, saying why."""
    data, obj = good[writer]
    p = tmp_path / "deflated.pt"
    rewrite_zip(data, p, zipfile.ZIP_DEFLATED)
    with zipfile.ZipFile(p) as z:
        assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in z.infolist())
    assert_same(torch.load(p, weights_only=True), obj)  # the file itself is fine
    assert_same(ckptio.load(p), obj)
    with pytest.raises(ckptio.FormatError, match="torch.load reads it"):
        ckptio.records(p)


def test_python_zipfile_stored_rewrite_loads(tmp_path, good, writer):
    """Control: the same rewrite with stored records (unaligned) loads bit-exact."""
    data, obj = good[writer]
    p = tmp_path / "stored.pt"
    rewrite_zip(data, p)
    assert_same(ckptio.load(p), obj)


@pytest.mark.parametrize("how", ["shorter", "longer"])
def test_record_size_differs_from_pickle_is_formaterror(tmp_path, good, how):
    """A data record shorter or longer than the storage the pickle declares is refused.

    (torch.load refuses it too: RuntimeError 'record size ... does not match'.)
    """
    data, _ = good["torch"]
    p = tmp_path / "size.pt"

    def change(name: str, content: bytes) -> bytes:
        if name.endswith("/data/0"):
            return content[:100] if how == "shorter" else content + b"\0" * 4096
        return content

    rewrite_zip(data, p, change=change)
    with pytest.raises(RuntimeError, match="record size"):
        torch.load(p, weights_only=True)
    with pytest.raises(ckptio.FormatError):
        ckptio.load(p)


@pytest.mark.parametrize(
    "records",
    [{}, {"ckpt/other": b"x"}, {"ckpt/version": b"3\n"}],
    ids=["no_records", "unrelated_record", "no_data_pkl"],
)
def test_zip_without_a_pickle_is_refused_naming_the_file(tmp_path, records):
    """A valid zip that holds no checkpoint is refused (FormatError, or torch's RuntimeError),
    and the message does not name ckptio's internal /proc/self/fd/N path instead of the file."""
    p = tmp_path / "ckpt.pt"
    with zipfile.ZipFile(p, "w") as z:
        for name, content in records.items():
            z.writestr(name, content)
    for fn in (ckptio.load, ckptio.records):
        with pytest.raises((ckptio.FormatError, RuntimeError)) as ei:
            fn(p)
        assert "/proc/self/fd" not in str(ei.value), f"{fn.__name__}: {ei.value}"


def patch_pickle(data: bytes, key: str, field: str, value: int) -> bytes:
    """Change the size or storage offset of tensor ``key`` in a torch.save file's data.pkl.

    Works in place on the stored record (same opcode width), as a corrupted byte would.
    """
    name = next(n for n in central_entries(data) if n.endswith("/data.pkl"))
    pkl = stored_records(data)[name]
    start = data.index(pkl)
    ops = list(pickletools.genops(pkl))
    i = next(j for j, (op, arg, _) in enumerate(ops) if op.name == "BINUNICODE" and arg == key)
    persid = next(j for j in range(i, len(ops)) if ops[j][0].name == "BINPERSID")
    ints = [j for j in range(persid, len(ops)) if ops[j][0].name.startswith("BININT")]
    op, arg, pos = ops[ints[0] if field == "storage_offset" else ints[1]]
    width = {"BININT1": "<B", "BININT2": "<H", "BININT": "<i"}[op.name]
    return patched(data, start + pos + 1, width, value)


@pytest.mark.parametrize(
    "n,field,value,says",
    [
        (100, "size", 200, "reaches past its storage's record.*800"),
        (100, "storage_offset", 50, "reaches past its storage's record.*800"),
        (1 << 23, "size", 1 << 24, f"reaches past its storage's record.*{1 << 26}"),
        (1 << 23, "size", -5, r"data/0: .*a tensor's size \(-5,\)"),
    ],
    ids=["size", "storage_offset", "size-64MiB", "negative-size"],
)
def test_tensor_beyond_its_storage_is_refused(tmp_path, n, field, value, says):
    """A pickle whose tensor reaches past the end of its storage record is refused, as torch.load
    refuses it (RuntimeError: storage not resizable); never returned with bytes from nowhere.
    ckptio.load makes the tensors while the engine fills their storages (64 MiB: still
    reading), so it must refuse before set_ would reallocate one. A negative size (a
    damaged 4-byte int): the native reader's layout check refuses the view, the message
    says what is wrong."""
    src = tmp_path / "src.pt"
    torch.save({"t": torch.arange(n, dtype=torch.int64), "u": torch.ones(3)}, src)
    p = tmp_path / "bad.pt"
    p.write_bytes(patch_pickle(src.read_bytes(), "t", field, value))
    with pytest.raises(RuntimeError):
        torch.load(p, weights_only=True)
    with pytest.raises(ckptio.FormatError, match=says):
        ckptio.load(p)
    # In place, where the tensors are never made (placeholders): refused too, nothing written.
    m = torch.nn.Module()
    m.register_buffer("t", torch.zeros(n, dtype=torch.int64))
    m.register_buffer("u", torch.zeros(3))
    with pytest.raises(ckptio.FormatError, match=says):
        ckptio.load_state_dict(m, p)
    assert not m.t.any() and not m.u.any()


def test_storage_location_torch_cannot_restore_is_refused_in_place(tmp_path):
    """A storage tagged with a location torch.load cannot restore (a damaged tag) is a
    FormatError for loads in place too, though they never move storages to it."""
    src = tmp_path / "src.pt"
    torch.save({"t": torch.arange(4.0)}, src)
    tag = b"X\x03\x00\x00\x00cpu"  # BINUNICODE "cpu" in data.pkl
    data = src.read_bytes()
    assert data.count(tag) == 1
    p = tmp_path / "bad.pt"
    p.write_bytes(data.replace(tag, b"X\x03\x00\x00\x00cpx"))
    with pytest.raises(RuntimeError):
        torch.load(p, weights_only=True)
    out = {"t": torch.zeros(4)}
    with pytest.raises(ckptio.FormatError, match="location is 'cpx'"):
        ckptio.load(p, out=out)
    m = torch.nn.Module()
    m.register_buffer("t", torch.zeros(4))
    with pytest.raises(ckptio.FormatError, match="location is 'cpx'"):
        ckptio.load_state_dict(m, p)
    assert not out["t"].any() and not m.t.any()


def test_storage_location_cpu_with_an_index_as_torch(tmp_path, monkeypatch):
    """A "cpu:0" tag: torch.load refuses it unless a map_location replaces it; so does
    ckptio.load, typed (a FormatError naming the file, a RuntimeError as torch's), and a
    load in place."""
    p = tmp_path / "cpu0.pt"
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cpu:0")
    torch.save({"t": torch.arange(4.0)}, p)
    monkeypatch.undo()
    with pytest.raises(RuntimeError) as want:
        torch.load(p, weights_only=True)
    with pytest.raises(ckptio.FormatError, match="cpu:0") as got:
        ckptio.load(p)
    assert isinstance(got.value, type(want.value))
    assert torch.equal(torch.load(p, map_location="cpu")["t"], torch.arange(4.0))
    assert torch.equal(ckptio.load(p, map_location="cpu")["t"], torch.arange(4.0))
    with pytest.raises(ckptio.FormatError, match="location is 'cpu:0'"):
        ckptio.load(p, out={"t": torch.zeros(4)})


def test_missing_data_record_is_a_formaterror_naming_it(tmp_path, good):
    """A data record the pickle needs is absent: torch's reader refuses it (RuntimeError);
    ckptio says so typed, naming the file and the record (issue 35), and verify agrees."""
    data, _ = good["torch"]
    p = tmp_path / "missing.pt"
    rewrite_zip(data, p, change=lambda n, c: None if n.endswith("/data/1") else c)
    with pytest.raises(ckptio.FormatError, match="data/1") as e:
        ckptio.load(p)
    assert str(p) in str(e.value)
    assert not ckptio.verify(p).ok


FUZZ_SCRIPT = """
import random, zipfile
src, work, iters = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = open(src, "rb").read()
spots = set()
with zipfile.ZipFile(src) as z:  # (infolist does not check the CRC-32s ckptio leaves at 0)
    for i in z.infolist():
        spots.update(range(i.header_offset, i.header_offset + 30 + len(i.filename)))
        if i.filename.endswith("data.pkl"):
            start = i.header_offset + 30 + len(i.filename)
            extra = int.from_bytes(data[i.header_offset + 28:i.header_offset + 30], "little")
            spots.update(range(start + extra, start + extra + i.file_size))
eocd = data.rfind(b"PK\\x05\\x06")
cd = int.from_bytes(data[eocd + 16:eocd + 20], "little")
if cd == 0xFFFFFFFF:
    loc = data.rfind(b"PK\\x06\\x07")
    z64 = int.from_bytes(data[loc + 8:loc + 16], "little")
    cd = int.from_bytes(data[z64 + 48:z64 + 56], "little")
spots.update(range(min(cd, eocd - 200), len(data)))
spots = sorted(spots)
rng = random.Random(int(sys.argv[4]))

def same(a, b):
    if isinstance(a, torch.Tensor):
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(raw(a), raw(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b

bad, outcomes = [], {}
path = os.path.join(work, "fuzz.pt")
for it in range(iters):
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3])):
        b[rng.choice(spots)] = rng.randrange(256)
    open(path, "wb").write(b)
    try:
        got, ck = ckptio.load(path), None
    except Exception as e:
        got, ck = None, e
    try:
        want, tk = torch.load(path, weights_only=True), None
    except Exception as e:
        want, tk = None, e
    key = (type(ck).__name__ if ck else "ok") + "/" + (type(tk).__name__ if tk else "ok")
    outcomes[key] = outcomes.get(key, 0) + 1
    if ck is None and tk is not None:
        bad.append(f"#{it}: ckptio returned data where torch.load raised {tk!r}")
    elif ck is None and not same(got, want):
        bad.append(f"#{it}: ckptio and torch.load return different data")
    elif ck is not None and not isinstance(ck, ckptio.FormatError) and tk is None:
        bad.append(f"#{it}: ckptio raised {ck!r} where torch.load read the file")
print(json.dumps({"bad": bad[:20], "outcomes": outcomes}))
"""


def test_fuzzed_headers_never_crash_nor_give_wrong_data(tmp_path, good, writer):
    """Random byte changes in headers, pickle and end records: a FormatError or torch's own
    refusal, or exactly the data torch.load reads; never a crash (the fuzz runs in a child)."""
    data, _ = good[writer]
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    res = run_child(FUZZ_SCRIPT, src, tmp_path, 250, 7 if writer == "torch" else 11)
    assert res["bad"] == [], res
    assert sum(res["outcomes"].values()) == 250


# --------------------------------------------------------------------------- 3. unpicklable


def make_local_instance() -> Any:
    class Local:
        pass

    return Local()


class Boom:
    """Pickling raises half-way through the object (after tensors were pickled)."""

    def __reduce__(self):
        raise TypeError("Boom refuses to be pickled")


@pytest.mark.parametrize(
    "bad", [lambda: lambda x: x, make_local_instance, Boom], ids=["lambda", "local", "raises"]
)
def test_unpicklable_object_raises_torch_error_and_keeps_previous(tmp_path, bad):
    """An object torch.save cannot pickle raises the same error, and the old checkpoint stays."""
    prev = make_prev(tmp_path / "ckpt.pt")
    obj = {"t": torch.ones(1000), "bad": bad(), "u": torch.zeros(10)}
    with pytest.raises(Exception) as want:
        torch.save(obj, io.BytesIO())
    with pytest.raises(Exception) as ei:
        ckptio.save(obj, prev.path)
    assert isinstance(ei.value, (pickle.PicklingError, AttributeError, TypeError)), ei.value
    assert type(ei.value) is type(want.value)
    prev.assert_intact()


# --------------------------------------------------------------------------- 4. malicious pickle


class Evil:
    """Unpickling calls os.system."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


@pytest.mark.parametrize("saver", ["torch", "ckptio"])
def test_malicious_pickle_is_refused_under_weights_only(tmp_path, saver):
    """A checkpoint whose pickle calls os.system is refused with UnpicklingError, the call
    never runs; the same file under torch.load(weights_only=False) does run it."""
    p = tmp_path / "evil.pt"
    marker = tmp_path / "pwned"
    obj = {"t": torch.ones(3), "x": Evil(f"echo pwned > {marker}")}
    (torch.save if saver == "torch" else ckptio.save)(obj, p)
    pkl = next(c for n, c in stored_records(p.read_bytes()).items() if n.endswith("data.pkl"))
    assert b"system" in pkl
    for load in (
        ckptio.load,
        lambda f: ckptio.load(f, map_location="cpu"),
        lambda f: ckptio.load(f, mmap=True),
        ckptio.records,
    ):
        with pytest.raises(pickle.UnpicklingError):
            load(p)
        assert not marker.exists()
    # Control: the payload is real.
    torch.load(p, weights_only=False)
    assert marker.read_text().strip() == "pwned"


# --------------------------------------------------------------------------- 5. disk full

FSIZE_SCRIPT = """
import resource, signal
target, limit, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
obj = {"w": torch.ones(nbytes // 4)}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
print(json.dumps(attempt(lambda: ckptio.save(obj, target, direct=sys.argv[4]))))
"""


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_file_size_limit_is_efbig_and_keeps_previous(tmp_path, direct):
    """Under RLIMIT_FSIZE a save too big raises OSError EFBIG naming the path; old file stays."""
    prev = make_prev(tmp_path / "ckpt.pt")
    res = run_child(FSIZE_SCRIPT, prev.path, MIB, 8 * MIB, direct)
    prev.assert_intact()
    assert_child_os_error(res, OSError, errno.EFBIG, prev.path)


def _mount(args: list[str], mnt: Path) -> None:
    r = subprocess.run(["mount", *args, str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount ({' '.join(args)}): {r.stderr.strip()}")


@pytest.fixture(params=["tmpfs", "ext4", "ext2"])
def small_fs(request, tmp_path):
    """A tiny filesystem mounted for the test: tmpfs 4 MiB, or an 8 MiB ext4/ext2 loop image
    (ext2 has no fallocate, so the O_DIRECT writes themselves hit ENOSPC)."""
    if not IS_ROOT:
        pytest.skip("mounting needs root")
    kind = request.param
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if kind == "tmpfs":
        _mount(["-t", "tmpfs", "-o", "size=4m", "tmpfs"], mnt)
    else:
        mkfs = shutil.which(f"mkfs.{kind}")
        if mkfs is None:
            pytest.skip(f"mkfs.{kind} not available")
        img = tmp_path / "fs.img"
        with open(img, "wb") as f:
            f.truncate(8 * MIB)
        r = subprocess.run([mkfs, "-q", "-F", str(img)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mkfs.{kind} failed: {r.stderr.strip()}")
        _mount(["-o", "loop", str(img)], mnt)
    try:
        yield kind, mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_is_enospc_and_keeps_previous(small_fs):
    """Saving 16 MiB onto a 4-8 MiB filesystem raises ENOSPC naming the path; the previous
    (small) checkpoint stays, no temp is left and its space is given back."""
    kind, mnt = small_fs
    direct = "auto" if kind == "tmpfs" else "on"
    try:
        prev = make_prev(mnt / "ckpt.pt", direct=direct)
    except ckptio.CkptioError as e:
        pytest.skip(f"O_DIRECT unavailable on {kind}: {e}")
    if kind != "tmpfs":
        ckptio.save({"x": torch.ones(1024)}, mnt / "probe.pt", direct="on")
        assert ckptio.last_report().direct
        os.remove(mnt / "probe.pt")
    with pytest.raises(OSError) as ei:
        ckptio.save({"big": torch.ones(4 * MIB)}, prev.path, direct=direct)
    prev.assert_intact()
    assert_os_error(ei.value, OSError, errno.ENOSPC, prev.path)
    # The failed temp file's space is free again: half the filesystem fits.
    half = {"half": torch.arange(MIB // 2, dtype=torch.int32)}
    ckptio.save(half, mnt / "after.pt", direct=direct)
    assert_same(ckptio.load(mnt / "after.pt"), half)
    prev.assert_intact()


def fill(folder: Path) -> None:
    """Write a filler file until the filesystem has no free byte left."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (MIB, 4096, 512, 1):
            try:
                while os.write(fd, b"\xff" * size) == size:
                    pass
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


def test_save_onto_a_full_disk_is_enospc_and_keeps_previous(small_fs):
    """On a filesystem with no free block at all even the metadata cannot be written: ENOSPC
    naming the path, the previous checkpoint intact, no temp left."""
    kind, mnt = small_fs
    prev = make_prev(mnt / "ckpt.pt")
    fill(mnt)
    with pytest.raises(OSError) as ei:
        ckptio.save(sample_state(1), prev.path)
    prev.assert_intact()
    assert_os_error(ei.value, OSError, errno.ENOSPC, prev.path)
    # The failed save left nothing behind: with the filler gone, the next one fits.
    os.remove(mnt / "filler")
    ckptio.save(sample_state(1), prev.path)
    assert_same(ckptio.load(prev.path), sample_state(1))


@pytest.fixture
def tmpfs64(tmp_path):
    """A 64 MiB tmpfs mounted for the test."""
    if not IS_ROOT:
        pytest.skip("mounting needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=64m", "tmpfs"], mnt)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _no_room_mib(folder: Path) -> int:
    """MiB of a save that cannot fit beside what is there (48 at least)."""
    st = os.statvfs(folder)
    return max(48, st.f_bavail * st.f_frsize // MIB + 8)


def test_a_failed_sharded_save_leaves_room_for_the_next(tmpfs64):
    """A 16 MiB sharded checkpoint on a 64 MiB tmpfs, a save that cannot fit (ENOSPC after
    some shards were written), then a 16 MiB save: it succeeds, because the failed save
    removed what it wrote before it raised; the old checkpoint loads meanwhile."""
    folder = tmpfs64 / "sharded"
    old = {f"w{i}": torch.full((MIB,), float(i)) for i in range(4)}  # 16 MiB
    cst.save_sharded(old, folder, max_shard_size="4MiB")
    before = sorted(os.listdir(folder))
    n = _no_room_mib(tmpfs64) // 4
    big = {f"b{i}": torch.zeros(MIB) for i in range(n)}
    with pytest.raises(OSError) as e:
        cst.save_sharded(big, folder, max_shard_size="4MiB")
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(folder)) == before  # nothing of the failed save stays
    assert_same(cst.load_sharded(folder), old)
    new = {f"n{i}": torch.full((MIB,), -float(i)) for i in range(4)}
    cst.save_sharded(new, folder, max_shard_size="4MiB")
    assert_same(cst.load_sharded(folder), new)


def test_a_killed_sharded_save_is_swept_by_the_next_save_and_by_clean(tmpfs64):
    """What a save that died left (shards no index names, no live writer holding them)
    goes with the next save, before it writes, and with ckptio.clean; shards a live save
    holds stay."""
    folder = tmpfs64 / "sharded"
    old = {f"w{i}": torch.full((MIB,), float(i)) for i in range(4)}
    cst.save_sharded(old, folder, max_shard_size="4MiB")
    for i in range(8):  # a dead save's shards: 32 MiB named by no index
        (folder / f"model-deadbeef-{i + 1:05d}-of-00008.safetensors").write_bytes(b"\0" * 4 * MIB)
    new = {f"n{i}": torch.full((MIB,), -float(i)) for i in range(4)}
    cst.save_sharded(new, folder, max_shard_size="4MiB")  # 16 MiB more would not fit beside them
    assert not any("deadbeef" in n for n in os.listdir(folder))
    assert_same(cst.load_sharded(folder), new)
    (folder / "model-cafe0000-00001-of-00002.safetensors").write_bytes(b"x")
    assert ckptio.clean(folder) == ["model-cafe0000-00001-of-00002.safetensors"]
    assert_same(cst.load_sharded(folder), new)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_failed_dcp_save_leaves_room_for_the_next(tmpfs64, world):
    """As for sharded safetensors, with DCP saves of ``world`` ranks (gloo processes):
    a 16 MiB checkpoint, a save that cannot fit, then a 16 MiB save that must succeed;
    each rank's files of the failed save go (by that rank when it failed, else by the
    next save's sweep), and the old checkpoint loads in between."""
    from test_dcp import _run_ranks

    _run_ranks(world, "disk_full", str(tmpfs64), NO_ROOM_MIB=str(_no_room_mib(tmpfs64)))


# --------------------------------------------------------------------------- 6. SIGKILL mid-write

KILL_SCRIPT = """
target, n = sys.argv[1], int(sys.argv[2])
w = torch.arange(n, dtype=torch.int32) + 1
print("ready", flush=True)
sys.stdin.readline()
gen = 0
while True:
    ckptio.save({"gen": torch.tensor(gen), "w": w}, target)
    gen += 1
"""


def pid_of(temp_name: str) -> int:
    return int(TEMP_RE.match(temp_name)["pid"])


@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous_and_next_save_cleans_up(tmp_path):
    """Children saving 256 MiB are SIGKILLed at moments spread over a save: the file at the path
    is always a complete checkpoint (bit-exact), a killed save leaves only its temp file, and
    the next save (of a later child, or the final one here) removes the dead ones' temps."""
    n = 64 * MIB  # int32: 256 MiB
    target = tmp_path / "ckpt.pt"
    base = torch.arange(n, dtype=torch.int32)
    t0 = time.perf_counter()
    ckptio.save({"gen": torch.tensor(-1), "w": base}, target)
    save_s = max(time.perf_counter() - t0, 0.05)
    digest = sha256(target)
    gen_of_file = -1

    # Moments as fractions of one save; the last kill aims mid-save so that the final save
    # below usually has a stale temp to remove.
    fractions = [0.02, 1.5, 0.2, 1.0, 0.8, 0.4, 0.6]
    rng = random.Random(1234)
    hits, left_behind, dead, log = 0, 0, set(), [f"one save takes {save_s:.2f} s"]
    with ready_children(KILL_SCRIPT, len(fractions), target, n) as children:
        for child, frac in zip(children, fractions, strict=True):
            go(child)
            delay = save_s * frac * rng.uniform(0.8, 1.2)
            time.sleep(delay)
            now = temps(tmp_path)
            sigkill(child)
            mine = [t for t in now if pid_of(t) == child.pid]
            older = [t for t in now if pid_of(t) in dead]
            dead.add(child.pid)
            after = [t for t in temps(tmp_path) if pid_of(t) == child.pid]
            hits += bool(mine)
            left_behind += bool(after)
            log.append(
                f"kill after {delay:.2f} s: temp {'present' if mine else 'absent'}, "
                f"{len(after)} left after the kill"
            )
            # The running save removed the temps of earlier, dead children before making its own.
            assert not (mine and older), f"stale temps {older} outlived a new save: {log}"
            assert len(after) <= 1, log
            if sha256(target) != digest:
                # The child completed a save before the kill: the file is that save, whole.
                got = ckptio.load(target)
                assert int(got["gen"]) >= 0
                assert torch.equal(got["w"], base + 1)
                digest, gen_of_file = sha256(target), int(got["gen"])
                log.append(f"  the file is now the child's save #{gen_of_file}")
    assert hits >= 2, f"only {hits} of {len(fractions)} kills hit a save in progress: {log}"
    assert left_behind >= 1, f"no kill left a temp file behind: {log}"

    expect = {"gen": torch.tensor(gen_of_file), "w": base if gen_of_file < 0 else base + 1}
    assert sha256(target) == digest
    assert_same(ckptio.load(target), expect)
    assert_same(torch.load(target, weights_only=True), expect)
    del expect
    assert all(pid_of(t) in dead for t in temps(tmp_path))

    small = sample_state(9)
    ckptio.save(small, target)
    assert temps(tmp_path) == [], "the next save did not remove the dead processes' temps"
    assert_same(ckptio.load(target), small)
    assert_same(torch.load(target, weights_only=True), small)


# --------------------------------------------------------------------------- 7. bad arguments


@pytest.mark.parametrize("fn", ["save", "load", "records"])
@pytest.mark.parametrize("f", [123, io.BytesIO(), None], ids=["int", "BytesIO", "None"])
def test_non_path_argument_is_typeerror(tmp_path, fn, f):
    """A file argument that is not a path raises TypeError naming the argument and its type
    (save and load take file objects, as torch does: tests/test_fidelity.py)."""
    if fn != "records" and isinstance(f, io.BytesIO):
        pytest.skip("save and load take file objects")
    call = (
        (lambda: ckptio.save({"x": torch.ones(2)}, f))
        if fn == "save"
        else (lambda: getattr(ckptio, fn)(f))
    )
    with pytest.raises(TypeError) as ei:
        call()
    msg = str(ei.value)
    assert "path" in msg, msg
    assert type(f).__name__ in msg, msg


@pytest.mark.parametrize(
    "kw",
    [
        dict(threads=0),
        dict(threads=-1),
        dict(threads=100_000),
        dict(chunk_size=0),
        dict(chunk_size=-1),
        dict(chunk_size=1000),
        dict(chunk_size=4096 + 1),
        dict(direct="sometimes"),
        dict(direct="2"),
    ],
    ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()),
)
def test_bad_engine_options_are_valueerror(tmp_path, kw):
    """Bad threads / chunk_size / direct values raise ValueError before touching the old file."""
    prev = make_prev(tmp_path / "ckpt.pt")
    with pytest.raises(ValueError):
        ckptio.save(sample_state(1), prev.path, **kw)
    prev.assert_intact()
    with pytest.raises(ValueError):
        ckptio.load(prev.path, **kw)


@pytest.mark.parametrize("direct", [3, 1.5, object()], ids=["int", "float", "object"])
def test_bad_direct_type_is_typeerror(tmp_path, direct):
    """A ``direct`` that is neither None, a bool nor a string raises TypeError; old file intact."""
    prev = make_prev(tmp_path / "ckpt.pt")
    with pytest.raises(TypeError, match="direct"):
        ckptio.save(sample_state(1), prev.path, direct=direct)
    with pytest.raises(TypeError, match="direct"):
        ckptio.load(prev.path, direct=direct)
    prev.assert_intact()


# --------------------------------------------------------------------------- not regular files


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "ckpt.pt"
    os.mkfifo(p)
    # A read that blocked would hang the test: fail it instead.
    faulthandler.dump_traceback_later(60, exit=True)
    yield p
    faulthandler.cancel_dump_traceback_later()


def _refused(fn):
    with pytest.raises(OSError, match="not a regular file") as e:
        fn()
    return e.value


def test_a_fifo_is_refused_before_anything_is_read(fifo, tmp_path):
    """A read of a FIFO blocks until a writer comes (torch.load's too): every reader of
    every format refuses it, typed, naming it."""
    import ckptio.dcp
    import torch.distributed.checkpoint as dcp

    e = _refused(lambda: ckptio.load(fifo))
    assert e.filename == str(fifo) or str(fifo) in str(e)
    _refused(lambda: ckptio.load(fifo, out={"x": torch.zeros(3)}))
    _refused(lambda: ckptio.load_state_dict(torch.nn.Linear(2, 2), fifo))
    _refused(lambda: cst.load_file(fifo))
    _refused(lambda: cst.metadata(fifo))
    _refused(lambda: ckptio.listing(fifo))
    _refused(lambda: ckptio.verify(fifo))  # one that cannot be opened: OSError, as a missing one
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    _refused(lambda: cst.load_sharded(index))
    folder = tmp_path / "dcp"
    folder.mkdir()
    os.mkfifo(folder / ".metadata")
    with pytest.raises(BaseException) as e:
        dcp.load({"x": torch.zeros(3)}, storage_reader=ckptio.dcp.FileSystemReader(folder))
    assert "not a regular file" in str(e.value)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_node_is_refused(device):
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        for fn in (ckptio.load, cst.load_file, ckptio.listing):
            with pytest.raises(OSError, match="character device"):
                fn(device)
    finally:
        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------- review of 2026-12-06, later


def test_a_save_over_a_fifo_or_device_is_refused_and_leaves_it(tmp_path):
    """A save is a rename over its target: as root, ckptio.save / convert to
    /dev/null replaced the device node with a regular file. Every saver now
    refuses a target that is not a regular file, and leaves it as it is."""
    import stat

    from ckptio.tools.convert import convert

    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(3)}, src)
    savers = {
        "ckptio.save": lambda p: ckptio.save({"w": torch.ones(3)}, p),
        "save_file": lambda p: cst.save_file({"w": torch.ones(3)}, p),
        "convert": lambda p: convert(str(src), str(p)),
    }
    for name, save in savers.items():
        with pytest.raises(OSError, match="not a regular file: a FIFO") as e:
            save(fifo)
        assert str(fifo) in str(e.value), name
        assert stat.S_ISFIFO(os.stat(fifo).st_mode), name
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "src.pt"]


@pytest.mark.parametrize("index", [2**26 - 1, 2**32 - 1])
def test_a_memo_index_out_of_order_loads_as_with_torch(tmp_path, good, index):
    """A PUT of a huge memo index (5 bytes of pickle) made the native unpickler
    allocate a table of that many entries (1.5 GiB: an abort under a memory
    limit), verify's scan MemoryError; torch.load reads such a file."""
    data, obj = good["torch"]
    p = tmp_path / "memo.pt"

    def change(name: str, content: bytes) -> bytes:
        if name.endswith("/data.pkl"):
            assert content.endswith(b".")
            return content[:-1] + b"r" + index.to_bytes(4, "little") + b"."
        return content

    rewrite_zip(data, p, change=change)
    assert_same(torch.load(p, weights_only=True), obj)
    script = textwrap.dedent(f"""
        import resource, ckptio
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        assert ckptio.verify({str(p)!r}).ok
        print(sorted(ckptio.load({str(p)!r})))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(sorted(obj))
