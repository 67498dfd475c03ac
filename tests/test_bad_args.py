"""Public functions given wrong types, negative offsets, misaligned sizes, finished handles,
tensors on the wrong device, storages too small: a clear error naming the argument."""

from __future__ import annotations

import errno
import fcntl
import gc
import os

import ckptio
import pytest
import torch
from ckptio import _native
from ckptio.io import transfer as _transfer
from test_faults import make_prev, sample_state


@pytest.fixture
def gds(tmp_path):
    return ckptio.GdsFile(tmp_path / "g.bin", os.O_CREAT | os.O_RDWR)


@pytest.mark.parametrize("method", ["save_storage", "load_storage"])
@pytest.mark.parametrize(
    ("storage", "offset", "exc", "match"),
    [
        (torch.ones(3), 0, TypeError, "storage must be a torch storage.*Tensor.*untyped_storage"),
        ("s", 0, TypeError, "storage must be a torch storage.*str"),
        (None, 0, TypeError, "storage must be a torch storage.*NoneType"),
        (torch.ones(3).untyped_storage(), -1, ValueError, "offset must be >= 0"),
        (torch.ones(3).untyped_storage(), "x", TypeError, "offset must be an int, not str"),
        (torch.ones(3).untyped_storage(), 1.5, TypeError, "offset must be an int, not float"),
        (torch.ones(3).untyped_storage(), True, TypeError, "offset must be an int, not bool"),
        (torch.empty(3, device="meta").untyped_storage(), 0, ValueError, "storage is on .*meta"),
    ],
    ids=["tensor", "str", "None", "negative", "str-offset", "float-offset", "bool-offset", "meta"],
)
def test_gdsfile_bad_arguments_name_the_argument(gds, method, storage, offset, exc, match):
    with pytest.raises(exc, match=match):
        getattr(gds, method)(storage, offset)


def test_gdsfile_misaligned_offsets_and_sizes_roundtrip_and_short_file_is_an_error(gds):
    """Odd offsets and sizes work (unaligned heads and tails go buffered); reading past the end
    of the file is a FormatError naming the file; after deregister_handle transfers still work."""
    src = torch.randint(0, 255, (4097,), dtype=torch.uint8)
    gds.save_storage(src.untyped_storage(), 7)
    dst = torch.zeros(4097, dtype=torch.uint8)
    gds.load_storage(dst.untyped_storage(), 7)
    assert torch.equal(src, dst)
    with pytest.raises(ckptio.FormatError, match="g.bin"):
        gds.load_storage(torch.zeros(10_000, dtype=torch.uint8).untyped_storage(), 7)
    gds.deregister_handle()
    gds.save_storage(src.untyped_storage(), 100_003)
    gds.load_storage(dst.untyped_storage(), 100_003)
    assert torch.equal(src, dst)


def test_gds_has_every_name_of_torchs():
    """ckptio.gds lacked torch.cuda.gds.is_available."""
    import torch.cuda.gds as tg

    assert [n for n in tg.__all__ if not hasattr(ckptio.gds, n)] == []
    # torch 2.11's has no is_available (later ones do): ckptio's always does.
    assert sorted(set(ckptio.gds.__all__) - {"is_available"}) == sorted(
        set(tg.__all__) - {"is_available"}
    )
    assert ckptio.gds.is_available() is True and ckptio.is_available is ckptio.gds.is_available


def test_gdsfile_takes_what_torchs_binding_takes(tmp_path):
    """GdsFile refused offsets torch's binding takes (numpy integers, 0-d integer
    tensors: ``__index__``) and a bytes file name (os.open's)."""
    import numpy as np

    p = tmp_path / "g.bin"
    f = ckptio.GdsFile(os.fsencode(p), os.O_CREAT | os.O_RDWR)
    assert f.filename == str(p)
    x = torch.arange(8, dtype=torch.uint8)
    for off in (np.int64(3), torch.tensor(3), np.uint8(3)):
        f.save_storage(x.untyped_storage(), off)
        y = torch.zeros_like(x)
        f.load_storage(y.untyped_storage(), off)
        assert torch.equal(x, y), type(off)
    for off in (torch.tensor(True), torch.tensor(1.0), np.float64(1), "1"):
        with pytest.raises(TypeError, match="offset must be an int"):
            f.load_storage(x.untyped_storage(), off)
    with pytest.raises(ValueError, match=">= 0, not -1"):
        f.load_storage(x.untyped_storage(), np.int64(-1))


