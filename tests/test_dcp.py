"""ckptio.staging and ckptio.dcp with torch.distributed.checkpoint (CPU; GPU ones in test_gpu)."""

import gc
import os
import re
import socket
import subprocess
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future

import ckptio
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter
from ckptio.staging import BlockingAsyncStager, DefaultStager, StagingOptions
from test_soak import rss

HERE = os.path.dirname(__file__)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "w": torch.randn(256, 128, generator=g),
        "h": torch.randn(1000, generator=g).half(),
        "i": torch.randint(0, 1 << 30, (77,), generator=g),
        "t": torch.randn(30, 20, generator=g).t(),  # non-contiguous
        "e": torch.empty(0, 3),
        "z": torch.tensor(3.5),
        "nested": {"lst": [torch.arange(10), 7, "x"], "tup": (1.5, torch.ones(3))},
        "step": 12,
    }
    sd["view"] = sd["w"][10:20]  # shares w's storage
    return sd


def zeros_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(zeros_like(v) for v in sd)
    return None


def assert_same(a, b, where="sd"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        assert torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def result(x):
    return x.result() if isinstance(x, Future) else x


# -- stagers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        StagingOptions(),
        StagingOptions(use_shared_memory=False),
        StagingOptions(use_async_staging=False),
        StagingOptions(use_pinned_memory=False, use_shared_memory=False),
    ],
    ids=["default", "private", "blocking", "pageable"],
)
def test_stager_snapshot_is_exact_and_reused(opts):
    sd = state()
    with DefaultStager(opts) as st:
        held = None
        for _i in range(5):
            sd["w"].add_(1.0)
            staged = result(st.stage(sd))
            assert_same(sd, staged)
            # aliasing: the view and its base share one staged storage
            assert staged["view"].untyped_storage().data_ptr() == (
                staged["w"].untyped_storage().data_ptr()
            )
            assert staged["view"].storage_offset() == sd["view"].storage_offset()
            assert staged["t"].stride() == sd["t"].stride()
            assert staged["w"].is_shared() == opts.use_shared_memory
            # the snapshot does not follow later updates... until the next stage
            before = staged["w"].clone()
            sd["w"].add_(5.0)
            assert torch.equal(staged["w"], before)
            sd["w"].sub_(5.0)
            buf = staged["w"].untyped_storage().data_ptr()
            if held is not None:
                assert buf == held, "cached buffer not reused"
            held = buf
        assert st.staged_bytes() > 0
    assert st.staged_bytes() == 0  # close() freed the cache


