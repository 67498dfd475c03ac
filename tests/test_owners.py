"""Soundness does not rest on the Python caller (issue 36): every native call that
takes raw addresses also takes the objects owning that memory, reads each owner's
extent from the owner itself (data_ptr, nbytes, device), and refuses, before any
byte moves, a range outside every owner (ValueError naming it), an owner of another
type (TypeError), and reads whose destinations overlap (ValueError). Zero-length
ranges are accepted at any address: nothing is read or written there.

Each native entry point gets an out-of-range, a wrong-memory and a zero-length
range here; the calls that fill memory also get overlapping destinations.
"""

from __future__ import annotations

import os

import ckptio
import pytest
import torch
from ckptio import _native
from ckptio.io.engines import engine as _engine

OUTSIDE = "is not inside the memory of any of its owners"


@pytest.fixture
def engine():
    return _engine(2, 1 << 16, None)


@pytest.fixture
def archive(tmp_path):
    """A torch.save file with one 4 KiB record: (path, its data offset)."""
    p = tmp_path / "a.pt"
    ckptio.save({"a": torch.arange(4096, dtype=torch.uint8)}, p)
    r = _native.Reader(p)
    _, off, size = next(x for x in r.records() if "/data/" in x[0])
    assert size == 4096
    return p, off


def host(n: int = 4096) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def bad_ranges(buf: torch.Tensor, off: int = 0):
    """(segments, owners, expected error, match) for a 4 KiB buffer: past its end,
    before its start, a pointer into another buffer, the right range on the wrong
    memory, and an owner that is no memory object."""
    p = buf.data_ptr()
    other = host()
    return [
        ([(off, p + 1, 4096, -1)], [buf], ValueError, rf"segment 0 \(4096 bytes at {p + 1:#x}"),
        ([(off, p - 8, 16, -1)], [buf], ValueError, OUTSIDE),
        ([(off, other.data_ptr(), 16, -1)], [buf], ValueError, OUTSIDE),
        ([(off, p, 16, 0)], [buf], ValueError, "CUDA device 0 memory"),
        ([(off, p, 16, -1)], [buf, "not memory"], TypeError, "owner 1 is a str"),
        ([(off, p, 16, -1)], [], ValueError, OUTSIDE),
    ]


def test_reader_checks_destinations_against_their_owners(archive, engine):
    path, off = archive
    r = _native.Reader(path)
    buf = host()
    for segs, owners, exc, match in bad_ranges(buf, off):
        with pytest.raises(exc, match=match):
            r.read_segments(engine, segs, owners, [])
    assert not buf.any()  # nothing was read
    # Zero-length segments anywhere are accepted (and move nothing); the rest reads.
    stats = r.read_segments(
        engine, [(off, 0xDEAD, 0, -1), (off, buf.data_ptr(), 4096, -1)], [buf], []
    )
    assert stats["bytes"] == 4096 and torch.equal(buf, torch.arange(4096, dtype=torch.uint8))
    # A view's storage owns all of its memory: a tensor owner covers its storage.
    view = buf[100:200]
    r.read_segments(engine, [(off, buf.data_ptr(), 4096, -1)], [view], [])


def test_reads_into_overlapping_destinations_are_refused(archive, engine, tmp_path):
    path, off = archive
    buf = host(8192)
    p = buf.data_ptr()
    overlapping = [(off, p, 4096, -1), (off, p + 4000, 100, -1)]
    with pytest.raises(ValueError, match="segment 1 .* overlaps segment 0 in host memory"):
        _native.Reader(path).read_segments(engine, overlapping, [buf], [])
    f = _native.DeviceFile(path, False)
    with pytest.raises(ValueError, match="overlaps segment 0"):
        f.read_segments(engine, overlapping, [buf], [])
    assert not buf.any()
    # One file range into two memories is fine; touching destinations too.
    f.read_segments(engine, [(off, p, 4096, -1), (off, p + 4096, 4096, -1)], [buf], [])
    assert torch.equal(buf[:4096], buf[4096:])
    # Writes from overlapping memory are fine (only read).
    w = _native.AtomicWriter(tmp_path / "w.bin")
    w.write_segments(engine, [(0, p, 4096, -1), (4096, p + 10, 100, -1)], [buf], [])
    w.abort()


def test_device_file_checks_both_directions(archive, engine, tmp_path):
    path, off = archive
    data = tmp_path / "d.bin"
    data.write_bytes(bytes(8192))
    for f, fn in (
        (_native.DeviceFile(path, False), "read_segments"),
        (_native.DeviceFile(data, True), "write_segments"),
    ):
        buf = host()
        for segs, owners, exc, match in bad_ranges(buf, 0):
            with pytest.raises(exc, match=match):
                getattr(f, fn)(engine, segs, owners, [])
        getattr(f, fn)(engine, [(0, 8, 0, -1)], [], [])  # zero-length, no owner
    assert data.read_bytes() == bytes(8192)  # nothing was written


