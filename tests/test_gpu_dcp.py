"""Staging and DCP with CUDA tensors (run on the GPU machine; skipped without CUDA)."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter
from ckptio.staging import DefaultStager, StagingOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]


def cuda_state(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sd = {
        "w": torch.randn(4096, 1024, device="cuda", generator=g),
        "b": torch.randn(3000, device="cuda", generator=g).bfloat16(),
        "t": torch.randn(300, 200, device="cuda", generator=g).t(),
        "cpu": torch.arange(100),
        "step": 3,
    }
    sd["v"] = sd["w"][7:9]
    return sd


@pytest.mark.parametrize(
    "opts",
    [
        StagingOptions(),
        StagingOptions(use_shared_memory=False),
        StagingOptions(device_snapshot=True),
    ],
    ids=["shared-pinned", "pinned", "device-snapshot"],
)
def test_cuda_snapshot_reflects_queued_work(opts):
    sd = cuda_state()
    with DefaultStager(opts) as st:
        for i in range(3):
            # Queue a lot of work that changes w, then stage at once: the snapshot
            # must include it (stage waits for work queued before it).
            x = torch.full((4096, 4096), 1.0 / 4096, device="cuda")
            for _ in range(20):
                x = x @ x  # stays 1/4096 everywhere
            sd["w"].add_(x[:, :1024] * 4096 * (i + 1))
            staged = st.stage(sd).result()
            torch.cuda.synchronize()
            for k in ("w", "b", "t", "cpu", "v"):
                assert torch.equal(staged[k].cpu(), sd[k].cpu()), k
            assert (
                staged["v"].untyped_storage().data_ptr() == staged["w"].untyped_storage().data_ptr()
            )
            if opts.device_snapshot:
                assert staged["w"].is_cuda and staged["w"].data_ptr() != sd["w"].data_ptr()
            else:
                assert not staged["w"].is_cuda
        if not opts.device_snapshot:
            assert st.pinned_bytes() >= sd["w"].untyped_storage().nbytes()
            assert st.last_stats["unpinned_device_bytes"] == 0
    assert st.pinned_bytes() == 0


def test_copies_made_by_the_walk_wait_for_the_callers_stream():
    # Tensors the staging buffers do not take (here a conjugate view) are copied
    # by the walk itself, on the staging thread: after the work queued before
    # stage() on the caller's (non-default) stream.
    side = torch.cuda.Stream()
    with DefaultStager(StagingOptions(use_shared_memory=False)) as st, torch.cuda.stream(side):
        for i in range(3):
            z = torch.zeros(4096, 4096, dtype=torch.complex64, device="cuda")
            x = torch.full((4096, 4096), 1.0 / 4096, device="cuda")
            for _ in range(20):
                x = x @ x  # stays 1/4096 everywhere
            z.real.copy_(x * 4096 * (i + 1))
            staged = st.stage({"c": z.conj()}).result()
            side.synchronize()
            assert torch.equal(staged["c"], z.conj().resolve_conj().cpu()), i


@pytest.mark.parametrize("shared", [False, True], ids=["anon", "shared"])
def test_prepare_pins_buffers_ahead(shared):
    # prepare() pins the buffers in the background; the first save then copies
    # into pinned memory only, and is exact.
    sd = cuda_state()
    with DefaultStager(StagingOptions(use_shared_memory=shared)) as st:
        n = st.prepare(sd).result()
        assert n >= sd["w"].untyped_storage().nbytes() and st.pinned_bytes() == n
        for i in range(2):
            sd["w"].add_(1.0)
            staged = st.stage(sd).result()
            for k in ("w", "b", "t", "cpu", "v"):
                assert torch.equal(staged[k].cpu(), sd[k].cpu()), (i, k)
            assert st.last_stats["unpinned_device_bytes"] == 0
            assert st.pinned_bytes() == n
    assert st.pinned_bytes() == 0


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_staged_host_tensors_copy_back_to_the_gpu(shared):
    # torch's copies out of staged tensors (a replica moved back to the GPU)
    # fail on a host range that spans two CUDA registrations: each buffer is
    # registered whole (it was in 64 MiB pieces); sizes need not be page multiples.
    g = torch.Generator(device="cuda").manual_seed(2)
    sizes = {"odd": 9 * 2**20 + 7, "one": 1, "big": 150 * 2**20 + 5}
    sd = {
        k: torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        for k, n in sizes.items()
    }
    with DefaultStager(StagingOptions(use_shared_memory=shared)) as st:
        for _ in range(2):
            staged = st.stage(sd).result()
            # Storages under 1 MiB share a slab, in slots 16 bytes apart.
            slots = sum(n if n >= 2**20 else -(-n // 16) * 16 for n in sizes.values())
            assert st.pinned_bytes() == slots
            for k in sd:
                assert torch.equal(staged[k].cuda(), sd[k]), k
                back = staged[k][3:].to("cuda", non_blocking=True)
                assert torch.equal(back, sd[k][3:]), k


def test_device_snapshot_without_room_stages_to_host(monkeypatch):
    # No device can keep a headroom of 1 PiB: the stager warns and stages to
    # host for this save; its device buffers are never allocated.
    from ckptio import staging

    allocated = []
    real = staging._DeviceBuffer._allocate
    monkeypatch.setattr(
        staging._DeviceBuffer, "_allocate", lambda self: allocated.append(self) or real(self)
    )
    sd = cuda_state()
    opts = StagingOptions(device_snapshot=True, device_headroom=1 << 50)
    with DefaultStager(opts) as st:
        st.prepare(sd).result()  # no room there either: host buffers, none on the device
        assert not any(k[3] for k in st._cache.buffers)
        with pytest.warns(RuntimeWarning, match="not enough free device memory"):
            staged = st.stage(sd).result()
        assert not staged["w"].is_cuda and torch.equal(staged["w"].cuda(), sd["w"])
        assert not allocated and st.device_bytes() == 0


def test_device_snapshot_allocates_on_the_staging_thread(monkeypatch):
    import threading

    from ckptio import staging

    threads = []
    real = staging._DeviceBuffer._allocate
    monkeypatch.setattr(
        staging._DeviceBuffer,
        "_allocate",
        lambda self: threads.append(threading.current_thread()) or real(self),
    )
    sd = cuda_state()
    with DefaultStager(StagingOptions(device_snapshot=True)) as st:
        staged = st.stage(sd).result()
        assert threads and threading.main_thread() not in threads
        torch.cuda.synchronize()
        for k in ("w", "b", "t", "v"):
            assert staged[k].is_cuda and torch.equal(staged[k], sd[k]), k
        assert st.device_bytes() >= sd["w"].untyped_storage().nbytes()


@pytest.mark.parametrize("snapshot", [False, True], ids=["host", "device-snapshot"])
def test_cuda_async_save_and_load(tmp_path, snapshot):
    sd = cuda_state()
    st = DefaultStager(StagingOptions(device_snapshot=snapshot, use_shared_memory=False))
    for i in range(3):
        sd["w"].add_(1)
        r = dcp.async_save(
            sd, storage_writer=FileSystemWriter(tmp_path / str(i)), async_stager=st, no_dist=True
        )
        r.staging_completion.result()
        r.upload_completion.result()
        out = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()
        }
        reader = FileSystemReader(tmp_path / str(i))
        dcp.load(out, storage_reader=reader, no_dist=True)
        for k in ("w", "b", "t", "cpu", "v"):
            assert torch.equal(out[k], sd[k]), k
        assert out["w"].is_cuda
        assert any(s.get("device_path") in ("bounce", "cufile") for s in reader.last_stats)
        # torch's reader reads what ours wrote from CUDA tensors
        out2 = {"w": torch.zeros_like(sd["w"])}
        dcp.load(out2, storage_reader=dcp.FileSystemReader(tmp_path / str(i)), no_dist=True)
        assert torch.equal(out2["w"], sd["w"])
    st.close()


def test_cuda_sync_save_from_device(tmp_path):
    sd = cuda_state()
    w = FileSystemWriter(tmp_path)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert w.last_stats[0]["device_path"] in ("bounce", "cufile")
    out = {"w": torch.zeros_like(sd["w"], device="cpu"), "t": torch.zeros(200, 300)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["w"], sd["w"].cpu()) and torch.equal(out["t"], sd["t"].cpu())


@pytest.mark.parametrize("backend", ["posix", None], ids=["bounce", "auto"])
def test_cuda_load_with_verify(tmp_path, backend):
    """verify=True into CUDA tensors: bytes through the bounce buffers are checked against the
    item CRC-32s (a flipped bit is a FormatError naming the item); bytes cuFile moved (no host
    copy to checksum) are listed as unchecked, never reported verified."""
    from ckptio import _native
    from ckptio.dcp import read_metadata

    sd = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(77, device="cuda")}
    # Written through the bounce buffers, so that every item stores its CRC-32.
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, backend="bounce"), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = FileSystemReader(tmp_path, verify=True, backend=backend)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    stats = reader.last_stats[0]
    assert sorted(stats["verified"] + stats["unchecked"]) == ["b", "w"]
    if stats["device_path"] == "bounce":
        assert sorted(stats["verified"]) == ["b", "w"], stats
    md = read_metadata(tmp_path / ".metadata")
    info = next(i for k, i in md.storage_data.items() if k.fqn == "w")
    path = tmp_path / info.relative_path
    item = _native.Reader(path, "off", None, info.offset, info.length)
    at = next(o for name, o, _ in item.records() if name.endswith("/data/0"))
    raw = bytearray(path.read_bytes())
    raw[at + 12345] ^= 1
    path.write_bytes(bytes(raw))
    if backend == "posix":
        with pytest.raises(BaseException, match="CRC-32"):
            reader = FileSystemReader(tmp_path, verify=True, backend=backend)
            dcp.load(out, storage_reader=reader, no_dist=True)