def test_stager_frees_buffers_of_storages_that_left():
    st = DefaultStager(StagingOptions(use_async_staging=False, use_shared_memory=False))
    a, b = torch.randn(1000), torch.randn(2000)
    st.stage({"a": a, "b": b})
    assert st.staged_bytes() == 12000
    st.stage({"a": a})
    assert st.staged_bytes() == 4000
    st.close()
    with pytest.raises(RuntimeError, match="closed"):
        st.stage({"a": a})


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "memfd"])
def test_first_stage_allocates_on_the_staging_thread(monkeypatch, shared):
    # Allocation (torch zero-fills shared memory) must not block stage(): the
    # staged views exist at once, with their final shapes, and point at the
    # buffers once the future is done.
    from ckptio import staging

    threads = []
    real = staging._HostBuffer._allocate

    def spy(self):
        threads.append(threading.current_thread())
        return real(self)

    monkeypatch.setattr(staging._HostBuffer, "_allocate", spy)
    w = torch.randn(64, 48)
    sd = {"w": w, "t": w.t(), "v": w[3:5], "n": 4}
    with DefaultStager(StagingOptions(use_shared_memory=shared)) as st:
        fut = st.stage(sd)
        out = fut.result()
        assert threads and all(t is not threading.main_thread() for t in threads)
        assert len(threads) == 1  # one buffer for the three views of one storage
        for k in ("w", "t", "v"):
            assert out[k].shape == sd[k].shape and out[k].stride() == sd[k].stride()
            assert torch.equal(out[k], sd[k])
        assert out["v"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
        assert out["w"].untyped_storage().nbytes() == w.untyped_storage().nbytes()
        assert out["w"].untyped_storage().is_shared() == shared
        if shared:  # DCP's PROCESS mode pickles it by descriptor, without moving the bytes
            import io
            from multiprocessing.reduction import ForkingPickler

            ptr = out["w"].untyped_storage().data_ptr()
            ForkingPickler(io.BytesIO()).dump(out["w"])
            assert out["w"].untyped_storage().data_ptr() == ptr
        st.stage(sd).result()
        assert len(threads) == 1  # reused, not allocated again


def test_async_stage_walks_on_the_staging_thread(monkeypatch):
    # stage() only marks the CUDA streams: the walk runs on the staging thread,
    # stagings queue there in call order, and a failed one fails its own future.
    walkers = []
    real = DefaultStager._plan

    def spy(self, sd):
        walkers.append(threading.current_thread())
        return real(self, sd)

    monkeypatch.setattr(DefaultStager, "_plan", spy)
    a, b = torch.randn(1000), torch.randn(50)
    with DefaultStager(StagingOptions(use_shared_memory=False)) as st:
        f1 = st.stage({"a": a, "n": [1, 2]})
        f2 = st.stage({"a": a, "b": b, "bad": threading.Lock()})  # not deep-copyable
        f3 = st.stage({"b": b})
        assert torch.equal(f1.result()["a"], a) and f1.result()["n"] == [1, 2]
        with pytest.raises(TypeError, match="lock"):
            f2.result()
        assert torch.equal(f3.result()["b"], b)
        assert st.staged_bytes() == 200  # a's buffer went with the third staging
        assert len(walkers) == 3 and threading.main_thread() not in walkers


def test_byte_counts_while_the_staging_thread_walks():
    # The caller may ask for the counts while the staging thread adds buffers.
    # A short switch interval makes the threads interleave often: the race
    # shows, and the walk is not starved by a caller that spins.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        sd = {f"t{i}": torch.full((8,), float(i)) for i in range(3000)}
        with DefaultStager(StagingOptions(use_shared_memory=False)) as st:
            for _ in range(3):
                fut = st.stage(sd)
                while not fut.done():
                    st.staged_bytes(), st.pinned_bytes(), st.device_bytes()
                assert torch.equal(fut.result()["t2999"], sd["t2999"])
            assert st.staged_bytes() == 3000 * 32
    finally:
        sys.setswitchinterval(old)


def test_unallocated_views_sit_on_a_placeholder_that_never_grows():
    # Views of not-yet-allocated buffers point at one storage without memory;
    # set_ must not resize it (that would allocate and copy on the caller's thread).
    from ckptio import staging

    sd = {f"t{i}": torch.randn(1 << (10 + i)) for i in range(8)}
    with DefaultStager(StagingOptions(use_shared_memory=False)) as st:
        fut = st.stage(sd)
        ph = staging._placeholder(torch.device("cpu"))
        assert ph.nbytes() == 1 << 50 and not ph.resizable()
        out = fut.result()
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        assert all(out[k].untyped_storage().data_ptr() != 0 for k in sd)
    assert ph.nbytes() == 1 << 50


def test_stager_recovers_from_a_failed_allocation(monkeypatch):
    # A buffer that cannot be allocated fails that save (through its future);
    # the next stage() tries again and succeeds.
    from ckptio import staging

    real = staging._HostBuffer._allocate
    fail = [True]

    def flaky(self):
        if fail and fail.pop():
            raise MemoryError("no memory for a staging buffer")
        return real(self)

    monkeypatch.setattr(staging._HostBuffer, "_allocate", flaky)
    sd = {"a": torch.randn(100), "b": torch.randn(200)}
    with DefaultStager(StagingOptions(use_shared_memory=False)) as st:
        with pytest.raises(MemoryError, match="staging buffer"):
            st.stage(sd).result()
        out = st.stage(sd).result()
        assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"], sd["b"])
        assert st.staged_bytes() == 1200


def test_stager_bad_options():
    with pytest.raises(ValueError, match="threads"):
        DefaultStager(StagingOptions(threads=0))
    # A dict or another object was taken for "all defaults" (async staging).
    for bad in ({"use_async_staging": False}, object()):
        with pytest.raises(TypeError, match="StagingOptions"):
            DefaultStager(bad)


@pytest.mark.parametrize("async_staging", [True, False])
def test_staged_containers_keep_their_types_identity_and_cycles(tmp_path, async_staging):
    """What torch's stager (a deep copy) keeps: torch.Size, namedtuples and
    torch.return_types, dict and list subclasses with their attributes, a
    defaultdict's factory, one list under two keys, a cycle; and an object's
    tensors are staged (not deep-copied on their device). Each was a plain
    tuple, dict or list, two lists, or a RecursionError."""
    from collections import OrderedDict, defaultdict

    class Tagged(dict):
        pass

    class Items(list):
        pass

    class Holder:
        def __init__(self, t):
            self.t = t

    shared = [torch.ones(2), 3]
    tagged = Tagged(w=torch.full((3,), 2.0))
    tagged.tag = "t"
    cyc: dict = {"x": torch.zeros(1)}
    cyc["self"] = cyc
    dd = defaultdict(list, {"k": [torch.ones(1)]})
    sd = {
        "size": torch.Size([3, 4]),
        "max": torch.max(torch.tensor([[1.0, 5.0]]), 1),
        "od": OrderedDict(a=torch.ones(2)),
        "dd": dd,
        "tagged": tagged,
        "items": Items([torch.ones(4)]),
        "s1": shared,
        "s2": shared,
        "cyc": cyc,
        "holder": Holder(torch.arange(5.0)),
    }
    st = DefaultStager(StagingOptions(use_async_staging=async_staging))
    out = st.stage(sd)
    out = out.result() if async_staging else out
    assert type(out["size"]) is torch.Size and out["size"] == sd["size"]
    assert type(out["max"]) is type(sd["max"]) and torch.equal(out["max"].values, sd["max"].values)
    assert type(out["od"]) is OrderedDict and torch.equal(out["od"]["a"], torch.ones(2))
    assert type(out["dd"]) is defaultdict and out["dd"].default_factory is list
    assert type(out["tagged"]) is Tagged and out["tagged"].tag == "t"
    assert type(out["items"]) is Items and torch.equal(out["items"][0], torch.ones(4))
    assert out["s1"] is out["s2"] and out["s1"] is not shared
    assert out["cyc"]["self"] is out["cyc"] and out["cyc"] is not cyc
    assert type(out["holder"]) is Holder and torch.equal(out["holder"].t, torch.arange(5.0))
    # Snapshots, not the sources: a change after staging is not in them.
    for t in (tagged["w"], dd["k"][0], sd["holder"].t, cyc["x"]):
        t.add_(10)
    assert torch.equal(out["tagged"]["w"], torch.full((3,), 2.0))
    assert torch.equal(out["dd"]["k"][0], torch.ones(1))
    assert torch.equal(out["holder"].t, torch.arange(5.0))
    assert torch.equal(out["cyc"]["x"], torch.zeros(1))
    st.close()
    # End to end: a torch.Size saved through async_save loads back as a torch.Size.
    st = DefaultStager()
    resp = dcp.async_save(
        {"shape": torch.Size([3]), "w": torch.ones(3)},
        checkpoint_id=str(tmp_path / "c"),
        async_stager=st,
        no_dist=True,
    )
    (resp.upload_completion if hasattr(resp, "upload_completion") else resp).result()
    got = {"shape": None, "w": torch.zeros(3)}
    dcp.load(got, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert type(got["shape"]) is torch.Size
    st.close()


@pytest.mark.parametrize("async_staging", [True, False])
def test_prepare_then_stage(async_staging):
    # Without a GPU nothing is pinned (0 bytes), but prepare() allocates the
    # buffers that the first stage() then reuses; closed stagers refuse it.
    sd = {"w": torch.randn(300, 20), "v": torch.arange(7), "n": 3}
    st = DefaultStager(StagingOptions(use_async_staging=async_staging))
    assert st.prepare(sd).result() == st.pinned_bytes()
    held = st.staged_bytes()
    assert held >= sd["w"].untyped_storage().nbytes()
    out = st.stage(sd)
    out = out.result() if async_staging else out
    assert torch.equal(out["w"], sd["w"]) and out["n"] == 3 and st.staged_bytes() == held
    st.close()
    with pytest.raises(RuntimeError, match="closed"):
        st.prepare(sd)


def test_stager_accepts_torch_options_and_protocol():
    from torch.distributed.checkpoint.staging import AsyncStager
    from torch.distributed.checkpoint.staging import StagingOptions as TorchOptions

    st = DefaultStager(TorchOptions(True, False, False, False))
    assert isinstance(st, AsyncStager)
    assert isinstance(st.stage({"x": torch.ones(3)}), dict)
    st.synchronize_staging()
    st.close()
    st.close()  # idempotent


@pytest.mark.parametrize("cache", [False, True])
def test_blocking_async_stager(cache):
    sd = state()
    st = BlockingAsyncStager(cache_staged_state_dict=cache)
    assert st.should_synchronize_after_execute is False
    for _ in range(3):
        staged = st.stage(sd)
        assert_same(sd, staged)
    assert (st.staged_bytes() > 0) == cache
    st.close()


@pytest.mark.parametrize("how", ["pickle", "share", "blocking-cache"])
def test_stager_follows_staged_storages_moved_to_shared_memory(how):
    """DCP's PROCESS mode pickles the staged dict with ForkingPickler, which moves
    each storage that is not shared into shared memory in place (share_memory_):
    the cached buffers must follow their storages, never copy to the old
    address (freed: the next stage() crashed or wrote into unrelated tensors)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the storage reductions

    if how == "blocking-cache":  # forces use_shared_memory=False
        st = BlockingAsyncStager(cache_staged_state_dict=True)
    else:
        st = DefaultStager(StagingOptions(use_shared_memory=False, use_async_staging=False))
    sd = {"w": torch.full((1 << 20,), 1.0), "s": torch.ones(4), "u": torch.ones(300)}
    staged = st.stage(sd)
    moved = {k: v.data_ptr() for k, v in staged.items()}
    if how == "share":
        for v in staged.values():
            v.untyped_storage().share_memory_()
    else:
        ForkingPickler(io.BytesIO()).dump(staged)
    assert all(v.data_ptr() != moved[k] for k, v in staged.items())  # the premise
    # Unrelated tensors allocated now may take the freed memory.
    others = [torch.zeros(1 << 20) for _ in range(8)] + [torch.zeros(64) for _ in range(64)]
    for i in range(2, 5):
        for v in sd.values():
            v.fill_(float(i))
        staged = st.stage(sd)
        for k, v in sd.items():
            assert torch.equal(staged[k], v), (i, k)
        assert not any(bool(o.any()) for o in others), "a copy went to a stale address"
    st.close()


def test_slabs_are_not_kept_alive_by_a_few_survivors():
    """Small tensors made anew at every save share a slab with whatever else is
    new in it; one that stays (a growing history) kept its save's whole slab
    alive, one slab more per save. A slab less than half used now has its
    survivors placed anew, with their views and values."""
    st = DefaultStager(StagingOptions(use_async_staging=False, use_shared_memory=False))
    history: list = []
    base = torch.arange(64.0)
    held = []
    for step in range(1, 31):
        history.append(torch.tensor(float(step)))
        sd = {
            "fresh": [torch.randn(2000) for _ in range(20)],
            "history": history,
            "base": base,
            "view": base[8:16],
        }
        staged = st.stage(sd)
        assert_same(sd, staged)
        assert staged["view"].data_ptr() == staged["base"].data_ptr() + 8 * 4
        held.append(sum(b.nbytes for b in st._cache._host_buffers()))
    live = sum(t.untyped_storage().nbytes() for t in [*sd["fresh"], *history, base])
    assert max(held[5:]) < 2 * live + 4096, held  # was one slab (160 KB) more per save
    st.close()


def test_cached_staged_views_are_bounded():
    """A storage staged through a view that changes from save to save cached one
    staged view more per save, forever; past _VIEWS_MAX a buffer keeps only
    those its last walk met. Many stable views of one storage stay cached."""
    from ckptio import staging

    cap = getattr(staging, "_VIEWS_MAX", 256)
    st = DefaultStager(StagingOptions(use_async_staging=False, use_shared_memory=False))
    pool, small = torch.randn(1 << 19), torch.randn(1000)
    flat = torch.randn(4 * (cap + 50))  # more stable views than the cap
    parts = list(flat.split(4))
    for n in range(1, 2 * cap + 20):
        sd = {"pool": pool[:n], "small": small[: n % 999 + 1], "parts": parts}
        staged = st.stage(sd)
        assert_same(sd, staged)
        counts = {k[2]: len(b.views) for k, b in st._cache.buffers.items()}
        assert counts.pop(flat.untyped_storage().nbytes()) == len(parts)
        assert max(counts.values()) <= cap + 1, counts
    again = st.stage(sd)
    assert all(a is b for a, b in zip(again["parts"], staged["parts"], strict=True))
    st.close()


def test_blocking_async_stager_without_cache_from_two_threads():
    """BlockingAsyncStager(cache_staged_state_dict=False) dropped its cache after
    letting go of its locks: another thread's stage() then found its buffers
    gone (KeyError) or freed. Each stage now drops it under the work lock."""
    st = BlockingAsyncStager(cache_staged_state_dict=False)
    errors: list = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)

    def worker(val: float) -> None:
        sd = {f"t{i}": torch.full((64 + i,), val) for i in range(100)}
        sd["big"] = torch.full((1 << 19,), val)
        try:
            for _ in range(15):
                out = st.stage(sd)
                assert all(bool((v == val).all()) for v in out.values()), val
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(v,)) for v in (1.0, 2.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert st.staged_bytes() == 0
    st.close()


@pytest.mark.parametrize("async_staging", [True, False])
def test_staged_tensors_keep_their_python_attributes(async_staging):
    """Attributes set on tensors (w.tp_dim = 0) were dropped by staging; torch's
    stager copies them (tensors among them staged). A cached staged view keeps
    no attribute its source lost; an attribute may refer back to its tensor."""
    from torch.testing._internal.two_tensor import TwoTensor

    w = torch.nn.Parameter(torch.ones(3))
    w.tp_dim = 0
    b = torch.ones(2)
    b.scale = torch.tensor(0.5)
    b.me = b
    two = TwoTensor(torch.arange(3.0), torch.arange(3.0))
    two.tag = "t"
    sd = {"w": w, "b": b, "two": two, "e": torch.empty(0)}
    sd["e"].note = [1, 2]
    with DefaultStager(StagingOptions(use_async_staging=async_staging)) as st:
        out = result(st.stage(sd))
        assert out["w"].tp_dim == 0 and out["w"].requires_grad is False
        assert torch.equal(out["b"].scale, torch.tensor(0.5)) and out["b"].me is out["b"]
        assert out["b"].scale is not b.scale  # staged: a snapshot
        assert out["two"].tag == "t" and out["e"].note == [1, 2]
        del w.tp_dim
        w.other = "x"
        out = result(st.stage(sd))
        assert not hasattr(out["w"], "tp_dim") and out["w"].other == "x"


@pytest.mark.parametrize("async_staging", [True, False])
def test_tensors_of_one_geometry_stay_distinct(async_staging):
    """x and x.view(3) (two tensors over the same memory with one dtype, offset,
    shape and strides) were staged as one tensor object, the last one's
    attributes on both; torch's stager keeps them two objects (of one staged
    storage), each with its own attributes. One tensor at two paths stays one."""
    x = torch.arange(3.0)
    y, z = x.view(3), x.view(3)
    x.tag, y.tag = "x", "y"
    with DefaultStager(StagingOptions(use_async_staging=async_staging)) as st:
        for sd in ({"a": x, "b": y, "c": x, "z": z}, {"z": z, "b": y, "a": x, "c": x}):
            out = result(st.stage(sd))  # the second time from the cached views, in another order
            assert out["a"] is out["c"]
            assert len({id(out["a"]), id(out["b"]), id(out["z"])}) == 3
            assert (out["a"].tag, out["b"].tag) == ("x", "y") and not hasattr(out["z"], "tag")
            ptrs = {out[k].untyped_storage().data_ptr() for k in "abz"}
            assert len(ptrs) == 1 and ptrs != {x.untyped_storage().data_ptr()}
            assert all(torch.equal(out[k], x) for k in "abz")
        out = result(st.stage({"b": y}))
        assert out["b"].tag == "y"


@pytest.mark.parametrize("async_staging", [True, False])
def test_one_tensor_the_buffers_do_not_take_at_two_paths(async_staging):
    """A tensor staged outside the buffers (of a storage of no bytes, a
    conjugate view) met at two paths was staged twice, the second copy without
    its attributes; torch's stager (a deep copy) keeps it one object."""
    e = torch.empty(0)
    c = torch.randn(3, dtype=torch.complex64).conj()
    e.note, c.note = 1, 2
    sd = {"a": e, "b": e, "c": c, "d": [c]}
    with DefaultStager(StagingOptions(use_async_staging=async_staging)) as st:
        out = result(st.stage(sd))
        assert out["a"] is out["b"] and out["b"].note == 1
        assert out["c"] is out["d"][0] and out["d"][0].note == 2
        assert torch.equal(out["c"], c) and out["c"] is not c


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (for DTensor and ShardedTensor)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("async_staging", [True, False])
def test_stager_dtensors_and_sharded_tensors(one_rank_group, async_staging):
    """A DTensor Parameter was staged requiring grad (an in-place op on the
    snapshot failed); a DTensor or a shard whose local tensor is a wrapper
    subclass (TwoTensor; FSDP2 with float8 all-gathers) failed to stage
    ("invalid python storage"). Now: no grad, and such local tensors are
    copied as other subclasses are."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
    from torch.testing._internal.two_tensor import TwoTensor

    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(DTensor.from_local(torch.ones(4), mesh, [Replicate()]))
    wrapped = TwoTensor(torch.arange(4.0), torch.arange(4.0) + 1)
    dt = DTensor.from_local(wrapped, mesh, [Replicate()], run_check=False)
    meta = ShardMetadata([0], [4], "rank:0/cpu")
    sharded = init_from_local_shards([Shard(TwoTensor(torch.ones(4), torch.ones(4)), meta)], [4])
    sd = {"param": param, "dt": dt, "sharded": sharded}
    with DefaultStager(StagingOptions(use_async_staging=async_staging)) as st:
        for _ in range(2):
            out = result(st.stage(sd))
            assert isinstance(out["param"], DTensor) and out["param"].requires_grad is False
            out["param"].zero_()  # a snapshot: no autograd leaf in the way
            assert torch.equal(param.to_local(), torch.ones(4))
            local = out["dt"].to_local()
            assert type(local) is TwoTensor and local is not wrapped
            assert torch.equal(local.a, wrapped.a) and torch.equal(local.b, wrapped.b)
            shard = out["sharded"].local_shards()[0].tensor
            assert type(shard) is TwoTensor and torch.equal(shard.a, torch.ones(4))


@pytest.mark.parametrize("async_staging", [True, False])
def test_gc_is_paused_for_the_walk_only(monkeypatch, async_staging):
    """Cyclic GC was paused process-wide for the whole staging, copies included
    (and turned back on after them even if the application had turned it off
    meanwhile); it is now paused while the state dict is walked only."""
    import ckptio.staging as staging

    seen: dict = {"walk": [], "copy": []}
    real_plan, real_copy = DefaultStager._plan, staging._native.stage_copy

    def plan(self, sd):
        seen["walk"].append(gc.isenabled())
        return real_plan(self, sd)

    def stage_copy(*args, **kwargs):
        seen["copy"].append(gc.isenabled())
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(DefaultStager, "_plan", plan)
    monkeypatch.setattr(staging._native, "stage_copy", stage_copy)
    assert gc.isenabled()
    sd = {f"t{i}": torch.full((10,), float(i)) for i in range(50)}
    with DefaultStager(StagingOptions(use_async_staging=async_staging)) as st:
        for _ in range(2):
            assert_same(sd, result(st.stage(sd)))
    assert seen == {"walk": [False, False], "copy": [True, True]}
    assert gc.isenabled()


# -- DCP writer and reader, one process -------------------------------------------


def test_writer_files_are_aligned_and_stock_readable(tmp_path):
    from ckptio.formats.torchzip import PACK_BELOW

    sd = state()
    sd["big"] = torch.randn(PACK_BELOW // 4 + 4096)  # an item past the packing threshold
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and names[0] == ".metadata", names
    assert re.fullmatch(r"__0_[0-9a-f]{8}_0\.distcp", names[1]), names  # this generation's
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    for info in md.storage_data.values():
        # large items (and their data) on 4 KiB boundaries, small ones packed at 64 bytes
        big = info.length >= PACK_BELOW + 8192
        assert info.offset % (4096 if big else 64) == 0, info
    assert any(i.length >= PACK_BELOW + 8192 for i in md.storage_data.values())
    for reader in (dcp.FileSystemReader(tmp_path), FileSystemReader(tmp_path)):
        out = zeros_like(sd)
        dcp.load(out, storage_reader=reader, no_dist=True)
        for k in ("w", "h", "i", "t", "e", "z", "view", "step", "big"):
            assert_same(sd[k], out[k], k)
        assert_same(sd["nested"]["lst"][0], out["nested"]["lst"][0])


def test_reader_reads_stock_checkpoints(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    out = zeros_like(sd)
    reader = FileSystemReader(tmp_path)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["t"], sd["t"])
    assert out["step"] == 12
    assert reader.last_stats and reader.last_stats[0]["bytes"] > 0


class _Tied(torch.nn.Module):
    """Tied weights (tie_word_embeddings): two keys, one tensor."""

    def __init__(self, vocab: int = 2048, dim: int = 256) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("vocab", [2048, 64])  # 2 MiB (read straight) and 64 KiB (small)
def test_reader_loads_tied_weights(tmp_path, verify, vocab):
    """Two keys of one destination: the engine cannot fill one memory twice in a
    read; the second goes through a temporary (it failed with an overlap error
    at 1 MiB and more, at any size with verify=True)."""
    m = _Tied(vocab)
    dcp.save({"model": m.state_dict()}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    for reader in (FileSystemReader(tmp_path, verify=verify), dcp.FileSystemReader(tmp_path)):
        back = _Tied(vocab)
        sd = {"model": back.state_dict()}
        dcp.load(sd, storage_reader=reader, no_dist=True)
        assert back.head.weight is back.emb.weight
        assert torch.equal(back.emb.weight, m.emb.weight)


def test_reader_casts_to_the_destinations_dtype_as_torchs_does(tmp_path):
    """torch's reader copy_s each item into its destination, casting: fp32 master
    weights into a bf16 model load (ckptio raised a FormatError)."""
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randn(1 << 19, generator=g), "small": torch.randn(4, 4, generator=g)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    for dtype in (torch.bfloat16, torch.float64, torch.int64):
        for verify in (False, True):
            ours = {k: torch.zeros_like(v, dtype=dtype) for k, v in sd.items()}
            theirs = {k: torch.zeros_like(v, dtype=dtype) for k, v in sd.items()}
            reader = FileSystemReader(tmp_path, verify=verify)
            dcp.load(ours, storage_reader=reader, no_dist=True)
            dcp.load(theirs, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
            for k in sd:
                assert ours[k].dtype == dtype and torch.equal(ours[k], theirs[k]), (k, dtype)


def test_reader_into_conjugate_and_negative_views(tmp_path):
    """A destination that is a conjugate or negative view (``t.conj()``,
    ``torch._neg_view(t)``) was read straight into, its bit then applied to
    the bytes read: an item over 1 MiB came back conjugated or negated. torch's
    reader copy_s into it: the view reads as the values saved."""
    g = torch.Generator().manual_seed(5)
    sd = {
        "c": torch.randn(200_000, dtype=torch.complex64, generator=g),  # 1.6 MB
        "r": torch.randn(300_000, generator=g),
        "small": torch.randn(8, dtype=torch.complex64, generator=g),
    }
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    for verify in (False, True):
        dest = {
            "c": torch.zeros(200_000, dtype=torch.complex64).conj(),
            "r": torch._neg_view(torch.zeros(300_000)),
            "small": torch.zeros(8, dtype=torch.complex64).conj(),
        }
        dcp.load(dest, storage_reader=FileSystemReader(tmp_path, verify=verify), no_dist=True)
        for k, v in sd.items():
            assert torch.equal(dest[k], v), (k, verify)
        assert dest["c"].is_conj() and dest["r"].is_neg()


def test_reader_verify_checks_non_tensor_values(tmp_path):
    """verify=True checks a non-tensor value's archive against its CRC-32s, as a
    tensor's bytes (a flipped byte in one loaded as another value); a value cut
    short is a FormatError naming the file and item, with or without verify."""
    sd = {"w": torch.ones(4), "sched": {"last_epoch": 1000, "name": "cosine"}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    fresh = lambda: {"w": torch.zeros(4), "sched": {"last_epoch": 0, "name": ""}}  # noqa: E731
    r = FileSystemReader(tmp_path, verify=True)
    out = fresh()
    dcp.load(out, storage_reader=r, no_dist=True)
    assert out["sched"] == sd["sched"]
    assert "sched.name" in r.last_stats[0]["verified"], r.last_stats
    data = next(tmp_path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[raw.index(b"cosine")] ^= 0x20
    data.write_bytes(bytes(raw))

    def error(verify: bool) -> BaseException:
        with pytest.raises(BaseException) as ei:  # DCP's CheckpointException
            reader = FileSystemReader(tmp_path, verify=verify)
            dcp.load(fresh(), storage_reader=reader, no_dist=True)
        e = ei.value
        return e.failures[0][0] if hasattr(e, "failures") else e

    e = error(True)
    assert isinstance(e, ckptio.FormatError) and "'sched.name'" in str(e) and "CRC-32" in str(e)
    os.truncate(data, len(raw) - 100)  # the value (saved last) cut short
    for verify in (False, True):
        e = error(verify)
        assert isinstance(e, ckptio.FormatError) and "the file ends" in str(e), repr(e)


def test_writer_options(tmp_path):
    sd = state()
    dcp.save(
        sd,
        storage_writer=FileSystemWriter(tmp_path, single_file_per_rank=False, threads=2),
        no_dist=True,
    )
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".distcp")]) > 5
    out = zeros_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(tmp_path, direct=False), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
    w = FileSystemWriter(tmp_path / "x", thread_count=3)
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert len([n for n in os.listdir(tmp_path / "x") if n.endswith(".distcp")]) == 3


def test_strided_read_requests(tmp_path):
    """Row-sharded saves read back into column slices (strided requests)."""
    from torch.distributed.checkpoint.planner import LoadItemType  # noqa: F401

    sd = {"m": torch.randn(64, 32)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    out = {"m": torch.zeros(64, 32).t().contiguous().t()}  # column-major destination
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["m"], sd["m"])


def test_reader_errors_are_typed(tmp_path):
    sd = {"w": torch.randn(100, 100)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    (data,) = tmp_path.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[0:4] = b"XXXX"  # break the item's zip
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    # DCP wraps a rank's error in CheckpointException (a BaseException) with its traceback.
    with pytest.raises(BaseException) as ei:
        dcp.load(
            {"w": torch.zeros(100, 100)}, storage_reader=FileSystemReader(tmp_path), no_dist=True
        )
    assert "FormatError" in str(ei.value) and data.name in str(ei.value)
    with pytest.raises(BaseException, match="(?i)shape|size"):
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ok"), no_dist=True)
        dcp.load(
            {"w": torch.zeros(10, 100)},
            storage_reader=FileSystemReader(tmp_path / "ok"),
            no_dist=True,
        )


def test_reader_reads_large_items_in_batches_beside_the_small_ones(tmp_path, monkeypatch):
    """The large items of a data file go to the engine in batches of
    transfer.BATCH_BYTES while the rest are planned (those planned during a
    read joining the next), the small ones in one buffer with the first batch:
    every item lands, each once; a bad request in a later batch raises only
    once the batches already reading are done."""
    import ckptio.dcp as cdcp

    monkeypatch.setattr(cdcp.transfer, "BATCH_BYTES", 4 << 20)  # four large items

    sd = {f"big{i:02d}": torch.randn(256 * 1024 + i) for i in range(45)}  # > 1 MiB items
    sd.update({f"small{i:02d}": torch.randn(7 + i) for i in range(30)})
    sd["strided"] = torch.randn(600, 700)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    out = zeros_like(sd)
    out["strided"] = torch.zeros(700, 600).t()  # a column-major destination
    reader = FileSystemReader(tmp_path)
    calls = []
    real = cdcp.transfer.read_after
    monkeypatch.setattr(
        cdcp.transfer, "read_after", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k)
    )
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert_same(sd, out)
    # The small items' buffer and the first 4 large items with their zip heads
    # (where the data lies is predicted, the heads read to confirm it), then more.
    assert calls[0] == 30 + 2 * 4 and len(calls) >= 2, calls
    assert sum(calls) == 30 + 2 * 46  # every item read once
    # Every tensor's bytes, and the zips around them: the small items' read whole,
    # the large items' heads (20 KiB at ckptio's 4 KiB alignment).
    extra = reader.last_stats[0]["bytes"] - sum(t.nbytes for t in sd.values())
    assert 46 * 20 << 10 <= extra < (30 + 46) * 24 << 10
    # An item of the third batch refused: the error raised once the reads in
    # flight are done (their destinations are the engine's).
    plan_read = FileSystemReader._plan_read

    def refuse(self, path, req, *args):
        if req.storage_index.fqn == "big44":
            raise ckptio.FormatError("big44 refused")
        return plan_read(self, path, req, *args)

    with monkeypatch.context() as m:
        m.setattr(FileSystemReader, "_plan_read", refuse)
        calls.clear()
        with pytest.raises(BaseException, match="FormatError.*big44 refused"):
            dcp.load(zeros_like(sd), storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert len(calls) >= 2, calls
    # One of another dtype there is cast, as torch's reader casts.
    cast = zeros_like(sd)
    cast["big44"] = torch.zeros(256 * 1024 + 44, dtype=torch.float64)
    dcp.load(cast, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(cast["big44"], sd["big44"].double())
    # Heads that differ from the prediction (another writer's layout): the file
    # is read again with every item's zip mapped, and the destinations hold it.
    from ckptio.formats import dcp as dcp_format

    real_zip = dcp_format.item_zip

    def wrong(dtype, shape, align=dcp_format.ALIGN):
        z = real_zip(dtype, shape, align)
        return z._replace(head=bytes(len(z.head)))

    monkeypatch.setattr(dcp_format, "item_zip", wrong)
    out = zeros_like(sd)
    calls.clear()
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert_same(sd, out)
    assert sum(calls) == 2 * (30 + 46) + 46, calls  # every item twice, the heads once


def test_metadata_replaced_atomically(tmp_path):
    sd = {"w": torch.randn(10)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    before = (tmp_path / ".metadata").stat().st_ino
    sd["w"].add_(1)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    assert (tmp_path / ".metadata").stat().st_ino != before  # a new file renamed over
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]
    out = {"w": torch.zeros(10)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["w"], sd["w"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: DefaultStager(),
        lambda: DefaultStager(StagingOptions(use_shared_memory=False)),
        lambda: BlockingAsyncStager(cache_staged_state_dict=True),
        lambda: None,  # the writer is the stager (torch's default for FileSystemWriter)
    ],
    ids=["default", "private", "blocking", "writer"],
)
def test_async_save_five_times(tmp_path, make):
    sd = state()
    stager = make()
    for i in range(5):
        sd["w"].add_(1)
        kw = {"async_stager": stager} if stager is not None else {}
        r = dcp.async_save(
            sd, storage_writer=FileSystemWriter(tmp_path / str(i)), no_dist=True, **kw
        )
        up = r.upload_completion if hasattr(r, "upload_completion") else r
        if hasattr(r, "staging_completion"):
            r.staging_completion.result()
        up.result()
        out = zeros_like(sd)
        dcp.load(out, storage_reader=FileSystemReader(tmp_path / str(i)), no_dist=True)
        assert torch.equal(out["w"], sd["w"]) and torch.equal(out["h"], sd["h"])
    if stager is not None:
        stager.close()


@pytest.mark.slow
def test_fifty_async_saves_keep_memory_flat(tmp_path):
    sd = {f"p{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    stager = DefaultStager()
    samples = []
    for _i in range(50):
        r = dcp.async_save(
            sd, storage_writer=FileSystemWriter(tmp_path), async_stager=stager, no_dist=True
        )
        r.upload_completion.result()
        del r
        gc.collect()
        samples.append((rss(), stager.staged_bytes(), len(os.listdir("/proc/self/fd"))))
    stager.close()
    warm = samples[9]
    last = samples[-1]
    assert last[1] == warm[1] == 8 << 20, samples[-1]
    assert last[2] <= warm[2] + 2, (warm, last)
    assert last[0] - warm[0] < 64 << 20, f"RSS grew {(last[0] - warm[0]) >> 20} MiB"


# -- several processes over gloo ------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(
    world: int, scenario: str, ckpt, backend: str = "gloo", argv: list | None = None, **extra: str
) -> None:
    """``world`` processes of dist_worker.py (or ``argv``: another script and its
    arguments), each given its rank in the environment; fails if any fails."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            CKPTIO_DIST_BACKEND=backend,
            **extra,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *(argv or [os.path.join(HERE, "dist_worker.py"), scenario, ckpt])],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out.decode(errors="replace")))
    bad = [i for i, (rc, _) in enumerate(outs) if rc != 0]
    for i in bad:
        print(f"--- {scenario} rank {i} of {world} (exit {outs[i][0]}):\n{outs[i][1][-4000:]}")
    assert not bad, f"{scenario}: ranks {bad} of {world} failed (their output is printed above)"


