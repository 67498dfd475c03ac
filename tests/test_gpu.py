"""GPU data path: CUDA state dicts through the bounce pipeline and cuFile.

Marked ``gpu``: skipped where there is no CUDA device (CI). scripts/gpu_check.sh
runs them on the GPU machine twice: without the udev entry cuFile needs on that
VM (automatic fallback to the bounce pipeline) and with it (cuFile for real).
CKPTIO_EXPECT_BACKEND ("bounce" or "cufile") tells the tests which path the
automatic choice must take there.
"""

import os
import pathlib

import ckptio
import pytest
import torch
from conftest import auto_read_path

pytestmark = pytest.mark.gpu
EXPECT = os.environ.get("CKPTIO_EXPECT_BACKEND")  # "bounce" | "cufile" | None
DTYPES = [
    torch.float32,
    torch.float16,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def rand(shape, dtype, device="cuda"):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, device=device).bool()
    if dtype.is_complex or dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-100, 100, shape, device=device).to(dtype)


def bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    ua, ub = a.untyped_storage(), b.untyped_storage()
    assert ua.nbytes() == ub.nbytes()
    ta = torch.empty(0, dtype=torch.uint8, device=a.device).set_(ua)
    tb = torch.empty(0, dtype=torch.uint8, device=b.device).set_(ub)
    assert torch.equal(ta.cpu(), tb.cpu())


def check_backend(rep):
    assert rep is not None
    if EXPECT:
        # A file read from memory (tmpfs, cached pages) fills device memory
        # through the bounce lanes whatever cuFile could do; so does a read of
        # a file on the disk where cuFile runs in compat mode.
        if rep.read_path is None:  # a write
            assert rep.device_path == EXPECT, rep
        elif rep.read_path == "memory":
            assert rep.device_path == "bounce", rep
        else:
            assert rep.device_path == auto_read_path(EXPECT), rep
    if rep.device_path == "cufile":
        assert rep.gds_mode in ("p2p", "compat")
    if rep.device_path == "bounce":
        assert rep.fallback_reason or rep.backend == "bounce"


@pytest.mark.parametrize("backend", [None, "bounce", "posix"])
def test_gpu_state_dict_all_dtypes(tmp_path, backend):
    sd = {str(d): rand((33, 65), d) for d in DTYPES}
    sd["scalar"] = torch.tensor(3.5, device="cuda")
    sd["empty"] = torch.empty(0, 7, device="cuda")
    p = tmp_path / "gpu.pt"
    assert ckptio.save(sd, p, backend=backend) is None
    rep = ckptio.last_report()
    if backend is None:
        check_backend(rep)
    else:  # "posix" is the older name of "bounce"
        assert (rep.backend, rep.device_path) == ("bounce", "bounce")
    out = ckptio.load(p, map_location="cuda", backend=backend)
    if backend is None:
        check_backend(ckptio.last_report())
    for k in sd:
        assert out[k].device.type == "cuda"
        bits_equal(sd[k], out[k])


def test_gpu_views_and_aliasing(tmp_path):
    base = torch.arange(10_000, device="cuda", dtype=torch.float32)
    sd = {"base": base, "slice": base[100:200], "t": base[:9000].view(90, 100).t(), "b2": base}
    p = tmp_path / "views.pt"
    ckptio.save(sd, p)
    assert ckptio.last_report().storages == 1
    out = ckptio.load(p, map_location="cuda")
    assert len({t.untyped_storage().data_ptr() for t in out.values()}) == 1
    for k in sd:
        bits_equal(sd[k], out[k])


def test_multi_gib_tensor(tmp_path):
    n = 3 * 2**30 // 2 + 12345  # > 3 GiB of bf16, odd length
    big = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    sd = {"big": big, "small": torch.ones(3, device="cuda")}
    p = tmp_path / "big.pt"
    ckptio.save(sd, p)
    out = ckptio.load(p, map_location="cuda")
    assert torch.equal(out["big"], big) and torch.equal(out["small"], sd["small"])
    eng = ckptio.io.engines.engine(None, None, None)
    # The engine's documented bound (Engine.pinned_bytes): the file lanes and the
    # memory path's lanes share the pool, so the larger count and chunk size.
    lanes = max(eng.threads, eng.memory_threads)
    limit = lanes * 2 * (max(eng.chunk_size, eng.memory_chunk_size) + 2 * 4096 + 4096)
    assert eng.pinned_bytes() <= limit, (eng.pinned_bytes(), limit)


