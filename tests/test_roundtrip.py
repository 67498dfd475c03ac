"""Round trips through ckptio.save / ckptio.load, and interop with torch.save / torch.load."""

import collections
import mmap
import os

import ckptio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
] + [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]


def rand(shape, dtype, gen=None):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=gen)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype, generator=gen
    )


def same(a, b):
    """Structural and bit-exact equality (NaN-safe: compares bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), type(b)
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
        assert a.requires_grad == b.requires_grad
        ua, ub = a.untyped_storage(), b.untyped_storage()
        assert ua.nbytes() == ub.nbytes()
        assert bytes(ua.cpu()) == bytes(ub.cpu())
        return
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(tmp_path, dtype):
    sd = {"t": rand((7, 13), dtype), "scalar": rand((), dtype), "empty": rand((0, 4), dtype)}
    p = tmp_path / "c.pt"
    ckptio.save(sd, p)
    same(sd, ckptio.load(p))
    same(sd, torch.load(p, weights_only=True))


def test_views_and_aliasing_survive(tmp_path):
    base = torch.arange(100, dtype=torch.float32)
    sd = {
        "base": base,
        "slice": base[10:20],
        "strided": base[::3],
        "matrix_t": base[:90].view(9, 10).t(),
        "again": base,
    }
    p = tmp_path / "views.pt"
    assert ckptio.save(sd, p) is None
    rep = ckptio.last_report()
    assert rep.storages == 1  # one storage, written once
    out = ckptio.load(p)
    same(sd, out)
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptrs) == 1, "views must share one storage after load"
    out["base"][15] = -1
    assert out["slice"][5] == -1
    assert out["again"] is out["base"] or out["again"].data_ptr() == out["base"].data_ptr()


def test_non_contiguous_and_large(tmp_path):
    big = torch.randn(64 << 20 // 4)  # 64 MiB: spans several engine chunks
    sd = {
        "big": big,
        "nc": torch.randn(300, 301)[:, 1::2],
        "perm": torch.randn(4, 5, 6).permute(2, 0, 1),
    }
    p = tmp_path / "large.pt"
    ckptio.save(sd, p, chunk_size=1 << 20, threads=4)
    same(sd, ckptio.load(p, threads=3, chunk_size=4 << 20))


def test_nested_containers_and_values(tmp_path):
    sd = collections.OrderedDict(
        model=collections.OrderedDict(w=torch.randn(3, 3), b=torch.zeros(3)),
        meta={"step": 10, "lr": 0.1, "name": "run", "flags": [True, None], "t": (1, 2.5, "x")},
        lst=[torch.ones(2), [torch.arange(3)], (torch.tensor(5),)],
    )
    p = tmp_path / "nested.pt"
    ckptio.save(sd, p)
    out = ckptio.load(p)
    assert type(out) is collections.OrderedDict
    same(sd, out)


def test_optimizer_state_dict(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    ck = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}
    p = tmp_path / "train.pt"
    ckptio.save(ck, p)
    out = ckptio.load(p)
    same(ck, out)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(out["optim"])
    model.load_state_dict(out["model"])


def test_parameters_and_requires_grad(tmp_path):
    sd = {"p": torch.nn.Parameter(torch.randn(4)), "g": torch.randn(3, requires_grad=True)}
    p = tmp_path / "params.pt"
    ckptio.save(sd, p)
    out = ckptio.load(p)
    assert isinstance(out["p"], torch.nn.Parameter)
    same(sd, out)


def test_large_storages_4k_aligned_small_ones_packed_torch_readable(tmp_path):
    from ckptio.formats.torchzip import PACK_BELOW

    sd = {f"t{i}": torch.randn(i * 100 + 1) for i in range(10)}
    sd["large"] = torch.randn(PACK_BELOW // 4)
    sd["larger"] = torch.randn(PACK_BELOW // 4 + 1)
    p = tmp_path / "aligned.pt"
    ckptio.save(sd, p)
    recs = [r for r in ckptio.records(p) if "/data/" in r.name]
    assert len(recs) == 12
    assert all(r.offset % (4096 if r.nbytes >= PACK_BELOW else 64) == 0 for r in recs)
    assert sum(r.offset % 4096 != 0 for r in recs) >= 9, "small storages are packed"
    names = sorted(t.name for r in recs for t in r.tensors)
    assert names == sorted(sd)
    same(sd, torch.load(p, weights_only=True))
    same(sd, torch.load(p, weights_only=True, mmap=True))


@pytest.mark.parametrize("alignment", [64, 4096])
def test_reads_plain_torch_save_files(tmp_path, alignment):
    from torch.utils.serialization import config

    sd = {"a": torch.randn(1000, 33), "b": torch.arange(7), "v": None}
    sd["v"] = sd["a"][1:3]
    p = tmp_path / "torch.pt"
    old = config.save.storage_alignment
    config.save.storage_alignment = alignment
    try:
        torch.save(sd, p)
    finally:
        config.save.storage_alignment = old
    out = ckptio.load(p)
    same(sd, out)
    assert out["v"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()


def test_map_location_forms(tmp_path):
    sd = {"a": torch.randn(10)}
    p = tmp_path / "m.pt"
    ckptio.save(sd, p)
    for ml in ("cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s, None):
        same(sd, ckptio.load(p, map_location=ml))


def test_overwrite_keeps_one_complete_file(tmp_path):
    p = tmp_path / "same.pt"
    for i in range(5):
        ckptio.save({"i": torch.full((1000,), i)}, p)
        assert ckptio.load(p)["i"][0] == i
    assert [f for f in os.listdir(tmp_path)] == ["same.pt"]


def test_direct_modes(tmp_path):
    sd = {"a": torch.randn(100_000)}
    for mode in ("auto", "off", False, None):
        p = tmp_path / f"d{mode}.pt"
        assert ckptio.save(sd, p, direct=mode) is None
        rep = ckptio.last_report()
        if mode in ("off", False):
            assert not rep.direct
        same(sd, ckptio.load(p, direct=mode))


def test_tmpfs_files(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        sd = {"a": torch.randn(50_000), "b": torch.randn(3)}
        assert ckptio.save(sd, os.path.join(d, "x.pt")) is None
        rep = ckptio.last_report()
        assert not rep.direct and "tmpfs" in rep.direct_reason
        same(sd, ckptio.load(os.path.join(d, "x.pt")))


tensors = st.builds(
    lambda dtype, shape, seed: rand(shape, dtype, torch.Generator().manual_seed(seed)),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    st.integers(0, 2**31),
)
values = st.recursive(
    tensors | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5) | st.none(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(obj=st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=6))
def test_random_state_dicts(tmp_path, obj):
    p = tmp_path / "h.pt"
    ckptio.save(obj, p)
    same(obj, ckptio.load(p))
    same(obj, torch.load(p, weights_only=True))


def test_cuda_reservation_covers_what_the_cache_lacks():
    from ckptio.io.memory import reservation as _reservation

    mib = 1 << 20
    sizes = [12 * mib + 1] * 8 + [4096] * 100  # small ones live in torch's small pool
    big = 8 * (12 * mib + 512)
    room = 80 << 30
    assert _reservation(sizes, 0, room, -1) == big
    assert _reservation(sizes, 20 * mib, room, -1) == big - 20 * mib
    assert _reservation(sizes, big, room, -1) == 0  # the cache holds it free
    assert _reservation([mib] * 500, 0, room, -1) == 0  # all in the small pool
    assert _reservation(sizes, 0, big, -1) == 0  # no room for it and a margin
    assert _reservation(sizes, 0, room, 64 * mib) == 0  # would not be split
    assert _reservation(sizes, 0, room, 2 * big) == big


def test_cuda_room_counts_the_cache_and_the_memory_fraction(monkeypatch):
    # One reading of a device's room serves the load's reservation and the
    # stager's device snapshot; no GPU needed, torch.cuda's answers are faked.
    from ckptio import staging
    from ckptio.io import memory

    gib = 1 << 30
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (60 * gib, 140 * gib))
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: 50 * gib)
    monkeypatch.setattr(cuda, "memory_allocated", lambda d: 45 * gib)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    assert memory.cuda_room(0) == (60 * gib, 5 * gib)
    # A fraction of 0.5 caps the process at 70 GiB, 50 of them held already.
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda d: 0.5)
    assert memory.cuda_room(0) == (20 * gib, 5 * gib)

    def no_fraction(d):
        raise RuntimeError("not supported by this allocator")

    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", no_fraction)
    assert memory.cuda_room(0) == (60 * gib, 5 * gib)

    plan = staging._Plan(headroom=gib)
    plan.claim_device_bytes(0, 60 * gib)  # 60 new + 5 cached - 1 headroom = 64
    plan.claim_device_bytes(0, 4 * gib)
    with pytest.raises(staging._NoRoom):
        plan.claim_device_bytes(0, 1)


def test_bench_floor_helpers(tmp_path):
    # The benches' same-run limits: a cold buffered read of a file, and the
    # fault-in of fresh memory that bounds a first staging from below.
    import benchlib
    from ckptio.tools import bench

    p = tmp_path / "raw.bin"
    p.write_bytes(os.urandom(3 << 20))
    assert benchlib.buffered_cold_read(str(p), 3 << 20, threads=2, chunk=1 << 20) > 0
    with pytest.raises(EOFError):
        benchlib.buffered_cold_read(str(p), 4 << 20, threads=2, chunk=1 << 20)
    assert benchlib.fresh_memory_fault_s([8 << 20, 4096, 3 << 20], threads=2, piece=1 << 20) > 0
    with open(p, "rb") as f:
        first = f.read(1 << 20)
    with mmap.mmap(-1, 1 << 20) as m:
        assert bench.cold_read(str(p), memoryview(m), 0, 2, 4096) > 0
        assert m[:] == first
        # raw_write wraps round a smaller source, as cold_read wraps round its buffer.
        m[:] = os.urandom(1 << 20)
        w = tmp_path / "w.bin"
        seconds, _ = bench.raw_write(str(w), memoryview(m), 2, 1 << 20, 3 << 20)
        assert seconds > 0 and w.read_bytes() == m[:] * 3
    # A disk settles within the timeout; a folder without block-device statistics at once.
    assert 0 <= bench.settle_disk(str(tmp_path), quiet=0.05, timeout=2.0) < 5
    if os.path.isdir("/dev/shm"):
        assert bench.settle_disk("/dev/shm") == 0.0