@pytest.mark.slow
def test_two_and_four_ranks_then_reshard(tmp_path):
    _run_ranks(4, "save", tmp_path)
    _run_ranks(2, "reshard", tmp_path)
    _run_ranks(2, "save", tmp_path / "two")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_over_nccl(tmp_path):
    # DTensors on 2 GPUs: sync save, async saves with host staging and device
    # snapshot, loads by both readers; then one GPU loads the 2-rank checkpoint;
    # then the replication exchange over NCCL.
    _run_ranks(2, "save", tmp_path, backend="nccl")
    _run_ranks(1, "reshard", tmp_path, backend="nccl", CKPTIO_LAST_STEP="6")
    _run_ranks(2, "replicate", tmp_path, backend="nccl")


@pytest.mark.slow
def test_sharded_tensor_local_shards(tmp_path):
    _run_ranks(2, "sharded_tensor", tmp_path)


@pytest.mark.slow
def test_replication_stager_exchange_and_recovery(tmp_path):
    _run_ranks(2, "replicate", tmp_path)
    assert sorted(os.listdir(tmp_path / "replicas")) == [
        "rank_0_replica_partner_1.pt",
        "rank_1_replica_partner_0.pt",
    ]


def test_replication_stager_needs_a_group():
    from ckptio.staging import ReplicationStager

    with pytest.raises(RuntimeError, match="process group"):
        ReplicationStager()