def test_non_default_stream(tmp_path):
    s = torch.cuda.Stream()
    p = tmp_path / "stream.pt"
    with torch.cuda.stream(s):
        x = torch.ones(64 << 20, device="cuda")
        for _ in range(20):  # queue real work on the side stream
            x = x * 1.0001 + 0.5
        expect = x.clone()
        ckptio.save({"x": x}, p)  # must wait for the queued work
        out = ckptio.load(p, map_location="cuda")
        y = out["x"] * 2  # a kernel on the current stream right after load
    torch.cuda.synchronize()
    assert torch.equal(out["x"], expect)
    assert torch.equal(y, expect * 2)


_CARVE_SCRIPT = """
import json, sys, torch, ckptio
from ckptio import safetensors

d = sys.argv[1]
# exactly 12 MiB each: their own segments leave no free pieces in the cache
sd = {f"t{i}": torch.full((3 << 20,), float(i), device="cuda") for i in range(16)}
ckptio.save(sd, f"{d}/c.pt")
safetensors.save_file(sd, f"{d}/c.safetensors")
res = {}
for name, load in (
    ("pt", lambda: ckptio.load(f"{d}/c.pt", map_location="cuda")),
    ("st", lambda: safetensors.load_file(f"{d}/c.safetensors", device="cuda")),
    ("dict", lambda: ckptio.load(f"{d}/c.pt", map_location={"cuda:0": "cuda:0"})),
):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats()["segment.large_pool.allocated"]
    out = load()
    made = torch.cuda.memory_stats()["segment.large_pool.allocated"] - before
    for k, v in sd.items():
        assert torch.equal(out[k], v) and out[k].untyped_storage().resizable(), k
    torch.cuda.empty_cache()  # the checks' temporaries
    reserved = torch.cuda.memory_reserved()
    out.pop("t3")
    torch.cuda.empty_cache()
    res[name] = [made, torch.cuda.memory_reserved() == reserved]
    del out
print(json.dumps(res))
"""