def test_gdsfile_errors_are_runtime_errors_as_torchs_and_name_a_short_read(tmp_path):
    """torch raises RuntimeError for a negative offset and a save to a file opened
    O_RDONLY (ckptio: ValueError, OSError only); a load past the end of the file
    read "not a usable checkpoint ... likely corrupted" (a raw file is no
    checkpoint), and an empty load at the end failed where an empty save works."""
    p = tmp_path / "g.bin"
    f = ckptio.GdsFile(p, os.O_CREAT | os.O_RDWR)
    f.save_storage(torch.arange(4.0).untyped_storage(), 0)  # 16 bytes
    with pytest.raises(RuntimeError, match="offset must be >= 0") as ei:
        f.save_storage(torch.ones(1).untyped_storage(), -1)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(ckptio.FormatError) as ei:
        f.load_storage(torch.empty(8).untyped_storage(), 4)
    assert str(ei.value) == (
        f"{p}: read of 32 bytes at offset 4 runs past the end of the file (16 bytes)"
    )
    for off in (16, 100):
        f.load_storage(torch.empty(0).untyped_storage(), off)
        f.save_storage(torch.empty(0).untyped_storage(), off)
    assert p.stat().st_size == 16
    r = ckptio.GdsFile(p, os.O_RDONLY)
    with pytest.raises(RuntimeError) as ei:
        r.save_storage(torch.ones(1).untyped_storage(), 0)
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.EBADF
    assert ei.value.filename == str(p)


def _cufile_driver_opens() -> bool:
    return bool(_native.info()["cufile"].get("driver_open"))


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(backend="cufle"), ValueError, "backend must be auto, cufile or bounce"),
        (dict(backend=3), TypeError, "backend"),
        (dict(direct="sometimes"), ValueError, "direct I/O mode must be auto, on or off"),
        (dict(direct=3), TypeError, "direct must be"),
        (dict(threads=0), ValueError, "threads must be a positive int"),
        (dict(threads="8"), TypeError, "threads must be an int"),
        (dict(chunk_size=-1), ValueError, "chunk_size must be a positive int"),
        pytest.param(
            dict(backend="cufile"),
            ckptio.BackendUnavailableError,
            "cufile",
            marks=pytest.mark.skipif(_cufile_driver_opens(), reason="cuFile's driver opens here"),
        ),
    ],
    ids=lambda x: str(x),
)
def test_gdsfile_refused_arguments_leave_the_file_alone(tmp_path, kw, exc, match):
    """Before, GdsFile opened the file with the caller's flags before its own arguments were
    checked: O_TRUNC had emptied an existing file, and O_CREAT left a new one, when the
    ValueError came. Now every argument (and, for backend="cufile", the driver) is checked
    first."""
    old = tmp_path / "old.bin"
    old.write_bytes(b"x" * 4096)
    with pytest.raises(exc, match=match):
        ckptio.GdsFile(old, os.O_CREAT | os.O_RDWR | os.O_TRUNC, **kw)
    assert old.read_bytes() == b"x" * 4096
    new = tmp_path / "new.bin"
    with pytest.raises(exc, match=match):
        ckptio.GdsFile(new, os.O_CREAT | os.O_RDWR, **kw)
    assert not new.exists()


def _descriptors_of(path) -> list[int]:
    """The status flags of every descriptor this process holds on ``path``."""
    real, out = os.path.realpath(path), []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != real:
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                line = next(x for x in info if x.startswith("flags:"))
        except OSError:
            continue
        out.append(int(line.split()[1], 8))
    return out


