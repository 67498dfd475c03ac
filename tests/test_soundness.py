"""Soundness (issue 24): the caller's CUDA stream order on every path, no Rust lock
waited for while holding the interpreter, owners held for as long as their
addresses are used, pinned memory given back, CKPTIO_THREADS read once; and
cuFile's log kept out of the current folder.

The page-collision test (a faked 512-byte O_DIRECT alignment, every page
written by both paths compared) is a Rust test:
``engine::tests::no_page_is_written_buffered_and_direct_at_once``.
Tests marked ``gpu`` need a CUDA device (scripts/gpu_check.sh runs them).
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import ckptio
import pytest
import torch
from ckptio import _native
from ckptio import safetensors as cst
from ckptio.io import transfer as _transfer
from ckptio.io.engines import engine as _engine

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The folder the ckptio under test was imported from (a checkout or an install).
PACKAGE = pathlib.Path(ckptio.__file__).resolve().parent


def run_python(code: str, cwd, env: dict | None = None, timeout: int = 120):
    """Run ``code`` in a fresh interpreter that imports the same ckptio."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("CUFILE_")}
    e["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), e.get("PYTHONPATH", "")])
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------- one way through


def test_every_transfer_goes_through_the_transfer_helper():
    """No module but ckptio.io.transfer calls the native transfers: the stream order
    and the owners cannot be forgotten by one format (the DCP reader once was)."""
    calls = re.compile(
        r"(?<!transfer)\.(read_segments|write_segments|write_storages|read_into|store_read_into)\("
    )
    offenders = []
    files = list(PACKAGE.rglob("*.py"))
    assert len(files) > 20  # the package's subfolders too
    for f in files:
        if f.relative_to(PACKAGE).as_posix() == "io/transfer.py":
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if calls.search(line):
                offenders.append(f"{f.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_reports_say_the_backend_asked_for_and_the_path_taken(tmp_path):
    sd = {"a": torch.arange(1000.0), "b": torch.ones(3, 5)}
    ckptio.save(sd, tmp_path / "a.pt")
    rep = ckptio.last_report()
    assert (rep.backend, rep.device_path) == ("auto", None)  # host memory only
    assert rep.pinned_bytes >= 0
    ckptio.save(sd, tmp_path / "b.pt", backend="posix")  # the older name
    assert ckptio.last_report().backend == "bounce"
    ckptio.load(tmp_path / "b.pt", backend="bounce")
    assert ckptio.last_report().backend == "bounce"
    cst.save_file(sd, tmp_path / "c.safetensors", device_backend="bounce")
    rep = ckptio.last_report()
    assert (rep.backend, rep.device_path) == ("bounce", None)
    with pytest.raises(ValueError, match="backend must be auto, cufile or bounce"):
        ckptio.save(sd, tmp_path / "d.pt", backend="posixx")


def test_gdsfile_names_backend_and_device_path(tmp_path):
    f = ckptio.GdsFile(tmp_path / "g.bin", os.O_CREAT | os.O_RDWR, backend="bounce")
    assert (f.backend, f.device_path) == ("bounce", "bounce")
    assert "bounce backend requested" in f.fallback_reason
    x = torch.arange(5000, dtype=torch.int16)
    f.save_storage(x.untyped_storage(), 100)
    f.deregister_handle()
    assert f.device_path is None  # closed; host transfers never needed it
    y = torch.empty_like(x)
    f.load_storage(y.untyped_storage(), 100)
    assert torch.equal(x, y)
    with pytest.raises(ckptio.FormatError, match="past the end of the file"):
        f.load_storage(y.untyped_storage(), 10**6)
    f.register_handle()
    assert f.device_path == "bounce"


def test_reader_refuses_ranges_outside_records_before_reading(tmp_path):
    p = tmp_path / "r.pt"
    ckptio.save({"a": torch.arange(100, dtype=torch.int64)}, p)
    r = _native.Reader(p)
    name, off, size = next(x for x in r.records() if "/data/" in x[0])
    buf = torch.empty(size + 8, dtype=torch.uint8)
    with pytest.raises(ckptio.FormatError, match="not inside one record"):
        _transfer.read(r, _native.Engine(), [(off, buf.data_ptr(), size + 8, -1)], [buf])
    stats = _transfer.read(
        r, _native.Engine(), [(off, buf.data_ptr(), size, -1)], [buf], verify=True
    )
    assert stats["verified"] == [name] and stats["unchecked"] == []


# ------------------------------------------------------------- locks and the GIL


_TWO_THREADS = """
import os, sys, threading, torch, ckptio
f = ckptio.GdsFile(sys.argv[1], os.O_CREAT | os.O_RDWR)
n = int(sys.argv[2])
def flip():  # closes and opens the device path (detached, under the file's locks)
    for _ in range(n):
        f.deregister_handle()
        f.register_handle()
def look():  # reads it, and transfers, while attached to the interpreter
    x = torch.arange(1 << 12, dtype=torch.uint8).untyped_storage()
    for _ in range(n):
        f.backend, f.device_path, f.gds_mode, f.fallback_reason
        f.save_storage(x, 0)
        f.load_storage(x, 0)
ts = [threading.Thread(target=flip), threading.Thread(target=look)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print("done")
"""


def test_two_threads_on_one_gdsfile_never_deadlock(tmp_path):
    """One thread registers and deregisters the handle while another reads the
    file's state and transfers: before, register_handle held the file's mutex
    across its detached call and the re-attach while the getters waited for it
    attached, and the two threads each waited for what the other held (main
    hung in every run of 2,000 rounds)."""
    code = _TWO_THREADS
    try:
        run = run_python(
            f"import sys; sys.argv[1:] = [{str(tmp_path / 'g.bin')!r}, '2000']\n{code}",
            tmp_path,
            timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("two threads on one GdsFile deadlocked (no progress in 240 s)")
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-3000:]


def test_writer_commit_waits_detached_for_a_write_in_flight(tmp_path):
    """commit/abort take the writer's lock detached: a thread committing while another
    writes neither hangs nor stalls the interpreter."""
    import threading

    w = _native.AtomicWriter(tmp_path / "w.bin", "off")
    data = torch.arange(1 << 22, dtype=torch.uint8)
    e = _engine(2, 1 << 16, "off")
    errors: list[BaseException] = []
    first = threading.Event()

    def writes():
        try:
            for _ in range(20):
                _transfer.write(w, e, [(0, data.data_ptr(), data.numel(), -1)], [data])
                first.set()
        except ValueError:
            pass  # committed meanwhile: "already committed or aborted"
        except BaseException as x:  # noqa: BLE001
            errors.append(x)
        first.set()

    t = threading.Thread(target=writes)
    t.start()
    assert first.wait(timeout=120)
    ticks = sum(1 for _ in range(2000))  # the interpreter keeps running meanwhile
    w.commit()
    t.join(timeout=120)
    assert not t.is_alive() and not errors and ticks == 2000
    assert (tmp_path / "w.bin").stat().st_size == 1 << 22


# ---------------------------------------------------------------------- owners


def test_pins_and_native_calls_hold_their_owners():
    storage = torch.empty(1 << 16, dtype=torch.uint8).untyped_storage()
    before = sys.getrefcount(storage)
    pin = _native.HostPin(storage, storage.data_ptr(), storage.nbytes(), pin=False)
    assert sys.getrefcount(storage) == before + 1
    pin.close()
    assert sys.getrefcount(storage) == before
    pin.close()  # idempotent
    # A transfer's owners are held for the call, and let go after it.
    src = torch.arange(1 << 16, dtype=torch.uint8)
    pin = _native.HostPin(storage, storage.data_ptr(), storage.nbytes(), pin=False)
    base = sys.getrefcount(src)
    stats = _native.stage_copy([(src.data_ptr(), -1, pin, 0, src.numel())], [src])
    assert stats["bytes"] == 1 << 16 and sys.getrefcount(src) == base
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(storage), src)
    pin.close()


# --------------------------------------------------------------- pinned memory


def engines():
    return [_engine(2, 1 << 16, None), _engine(3, 1 << 17, "off"), _engine(1, None, None)]


def test_release_buffers_gives_every_engines_memory_back(tmp_path):
    """Soak through several engines: what they keep between calls returns to zero."""
    sd = {f"t{i}": torch.randn(10_000 + i) for i in range(8)}
    for round_ in range(10):
        for i, (threads, chunk) in enumerate([(2, 1 << 16), (3, 1 << 17), (1, None)]):
            p = tmp_path / f"{i}.pt"
            ckptio.save(sd, p, threads=threads, chunk_size=chunk)
            got = ckptio.load(p, threads=threads, chunk_size=chunk)
            assert all(torch.equal(got[k], sd[k]) for k in sd) or round_
    assert sum(e.pooled_bytes() for e in engines()) > 0
    freed = ckptio.release_buffers()
    assert freed > 0
    assert [e.pooled_bytes() for e in engines()] == [0, 0, 0]
    assert [e.pinned_bytes() for e in engines()] == [0, 0, 0]
    assert ckptio.release_buffers() == 0
    # The engines still work, and allocate again.
    ckptio.save(sd, tmp_path / "again.pt", threads=2, chunk_size=1 << 16)
    assert _engine(2, 1 << 16, None).pooled_bytes() > 0


def test_engine_close_and_idle_release(tmp_path):
    x = torch.randn(1 << 16)
    e = _native.Engine(threads=2, chunk_size=1 << 16, idle_release=0.05)
    assert e.idle_release == pytest.approx(0.05)
    w = _native.AtomicWriter(tmp_path / "x.bin")
    _transfer.write(w, e, [(0, x.data_ptr(), x.nbytes, -1)], [x])
    w.commit()
    for _ in range(1500):  # the reaper frees them after 50 ms idle; wait up to 30 s
        if e.pooled_bytes() == 0:
            break
        time.sleep(0.02)
    assert e.pooled_bytes() == 0, "idle buffers were never given back"
    c = _native.Engine(threads=2, chunk_size=1 << 16)
    w = _native.AtomicWriter(tmp_path / "y.bin")
    _transfer.write(w, c, [(0, x.data_ptr(), x.nbytes, -1)], [x])
    assert c.pooled_bytes() > 0 and c.close() > 0
    _transfer.write(w, c, [(0, x.data_ptr(), x.nbytes, -1)], [x])
    w.commit()
    assert c.pooled_bytes() == 0  # closed: keeps nothing, still works
    with pytest.raises(ValueError, match="idle_release"):
        _native.Engine(idle_release=-1.0)


def test_pinned_memory_is_reported(capsys):
    d = ckptio.info()
    assert d["pinned"]["held"] >= 0 and d["pinned"]["limit"] > 0
    assert _native.pinned_memory()["limit"] == d["pinned"]["limit"]
    from ckptio.tools.cli import main

    assert main(["info", "."]) == 0
    assert "Pinned:" in capsys.readouterr().out


def test_malformed_pinned_limit_and_idle_release_are_errors(tmp_path):
    run = run_python(
        """
        import ckptio
        from ckptio import _native
        try:
            _native.pinned_memory()
        except ValueError as e:
            print("limit:", e)
        try:
            _native.Engine()
        except ValueError as e:
            print("idle:", e)
        """,
        tmp_path,
        {"CKPTIO_PINNED_LIMIT": "lots", "CKPTIO_IDLE_RELEASE": "soon"},
    )
    assert "limit: CKPTIO_PINNED_LIMIT" in run.stdout, run.stdout + run.stderr
    assert "idle: CKPTIO_IDLE_RELEASE" in run.stdout, run.stdout + run.stderr


# ------------------------------------------------------------- CKPTIO_THREADS


@pytest.mark.parametrize("value", ["abc", "0", "1000"])
def test_ckptio_threads_is_read_once_with_one_policy(monkeypatch, value):
    """Before, the stagers ignored a malformed CKPTIO_THREADS that the engine refused."""
    from ckptio.staging import DefaultStager

    monkeypatch.setenv("CKPTIO_THREADS", value)
    with pytest.raises(ValueError, match="CKPTIO_THREADS") as engine_error:
        _native.Engine()
    with pytest.raises(ValueError, match="CKPTIO_THREADS") as stager_error:
        DefaultStager()
    assert str(engine_error.value) == str(stager_error.value)
    monkeypatch.setenv("CKPTIO_THREADS", "5")
    s = DefaultStager()
    assert s._threads == 5 and _native.Engine().threads == 5
    s.close()


# ------------------------------------------------------------------ cuFile log


_PROBE = """
import json, os
import ckptio
ckptio.info(".")
print(json.dumps({"log": os.environ.get("CUFILE_LOGFILE_PATH"), "files": os.listdir(".")}))
"""


def test_importing_and_probing_leaves_no_cufile_log_here(tmp_path):
    cache = tmp_path / "cache"
    work = tmp_path / "work"
    work.mkdir()
    run = run_python(_PROBE, work, {"XDG_CACHE_HOME": str(cache)})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "cufile.log" not in out["files"]
    assert out["log"] == str(cache / "ckptio" / "cufile.log")
    # The user's own choice stands: a log path, or a cufile.json of their own.
    mine = str(tmp_path / "mine.log")
    run = run_python(_PROBE, work, {"CUFILE_LOGFILE_PATH": mine})
    assert json.loads(run.stdout.strip().splitlines()[-1])["log"] == mine
    run = run_python(_PROBE, work, {"CUFILE_ENV_PATH_JSON": str(tmp_path / "cufile.json")})
    assert json.loads(run.stdout.strip().splitlines()[-1])["log"] is None


def test_no_cufile_log_is_committed():
    root = ROOT
    assert not (root / "cufile.log").exists() or "cufile.log" in (root / ".gitignore").read_text()
    tracked = subprocess.run(
        ["git", "ls-files", "cufile.log"], cwd=root, capture_output=True, text=True
    )
    assert tracked.stdout.strip() == ""


# ------------------------------------------------------------------------ GPU


def _busy_then(fn) -> None:
    """Queue ~0.2-0.5 s of spinning on the current stream, then ``fn`` (a kernel)."""
    torch.cuda._sleep(int(5e8))
    fn()


@pytest.mark.gpu
def test_dcp_reader_orders_after_work_queued_on_the_destination(tmp_path):
    """A kernel queued on the current stream writes the destination while the load
    runs: the load's bytes must land after it (before, the DCP reader did not order
    the engine's writes after torch's stream at all)."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    src = {"w": torch.arange(1 << 22, dtype=torch.float32, device="cuda")}
    dcp.save(src, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    for backend in ("bounce", None):
        dest = {"w": torch.zeros(1 << 22, device="cuda")}
        _busy_then(lambda d=dest: d["w"].fill_(-1.0))  # still queued when the load starts
        dcp.load(dest, storage_reader=FileSystemReader(tmp_path, backend=backend), no_dist=True)
        torch.cuda.synchronize()
        assert torch.equal(dest["w"], src["w"]), backend


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp", "gds"])
def test_saves_see_work_queued_before_them(tmp_path, fmt):
    """Every format's save reads the source after the kernels queued on it."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # a stream of the caller's, not the default one
        x = torch.zeros(1 << 22, device="cuda")
        _busy_then(lambda: x.fill_(7.0))
        if fmt == "torch":
            ckptio.save({"x": x}, tmp_path / "x.pt", backend="bounce")
            back = ckptio.load(tmp_path / "x.pt")["x"]
        elif fmt == "safetensors":
            cst.save_file({"x": x}, tmp_path / "x.safetensors", device_backend="bounce")
            back = cst.load_file(tmp_path / "x.safetensors")["x"]
        elif fmt == "dcp":
            import torch.distributed.checkpoint as dcp
            from ckptio.dcp import FileSystemReader, FileSystemWriter

            dcp.save(
                {"x": x}, storage_writer=FileSystemWriter(tmp_path, backend="bounce"), no_dist=True
            )
            back = {"x": torch.zeros(1 << 22)}
            dcp.load(back, storage_reader=FileSystemReader(tmp_path), no_dist=True)
            back = back["x"]
        else:
            f = ckptio.GdsFile(tmp_path / "x.bin", os.O_CREAT | os.O_RDWR, backend="bounce")
            f.save_storage(x.untyped_storage(), 0)
            back = torch.empty(1 << 22)
            f.load_storage(back.untyped_storage(), 0)
    assert torch.equal(back.cpu(), torch.full((1 << 22,), 7.0)), fmt


@pytest.mark.gpu
def test_gdsfile_load_orders_after_work_queued_on_the_destination(tmp_path):
    f = ckptio.GdsFile(tmp_path / "g.bin", os.O_CREAT | os.O_RDWR)
    src = torch.arange(1 << 22, dtype=torch.float32, device="cuda")
    f.save_storage(src.untyped_storage(), 0)
    dest = torch.zeros_like(src)
    _busy_then(lambda: dest.fill_(-1.0))
    f.load_storage(dest.untyped_storage(), 0)
    torch.cuda.synchronize()
    assert torch.equal(dest, src)


@pytest.mark.gpu
def test_a_registration_holds_its_storage():
    """Before, gds_register_buffer let go of the storage: after ``del t`` and
    empty_cache the registration outlived its allocation."""
    torch.cuda.synchronize()
    gc.collect()  # garbage of earlier tests freed now, not while this one measures
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    ckptio.gds_register_buffer(t.untyped_storage())
    st = t.untyped_storage()
    registered = st.data_ptr() in ckptio.gds._registrations
    del t, st
    gc.collect()
    torch.cuda.empty_cache()
    if registered:  # cuFile took it: the memory stays while registered
        assert torch.cuda.memory_allocated() >= base + (64 << 20)
        (reg,) = ckptio.gds._registrations.values()
        reg.close()
        ckptio.gds._registrations.clear()
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == base


_PINNED_SOAK = """
import json, torch, ckptio
from ckptio import _native
from ckptio.staging import DefaultStager, StagingOptions
sd = {f"t{i}": torch.randn(1 << 20, device="cuda") for i in range(4)}
peak = 0
for round_ in range(5):
    for i, (threads, chunk) in enumerate([(2, 1 << 20), (4, 4 << 20), (8, None)]):
        p = f"{DIR}/{i}.pt"
        ckptio.save(sd, p, threads=threads, chunk_size=chunk, backend="bounce")
        got = ckptio.load(
            p, map_location="cuda", threads=threads, chunk_size=chunk, backend="bounce"
        )
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        peak = max(peak, ckptio.last_report().pinned_bytes)
st = DefaultStager(StagingOptions(use_async_staging=False))
staged = st.stage(sd)
assert all(torch.equal(staged[k], sd[k].cpu()) for k in sd)
with_stager = _native.pinned_memory()["held"]
ckptio.release_buffers()
after_release = _native.pinned_memory()["held"]
st.close()
end = _native.pinned_memory()
print(json.dumps({"peak": peak, "with_stager": with_stager, "after_release": after_release,
                  "after_close": end["held"], "limit": end["limit"]}))
"""


@pytest.mark.gpu
def test_pinned_memory_returns_to_zero(tmp_path):
    """Saves and loads through several engines pin bounce buffers; release_buffers()
    gives the engines' back and the stager's close() its own: ckptio holds 0 after."""
    run = run_python(f"DIR = {str(tmp_path)!r}\n{_PINNED_SOAK}", tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["peak"] > 0 and r["with_stager"] > 0, r
    assert r["after_release"] > 0  # the stager's pins are the stager's
    assert r["after_close"] == 0, r


@pytest.mark.gpu
def test_pinned_cap_is_respected_and_transfers_still_work(tmp_path):
    """Under a cap of 0 nothing is pinned: bounce lanes run pageable, stagers unpinned."""
    code = f"DIR = {str(tmp_path)!r}\n{_PINNED_SOAK}"
    run = run_python(code, tmp_path, {"CKPTIO_PINNED_LIMIT": "0"}, 600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["limit"] == 0 and r["peak"] == 0 and r["with_stager"] == 0, r


@pytest.mark.gpu
def test_idle_bounce_buffers_are_unpinned_after_a_while(tmp_path):
    run = run_python(
        f"""
        import time, torch, ckptio
        from ckptio import _native
        ckptio.save({{"x": torch.randn(1 << 22, device="cuda")}}, {str(tmp_path / "x.pt")!r},
                    backend="bounce")
        held = _native.pinned_memory()["held"]
        for _ in range(600):
            if _native.pinned_memory()["held"] == 0:
                break
            time.sleep(0.05)
        print(held, _native.pinned_memory()["held"])
        """,
        tmp_path,
        {"CKPTIO_IDLE_RELEASE": "0.2"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    held, after = map(int, run.stdout.split())
    assert held > 0 and after == 0


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["torch", "ckptio"])
def test_cufile_driver_open_leaves_no_log_here(tmp_path, first):
    """With a GPU, ckptio.info opens cuFile's driver, which logs: never into the
    current folder, whichever of torch and ckptio is imported first."""
    work = tmp_path / "work"
    work.mkdir()
    imports = "import torch, ckptio" if first == "torch" else "import ckptio, torch"
    run = run_python(
        _PROBE.replace("import ckptio", imports), work, {"XDG_CACHE_HOME": str(tmp_path / "c")}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "cufile.log" not in out["files"], out


@pytest.mark.gpu
def test_transfers_leave_the_current_device_alone(tmp_path):
    """The stream-order event is recorded on the caller's thread: its current CUDA
    context (torch's current device) is restored afterwards."""
    n = torch.cuda.device_count()
    sd = {f"d{i}": torch.full((1 << 20,), float(i), device=f"cuda:{i}") for i in range(n)}
    for dev in range(n):
        torch.cuda.set_device(dev)
        ckptio.save(sd, tmp_path / "m.pt", backend="bounce")
        got = ckptio.load(
            tmp_path / "m.pt", map_location={f"cuda:{i}": f"cuda:{i}" for i in range(n)}
        )
        assert torch.cuda.current_device() == dev
        assert all(torch.equal(got[k].cpu(), sd[k].cpu()) for k in sd)
    torch.cuda.set_device(0)
