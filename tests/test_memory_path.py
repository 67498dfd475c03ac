"""Loads from memory (tmpfs, the page cache) and huge pages for host memory.

The engine decides per file and per read: a file on tmpfs, or one whose pages
are in the page cache, is copied from memory (through a mapping, or with pread
under CKPTIO_MEMORY_PATH=pread); a cold file keeps O_DIRECT. ``last_report()``
says which ran and why. Host storages of a load and private staging buffers ask
for huge pages (CKPTIO_HUGE_PAGES: auto, on, off).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import benchlib
import ckptio
import ckptio.dcp
import ckptio.safetensors as cst
import pytest
import torch
from ckptio import _native
from ckptio.tools import bench
from test_fault_injection import run_faulty

SHM = Path("/dev/shm")
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

#: A probe hook: only in a build with the cargo feature "probes" (scripts/dev_build.sh).
host_memory = getattr(_native, "host_memory", None)
needs_probes = pytest.mark.skipif(
    host_memory is None, reason="needs the probe hooks (cargo feature probes: scripts/dev_build.sh)"
)


def no_file_mappings() -> bool:
    """No file mapping of a read left alive (not checked without the probe hook)."""
    return host_memory is None or host_memory()["file_mappings"] == 0


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ckptio-test-", dir=SHM))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def engine_env(monkeypatch):
    """Set CKPTIO_* variables for the engines made from now on (they are cached)."""

    def set_env(**kw: str) -> None:
        for k, v in kw.items():
            monkeypatch.setenv(k, v)
        ckptio.io.engines.engine.cache_clear()

    yield set_env
    ckptio.io.engines.engine.cache_clear()


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: several chunks, huge pages
        "odd": torch.randint(0, 255, (1_000_003,), dtype=torch.uint8, generator=g),
        "half": torch.randn(700, 300, generator=g).half(),
        "tiny": torch.arange(7),
    }
    sd["view"] = sd["big"][5:1000]  # shares the storage of "big"
    return sd


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def warm(path: Path) -> None:
    """Read the file once through the page cache, as another process would."""
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def cold(path: Path) -> None:
    bench.drop_cache(str(path))


def vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``addr``."""
    flags: list[str] | None = None
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {addr:#x}"
    return flags


@needs_shm
@pytest.mark.parametrize("memory_path", ["map", "map-nt", "pread", "off"])
def test_memory_path_and_disk_path_give_identical_bytes(tmp_path, shm_dir, engine_env, memory_path):
    """The same checkpoint read from tmpfs, from the page cache and cold from the disk
    (O_DIRECT), whichever way memory is read, gives the saved bytes; torch.save files
    (64-byte aligned records) too."""
    engine_env(CKPTIO_MEMORY_PATH=memory_path, CKPTIO_CHUNK_SIZE="1M")
    sd = state()
    for folder in (shm_dir, tmp_path):
        for name, saver in (("c.pt", ckptio.save), ("t.pt", torch.save)):
            p = folder / name
            saver(sd, p)
            for how in ("as written", "cold", "warm"):
                if folder == tmp_path and how != "as written":
                    (cold if how == "cold" else warm)(p)
                out = ckptio.load(p)
                rep = ckptio.last_report()
                assert same(out, sd), (folder, name, how)
                view, big = out["view"].untyped_storage(), out["big"].untyped_storage()
                assert view.data_ptr() == big.data_ptr()
                assert rep.read_path in ("memory", "disk") and rep.read_reason
            out = ckptio.load(p, verify=True)
            assert same(out, sd) and ckptio.last_report().verified
    assert no_file_mappings()


def test_the_per_file_decision_and_its_report(tmp_path, engine_env):
    """A cold disk file is read from the disk, O_DIRECT; once its pages are in the
    page cache, from memory through a mapping (pread with CKPTIO_MEMORY_PATH=pread);
    CKPTIO_MEMORY_PATH=off never looks at the page cache."""
    engine_env(CKPTIO_MEMORY_PATH="auto")
    sd = state(1)
    p = tmp_path / "c.pt"
    ckptio.save(sd, p)
    direct = ckptio.info(tmp_path)["folder"]["o_direct"]
    cold(p)
    assert same(ckptio.load(p), sd)
    rep = ckptio.last_report()
    assert rep.read_path == "disk" and rep.read_reason.startswith("cold:"), rep
    assert rep.read_source == ("direct" if direct else "buffered")
    assert rep.direct == direct
    warm(p)
    assert same(ckptio.load(p), sd)
    rep = ckptio.last_report()
    assert (rep.read_path, rep.read_source) == ("memory", "map"), rep
    assert rep.read_reason.startswith("page cache: 100%"), rep
    assert not rep.direct and "read from memory" in rep.direct_reason
    for mode in ("pread", "map-nt"):
        engine_env(CKPTIO_MEMORY_PATH=mode)
        assert same(ckptio.load(p), sd)
        rep = ckptio.last_report()
        assert (rep.read_path, rep.read_source) == ("memory", mode), rep
    engine_env(CKPTIO_MEMORY_PATH="off")
    assert same(ckptio.load(p), sd)
    rep = ckptio.last_report()
    assert rep.read_path == "disk" and "off" in rep.read_reason
    assert _native.Engine(memory_path="pread").memory_path == "pread"
    with pytest.raises(ValueError, match="memory path"):
        _native.Engine(memory_path="sometimes")
    engine_env(CKPTIO_MEMORY_PATH="bogus")
    with pytest.raises(ValueError, match="memory path"):
        ckptio.load(p)


@needs_shm
def test_tmpfs_files_are_read_from_memory_by_every_loader(shm_dir, engine_env):
    """ckptio.load, safetensors load_file / load_sharded and the DCP reader all take
    the memory path for files on tmpfs (and the disk path for cold ones)."""
    engine_env(CKPTIO_MEMORY_PATH="auto")
    sd = {k: v.clone() for k, v in state(2).items() if k != "view"}
    ckptio.save(sd, shm_dir / "c.pt")
    assert same(ckptio.load(shm_dir / "c.pt"), sd)
    assert ckptio.last_report().read_reason == "tmpfs"
    cst.save_file(sd, shm_dir / "m.safetensors")
    assert same(cst.load_file(shm_dir / "m.safetensors"), sd)
    rep = ckptio.last_report()
    assert (rep.read_path, rep.read_source, rep.read_reason) == ("memory", "map", "tmpfs")
    cst.save_sharded(sd, shm_dir / "sh", max_shard_size=8 << 20)
    assert same(cst.load_sharded(shm_dir / "sh"), sd)
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=ckptio.dcp.FileSystemWriter(shm_dir / "d"))
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = ckptio.dcp.FileSystemReader(shm_dir / "d")
    dcp.load(back, storage_reader=reader)
    assert same(back, sd)
    assert reader.last_stats and all(s["read_path"] == "memory" for s in reader.last_stats)