@pytest.mark.parametrize("sync", ["O_SYNC", "O_DSYNC"])
def test_gdsfile_writes_with_the_callers_sync_flag(tmp_path, sync):
    """Before, the flags only reached a throw-away os.open and the core reopened the path
    read+write: no descriptor it wrote through had O_SYNC / O_DSYNC, so save_storage returned
    before the data was durable. Now both of its descriptors (the O_DIRECT one too) have it."""
    flag = getattr(os, sync)
    p = tmp_path / "s.bin"
    f = ckptio.GdsFile(p, os.O_CREAT | os.O_RDWR | flag)
    fds = _descriptors_of(p)
    assert fds and all(fl & flag == flag for fl in fds), [oct(x) for x in fds]
    assert all(fl & os.O_ACCMODE == os.O_RDWR for fl in fds)
    x = torch.arange(3 * 4096, dtype=torch.int32)
    f.save_storage(x.untyped_storage(), 4096)
    y = torch.zeros_like(x)
    f.load_storage(y.untyped_storage(), 4096)
    assert torch.equal(x, y)


def test_gdsfile_keeps_the_callers_access_mode(tmp_path):
    """Before, a GdsFile opened O_WRONLY could be read (the core reopened it read+write).
    Now loading from it raises OSError(EBADF) before anything moves, as saving to a file
    opened O_RDONLY does, and the core's own descriptors have the caller's access mode."""
    p = tmp_path / "a.bin"
    x = torch.arange(4 * 4096, dtype=torch.uint8)
    ckptio.GdsFile(p, os.O_CREAT | os.O_RDWR).save_storage(x.untyped_storage(), 0)
    w = ckptio.GdsFile(p, os.O_WRONLY)
    assert all(fl & os.O_ACCMODE == os.O_WRONLY for fl in _descriptors_of(p))
    y = torch.zeros_like(x)
    with pytest.raises(OSError) as ei:
        w.load_storage(y.untyped_storage(), 0)
    assert ei.value.errno == errno.EBADF and ei.value.filename == str(p)
    assert not y.any()
    w.save_storage(torch.flip(x, [0]).untyped_storage(), 0)
    del w
    r = ckptio.GdsFile(p, os.O_RDONLY)
    with pytest.raises(OSError) as ei:
        r.save_storage(x.untyped_storage(), 0)
    assert ei.value.errno == errno.EBADF
    r.load_storage(y.untyped_storage(), 0)
    assert torch.equal(y, torch.flip(x, [0]))
    del r
    # The core refuses by itself too: its descriptors are write-only.
    core = _native.DeviceFile.open(str(p), os.O_WRONLY)
    with pytest.raises(OSError) as ei:
        _transfer.read(core, _native.Engine(), [(0, y.data_ptr(), y.nbytes, -1)], [y])
    assert ei.value.errno == errno.EBADF


@pytest.mark.parametrize(
    ("flag", "match"),
    [
        ("O_APPEND", "O_APPEND is not supported"),
        ("O_PATH", "O_PATH is not supported"),
        ("O_ACCMODE", "the access mode must be O_RDONLY, O_WRONLY or O_RDWR"),
    ],
)
def test_gdsfile_refuses_flags_it_cannot_honour_before_opening(tmp_path, flag, match):
    """Before, O_APPEND reached only the throw-away os.open (the core wrote at the offsets
    regardless), and O_PATH and an access mode of 3 failed later or not at all. Now each is a
    ValueError before anything is opened, as are negative flags."""
    p = tmp_path / "n.bin"
    with pytest.raises(ValueError, match=match):
        ckptio.GdsFile(p, os.O_CREAT | os.O_RDWR | getattr(os, flag))
    assert not p.exists()
    with pytest.raises(ValueError, match="flags must be os.open flags"):
        ckptio.GdsFile(p, -1)


def test_gdsfile_with_o_tmpfile(tmp_path):
    """Before, O_TMPFILE failed (the core reopened the folder's path: IsADirectoryError). Now
    the unnamed file is the one read and written, and nothing is left in the folder."""
    d = tmp_path / "d"
    d.mkdir()
    f = ckptio.GdsFile(d, os.O_TMPFILE | os.O_RDWR)
    x = torch.arange(5000, dtype=torch.int16)
    f.save_storage(x.untyped_storage(), 100)
    y = torch.empty_like(x)
    f.load_storage(y.untyped_storage(), 100)
    assert torch.equal(x, y)
    del f
    assert list(d.iterdir()) == []


