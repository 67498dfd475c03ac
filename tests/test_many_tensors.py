"""Many tensors: small storages packed at torch's 64 bytes, large ones at 4 KiB,
torch.save's pickle written and read natively, every I/O shared by many records.

What must hold whatever the count: files torch.load reads (plainly and mmapped)
and ckptio reads both ways, CRC-32s that verify catches a flipped bit with, a
previous file left whole by a killed save, and the objects torch itself returns.
"""

from __future__ import annotations

import collections
import io
import os
import random
import time
import zipfile
from typing import Any

import ckptio
import pytest
import torch
from ckptio.formats import safetensors as st_format
from ckptio.formats import torchzip
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_faults import TEMP_RE, go, ready_children, sha256, sigkill, temps

PACK = torchzip.PACK_BELOW


def mixed_state(n: int, seed: int = 0) -> collections.OrderedDict[str, Any]:
    """``n`` tensors: empty ones, 1-byte ones, small floats of many dtypes, a few
    just under, at and just over the packing threshold, and views sharing storages
    on both sides of it; a state_dict-like OrderedDict with ``_metadata``."""
    g = torch.Generator().manual_seed(seed)
    sd: collections.OrderedDict[str, Any] = collections.OrderedDict()
    big = torch.randn(PACK // 4 + 16, generator=g)  # over the threshold
    under = torch.randn(PACK // 4 - 1, generator=g)  # just under it
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16, torch.bool]
    for i in range(n):
        k = i % 97
        if k == 0:
            t = torch.empty(0)
        elif k == 1:
            t = torch.randint(0, 255, (1,), dtype=torch.uint8, generator=g)
        elif k == 2 and i % 5 == 0:
            t = big[i % 1000 : i % 1000 + 7]  # a view of a large storage
        elif k == 3 and i % 5 == 0:
            t = under[3:][: 1 + i % 50]  # a view of a storage just under the threshold
        elif k == 4 and i < 97 * 8:
            # PACK - 4, PACK and PACK + 4 bytes
            t = torch.randn(PACK // 4 + (i // 97) % 3 - 1, generator=g)
        else:
            dt = dtypes[i % len(dtypes)]
            t = torch.randn(1 + i % 33, generator=g).to(dt)
        sd[f"layers.{i // 10}.w{i % 10}"] = t
    sd["shared.big"] = big
    sd["shared.under"] = under
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return sd


def same(a: Any, b: Any) -> None:
    """Equal values, types, dtypes, shapes, strides; for tensors the same bytes."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
        assert a.requires_grad == b.requires_grad
        if a.numel():
            assert torch.equal(raw(a), raw(b))
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def shared_storages(obj: dict[str, Any]) -> set[frozenset[str]]:
    """Groups of names whose tensors share a storage."""
    by: dict[int, set[str]] = {}
    for k, v in obj.items():
        if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes():
            by.setdefault(v.untyped_storage().data_ptr(), set()).add(k)
    return {frozenset(g) for g in by.values() if len(g) > 1}


@pytest.mark.slow
def test_100k_mixed_tensors_round_trip_both_ways(tmp_path):
    sd = mixed_state(100_000)
    ours, theirs = tmp_path / "ckptio.pt", tmp_path / "torch.pt"
    ckptio.save(sd, ours)
    torch.save(sd, theirs)
    assert os.path.getsize(ours) <= 1.15 * os.path.getsize(theirs)
    groups = shared_storages(sd)
    for got in (
        torch.load(ours, weights_only=True),
        torch.load(ours, weights_only=True, mmap=True),
        ckptio.load(ours),
        ckptio.load(theirs),
    ):
        same(sd, got)
        assert shared_storages(got) == groups
    rep = ckptio.verify(ours)
    assert rep.ok and not rep.unchecked, rep.summary()
    recs = [r for r in ckptio.records(ours) if "/data/" in r.name]
    assert all(r.offset % (4096 if r.nbytes >= PACK else 64) == 0 for r in recs)
    assert sum(r.nbytes >= PACK for r in recs) >= 4  # big, PACK, PACK+4 and more


def torch_pickle(obj: Any) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return zipfile.ZipFile(b).read("archive/data.pkl")


def python_pickle(obj: Any) -> bytes:
    b = io.BytesIO()
    torchzip._Pickler(b).dump(obj)
    return b.getvalue()


def pickle_cases() -> list[Any]:
    sd = mixed_state(3000, seed=1)
    sd["param"] = torch.nn.Parameter(torch.ones(3))
    sd["nested"] = {"a": [1, 2.5, None, True, "s", (1, 2), (), (1, 2, 3, 4), [], {}]}
    sd["big_int"] = 1 << 40
    sd["t4"] = torch.randn(3, 4, 5, 6).transpose(1, 2)
    opt = {
        "state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)} for i in range(1001)},
        "param_groups": [{"lr": 0.1, "params": list(range(1001))}],
    }
    loop: tuple[list[Any]] = ([],)
    loop[0].append(loop)
    return [sd, opt, {f"k{i}": i for i in range(2000)}, [torch.ones(2)] * 3, {"loop": loop}]


@pytest.mark.parametrize("case", range(5))
def test_the_pickle_is_torch_saves_byte_for_byte(case):
    obj = pickle_cases()[case]
    want = torch_pickle(obj)
    native = torchzip.native_pickler().dump(obj)
    assert native is not None
    assert native[0] == want
    assert python_pickle(obj) == want


def test_objects_outside_the_native_subset_take_the_python_pickler(tmp_path):
    for obj in (
        {"sparse": torch.ones(2).to_sparse()},
        {"dev": torch.device("cpu"), "t": torch.ones(2)},
        {"u16": torch.ones(2, dtype=torch.uint16)},
        {"conj": torch.ones(2, dtype=torch.complex64).conj()},
        {"set": {1, 2}},
    ):
        assert torchzip.native_pickler().dump(obj) is None
        assert python_pickle(obj) == torch_pickle(obj)
        ckptio.save(obj, tmp_path / "x.pt")
        got = torch.load(tmp_path / "x.pt", weights_only=False)
        assert list(got) == list(obj)


def test_state_dicts_load_without_torch_load(tmp_path, monkeypatch):
    sd = mixed_state(500)
    sd["param"] = torch.nn.Parameter(torch.randn(4))
    sd["nested"] = {"t": sd["layers.0.w5"], "l": [sd["shared.big"], 3, "x"]}
    p = tmp_path / "sd.pt"
    ckptio.save(sd, p)
    want = torch.load(p, weights_only=True)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    got = ckptio.load(p)
    same(want, got)
    assert got["nested"]["t"] is got["layers.0.w5"]  # one object, as pickled
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    assert got["layers.0.w1"]._backward_hooks == collections.OrderedDict()
    # what torch.load does otherwise: map_location as a callable, pickle arguments
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or {})
    ckptio.load(p, map_location=lambda s, loc: s)
    ckptio.load(p, encoding="latin1")
    assert len(calls) == 2


def test_other_pickles_fall_back_to_torch_load(tmp_path):
    obj = {"dev": torch.device("cpu"), "t": torch.ones(2), "s": torch.Size([2, 3])}
    p = tmp_path / "o.pt"
    ckptio.save(obj, p)
    got = ckptio.load(p)
    assert got["dev"] == torch.device("cpu") and got["s"] == torch.Size([2, 3])
    assert torch.equal(got["t"], obj["t"])


def test_mixed_alignment_files_keep_torchs_computed_offsets_right(tmp_path):
    """torch may compute storage offsets from ``.storage_alignment``; a file with
    two alignments does not claim the format version that allows it."""
    from torch.utils.serialization import config

    mixed = {"small": torch.randn(10), "big": torch.randn(PACK // 4), "small2": torch.randn(3)}
    small = {f"s{i}": torch.randn(i + 1) for i in range(20)}
    for obj, versioned in ((mixed, False), (small, True)):
        p = tmp_path / "m.pt"
        ckptio.save(obj, p)
        names = zipfile.ZipFile(p).namelist()
        assert ("archive/.format_version" in names) == versioned
        old = config.load.calculate_storage_offsets
        config.load.calculate_storage_offsets = True
        try:
            same(obj, torch.load(p, mmap=True, weights_only=True))
            for k, t in torch.load(p, map_location="meta", weights_only=True).items():
                assert t.shape == obj[k].shape
        finally:
            config.load.calculate_storage_offsets = old
        assert {r.name: r.offset for r in ckptio.records(p)} == {
            n: o for n, o, _ in ckptio._native.map_archive(p)
        }


def test_a_flipped_bit_in_a_packed_record_is_caught_and_named(tmp_path):
    sd = {f"w{i}": torch.randn(1 + i % 50) for i in range(2000)}
    p = tmp_path / "flip.pt"
    ckptio.save(sd, p)
    recs = {r.name: r for r in ckptio.records(p)}
    victim = recs["archive/data/1234"]
    assert victim.offset % 4096 and victim.nbytes < PACK  # packed
    data = bytearray(p.read_bytes())
    data[victim.offset + victim.nbytes // 2] ^= 0x10
    p.write_bytes(bytes(data))
    rep = ckptio.verify(p)
    assert not rep.ok and [b.name for b in rep.bad] == ["archive/data/1234"], rep.summary()
    with pytest.raises(ckptio.FormatError, match="archive/data/1234"):
        ckptio.load(p, verify=True)


KILL_MANY = """
target = sys.argv[1]
ws = {f"w{i}": torch.full((1 + i % 300,), float(i)) for i in range(20000)}
ws["big"] = torch.arange(16 << 20, dtype=torch.float32)  # the write phase takes a while
print("ready", flush=True)
sys.stdin.readline()
gen = 0
while True:
    ckptio.save({"gen": torch.tensor(gen), **ws}, target)
    gen += 1
"""


@pytest.mark.slow
def test_sigkill_during_a_save_of_many_small_tensors_leaves_a_whole_file(tmp_path):
    target = tmp_path / "many.pt"
    ws = {f"w{i}": torch.full((1 + i % 300,), float(i)) for i in range(20000)}
    ws["big"] = torch.arange(16 << 20, dtype=torch.float32)
    t0 = time.perf_counter()
    ckptio.save({"gen": torch.tensor(-1), **ws}, target)
    save_s = max(time.perf_counter() - t0, 0.05)
    rng = random.Random(23)
    # A fraction of a save's time after "go"; None: once the child's temp file
    # is there (the write phase: 20,000 small tensors are pickled and laid
    # out before the temp file opens, so timed kills often land outside it).
    fractions = [0.1, None, 0.9, 1.3, None, 0.7]
    mid_save = 0
    with ready_children(KILL_MANY, len(fractions), target) as children:
        for child, frac in zip(children, fractions, strict=True):
            go(child)

            def writing(pid: int = child.pid) -> bool:
                return any(int(TEMP_RE.match(t)["pid"]) == pid for t in temps(tmp_path))

            if frac is None:
                deadline = time.monotonic() + 30
                while not writing() and time.monotonic() < deadline:
                    time.sleep(0.0005)
            else:
                time.sleep(save_s * frac * rng.uniform(0.8, 1.2))
            mid_save += writing()
            sigkill(child)
            before = sha256(target)
            got = ckptio.load(target, verify=True)  # whole: every CRC-32 matches
            assert int(got["gen"]) >= -1
            for k, w in ws.items():
                assert torch.equal(got[k], w), k
            assert sha256(target) == before
    assert mid_save >= 1, f"no kill landed while a temp file existed ({fractions})"
    ckptio.save({"gen": torch.tensor(99), **ws}, target)
    assert temps(tmp_path) == []


# --------------------------------------------------------------------------- the native reader


tensors = st.builds(
    lambda n, dt, view: (lambda t: t[1:] if view and t.numel() > 1 else t)(
        torch.arange(n, dtype=torch.float32).to(dt)
    ),
    st.integers(0, 40),
    st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.uint8, torch.bool]),
    st.booleans(),
)
leaves = st.one_of(
    tensors,
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.booleans(),
    st.none(),
)
values = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=5),
        st.dictionaries(st.text(max_size=5), kids, max_size=5),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), kids, max_size=5).map(collections.OrderedDict),
    ),
    max_leaves=30,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(obj=values)
def test_the_native_reader_returns_what_torch_load_returns(tmp_path, obj):
    p = tmp_path / "h.pt"
    torch.save(obj, p)
    want = torch.load(p, weights_only=True)
    got = ckptio.load(p)
    same(want, got)
    ckptio.save(obj, p)
    same(want, ckptio.load(p))
    same(want, torch.load(p, weights_only=True))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["posix", "cufile"])
def test_many_small_cuda_tensors_round_trip(tmp_path, backend):
    sd = {k: v.cuda() for k, v in mixed_state(20_000).items()}
    p = tmp_path / "gpu.pt"
    try:
        ckptio.save(sd, p, backend=backend)
    except (ckptio.BackendUnavailableError, ckptio.CuFileError) as e:
        pytest.skip(f"cuFile unavailable: {e}")
    same(sd, torch.load(p, weights_only=True))
    got = ckptio.load(p, map_location="cuda", backend=backend, verify=True)
    same(sd, got)
    assert ckptio.verify(p).ok


# --------------------------------------------------------------------------- safetensors


def test_many_small_tensors_through_safetensors_both_ways(tmp_path, monkeypatch):
    import ckptio.safetensors as cst
    import safetensors.torch as sft

    g = torch.Generator().manual_seed(3)
    sd = {f"m.{i}.w": torch.randn(1 + i % 70, generator=g) for i in range(20_000)}
    sd["half"] = torch.ones(3, dtype=torch.float16)
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    cst.save_file(sd, ours, {"k": "v"})
    sft.save_file(sd, theirs, {"k": "v"})
    # headers as safetensors and ckptio write them are read natively
    monkeypatch.setattr(st_format, "parse_header", lambda *a: pytest.fail("Python header reader"))
    for got in (sft.load_file(ours), cst.load_file(ours), cst.load_file(theirs)):
        assert got.keys() == sd.keys()
        for k, v in sd.items():
            assert torch.equal(got[k], v), k
    assert cst.metadata(theirs) == {"k": "v"}


header_values = st.recursive(
    st.one_of(st.integers(-3, 40), st.text(max_size=4), st.none(), st.booleans(), st.floats(0, 2)),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=3), kids)),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    entries=st.lists(
        st.tuples(
            st.text(max_size=6),
            st.sampled_from(["F32", "U8", "BF16", "F64", "F4", "X"]),
            st.lists(st.integers(0, 4), max_size=3),
            st.integers(-2, 3),
            st.dictionaries(
                st.sampled_from(["extra", "dtype", "shape"]), header_values, max_size=2
            ),
        ),
        max_size=6,
    ),
    meta=st.one_of(st.none(), st.dictionaries(st.text(max_size=4), header_values, max_size=3)),
    slack=st.integers(-2, 2),
    dup=st.booleans(),
)
def test_the_native_header_reader_agrees_with_the_python_one(entries, meta, slack, dup):
    """Where the native reader accepts a header, the Python validator returns the
    same entries and metadata; where Python refuses, the native reader refuses."""
    import json

    from ckptio import _native
    from ckptio import safetensors as cst

    parts, at = [], 0
    for name, dt, shape, skew, extra in entries:
        size = cst.DTYPES[dt].itemsize if dt in cst.DTYPES else 4
        n = size * (int(torch.tensor(shape).prod()) if shape else 1)
        info = {
            "dtype": dt,
            "shape": shape,
            "data_offsets": [at, at + n + (skew if skew < 0 else 0)],
        }
        info.update({k: v for k, v in extra.items()})
        parts.append((name, info))
        at += n + max(skew, 0)
    body = [f"{json.dumps(k)}:{json.dumps(v)}" for k, v in parts]
    if meta is not None:
        body.append(f'"__metadata__":{json.dumps(meta)}')
    if dup and parts:
        body.append(f"{json.dumps(parts[0][0])}:{json.dumps(parts[0][1])}")
    raw = ("{" + ",".join(body) + "}").encode()
    data_len = max(at + slack, 0)
    fast = _native.safetensors_header(raw, data_len, st_format._ITEMSIZES)
    try:
        want = st_format.parse_header(raw, data_len, "h")
    except ckptio.FormatError:
        assert fast is None
        return
    if fast is not None:
        pairs, rows = fast
        assert (None if pairs is None else dict(pairs)) == want[0]
        assert [(n, cst.DTYPES[d], tuple(s), b, e) for n, d, s, b, e in rows] == [
            tuple(e) for e in want[1]
        ]


# --------------------------------------------------------------------------- DCP


def dcp_round_trip(tmp_path: Any, device: str = "cpu") -> None:
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    g = torch.Generator().manual_seed(5)
    model = {f"m.{i}.w": torch.randn(1 + i % 40, generator=g).to(device) for i in range(5000)}
    model["big"] = torch.randn(PACK // 2, generator=g).to(device)
    sd = {"model": model, "step": 3}
    for wname, writer in (("ours", FileSystemWriter), ("torch", dcp.FileSystemWriter)):
        dcp.save(sd, storage_writer=writer(tmp_path / wname), no_dist=True)
    size = {w: sum(p.stat().st_size for p in (tmp_path / w).iterdir()) for w in ("ours", "torch")}
    assert size["ours"] <= 1.15 * size["torch"], size
    for wname, reader in (
        ("ours", FileSystemReader),
        ("ours", dcp.FileSystemReader),
        ("torch", FileSystemReader),
    ):
        out = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "step": 0}
        dcp.load(out, storage_reader=reader(tmp_path / wname), no_dist=True)
        for k, v in model.items():
            assert torch.equal(out["model"][k], v), (wname, reader, k)
        assert out["step"] == 3


def test_dcp_items_of_many_small_tensors_both_ways(tmp_path):
    dcp_round_trip(tmp_path)


@pytest.mark.gpu
def test_dcp_items_of_many_small_cuda_tensors(tmp_path):
    dcp_round_trip(tmp_path, "cuda")


# --------------------------------------------------------------------------- stagers


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("shared", [True, False])
def test_stager_packs_many_small_storages_into_slabs(shared):
    from ckptio.staging import DefaultStager, StagingOptions

    g = torch.Generator().manual_seed(9)
    model = {f"m.{i}.w": torch.randn(1 + i % 100, generator=g) for i in range(20_000)}
    model["big"] = torch.randn(1 << 19, generator=g)  # 2 MiB: a buffer of its own
    model["view"] = model["m.7.w"][2:]
    sd = {"model": model, "step": 4}
    fds = open_fds()
    with DefaultStager(StagingOptions(use_shared_memory=shared)) as st:
        for _ in range(2):  # the second staging reuses the first one's buffers
            staged = st.stage(sd).result()
            for k, v in model.items():
                assert torch.equal(staged["model"][k], v), k
            held = st.staged_bytes()
            assert held == sum(
                v.untyped_storage().nbytes() for k, v in model.items() if k != "view"
            )
            storages = {v.untyped_storage().data_ptr() for v in staged["model"].values()}
            assert len(storages) <= 3  # the slab(s) and the big buffer
            assert open_fds() - fds <= 4, "a descriptor per small storage"
        # the view stays a view of its base's staged copy
        assert staged["model"]["view"].data_ptr() == staged["model"]["m.7.w"].data_ptr() + 8
        # a storage that leaves the state dict frees its slot; the slab stays while others live
        del model["m.3.w"]
        staged = st.stage(sd).result()
        assert st.staged_bytes() == held - 4 * 4
        assert torch.equal(staged["model"]["m.5.w"], model["m.5.w"])
    del staged  # staged tensors keep their (shared) slab alive
    assert open_fds() <= fds + 1


def test_async_save_of_a_nested_dict_of_20k_small_tensors(tmp_path):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter
    from ckptio.staging import DefaultStager

    model = {f"m.{i}.w": torch.full((1 + i % 50,), float(i)) for i in range(20_000)}
    with DefaultStager() as stager:
        r = dcp.async_save(
            {"model": model},
            storage_writer=FileSystemWriter(tmp_path / "c"),
            async_stager=stager,
            no_dist=True,
        )
        r.staging_completion.result()
        r.upload_completion.result()
    out = {"model": {k: torch.zeros_like(v) for k, v in model.items()}}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "c"), no_dist=True)
    for k, v in model.items():
        assert torch.equal(out["model"][k], v), k