TRUNCATE_SCRIPT = """
from ckptio import _native, serialization
out = []
device = sys.argv[1]
for folder in sys.argv[2:]:
    for mode in ("map", "map-nt", "pread", "off"):
        os.environ["CKPTIO_MEMORY_PATH"] = mode
        ckptio.io.engines.engine.cache_clear()
        sd = {"w": torch.arange(8 << 20, dtype=torch.int32), "s": torch.ones(3)}
        p = os.path.join(folder, "t.pt")
        for truncate_to in (0, 12 << 20, 4096 * 7 + 5):
            ckptio.save(sd, p)
            if mode != "off":
                open(p, "rb").read()  # in the page cache: the memory path
            _native._set_truncation("read", truncate_to, 2)
            res = attempt(lambda: ckptio.load(p, map_location=device, chunk_size=1 << 20))
            res["unfired"] = _native._clear_faults()
            probe = getattr(_native, "host_memory", None)  # the probes build only
            res["mem"] = probe() if probe else None
            res["case"] = [folder, mode, truncate_to]
            out.append(res)
print(json.dumps(out))
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_file_truncated_while_it_is_read_is_a_typed_error(tmp_path, device):
    """A file that shrinks under a load (truncated by someone else after the first
    chunk) fails it with FormatError naming the file: no SIGBUS from a mapping, no
    mapping left behind, whichever path reads it (mapping, pread, O_DIRECT), on
    the disk and on tmpfs, into host or device memory."""
    folders = [tmp_path]
    if SHM.is_dir():
        folders.append(Path(tempfile.mkdtemp(dir=SHM)))
    try:
        res = run_faulty(TRUNCATE_SCRIPT, device, *folders)
    finally:
        for f in folders[1:]:
            shutil.rmtree(f, ignore_errors=True)
    assert len(res) == 12 * len(folders)
    for r in res:
        assert r["unfired"] == [], r
        assert r["mem"] is None or r["mem"]["file_mappings"] == 0, r
        if r["type"] == "CuFileError" and device == "cuda":
            continue  # cuFile's own read of the cold file (its error, typed)
        assert r["type"] == "FormatError", r
        assert "t.pt" in r["message"], r


def test_huge_page_advice_is_applied_to_host_storages(tmp_path, engine_env):
    """With CKPTIO_HUGE_PAGES=on the large host storages of a load are mappings
    advised MADV_HUGEPAGE ("hg" in VmFlags); with off they are not, and the bytes
    are the same either way. The mapping goes with the last tensor using it."""
    sd = state(3)
    p = tmp_path / "c.pt"
    ckptio.save(sd, p)
    for setting, advised in (("on", True), ("off", False), ("auto", None)):
        engine_env(CKPTIO_HUGE_PAGES=setting)
        del ckptio.load(p)["big"]  # the engine's own buffers are made by the first load
        base = host_memory()["anon_bytes"] if host_memory else 0
        out = ckptio.load(p)
        assert same(out, sd)
        big = out["big"].untyped_storage()
        flags = vm_flags(big.data_ptr())
        if advised is not None:
            assert ("hg" in flags) == advised, (setting, flags)
        if host_memory:  # the probes build: the mapping's bytes come and go
            assert host_memory()["anon_bytes"] >= base + big.nbytes()
            del out, big
            assert host_memory()["anon_bytes"] == base
    m = _native.HostMemory(4 << 20)
    assert m.nbytes == 4 << 20 and m.addr % 4096 == 0
    assert not m.huge or m.addr % (2 << 20) == 0


def test_private_staging_buffers_ask_for_huge_pages(engine_env):
    """A private staging buffer is anonymous memory advised MADV_HUGEPAGE (when
    asked for); a shared one a memfd; both stage the same bytes."""
    from ckptio.staging import DefaultStager, StagingOptions

    sd = {"w": torch.randn(1 << 20), "b": torch.randn(10)}
    for shared, setting in ((False, "on"), (False, "off"), (True, "on")):
        engine_env(CKPTIO_HUGE_PAGES=setting)
        with DefaultStager(StagingOptions(use_shared_memory=shared, use_async_staging=False)) as s:
            staged = s.stage(sd)
            assert same(staged, sd)
            flags = vm_flags(staged["w"].data_ptr())
            assert ("hg" in flags) == (not shared and setting == "on"), (shared, setting, flags)
            assert ("sh" in flags) == shared


def test_info_says_what_huge_pages_do_here():
    h = ckptio.info()["huge_pages"]
    assert h["private_4k_gib_s"] > 0 and h["shared_gib_s"] > 0
    assert isinstance(h["advice"], bool) and isinstance(h["free_page_reporting"], bool)
    from ckptio.tools.sysinfo import format_info

    text = format_info(ckptio.info())
    assert "huge pages:  private" in text and "shared" in text
    json.dumps(h)


@pytest.mark.gpu
@needs_shm
@pytest.mark.parametrize("memory_path", ["map", "map-nt", "pread"])
def test_gpu_destinations_read_from_memory(tmp_path, shm_dir, engine_env, memory_path):
    """CUDA destinations of a file in memory (tmpfs, cached disk pages) are filled
    through the bounce lanes, whatever cuFile could do, with the saved bytes; a cold
    disk file keeps the disk path (cuFile or bounce)."""
    engine_env(CKPTIO_MEMORY_PATH=memory_path)
    sd = {k: v.cuda() for k, v in state(4).items() if k != "view"}
    for folder in (shm_dir, tmp_path):
        p = folder / "g.pt"
        ckptio.save(sd, p)
        if folder == tmp_path:
            cold(p)
            assert same(ckptio.load(p, map_location="cuda"), sd)
            assert ckptio.last_report().read_path == "disk"
            warm(p)
        out = ckptio.load(p, map_location="cuda")
        rep = ckptio.last_report()
        assert same(out, sd)
        assert (rep.read_path, rep.read_source) == ("memory", memory_path)
        assert rep.device_path == "bounce" and rep.fallback_reason
        cst.save_file(sd, folder / "g.safetensors")
        if folder == tmp_path:
            warm(folder / "g.safetensors")
        assert same(cst.load_file(folder / "g.safetensors", device="cuda"), sd)
        assert ckptio.last_report().read_path == "memory"
    assert no_file_mappings()


@needs_probes
@pytest.mark.parametrize("source", ["map", "map-nt", "pread"])
def test_the_copy_floor_probe_reads_a_whole_file(tmp_path, source):
    """The benches' CPU copy floor (``memory_copy_floor``) copies a whole file,
    short last chunk included, and refuses bad arguments with typed errors."""
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * (5 * 4096 + 3))
    seconds, pinned = _native.memory_copy_floor(p, source, 3, 64 << 10)
    assert seconds > 0 and pinned == torch.cuda.is_available()
    assert no_file_mappings()
    seconds, pinned = _native.memory_copy_floor(p, source, 2, 64 << 10, pinned=False)
    assert seconds > 0 and not pinned
    for bad in (dict(source="mmap"), dict(threads=0), dict(chunk_size=1000)):
        with pytest.raises(ValueError):
            _native.memory_copy_floor(p, **bad)
    with pytest.raises(OSError):
        _native.memory_copy_floor(tmp_path / "missing.bin")


def test_the_bench_times_the_engine_reads_of_a_load(tmp_path):
    """benchlib.EngineReads: the seconds of a load spent in the engine's reads."""
    p = tmp_path / "c.pt"
    ckptio.save(state(5), p)
    reads = benchlib.EngineReads()
    try:
        assert same(ckptio.load(p), state(5))
        assert reads.calls >= 1 and reads.seconds > 0
        reads.reset()
        assert (reads.calls, reads.seconds) == (0, 0.0)
    finally:
        reads.close()
    ckptio.load(p)
    assert reads.calls == 0