def test_gdsfile_fd_and_registering_twice_as_in_torch(tmp_path):
    """Before, GdsFile had no ``fd`` (torch's has: the descriptor opened with the flags) and
    registering a registered handle did nothing. Now ``fd`` is that descriptor until the
    GdsFile is deleted, and a second register_handle raises torch's AssertionError;
    deregistering twice stays harmless (documented)."""
    p = tmp_path / "fd.bin"
    f = ckptio.GdsFile(p, os.O_CREAT | os.O_RDWR | os.O_DSYNC)
    fd = f.fd
    assert isinstance(fd, int) and os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(p)
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    assert fl & os.O_ACCMODE == os.O_RDWR and fl & os.O_DSYNC and not fl & os.O_DIRECT
    f.save_storage(torch.arange(100, dtype=torch.int64).untyped_storage(), 0)
    os.fsync(f.fd)
    assert os.fstat(f.fd).st_size == 800
    with pytest.raises(AssertionError, match="Cannot register a handle that is already registered"):
        f.register_handle()
    assert f.handle is not None
    f.deregister_handle()
    f.deregister_handle()
    assert f.handle is None
    f.register_handle()
    assert f.handle is not None
    del f
    gc.collect()
    try:
        still = os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(p)
    except OSError:
        still = False
    assert not still


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        (dict(threads="8"), TypeError, "threads must be an int, not str"),
        (dict(threads=True), TypeError, "threads must be an int, not bool"),
        (dict(chunk_size=1.5), TypeError, "chunk_size must be an int, not float"),
        (dict(backend="bogus"), ValueError, "backend must be auto, cufile or bounce"),
        (dict(backend=3), TypeError, "backend"),
    ],
    ids=lambda x: str(x),
)
def test_save_and_load_bad_options_name_the_argument(tmp_path, kw, exc, match):
    prev = make_prev(tmp_path / "ckpt.pt")
    with pytest.raises(exc, match=match):
        ckptio.save(sample_state(1), prev.path, **kw)
    with pytest.raises(exc, match=match):
        ckptio.load(prev.path, **kw)
    prev.assert_intact()


@pytest.mark.parametrize("ml", [3, 1.5, object()], ids=["int", "float", "object"])
def test_load_bad_map_location_is_typeerror(tmp_path, ml):
    prev = make_prev(tmp_path / "ckpt.pt")
    with pytest.raises(TypeError, match="map_location"):
        ckptio.load(prev.path, map_location=ml)


def test_storage_too_small_for_its_record_names_the_record(tmp_path):
    """The writer refuses a storage whose size differs from its record, naming both."""
    p = tmp_path / "t.pt"
    w = _native.AtomicWriter(str(p))
    with torch.serialization.skip_data(), os.fdopen(os.dup(w.fileno()), "wb") as fh:
        torch.save({"a": torch.ones(100)}, fh)
    small = torch.ones(10).untyped_storage()
    engine = _native.Engine()
    with pytest.raises(ckptio.FormatError, match=r"data/0.*400 bytes.*storage 0 has 40"):
        w.write_storages(engine, [("0", small.data_ptr(), small.nbytes(), -1)], [small], [])
    with pytest.raises(ckptio.FormatError, match="no record for storage 7"):
        w.write_storages(engine, [("7", small.data_ptr(), small.nbytes(), -1)], [small], [])
    w.abort()
    assert not p.exists() and os.listdir(tmp_path) == []


def test_finished_writer_refuses_further_use(tmp_path):
    """A committed or aborted writer raises ValueError on any further call."""
    for finish in ("commit", "abort"):
        w = _native.AtomicWriter(str(tmp_path / f"{finish}.pt"))
        with os.fdopen(os.dup(w.fileno()), "wb") as fh:
            torch.save({"a": torch.ones(1)}, fh)
        getattr(w, finish)()
        with pytest.raises(ValueError, match="already committed or aborted"):
            w.write_storages(_native.Engine(), [], [], [])
        with pytest.raises(ValueError, match="already committed or aborted"):
            w.commit()
        w.abort()  # idempotent


