"""Temp files of saves: only those of dead saves are removed (whatever their name, whatever
the PID namespace of their writer), they are private from the start, a replaced file keeps
its owner, and a link at the target is followed by the kernel's rules."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ckptio
import ckptio.safetensors as cst
import pytest
import torch
from test_faults import CHILD_PRELUDE, IS_ROOT, TEMP_RE, temps

NOBODY = 65534

HOLDER = """
import time
from ckptio import _native
try:  # not sweeping: the test decides when dead temps go
    w = _native.AtomicWriter(sys.argv[1], None, None, False)
except TypeError:  # a ckptio without the sweep argument
    w = _native.AtomicWriter(sys.argv[1])
w.write_bytes(0, b"x" * 100_000)
print("ready", flush=True)
time.sleep(600)
"""


def hold_temp(target: Path) -> subprocess.Popen:
    """A process in the middle of a save to ``target``: its temp file exists, it is alive."""
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + HOLDER, str(target)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)


def owners(folder: Path) -> dict[str, int]:
    return {t: int(TEMP_RE.match(t)["pid"]) for t in temps(folder)}


def test_temps_of_dead_saves_under_other_names_are_removed(tmp_path, capsys):
    """Step-numbered checkpoints: a save of ckpt-step200.pt removes the temp file a killed save
    of ckpt-step100.pt left (as large as a checkpoint), but not the temp of a save of
    ckpt-step150.pt still running; `ckptio clean` removes it once its process is gone."""
    dead = hold_temp(tmp_path / "ckpt-step100.pt")
    kill(dead)
    live = hold_temp(tmp_path / "ckpt-step150.pt")
    try:
        assert sorted(owners(tmp_path).values()) == sorted([dead.pid, live.pid])
        ckptio.save({"x": torch.ones(3)}, tmp_path / "ckpt-step200.pt")
        assert list(owners(tmp_path).values()) == [live.pid], "dead temp stayed or live went"
        cst.save_file({"x": torch.ones(3)}, tmp_path / "other.safetensors")
        assert list(owners(tmp_path).values()) == [live.pid]
        rc, out, err = cli(["clean", str(tmp_path)], capsys)
        assert (rc, out, err) == (0, f"{tmp_path}: 0 files of dead saves removed", "")
        assert list(owners(tmp_path).values()) == [live.pid]
        name = temps(tmp_path)[0]
    finally:
        kill(live)
    (tmp_path / "notes.ckptio-1-0123456789abcdef.tmp").write_text("not ours: no leading dot")
    (tmp_path / ".notes.ckptio-1-0123456789ABCDEF.tmp").write_text("not ours: capitals")
    rc, out, err = cli(["clean", str(tmp_path)], capsys)
    assert (rc, out.splitlines()[0], err) == (0, name, ""), out
    assert temps(tmp_path) == []
    assert (tmp_path / "notes.ckptio-1-0123456789abcdef.tmp").exists()
    assert (tmp_path / ".notes.ckptio-1-0123456789ABCDEF.tmp").exists()
    rc, out, err = cli(["clean", str(tmp_path / "missing")], capsys)
    assert rc == 1 and len(err.splitlines()) == 1 and "FileNotFoundError" in err, err


def test_clean_is_a_python_call_too(tmp_path):
    dead = hold_temp(tmp_path / "ckpt.pt")
    kill(dead)
    name = temps(tmp_path)[0]
    assert ckptio.clean(tmp_path) == [name]
    assert temps(tmp_path) == [] and ckptio.clean(str(tmp_path)) == []
    with pytest.raises(FileNotFoundError):
        ckptio.clean(tmp_path / "missing")


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from ckptio.tools.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out.strip(), err.strip()


SAVER = """
import json, os, sys, time
import torch, ckptio
target, n, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
obj = {"w": torch.full((4 << 20,), os.getpid(), dtype=torch.int32)}
while time.time() < start:
    time.sleep(0.001)
fails = []
for _ in range(n):
    try:
        ckptio.save(obj, target)
    except Exception as e:
        fails.append(repr(e))