def _carve(tmp_path, **env):
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _CARVE_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_load_carves_destinations_out_of_one_segment(tmp_path):
    # Into an empty cache (a new process: the only way to be sure of one), a
    # load to one device reserves one segment for its 16 storages of 12 MiB
    # instead of a cudaMalloc each (safetensors too); each is still a block of
    # its own, the segment still in use after one is dropped. A dict
    # map_location may spread storages over devices: no reservation.
    res = _carve(tmp_path)
    assert res["pt"] == [1, True] and res["st"] == [1, True], res
    assert res["dict"][0] == 16, res
    # An allocator that would not split the segment: no reservation either.
    res = _carve(tmp_path, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64")
    assert res["pt"][0] == 16 and res["st"][0] == 16, res


def test_load_waits_for_work_queued_on_memory_it_reuses(tmp_path):
    # Blocks freed with kernels still queued on them go back to torch's cache at
    # once; the load's destinations reuse them, and the engine must not write
    # them before those kernels are done.
    sd = {"w": torch.full((4096, 4096), 3.0, device="cuda")}
    ckptio.save(sd, tmp_path / "w.pt")
    for _ in range(3):
        x = torch.full((4096, 4096), 1.0 / 4096, device="cuda")
        y = torch.empty_like(x)
        for _ in range(30):  # tens of ms of queued writes into both blocks
            torch.matmul(x, x, out=y)
            x, y = y, x
        del x, y
        out = ckptio.load(tmp_path / "w.pt", map_location="cuda")
        assert torch.equal(out["w"], sd["w"])


def test_gpu_written_read_on_cpu_and_back(tmp_path):
    sd = {"w": rand((500, 300), torch.bfloat16), "i": rand((7,), torch.int64)}
    p = tmp_path / "g.pt"
    ckptio.save(sd, p)
    cpu = ckptio.load(p, map_location="cpu")
    for k in sd:
        assert cpu[k].device.type == "cpu"
        bits_equal(sd[k].cpu(), cpu[k])
    tl = torch.load(p, weights_only=True)  # plain torch restores to cuda
    for k in sd:
        bits_equal(sd[k], tl[k])
    p2 = tmp_path / "c.pt"
    ckptio.save(cpu, p2)
    back = ckptio.load(p2, map_location="cuda:0")
    for k in sd:
        bits_equal(sd[k], back[k])
    # plain torch.save of GPU tensors (64-byte alignment) read straight to the GPU
    p3 = tmp_path / "t.pt"
    torch.save(sd, p3)
    for k, v in ckptio.load(p3).items():
        assert v.device.type == "cuda"
        bits_equal(sd[k], v)


def test_mixed_cpu_and_gpu(tmp_path):
    sd = {"gpu": rand((1000, 1000), torch.float32), "cpu": torch.randn(1000, 1000)}
    p = tmp_path / "mixed.pt"
    ckptio.save(sd, p)
    out = ckptio.load(p)
    assert out["gpu"].device.type == "cuda" and out["cpu"].device.type == "cpu"
    for k in sd:
        bits_equal(sd[k], out[k])


def test_tutorial_runs_with_ckptio_in_place_of_torch_cuda_gds(tmp_path, monkeypatch):
    src = (pathlib.Path(__file__).parent / "data" / "gpu_direct_storage_tutorial.py").read_text()
    assert "torch.cuda.gds.GdsFile" in src
    # The seed copy starts with a stray line naming the file; the rest is the tutorial.
    if src.startswith("gpu_direct_storage.py"):
        src = src.split("\n", 1)[1]
    src = src.replace("torch.cuda.gds.", "ckptio.")
    monkeypatch.chdir(tmp_path)
    from torch.utils.serialization import config

    old = config.save.storage_alignment
    try:
        exec(
            compile(src, "gpu_direct_storage_tutorial.py", "exec"),
            {"__name__": "__tut__", "ckptio": ckptio},
        )
    finally:
        config.save.storage_alignment = old


def test_gdsfile_api(tmp_path):
    p = str(tmp_path / "raw.bin")
    f = ckptio.GdsFile(p, os.O_CREAT | os.O_RDWR)
    if EXPECT:
        assert f.device_path == EXPECT, (f.device_path, f.fallback_reason)
    a = rand((1 << 20,), torch.float32)
    ckptio.gds_register_buffer(a.untyped_storage())
    f.save_storage(a.untyped_storage(), 4096)
    f.save_storage(torch.arange(10, dtype=torch.int64).untyped_storage(), 0)  # host memory too
    b = torch.empty_like(a)
    f.load_storage(b.untyped_storage(), 4096)
    assert torch.equal(a, b)
    odd = torch.empty(1000, dtype=torch.uint8, device="cuda")
    f.load_storage(odd.untyped_storage(), 4096 + 13)  # unaligned offset and size
    a_bytes = torch.empty(0, dtype=torch.uint8, device="cuda").set_(a.untyped_storage())
    assert torch.equal(odd, a_bytes[13:1013])
    ckptio.gds_deregister_buffer(a.untyped_storage())
    f.deregister_handle()
    assert f.device_path is None and f.backend == "auto"
    c = torch.empty_like(a)
    f.load_storage(c.untyped_storage(), 4096)  # still works without a handle (bounce)
    assert torch.equal(a, c)
    with pytest.raises(ValueError):
        f.save_storage(a.untyped_storage(), -1)
    del f


def test_forced_cufile(tmp_path):
    sd = {"x": rand((1000,), torch.float32)}
    p = tmp_path / "forced.pt"
    if EXPECT == "bounce":  # cuFile cannot register files here: a clear error, nothing lost
        ckptio.save({"old": torch.ones(3)}, p)
        with pytest.raises((ckptio.CuFileError, ckptio.BackendUnavailableError)) as ei:
            ckptio.save(sd, p, backend="cufile")
        assert "cuFile" in str(ei.value) or "cufile" in str(ei.value)
        assert torch.equal(ckptio.load(p)["old"], torch.ones(3))
        assert [x.name for x in tmp_path.iterdir()] == ["forced.pt"]
        with pytest.raises((ckptio.CuFileError, ckptio.BackendUnavailableError)):
            ckptio.GdsFile(str(p), os.O_RDWR, backend="cufile")
    elif EXPECT == "cufile":
        assert ckptio.save(sd, p, backend="cufile") is None
        rep = ckptio.last_report()
        assert rep.device_path == "cufile" and rep.gds_mode in ("compat", "p2p")
        assert torch.equal(ckptio.load(p, backend="cufile")["x"], sd["x"])
    else:
        pytest.skip("CKPTIO_EXPECT_BACKEND not set")


def test_info_reports_gpu():
    d = ckptio.info("/tmp")
    assert d["cuda"]["found"] and d["cuda"]["device_count"] >= 1
    if EXPECT == "cufile":
        assert d["cufile"]["found"] and d["folder"]["cufile_handle"]
    if EXPECT == "bounce":
        assert not d["folder"]["cufile_handle"] and d["folder"]["cufile_reason"]