def test_reader_bad_record_names_and_fault_points(tmp_path):
    prev = make_prev(tmp_path / "ckpt.pt")
    r = _native.Reader(str(prev.path))
    with pytest.raises(KeyError, match="nope"):
        r.verify(_native.Engine(), ["nope"])
    with pytest.raises(KeyError, match="nope"):
        r.read_record("nope")
    with pytest.raises(ValueError, match="fault point must be one of"):
        _native._set_fault("nowhere", 5)


@pytest.mark.parametrize(
    ("device", "copies", "match"),
    [
        (-1, [], "device must be >= 0"),
        (0, [(0, 4096, 16)], "device copy 0: null or overflowing"),
        (0, [(4096, 4096, 1), (4096, 0, 16)], "device copy 1: null or overflowing"),
        (0, [(2**64 - 8, 4096, 16)], "device copy 0: null or overflowing"),
    ],
)
def test_stage_device_copy_checks_ranges_before_the_driver(device, copies, match):
    """Bad device-copy jobs are a ValueError naming the job, checked before CUDA is touched."""
    with pytest.raises(ValueError, match=match):
        _native.stage_device_copy(device, 0, copies, [])


def test_engine_threads_for_files_in_memory(monkeypatch):
    """tmpfs files get memory_threads (default >= threads); an explicit thread count
    holds for every file; CKPTIO_MEMORY_THREADS sets it, and must be a number."""
    e = _native.Engine()
    assert e.memory_threads >= e.threads >= 1
    assert "memory_threads" in repr(e)
    e = _native.Engine(threads=3)
    assert (e.threads, e.memory_threads) == (3, 3)
    monkeypatch.setenv("CKPTIO_MEMORY_THREADS", "5")
    assert _native.Engine().memory_threads == 5
    monkeypatch.setenv("CKPTIO_MEMORY_THREADS", "many")
    with pytest.raises(ValueError, match="CKPTIO_MEMORY_THREADS"):
        _native.Engine()
    monkeypatch.setenv("CKPTIO_MEMORY_THREADS", "0")
    with pytest.raises(ValueError, match="memory_threads must be between 1 and 256"):
        _native.Engine()
    monkeypatch.delenv("CKPTIO_MEMORY_THREADS")
    e = _native.Engine(threads=4, memory_threads=2)  # memory_threads after threads
    assert (e.threads, e.memory_threads) == (4, 2)
    with pytest.raises(ValueError, match="memory_threads must be between 1 and 256"):
        _native.Engine(memory_threads=0)


def test_engine_chunk_size_for_files_in_memory(monkeypatch):
    """tmpfs files get memory_chunk_size (4 MiB by default); an explicit chunk size
    holds for every file; CKPTIO_MEMORY_CHUNK_SIZE sets it, and must be valid."""
    monkeypatch.delenv("CKPTIO_CHUNK_SIZE", raising=False)
    monkeypatch.delenv("CKPTIO_MEMORY_CHUNK_SIZE", raising=False)
    e = _native.Engine()
    assert (e.chunk_size, e.memory_chunk_size) == (16 << 20, 4 << 20)
    assert "memory_chunk_size" in repr(e)
    assert _native.Engine(chunk_size=1 << 20).memory_chunk_size == 1 << 20
    monkeypatch.setenv("CKPTIO_CHUNK_SIZE", "2M")
    assert _native.Engine().memory_chunk_size == 2 << 20
    monkeypatch.setenv("CKPTIO_MEMORY_CHUNK_SIZE", "8M")
    assert (_native.Engine().chunk_size, _native.Engine().memory_chunk_size) == (2 << 20, 8 << 20)
    monkeypatch.setenv("CKPTIO_MEMORY_CHUNK_SIZE", "5000")
    with pytest.raises(ValueError, match="memory_chunk_size must be a multiple of 4096"):
        _native.Engine()