def test_atomic_writer_checks_every_kind_of_write(tmp_path, engine):
    target = tmp_path / "t.pt"
    w = _native.AtomicWriter(target)
    buf = host()
    p = buf.data_ptr()
    for segs, owners, exc, match in bad_ranges(buf, 0):
        with pytest.raises(exc, match=match):
            w.write_segments(engine, segs, owners, [])
        (_, addr, n, dev) = segs[0]
        with pytest.raises(exc, match=match.replace("segment 0", "storage 0")):
            w.write_storages(engine, [("0", addr, n, dev)], owners, [])
        with pytest.raises(exc, match=match.replace("segment 0", 'record "r"')):
            w.write_archive(engine, [("r", (addr, n, dev), 64)], "arch", owners, [])
        if dev == -1:
            with pytest.raises(exc, match=match.replace("segment 0", "item 0")):
                w.write_zstd(engine, 0, [(b"h", addr, n, b"t", [])], owners)
    assert os.path.getsize(w.tmp_path) == 0  # nothing was written
    # Zero-length ranges at any address are fine.
    w.write_segments(engine, [(0, 0xBAD, 0, -1), (0, p, 16, -1)], [buf], [])
    w.write_zstd(engine, 16, [(b"h", 0xBAD, 0, b"t", [])], [])
    w.abort()


def test_map_archives_checks_its_buffer(archive):
    path, _ = archive
    raw = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    n = raw.numel()
    got = _native.map_archives(raw.data_ptr(), n, [(0, n)], [raw])
    assert got[0] is not None
    for addr, length, owners, exc in (
        (raw.data_ptr() + 1, n, [raw], ValueError),
        (raw.data_ptr(), n, [host()], ValueError),
        (raw.data_ptr(), n, [], ValueError),
        (raw.data_ptr(), n, [n], TypeError),
    ):
        with pytest.raises(exc, match="the buffer|owner 0"):
            _native.map_archives(addr, length, [(0, n)], owners)


def test_staging_checks_pins_sources_and_destinations():
    st = host(1 << 16).untyped_storage()
    p = st.data_ptr()
    # A pin inside its owner's memory only; host memory only.
    for addr, n, owner, exc in (
        (p + 1, 1 << 16, st, ValueError),
        (p - 4096, 4096, st, ValueError),
        (p, 16, object(), TypeError),
    ):
        with pytest.raises(exc, match="the pinned range|the owner"):
            _native.HostPin(owner, addr, n, pin=False)
    pin = _native.HostPin(st, p, 1 << 16, pin=False)
    assert _native.HostPin(st, 0, 0, pin=False).nbytes == 0  # empty: anywhere
    src = torch.arange(1 << 12, dtype=torch.uint8)
    s = src.data_ptr()
    for copies, owners, match in (
        ([(s + 1, -1, pin, 0, 4096)], [src], "copy 0 source"),
        ([(s, 0, pin, 0, 16)], [src], "copy 0 source .*CUDA device 0"),
        ([(s, -1, pin, 0, 16)], [], "copy 0 source"),
        # Destinations overlapping each other, or a source inside a destination.
        ([(s, -1, pin, 0, 16), (s, -1, pin, 8, 16)], [src], "overlaps that of copy 0"),
        ([(p + 64, -1, pin, 0, 128)], [st], "source overlaps the destination of copy 0"),
    ):
        with pytest.raises(ValueError, match=match):
            _native.stage_copy(copies, owners)
    assert not torch.empty(0, dtype=torch.uint8).set_(st).any()  # nothing was copied
    stats = _native.stage_copy([(s, -1, pin, 100, 4096), (0xBAD, -1, pin, 0, 0)], [src])
    assert stats["bytes"] == 4096
    assert torch.equal(torch.empty(0, dtype=torch.uint8).set_(st)[100:4196], src)
    pin.close()


def test_device_copies_and_registrations_need_cuda_owners():
    """Checked before CUDA is touched: host owners never hold device ranges."""
    src, dst = host(), host()
    copies = [(dst.data_ptr(), src.data_ptr(), 16)]
    with pytest.raises(ValueError, match="device copy 0 destination .* CUDA device 0"):
        _native.stage_device_copy(0, 0, copies, [src, dst])
    with pytest.raises(TypeError, match="owner 0 is a int"):
        _native.stage_device_copy(0, 0, copies, [3])
    if torch.cuda.is_available():
        _native.stage_device_copy(0, 0, [(0xBAD, 0xBAD, 0)], [])  # empty: nothing queued
    st = src.untyped_storage()
    with pytest.raises(ValueError, match="not CUDA memory"):
        _native.cufile_register_buffer(st, st.data_ptr(), st.nbytes())


def test_meta_and_other_devices_are_refused(archive, engine):
    path, off = archive
    meta = torch.empty(4096, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="owner 0 is on device meta"):
        _native.Reader(path).read_segments(engine, [(off, 4096, 4096, -1)], [meta], [])
    with pytest.raises(ValueError, match="owner 0 is on device meta"):
        _native.Reader(path).read_segments(
            engine, [(off, 4096, 4096, -1)], [meta.untyped_storage()], []
        )


def test_host_memory_and_parameters_are_owners(archive, engine):
    path, off = archive
    r = _native.Reader(path)
    m = _native.HostMemory(8192)
    r.read_segments(engine, [(off, m.addr + 4096, 4096, -1)], [m], [])
    with pytest.raises(ValueError, match=OUTSIDE):
        r.read_segments(engine, [(off, m.addr + 4097, 4096, -1)], [m], [])
    prm = torch.nn.Parameter(torch.zeros(1024))
    r.read_segments(engine, [(off, prm.data_ptr(), 4096, -1)], [prm], [])
    assert prm.detach().view(torch.uint8).equal(torch.arange(4096, dtype=torch.uint8))