print(json.dumps({"pid": os.getpid(), "fails": fails}), flush=True)
"""


def _free_host_pid() -> int:
    for pid in range(32000, 1000, -1):
        if not os.path.exists(f"/proc/{pid}") and not os.path.exists(f"/proc/{pid + 1}"):
            return pid
    pytest.skip("no free pid on this host")


@pytest.mark.slow
@pytest.mark.skipif(not IS_ROOT, reason="a PID namespace needs root")
def test_cleanup_never_removes_a_live_temp_of_another_pid_namespace(tmp_path):
    """Two writers save one path 20 times each at the same moments, one of them in its own PID
    namespace (a container sharing the volume) under a pid the host does not have: every save
    of both succeeds (a writer's cleanup never takes the other's live temp file)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    target = tmp_path / "ckpt.pt"
    saver = tmp_path / "saver.py"
    saver.write_text(SAVER)
    start = time.time() + 6
    last = _free_host_pid()
    # In the new namespace, ns_last_pid makes the next fork take pid last + 1.
    in_ns = (
        "import os, sys\n"
        "with open('/proc/sys/kernel/ns_last_pid', 'w') as f:\n"
        "    f.write(sys.argv[1])\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
        "os.waitpid(pid, 0)\n"
    )
    run = [str(saver), str(target), "20", str(start)]
    ns = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", in_ns, str(last)]
        + run,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    host = subprocess.Popen(
        [sys.executable, *run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    outs = []
    for p in (ns, host):
        out, err = p.communicate(timeout=300)
        if p is ns and "ns_last_pid" in err:
            pytest.skip(f"cannot pick pids in a new namespace: {err.strip()[-200:]}")
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    ns_out, host_out = outs
    assert ns_out["pid"] == last + 1 and not os.path.exists(f"/proc/{ns_out['pid']}"), ns_out
    assert ns_out["fails"] == [] and host_out["fails"] == [], outs
    assert temps(tmp_path) == []
    assert int(ckptio.load(target)["w"][0]) in (ns_out["pid"], host_out["pid"])


def test_temp_file_is_created_private(tmp_path):
    """Replacing a 0600 checkpoint: the temp file is created with the owner's bits only (the
    openat mode, seen by strace), so no other user can open it before it has its final mode."""
    if shutil.which("strace") is None:
        pytest.skip("no strace")
    target = tmp_path / "ckpt.pt"
    ckptio.save({"x": torch.ones(3)}, target)
    target.chmod(0o600)
    log = tmp_path / "strace.log"
    script = f"import torch, ckptio; ckptio.save({{'x': torch.zeros(3)}}, {str(target)!r})"
    r = subprocess.run(
        ["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(log), sys.executable, "-c", script],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    creates = [
        line for line in log.read_text().splitlines() if ".ckptio-" in line and "O_CREAT" in line
    ]
    assert creates, log.read_text()[-2000:]
    for line in creates:
        mode = int(line.rsplit(",", 1)[1].split(")")[0].strip(), 8)
        assert mode & 0o077 == 0, f"temp file created with mode {mode:o}: {line}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert torch.equal(ckptio.load(target)["x"], torch.zeros(3))


@pytest.mark.skipif(not IS_ROOT, reason="changing owners needs root")
def test_a_replaced_file_keeps_its_owner_group_and_mode(tmp_path):
    """root saving over a user's checkpoint (torch.save writes in place and keeps the owner):
    the new file is the user's, with the group and mode it had, for every writer."""
    for name, save in (
        ("ckpt.pt", lambda p: ckptio.save({"x": torch.ones(3)}, p)),
        ("m.safetensors", lambda p: cst.save_file({"x": torch.ones(3)}, p)),
    ):
        p = tmp_path / name
        save(p)
        os.chown(p, NOBODY, NOBODY)
        p.chmod(0o640)
        save(p)
        st = p.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o640), name


@pytest.mark.skipif(not IS_ROOT, reason="needs a link owned by another user")
def test_a_link_at_the_target_follows_the_kernels_rules():
    """A link another user planted in a sticky world-writable folder: ckptio.save follows it
    exactly when the kernel lets this process follow it (fs.protected_symlinks): with the
    protection on, PermissionError and the file it points to untouched, like torch.save."""
    base = Path(tempfile.mkdtemp(prefix="ckptio-links-"))
    try:
        sticky = base / "shared"
        sticky.mkdir()
        sticky.chmod(0o1777)
        victim = base / "victim.pt"
        ckptio.save({"x": torch.ones(3)}, victim)
        before = victim.read_bytes()
        link = sticky / "latest.pt"
        link.symlink_to(victim)
        os.lchown(link, NOBODY, NOBODY)
        try:
            os.close(os.open(link, os.O_RDONLY))  # the kernel's verdict on following it
            kernel_follows = True
        except PermissionError:
            kernel_follows = False
        protected = Path("/proc/sys/fs/protected_symlinks").read_text().strip() == "1"
        assert kernel_follows != protected
        if kernel_follows:
            ckptio.save({"x": torch.zeros(3)}, link)
            assert link.is_symlink() and torch.equal(ckptio.load(victim)["x"], torch.zeros(3))
        else:
            with pytest.raises(PermissionError):
                ckptio.save({"x": torch.zeros(3)}, link)
            with pytest.raises((PermissionError, RuntimeError), match="[Pp]ermission"):
                torch.save({"x": torch.zeros(3)}, link)  # its C++ writer: RuntimeError
            assert victim.read_bytes() == before
            assert temps(sticky) == [] and temps(base) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_link_to_nothing_is_refused(tmp_path):
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError) as ei:
        ckptio.save({"x": torch.ones(3)}, link)
    assert str(link) in str(ei.value)
    assert not (tmp_path / "missing.pt").exists() and temps(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_new_files_get_the_umasks_mode_in_every_format(tmp_path, umask):
    """docs/api-conventions.md, File modes: 0666 less the umask, as torch.save and open()
    make a file; safetensors' own 0600 is not copied."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter

    sd = {"x": torch.ones(3), "y": torch.zeros(4)}
    old = os.umask(umask)
    try:
        ckptio.save(sd, tmp_path / "a.pt")
        torch.save(sd, tmp_path / "torch.pt")
        cst.save_file(sd, tmp_path / "b.safetensors")
        cst.save_sharded(sd, tmp_path / "sharded", max_shard_size=16)
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "torch.pt").stat().st_mode) == want
    files = [tmp_path / "a.pt", tmp_path / "b.safetensors"]
    files += [p for d in ("sharded", "dcp") for p in (tmp_path / d).iterdir()]
    assert len(files) > 5
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == want, p