@pytest.mark.slow
def test_process_mode(tmp_path):
    _run_ranks(1, "process", tmp_path)


def test_public_names():
    import ckptio.dcp
    import ckptio.staging

    assert ckptio.staging.DefaultStager and ckptio.dcp.FileSystemWriter
    assert ckptio.__version__
    warnings.simplefilter("default")


@pytest.mark.slow
def test_training_example_resumes_exactly(tmp_path):
    ex = os.path.join(HERE, "..", "examples", "train_async_checkpoint.py")
    args = ["--steps", "8", "--every", "4", "--dim", "64", "--layers", "1", "--dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, ex, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "continues exactly: True" in out.stdout
    assert "left training unchanged (same losses): True" in out.stdout
    # medians with their spread, after a warm-up; blocked time per checkpoint
    assert "training blocked per checkpoint" in out.stdout and "after a warm-up" in out.stdout
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    for mode in ("torch", "ckptio"):
        assert re.search(r"\d+\.\d \[\d+\.\d-\d+\.\d\].*\(6 checkpoints\)", rows[mode]), rows


def test_stager_keeps_a_dropped_state_dict_alive_until_copied():
    """The caller may drop its dict as soon as stage() returns (async_save of a
    temporary): the copy must still see the original bytes, not reused memory."""
    st = DefaultStager(StagingOptions(use_shared_memory=False))
    for i in range(30):
        fut = st.stage({"t": torch.full((4096,), float(i)), "u": torch.full((7,), float(-i))})
        junk = [torch.full((4096,), -1.0) for _ in range(8)]  # reuse the freed memory
        staged = fut.result()
        assert torch.equal(staged["t"], torch.full((4096,), float(i))), i
        assert torch.equal(staged["u"], torch.full((7,), float(-i))), i
        del junk
    st.close()


@pytest.mark.parametrize(
    "dtype,shape",
    [(torch.float32, (3, 5)), (torch.bfloat16, (0,)), (torch.int8, ()), (torch.float16, (4097,))],
)
def test_item_template_is_a_torch_save_zip(dtype, shape):
    import io
    import zipfile

    from ckptio.formats.dcp import item_zip as _item_zip

    head, data_off, tail, length, *_ = _item_zip(dtype, shape)
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    assert length == data_off + nbytes + len(tail)
    assert data_off % 4096 == 0 or nbytes == 0  # an empty record has no data to align
    blob = head + bytes(nbytes) + tail
    assert len(blob) == length
    assert "archive/data.pkl" in zipfile.ZipFile(io.BytesIO(blob)).namelist()
    t = torch.load(io.BytesIO(blob), weights_only=True)
    assert t.dtype == dtype and tuple(t.shape) == shape and not t.any()


def test_item_template_past_4gib_needs_no_memory():
    from ckptio.formats.dcp import item_zip as _item_zip

    head, data_off, tail, length, crc_at, volatile = _item_zip(torch.uint8, (5 << 30,))
    assert len(crc_at) == 2  # data descriptor and central directory
    # What each save makes anew: the serialization id's digits and its two CRC-32s.
    assert sorted(n for _, n in volatile) == [4, 4, 40]
    assert all(tail[at : at + n].isdigit() for at, n in volatile if n == 40)
    assert data_off % 4096 == 0 and length == data_off + (5 << 30) + len(tail)
    assert len(head) < 1 << 20 and len(tail) < 1 << 20


def test_items_carry_real_crc32s(tmp_path):
    """Every tensor item is a zip whose data CRC-32 is filled (zipfile checks it)."""
    import io
    import zipfile

    sd = state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    (data,) = tmp_path.glob("*.distcp")
    blob = data.read_bytes()
    checked = 0
    for info in md.storage_data.values():
        item = blob[info.offset : info.offset + info.length]
        if not item.startswith(b"PK"):
            continue  # a BYTE_IO item
        with zipfile.ZipFile(io.BytesIO(item)) as z:
            assert z.testzip() is None
            if "archive/data/0" not in z.namelist():
                continue  # an empty tensor has no data record
            data = z.getinfo("archive/data/0")
            assert data.file_size == 0 or data.CRC != 0
            checked += 1
    assert checked >= 8
    # a flipped data bit is caught by the zip check
    info = next(i for i in md.storage_data.values() if i.length > 60000)
    bad = bytearray(blob[info.offset : info.offset + info.length])
    bad[len(bad) // 2] ^= 1  # inside the data (small records are padded to 4 KiB)
    with zipfile.ZipFile(io.BytesIO(bytes(bad))) as z:
        assert z.testzip() == "archive/data/0"


def test_one_writer_used_from_two_threads_does_not_deadlock(tmp_path):
    """The writer's lock is only held detached from the interpreter: a second
    thread calling into the same writer cannot block the first one's return."""
    import threading

    from ckptio import _native
    from ckptio.io.engines import engine as _engine

    w = _native.AtomicWriter(tmp_path / "f.bin", "off")
    data = torch.arange(1 << 22, dtype=torch.uint8)
    errors = []

    def small_writes():
        try:
            for i in range(300):
                w.write_bytes((1 << 22) + i, b"x")
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=small_writes)
    t.start()
    for _ in range(20):
        w.write_segments(
            _engine(2, 1 << 16, "off"), [(0, data.data_ptr(), data.numel(), -1)], [data], []
        )
    t.join(timeout=60)
    assert not t.is_alive() and not errors
    w.commit()
    assert (tmp_path / "f.bin").read_bytes()[:16] == bytes(range(16))


def test_file_urls_name_the_local_folder(tmp_path, monkeypatch):
    """FileSystemWriter/Reader("file:///abs/dcp") and checkpoint_id="file://..." use
    the folder the URL names, as ckptio.save does (a review of 2026-12-07: the
    writer wrote into ./file:/abs/dcp under the working folder)."""
    monkeypatch.chdir(tmp_path)
    sd = {"w": torch.randn(8), "b": torch.arange(3)}
    folder = tmp_path / "ck"
    dcp.save(sd, storage_writer=FileSystemWriter(f"file://{folder}"), no_dist=True)
    assert (folder / ".metadata").exists() and not (tmp_path / "file:").exists()
    out = zeros_like(sd)
    dcp.load(out, storage_reader=FileSystemReader(f"file://{folder}"), no_dist=True)
    assert_same(sd, out)
    other = tmp_path / "ck2"
    dcp.save(
        sd, checkpoint_id=f"file://{other}", storage_writer=FileSystemWriter(folder), no_dist=True
    )
    assert (other / ".metadata").exists()
    out = zeros_like(sd)
    reader = FileSystemReader(folder)
    dcp.load(out, checkpoint_id=f"file://{other}", storage_reader=reader, no_dist=True)
    assert_same(sd, out)
    assert not (tmp_path / "file:").exists()


def test_a_metadata_read_error_reaches_the_caller_typed_through_torchs_loader(tmp_path):
    """torch's loader catches read_metadata's error and asks for the rank's own
    metadata; torch 2.11 then said only "metadata is None". Every torch version
    now reports the first error, typed, in the CheckpointException."""
    with pytest.raises(dcp.api.CheckpointException) as ei:
        dcp.load({"w": torch.zeros(2)}, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    err = ei.value.failures[0][0]
    assert isinstance(err, FileNotFoundError) and ".metadata" in str(err), err
    (tmp_path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(dcp.api.CheckpointException) as ei:
        dcp.load({"w": torch.zeros(2)}, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    err = ei.value.failures[0][0]
    assert isinstance(err, ckptio.FormatError) and ".metadata" in str(err), err
    # The reader hands the error over as torch's loader asks for a rank's metadata:
    # it keeps no frame of the caller's (holding the destinations) alive.
    reader = FileSystemReader(tmp_path)

    def attempt() -> weakref.ref:
        dest = torch.zeros(2)  # in this frame, which the error's traceback holds
        try:
            reader.read_metadata()
        except ckptio.FormatError:
            pass
        assert "not read" in repr(reader.read_metadata(rank=0))
        return weakref.ref(dest)

    dest = attempt()
    gc.collect()
    assert dest() is None


def test_read_metadata_of_a_rank_raises_unless_the_global_read_just_failed(tmp_path):
    """The stand-in comes only where torch's loader would take a missing rank
    file for "metadata is None": after this reader's global read failed. A rank's
    own metadata is read whatever came before."""
    from torch.distributed.checkpoint.metadata import Metadata

    reader = FileSystemReader(tmp_path)
    with pytest.raises(FileNotFoundError):
        reader.read_metadata(rank=0)  # nothing failed before: the plain error
    (tmp_path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ckptio.FormatError) as first:
        reader.read_metadata()
    got = reader.read_metadata(rank=0)
    assert isinstance(got, Metadata) and "not read" in repr(got)
    with pytest.raises(ckptio.FormatError) as again:
        _ = got.state_dict_metadata
    assert again.value is first.value
    with pytest.raises(ckptio.FormatError):
        reader.set_up_storage_reader(got, True)
    good = tmp_path / "good"
    dcp.save({"w": torch.ones(2)}, storage_writer=FileSystemWriter(good), no_dist=True)
    (tmp_path / "__0.metadata").write_bytes((good / ".metadata").read_bytes())
    with pytest.raises(ckptio.FormatError):
        reader.read_metadata()
    assert "w" in reader.read_metadata(rank=0).state_dict_metadata
    os.remove(tmp_path / ".metadata")
    (tmp_path / ".metadata").write_bytes((good / ".metadata").read_bytes())
    reader.read_metadata()  # read: the next rank= call raises as before
    os.remove(tmp_path / "__0.metadata")
    with pytest.raises(FileNotFoundError):
        reader.read_metadata(rank=0)


def test_the_sweep_after_a_commit_does_not_unpickle_what_it_just_wrote(tmp_path, monkeypatch):
    """The writer's finish hands the sweep the .metadata bytes it committed and the
    files they name: a metadata file holding exactly those bytes is not unpickled
    again; one holding anything else is, and decides."""
    from ckptio.formats import dcp as fmt

    dcp.save({"a": torch.ones(3)}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    md_path = tmp_path / ".metadata"
    raw = md_path.read_bytes()
    named = fmt.files_named(raw, str(md_path))
    assert named and all((tmp_path / n).exists() for n in named)
    parsed = []
    real = fmt.parse_metadata
    monkeypatch.setattr(fmt, "parse_metadata", lambda *a, **k: parsed.append(1) or real(*a, **k))
    stray = tmp_path / "__0_0.distcp"  # torch's name, named by no metadata
    stray.write_bytes(b"x")
    assert fmt.sweep(str(tmp_path), written=(raw, named)) == [stray.name] and parsed == []
    stray.write_bytes(b"x")
    assert fmt.sweep(str(tmp_path), written=(raw + b"!", set())) == [stray.name]
    assert parsed == [1] and all((tmp_path / n).exists() for n in named)
    dcp.save({"a": torch.zeros(3)}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    assert not any((tmp_path / n).exists() for n in named)  # the old generation went
    out = {"a": torch.empty(3)}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert torch.equal(out["a"], torch.zeros(3))


def test_a_writer_that_stages_keeps_its_file_stats_apart_from_the_stagers(tmp_path):
    """FileSystemWriter is its own stager: stage() (which may run while a write
    appends to last_stats) records into last_stage_stats, never over the
    writer's per-file list."""
    sd = {"w": torch.arange(12.0)}
    w = FileSystemWriter(tmp_path / "ck")
    dcp.save(sd, storage_writer=w, no_dist=True)
    files = w.last_stats
    assert isinstance(files, list) and files and all("path" in s for s in files)
    staged = w.stage({"w": torch.arange(12.0)})
    assert torch.equal(staged["w"], sd["w"])
    assert w.last_stats is files and isinstance(w.last_stage_stats, dict)
    assert w.last_stage_stats["staged_bytes"] == 48