def test_the_probes_timers():
    """benchlib.timed_threads runs every thread to its end; benchlib.h2d_seconds fills
    its destination from a smaller source, piece by piece (on CUDA)."""
    import threading
    import time

    done: list[int] = []
    ths = [
        threading.Thread(target=lambda k=k: (time.sleep(0.01), done.append(k))) for k in range(3)
    ]
    assert benchlib.timed_threads(ths) >= 0.01 and sorted(done) == [0, 1, 2]
    if torch.cuda.is_available():
        src = torch.arange(256, dtype=torch.uint8).pin_memory()
        dst = torch.zeros(600, dtype=torch.uint8, device="cuda")
        assert benchlib.h2d_seconds(dst, src) > 0
        assert torch.equal(dst.cpu(), torch.arange(600).remainder(256).to(torch.uint8))


FORKED_LOADS = """
import os, sys, torch, ckptio
from ckptio import _native
path = sys.argv[1]
ckptio.save({"w": torch.ones(80 << 18)}, path)  # 80 MiB: its mapping is unmapped off-thread
ckptio.load(path)
ckptio.release_buffers()  # the kept mapping goes to the unmapping thread
pid = os.fork()
if pid == 0:  # the child's copies of the parent's mappings, and its own, are unmapped
    ckptio.load(path)
    ckptio.release_buffers()
    os._exit(0 if _native.host_memory()["file_mappings"] == 0 else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert _native.host_memory()["file_mappings"] == 0
print("ok")
"""


@needs_shm
@needs_probes
def test_a_forked_child_unmaps_its_file_mappings(shm_dir):
    # The thread that unmaps large mappings does not exist in a forked child:
    # the child starts its own, and waiting for its unmaps ends.
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", FORKED_LOADS, str(shm_dir / "big.pt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
