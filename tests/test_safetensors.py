"""ckptio.safetensors: format compatibility with the safetensors package (both
directions), layout, chunked parallel I/O, bad input, sharded checkpoints."""

import json
import os
import re
import struct
from pathlib import Path

import ckptio
import ckptio.safetensors as cst
import pytest
import torch
from ckptio.io.units import parse_size
from ckptio.tools import bench

st = pytest.importorskip("safetensors.torch")
PeerError = pytest.importorskip("safetensors").SafetensorError

DTYPES = [d for d in cst.DTYPES.values()]


def rand(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        t = t[..., 0] & 1
        return t.bool().to(device)
    return t.view(dtype).reshape(shape).to(device)


def bits(t):
    """The bytes of a tensor (NaN-safe equality; a copy with the usual strides,
    which a byte view needs)."""
    flat = t.detach().cpu().reshape(-1)
    return flat.clone(memory_format=torch.contiguous_format).view(torch.uint8)


def assert_same(got, want):
    assert list(got) == list(want) or set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].shape == want[k].shape, k
        assert torch.equal(bits(got[k]), bits(want[k])), k


def sample(seed=0):
    sd = {
        f"t.{str(d).removeprefix('torch.')}": rand((7, 13), d, seed=seed + i)
        for i, d in enumerate(DTYPES)
    }
    sd["scalar"] = torch.tensor(3.25)
    sd["empty"] = torch.empty(0, 5, dtype=torch.bfloat16)
    sd["z"] = torch.zeros(0, dtype=torch.int64)
    sd["big"] = rand((1000, 777), torch.bfloat16, seed=seed + 99)
    return sd


def temps(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# --------------------------------------------------------------------------- compatibility


def test_roundtrip_every_dtype_both_directions(tmp_path):
    sd = sample()
    meta = {"format": "pt", "note": "ünïcode ✓"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    assert cst.save_file(sd, ours, metadata=meta) is None
    rep = ckptio.last_report()
    assert rep.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
    st.save_file(sd, theirs, metadata=meta)
    assert_same(cst.load_file(ours), sd)
    assert ckptio.last_report().storages == len(sd)
    assert_same(st.load_file(ours), sd)
    # safetensors.torch.load (bytes) lacks F8_E8M0 and F4 in its table.
    no_e8 = {k: v for k, v in sd.items() if k not in ("t.float8_e8m0fnu", "t.float4_e2m1fn_x2")}
    cst.save_file(no_e8, ours, metadata=meta)
    assert_same(st.load_file(ours), no_e8)
    with st.safe_open(str(ours), "pt") as f:
        assert f.metadata() == meta
    assert_same(cst.load_file(theirs), sd)
    # bytes API, both ways
    assert_same(st.load(cst.save(no_e8, meta)), no_e8)
    assert_same(cst.load(st.save(no_e8, meta)), no_e8)
    assert_same(cst.load(cst.save(sd)), sd)


def test_layout_matches_the_package_but_for_padding(tmp_path):
    sd = sample(1)
    sd.pop("t.float8_e8m0fnu")
    ours, theirs = tmp_path / "o.safetensors", tmp_path / "t.safetensors"
    cst.save_file(sd, ours, {"a": "b"})
    st.save_file(sd, theirs, {"a": "b"})
    a, b = ours.read_bytes(), theirs.read_bytes()
    na, nb = struct.unpack("<Q", a[:8])[0], struct.unpack("<Q", b[:8])[0]
    assert (8 + na) % 4096 == 0 and a[8 + na - 1 : 8 + na] == b" "
    ha, hb = json.loads(a[8 : 8 + na]), json.loads(b[8 : 8 + nb])
    assert ha == hb
    # same tensor order in the header and the data section, same bytes
    assert list(ha) == list(json.loads(b[8 : 8 + nb], object_pairs_hook=lambda p: dict(p)))
    assert a[8 + na :] == b[8 + nb :]
    # bytes in memory keep safetensors' own 8-byte alignment: the very same bytes
    assert cst.save(sd, {"a": "b"}) == st.save(sd, {"a": "b"}) == b


def test_contiguous_tensors_with_any_stride_on_a_size_1_dimension(tmp_path):
    """Contiguous, though a dimension of size 1 has a stride other than 1 (a
    byte view refuses those strides): saved as safetensors saves them."""
    cases = {
        "row": torch.randn(3, 4, generator=torch.Generator().manual_seed(0))[0:1, 0],
        "step": torch.arange(4.0)[::2][:1],
        "ones": torch.arange(21.0).reshape(7, 3).as_strided((1, 1), (7, 3), 4),
        "bf16": torch.arange(6.0).bfloat16()[::3][1:2],
        "bool": torch.tensor([True, False, True])[::2][1:],
    }
    for name, t in cases.items():
        assert t.is_contiguous() and t.stride()[-1] != 1, name
        assert cst.save({name: t}) == st.save({name: t}), name
        cst.save_file({name: t}, tmp_path / "x.safetensors")
        assert_same(st.load_file(tmp_path / "x.safetensors"), {name: t})
    assert cst.save(cases) == st.save(cases)


def test_load_returns_own_storages_in_file_order(tmp_path):
    sd = {"b": torch.randn(300_000), "a": torch.arange(400_000), "c": torch.randn(3)}
    p = tmp_path / "x.safetensors"
    cst.save_file(sd, p)
    out = cst.load_file(p)
    assert list(out) == list(st.load_file(p))
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptrs) == len(out)
    st.save_file(out, tmp_path / "again.safetensors")  # not "shared" for the package
    for t in out.values():
        t.add_(1)  # writable


@pytest.mark.parametrize("direct", ["on", "off"])
def test_tensors_spanning_many_chunks(tmp_path, direct):
    if direct == "on" and not ckptio.info(tmp_path)["folder"]["o_direct"]:
        pytest.skip("no O_DIRECT here")
    # odd sizes: offsets off the 4 KiB grid, several 64 KiB chunks per tensor
    sd = {
        f"w{i}": rand((n,), torch.float16, seed=i)
        for i, n in enumerate([1, 70_001, 333_333, 5, 1_048_583])
    }
    sd["i64"] = rand((100_003,), torch.int64, seed=7)
    p = tmp_path / "c.safetensors"
    kw = dict(threads=3, chunk_size=64 << 10, direct=direct)
    assert cst.save_file(sd, p, **kw) is None
    rep = ckptio.last_report()
    assert rep.threads == 3 and rep.direct == (direct == "on")
    assert_same(st.load_file(p), sd)
    # safetensors' own load left the file in the page cache, which is read from
    # memory; dropped, it is read as asked.
    bench.drop_cache(str(p))
    assert_same(cst.load_file(p, **kw), sd)
    rep = ckptio.last_report()
    assert rep.device_path is None and rep.direct == (direct == "on") and rep.read_path == "disk"
    assert rep.backend == "auto"
    assert_same(st.load_file(p), sd)
    assert_same(cst.load_file(p, **kw), sd)
    assert ckptio.last_report().read_path == "memory"


def test_empty_dict_and_only_empty_tensors(tmp_path):
    for sd in ({}, {"e": torch.empty(0)}):
        p = tmp_path / "e.safetensors"
        cst.save_file(sd, p)
        assert p.stat().st_size == 4096
        assert_same(st.load_file(p), sd)
        assert_same(cst.load_file(p), sd)


def test_views_of_one_storage_that_do_not_overlap_are_fine(tmp_path):
    base = torch.arange(100, dtype=torch.float32)
    sd = {"lo": base[:50], "hi": base[50:]}
    p = tmp_path / "v.safetensors"
    cst.save_file(sd, p)
    assert_same(cst.load_file(p), sd)


def test_load_to_another_device_goes_through_host(tmp_path):
    sd = {"a": torch.randn(5)}
    p = tmp_path / "m.safetensors"
    cst.save_file(sd, p)
    out = cst.load_file(p, device="meta")
    assert out["a"].device.type == "meta" and out["a"].shape == (5,)


# --------------------------------------------------------------------------- refused on save


@pytest.mark.parametrize(
    "tensors, exc, match",
    [
        ([torch.zeros(1)], ValueError, "dict"),
        ({"a": 1}, ValueError, "`a`"),
        ({1: torch.zeros(1)}, TypeError, "str"),
        ({"a": torch.zeros(4, 4).t()}, ValueError, "non contiguous tensor: `a`"),
        ({"a": torch.zeros(4)[::2]}, ValueError, "non contiguous"),
        ({"a": torch.zeros(3, dtype=torch.complex128)}, ValueError, "complex128"),
        ({"a": torch.zeros(3).to_sparse()}, ValueError, "sparse"),
        ({"__metadata__": torch.zeros(1)}, ValueError, "reserved"),
    ],
)
def test_refused_tensors(tmp_path, tensors, exc, match):
    p = tmp_path / "x.safetensors"
    cst.save_file({"old": torch.ones(2)}, p)
    before = p.read_bytes()
    with pytest.raises(exc, match=match):
        cst.save_file(tensors, p)
    with pytest.raises(exc):
        cst.save(tensors)
    assert p.read_bytes() == before and temps(tmp_path) == []


def test_fake_tensors_are_refused_naming_the_key(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake, empty = torch.zeros(4), torch.zeros(0)
    p = tmp_path / "x.safetensors"
    with pytest.raises(PeerError):  # the package refuses it too
        st.save_file({"w": fake}, tmp_path / "ref.safetensors")
    for save in (lambda sd: cst.save_file(sd, p), cst.save):
        with pytest.raises(cst.SafetensorError, match="tensor 'w' is a FakeTensor"):
            save({"ok": torch.ones(1), "w": fake})
    assert not p.exists() and temps(tmp_path) == []
    # Nothing to read in an empty one: saved, as the package saves it.
    cst.save_file({"w": empty}, p)
    assert cst.load_file(p)["w"].shape == (0,)


def test_shared_tensors_are_refused_like_the_package(tmp_path):
    w = torch.randn(4, 4)
    sd = {"a": w, "b": w, "c": w[1], "d": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="share memory") as e:
        cst.save_file(sd, tmp_path / "s.safetensors")
    assert "'a', 'b', 'c'" in str(e.value)
    with pytest.raises(RuntimeError):
        st.save_file(sd, tmp_path / "s2.safetensors")
    assert cst.find_shared(sd) == [["a", "b", "c"]]
    assert not (tmp_path / "s.safetensors").exists() and temps(tmp_path) == []


@pytest.mark.parametrize("meta", [{"a": 1}, {1: "a"}, ["a"]])
def test_bad_metadata_is_typeerror(tmp_path, meta):
    with pytest.raises(TypeError, match="metadata"):
        cst.save_file({"a": torch.zeros(1)}, tmp_path / "m.safetensors", metadata=meta)


# --------------------------------------------------------------------------- bad files


def _file(header, data=b"", n=None, pad=True):
    js = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js) if n is None else n) + js + data


GOOD = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
BAD = {
    "empty file": (b"", "shorter than the 8-byte"),
    "7 bytes": (b"\x01" * 7, "shorter than the 8-byte"),
    "header length past the file": (_file(GOOD, bytes(8), n=10_000), "runs past the end"),
    "header length over the limit": (_file(GOOD, bytes(8), n=1 << 40), "limit"),
    "invalid JSON": (_file(b'{"x": {', bytes(8)), "not valid JSON"),
    "not UTF-8": (_file(b'{"\xff": 1}', bytes(8)), "UTF-8"),
    "JSON list": (_file([1, 2]), "list, not an object"),
    "duplicate key": (
        _file(b'{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"x":{}}'),
        "duplicate",
    ),
    "unknown dtype": (
        _file({"x": {"dtype": "F7", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)),
        "'x': dtype 'F7' is unknown",
    ),
    "F6 not readable": (
        _file({"x": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, bytes(3)),
        "'x': dtype 'F6_E2M3' is known to safetensors but not readable here",
    ),
    "F4 half a byte": (
        _file({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)),
        "'x': shape [3] of F4 does not fill whole bytes",
    ),
    "F4 odd last dimension": (
        _file({"x": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, bytes(3)),
        "'x': the last dimension of shape [2, 3] of F4 is not a multiple of 2",
    ),
    "entry not an object": (_file({"x": 3}), "'x'"),
    "negative shape": (
        _file({"x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
        "'x': shape",
    ),
    "offsets not a pair": (
        _file({"x": {"dtype": "U8", "shape": [1], "data_offsets": [1]}}, bytes(1)),
        "'x': data_offsets",
    ),
    "offsets reversed": (
        _file({"x": {"dtype": "U8", "shape": [1], "data_offsets": [2, 1]}}, bytes(2)),
        "'x': data_offsets",
    ),
    "size mismatch": (
        _file({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)),
        "'x': data_offsets [0, 8] hold 8 bytes but shape [3] of F32 needs 12",
    ),
    "offsets out of range": (
        _file({"x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(8)),
        "'x': data_offsets [4, 12] run past the end",
    ),
    "data truncated": (_file(GOOD, bytes(4)), "'x': data_offsets [0, 8] run past the end"),
    "overlap": (
        _file(
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            bytes(8),
        ),
        "tensor 'b' (bytes 4..8) overlaps tensor 'a'",
    ),
    "gap": (
        _file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)),
        "bytes 0..4 of the data section belong to no tensor",
    ),
    "trailing bytes": (_file(GOOD, bytes(12)), "end at byte 8 of the data section, the file at 12"),
    "metadata not strings": (_file({"__metadata__": {"a": 1}, **GOOD}, bytes(8)), "__metadata__"),
}


def _refused(tmp_path, data: bytes, cls: type[Exception], match: str):
    """``data`` refused by load_file (as a file, named in the error) and load
    (as bytes), as ``cls`` saying ``match``; the file's path."""
    p = tmp_path / "bad.safetensors"
    p.write_bytes(data)
    with pytest.raises(cls, match=re.escape(match)) as e:
        cst.load_file(p)
    assert str(p) in str(e.value)
    with pytest.raises(cls, match=re.escape(match)):
        cst.load(data)
    return p


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_is_formaterror_naming_file_and_tensor(tmp_path, case):
    data, match = BAD[case]
    p = _refused(tmp_path, data, ckptio.FormatError, match)
    # the package takes the last duplicate, knows F6, and reads an odd F4 row its own way
    if case not in ("duplicate key", "F6 not readable", "F4 odd last dimension"):
        with pytest.raises(Exception):  # noqa: B017 - the package refuses it too (its own type)
            st.load_file(p)


def _with_field(value: bytes, key: bytes = b'"x"') -> bytes:
    """A good file whose tensor has an unknown field ``"y": value`` (both
    readers skip such fields, after reading them as JSON)."""
    head = b"{" + key + b':{"dtype":"F32","shape":[2],"data_offsets":[0,8],"y":' + value + b"}}"
    return _file(head, bytes(8))


#: JSON that serde_json (safetensors' reader) refuses, and Python's json or a
#: loose reader would take: (file, what the error says).
NOT_JSON = {
    "escape with a sign": (_with_field(b"0", b'"\\u+041"'), "not valid JSON"),
    "escape with a space": (_with_field(b"0", b'"\\u 041"'), "not valid JSON"),
    "lone high surrogate": (_with_field(b'"\\ud800"'), "lone surrogate"),
    "lone low surrogate": (_with_field(b'"\\udc00"'), "lone surrogate"),
    "high surrogate then no low": (_with_field(b'"\\ud800\\u0041"'), "lone surrogate"),
    "lone surrogate in a key": (_with_field(b"0", b'"\\ud800"'), "lone surrogate"),
    "lone surrogate in metadata": (
        _file(
            b'{"__metadata__":{"k":"\\ud800"},"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
        ),
        "lone surrogate",
    ),
    **{
        f"number {v}": (_with_field(v.encode()), "not valid JSON")
        for v in ["+1", ".5", "1.", "+.5e-3", "01", "-", "1e", "1e+", "0x1", "NaN", "Infinity"]
        + ["-Infinity", "1E400", "-1e400"]
    },
    "integer past f64": (_with_field(b"1" + b"0" * 400), "out of range"),
    # 128 levels, with the file's object and the tensor's (serde_json's limit).
    "nested 128 deep": (_with_field(b"[" * 126 + b"]" * 126), "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(NOT_JSON))
def test_header_json_is_read_as_safetensors_reads_it(tmp_path, case):
    # Both readers (the native one of load_file, the Python one it falls back
    # to and load uses) refuse what safetensors refuses, as a malformed header.
    data, match = NOT_JSON[case]
    p = _refused(tmp_path, data, cst.SafetensorError, match)
    with pytest.raises(Exception):  # noqa: B017 - the package refuses it (its own type)
        st.load_file(p)


@pytest.mark.parametrize(
    "value",
    [b"-1.5e3", b"1E+5", b"-0", b"0.0", b"1e-400", b"18446744073709551616", b"[]", b"null"]
    + [b'"\\ud83d\\ude00"', b'"\\u00e9"', b"[" * 125 + b"]" * 125],  # 127 levels in all
)
def test_header_json_that_safetensors_reads_is_read(tmp_path, value):
    p = tmp_path / "ok.safetensors"
    p.write_bytes(_with_field(value))
    assert list(st.load_file(p)) == ["x"]
    assert list(cst.load_file(p)) == ["x"] and list(cst.load(p.read_bytes())) == ["x"]


def _tensor(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    "entry, data",
    [
        (_tensor("F6_E2M3", [4], 0, 3), b"\0" * 3),  # no torch dtype
        (_tensor("U8", [0, 2**64 - 1], 0, 0), b""),  # past int64, not past u64
        (_tensor("I64", [2**62, 2, 0], 0, 0), b""),
        (_tensor("F4", [2, 1], 0, 1), b"\0"),  # not torch's pairs
    ],
)
def test_metadata_reads_every_header_that_safetensors_reads(tmp_path, entry, data):
    """metadata() checks what reading the header needs (safetensors' checks),
    not whether torch can hold the tensors, which only a load needs."""
    p = tmp_path / "h.safetensors"
    p.write_bytes(_file({"__metadata__": {"k": "v"}, "a": entry}, data))
    with st.safe_open(str(p), "pt") as f:
        assert f.metadata() == {"k": "v"}
    assert cst.metadata(p) == {"k": "v"}
    with pytest.raises(cst.SafetensorError, match="tensor 'a'"):
        cst.load_file(p)


@pytest.mark.parametrize(
    "entry, data, match",
    [
        (_tensor("U8", [2**32, 2**32, 0], 0, 0), b"", "overflows"),
        (_tensor("U8", [0, 2**64], 0, 0), b"", "overflows"),
        (_tensor("C128", [1], 0, 16), b"\0" * 16, "unknown"),
        (_tensor("F4", [1], 0, 1), b"\0", "whole bytes"),
        (_tensor("F6_E3M2", [4], 0, 4), b"\0" * 4, "needs 3"),
        (_tensor("F6_E3M2", [4], 0, 3), b"\0" * 4, "the file at 4"),
    ],
)
def test_metadata_refuses_headers_that_safetensors_refuses(tmp_path, entry, data, match):
    p = tmp_path / "h.safetensors"
    p.write_bytes(_file({"__metadata__": {"k": "v"}, "a": entry}, data))
    with pytest.raises(PeerError), st.safe_open(str(p), "pt"):
        pass
    with pytest.raises(cst.SafetensorError, match=match):
        cst.metadata(p)


def test_good_hand_made_file_loads(tmp_path):
    p = tmp_path / "good.safetensors"
    p.write_bytes(_file(GOOD, struct.pack("<2f", 1.5, -2.0)))
    assert cst.load_file(p)["x"].tolist() == [1.5, -2.0]
    assert st.load_file(p)["x"].tolist() == [1.5, -2.0]


def test_missing_file_and_bad_device(tmp_path):
    with pytest.raises(FileNotFoundError):
        cst.load_file(tmp_path / "nope.safetensors")
    p = tmp_path / "x.safetensors"
    cst.save_file({"a": torch.zeros(1)}, p)
    with pytest.raises(TypeError, match="device"):
        cst.load_file(p, device=1.5)


def test_device_none_and_invalid_devices_as_the_package(tmp_path):
    p = tmp_path / "x.safetensors"
    cst.save_file({"a": torch.ones(2)}, p)
    # None: the host, as safetensors loads it.
    assert st.load_file(p, device=None)["a"].device.type == "cpu"
    got = cst.load_file(p, device=None)
    assert got["a"].device.type == "cpu" and torch.equal(got["a"], torch.ones(2))
    out = {"a": torch.zeros(2)}
    assert cst.load_file(p, None, out=out)["a"] is out["a"] and torch.equal(out["a"], torch.ones(2))
    cst.save_sharded({"a": torch.ones(2)}, tmp_path / "s")
    assert cst.load_sharded(tmp_path / "s", device=None)["a"].device.type == "cpu"
    # A device safetensors does not know: its SafetensorError, worded as it words it.
    for bad in ["CPU", "bogus", -1]:
        with pytest.raises(PeerError, match=f"device {bad} is invalid"):
            st.load_file(p, device=bad)
        with pytest.raises(cst.SafetensorError, match=f"^device {bad} is invalid$"):
            cst.load_file(p, device=bad)
        with pytest.raises(PeerError, match=f"device {bad} is invalid"):
            cst.load_sharded(tmp_path / "s", device=bad)
    with pytest.raises(TypeError, match="file path"):
        cst.save_file({}, open(p, "rb"))  # noqa: SIM115


def test_out_takes_any_spelling_of_the_host_as_device(tmp_path):
    """out= with a device: the destinations decide, so only the host is taken,
    however it is spelled; any other device is still refused."""
    p = tmp_path / "x.safetensors"
    cst.save_file({"a": torch.ones(2)}, p)
    cst.save_sharded({"a": torch.ones(2)}, tmp_path / "s")
    for dev in ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0), None]:
        for load, src in [(cst.load_file, p), (cst.load_sharded, tmp_path / "s")]:
            out = {"a": torch.zeros(2)}
            assert load(src, dev, out=out)["a"] is out["a"], (load, dev)
            assert torch.equal(out["a"], torch.ones(2))
    for dev in ["cuda", 0, "meta", torch.device("meta")]:
        with pytest.raises(TypeError, match="out= and device= cannot be combined"):
            cst.load_file(p, dev, out={"a": torch.zeros(2)})


# --------------------------------------------------------------------------- sharded


def test_sharded_roundtrip_names_and_index(tmp_path):
    sd = {f"layer.{i}.w": rand((100, 10), torch.float32, seed=i) for i in range(7)}  # 4000 B each
    sd["huge"] = rand((3000,), torch.float32, seed=9)  # 12000 B: a shard of its own
    sd["tail"] = torch.arange(10)
    assert cst.save_sharded(sd, tmp_path / "ck", max_shard_size="10KB", metadata={"m": "1"}) is None
    rep = ckptio.last_report()
    assert rep.storages == len(sd) and rep.nbytes == sum(t.nbytes for t in sd.values())
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == [
        "model-00001-of-00005.safetensors",
        "model-00002-of-00005.safetensors",
        "model-00003-of-00005.safetensors",
        "model-00004-of-00005.safetensors",
        "model-00005-of-00005.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "ck" / cst.INDEX_NAME).read_text())
    assert index["metadata"] == {"total_size": rep.nbytes, "m": "1"}
    wm = index["weight_map"]
    assert wm["layer.0.w"] == wm["layer.1.w"] == "model-00001-of-00005.safetensors"
    assert wm["huge"] == "model-00004-of-00005.safetensors"
    assert wm["tail"] == "model-00005-of-00005.safetensors"
    for f in set(wm.values()):
        with st.safe_open(str(tmp_path / "ck" / f), "pt") as h:
            assert h.metadata() == {"format": "pt", "m": "1"}
            assert set(h.keys()) == {k for k, v in wm.items() if v == f}
    for src in (tmp_path / "ck", tmp_path / "ck" / cst.INDEX_NAME):
        out = cst.load_sharded(src, threads=4, chunk_size=4096)
        assert_same(out, sd)
    rep = ckptio.last_report()
    assert rep.storages == len(sd) and rep.nbytes == sum(t.nbytes for t in sd.values())
    # A later save with one shard: model.safetensors, stale shards and index gone.
    cst.save_sharded({"only": torch.ones(3)}, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path / "ck")) == ["model.safetensors"]
    assert_same(cst.load_sharded(tmp_path / "ck"), {"only": torch.ones(3)})


def test_sharded_load_reads_the_shards_one_by_one_with_the_whole_engine(tmp_path, monkeypatch):
    # Side by side, the threads of a shard read first idle while the others are
    # read (1.30x as long from /dev/shm on an H100, probes/probe_sharded_workers.py).
    from ckptio.io import transfer

    reads, active = [], []
    real = transfer.read_after

    def read_after(source, engine, *a):
        active.append(source)
        assert len(active) == 1, "two shards read at once"
        reads.append((os.readlink(f"/proc/self/fd/{source.fileno()}"), engine.threads))
        try:
            return real(source, engine, *a)
        finally:
            active.remove(source)

    monkeypatch.setattr(transfer, "read_after", read_after)
    sd = {f"w{i}": rand((1000,), torch.float32, seed=i) for i in range(4)}
    cst.save_sharded(sd, tmp_path / "ck", max_shard_size="4KB")
    assert_same(cst.load_sharded(tmp_path / "ck", threads=8), sd)
    shards = sorted(str(p) for p in (tmp_path / "ck").glob("*.safetensors"))
    assert [r[0] for r in reads] == shards and {r[1] for r in reads} == {8}


def test_sharded_index_inconsistent_with_shards_is_formaterror(tmp_path):
    d = tmp_path / "ck"
    cst.save_sharded({"a": torch.zeros(100), "b": torch.ones(100)}, d, max_shard_size=400)
    ip = d / cst.INDEX_NAME
    index = json.loads(ip.read_text())
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    ip.write_text(json.dumps(index))
    with pytest.raises(ckptio.FormatError, match="'c'.*no shard holds it"):
        cst.load_sharded(d)
    del index["weight_map"]["c"]
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    ip.write_text(json.dumps(index))
    with pytest.raises(ckptio.FormatError, match="'b'"):
        cst.load_sharded(d)
    ip.write_text("{")
    with pytest.raises(ckptio.FormatError, match="invalid JSON"):
        cst.load_sharded(d)
    ip.write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
    with pytest.raises(ckptio.FormatError, match="weight_map"):
        cst.load_sharded(ip)
    with pytest.raises(FileNotFoundError):
        cst.load_sharded(tmp_path)


@pytest.mark.parametrize("shard", ["", ".", "..", "sub/x.safetensors", "/abs.safetensors"])
def test_a_shard_name_that_is_no_file_of_the_folder_names_index_and_tensor(tmp_path, shard):
    d = tmp_path / "ck"
    cst.save_sharded({"a": torch.zeros(4), "b": torch.ones(4)}, d, max_shard_size=16)
    ip = d / cst.INDEX_NAME
    index = json.loads(ip.read_text())
    index["weight_map"]["b"] = shard
    ip.write_text(json.dumps(index))
    for src in (d, ip):
        with pytest.raises(cst.SafetensorError, match=f"{re.escape(str(ip))}: .*tensor 'b'"):
            cst.load_sharded(src)


def _foreign(folder: Path, index: str, shards: dict[str, dict[str, torch.Tensor]]) -> dict:
    """A checkpoint another writer left in ``folder`` under ``index``: the
    shards (written by safetensors) and the bytes of each, to check they stay."""
    folder.mkdir(exist_ok=True)
    wm = {}
    for name, tensors in shards.items():
        st.save_file(tensors, folder / name)
        wm.update({k: name for k in tensors})
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return {n: (folder / n).read_bytes() for n in [*shards, index]}


def test_a_folder_is_read_through_its_own_checkpoint_before_another_index(tmp_path):
    """The folder lookup and save_sharded agree: model.safetensors.index.json,
    then model.safetensors; another index only where neither is there."""
    d = tmp_path / "ck"
    old = {"w": torch.zeros(2)}
    index = "consolidated.safetensors.index.json"
    _foreign(d, index, {"consolidated-00001-of-00001.safetensors": old})
    assert_same(cst.load_sharded(d), old)  # the lone other index
    new = {"w": torch.ones(2)}
    cst.save_sharded(new, d)  # one shard: model.safetensors
    assert_same(cst.load_sharded(d), new)
    cst.save_sharded({"w": torch.ones(2), "v": torch.ones(2)}, d, max_shard_size=8)
    assert_same(cst.load_sharded(d), {"w": torch.ones(2), "v": torch.ones(2)})
    assert_same(cst.load_sharded(d / index), old)


def test_a_save_neither_removes_nor_overwrites_shards_another_index_names(tmp_path):
    """Shards of the hub's names that another index of the folder names are
    that checkpoint's: no save (nor its sweep, nor ckptio clean) writes over
    them or removes them; only the save's own previous generation goes."""
    d = tmp_path / "ck"
    theirs = {
        "model-00001-of-00002.safetensors": {"a": torch.full((4,), 7.0)},
        "model-00002-of-00002.safetensors": {"b": torch.full((4,), 8.0)},
    }
    kept = _foreign(d, "other.safetensors.index.json", theirs)
    other = d / "other.safetensors.index.json"
    want = {"a": torch.full((4,), 7.0), "b": torch.full((4,), 8.0)}
    mine = [
        {"a": torch.ones(4)},  # model.safetensors
        {"a": torch.ones(4), "b": torch.ones(4)},  # two shards: the hub's names are taken
        {"a": torch.ones(4) * 2, "b": torch.ones(4) * 2},
        {"a": torch.ones(4) * 3},
    ]
    for sd in mine:
        cst.save_sharded(sd, d, max_shard_size=16)
        assert_same(cst.load_sharded(d), sd)
        assert {n: (d / n).read_bytes() for n in kept} == kept
        assert_same(cst.load_sharded(other), want)
        ckptio.clean(d, unreferenced=True)
        assert {n: (d / n).read_bytes() for n in kept} == kept
    # The last save's previous generation (two shards and their index) went.
    assert sorted(os.listdir(d)) == sorted([*kept, "model.safetensors"])


@pytest.mark.parametrize(
    "size, n",
    [(5, 5), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("4GiB", 4 << 30), ("1.5KB", 1500)]
    + [("1.5G", 3 << 29), ("1.1G", 1181116006), ("7", 7), ("7.0", 7), ("7B", 7), ("0.5K", 512)],
)
def test_shard_size_parsing(size, n):
    assert parse_size(size, "max_shard_size") == n


@pytest.mark.parametrize("size", ["", "GB", "5XB", 0, -1, "5iB", "0.5", "1.5", "1.5B", "0.9b"])
def test_bad_shard_size(size):
    with pytest.raises(ValueError):
        parse_size(size, "max_shard_size")


def test_a_fractional_number_of_bytes_is_refused(tmp_path):
    for size in ("1.5", "0.5", "2.5B"):
        with pytest.raises(ValueError, match=f"max_shard_size '{size}' is a fractional number"):
            cst.save_sharded({"a": torch.ones(2)}, tmp_path / "s", max_shard_size=size)
    assert not (tmp_path / "s").exists() or not os.listdir(tmp_path / "s")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "bounce"])
def test_gpu_save_and_load_to_cuda_and_cross_read(tmp_path, backend):
    sd = {k: v.cuda() for k, v in sample(3).items()}
    sd["big"] = rand((5_000_001,), torch.bfloat16, "cuda", seed=5)  # several chunks, odd offset
    ours = tmp_path / "g.safetensors"
    assert cst.save_file(sd, ours, device_backend=backend) is None
    rep = ckptio.last_report()
    assert rep.device_path in ("bounce", "cufile")
    assert backend is None or rep.device_path == backend
    out = cst.load_file(ours, device="cuda", device_backend=backend, chunk_size=1 << 20)
    assert ckptio.last_report().device_path in ("bounce", "cufile")
    assert all(v.device.type == "cuda" for v in out.values())
    assert_same(out, sd)
    assert_same(cst.load_file(ours, device=0), sd)
    no_e8 = {k: v for k, v in sd.items() if k != "t.float8_e8m0fnu"}
    cst.save_file(no_e8, ours)
    assert_same(st.load_file(ours, device="cuda"), no_e8)
    theirs = tmp_path / "t.safetensors"
    st.save_file(no_e8, theirs)
    assert_same(cst.load_file(theirs, device="cuda:0"), no_e8)
    d = tmp_path / "sh"
    cst.save_sharded(sd, d, max_shard_size="4MB")
    assert_same(cst.load_sharded(d, device="cuda"), sd)


def test_load_sharded_reads_each_file_while_the_next_is_made(tmp_path, monkeypatch):
    """load_sharded reads each file on a kept thread while the next file's
    tensors are made: every byte once, empty tensors included."""
    from ckptio.io import transfer

    sd = {f"t{i:02d}": torch.randn(i + 50 * (i % 4)) for i in range(60)}
    sd["t03"] = torch.zeros(0, 2)
    calls: list[int] = []
    real = transfer.read_after
    monkeypatch.setattr(
        transfer, "read_after", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k)
    )
    cst.save_sharded(sd, tmp_path / "sharded", max_shard_size="2KB")
    got = cst.load_sharded(tmp_path / "sharded")
    assert len(calls) > 2 and sum(calls) == 58, calls  # t00 and t03 hold no bytes
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)


def test_conjugate_and_negative_views_are_saved_with_their_values(tmp_path):
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    n = torch._neg_view(torch.tensor([1.0, 2.0]))
    ckptio.safetensors.save_file({"c": c, "n": n}, tmp_path / "v.safetensors")
    got = ckptio.safetensors.load_file(tmp_path / "v.safetensors")
    assert torch.equal(got["c"], c.resolve_conj()) and torch.equal(got["n"], n.resolve_neg())
    mem = ckptio.safetensors.load(ckptio.safetensors.save({"c": c, "n": n}))
    assert torch.equal(mem["c"], c.resolve_conj()) and torch.equal(mem["n"], n.resolve_neg())


def test_sharded_index_total_size_is_the_bytes_not_the_callers(tmp_path):
    sd = {f"t{i}": torch.ones(256) for i in range(4)}
    ckptio.safetensors.save_sharded(sd, tmp_path, 2048, metadata={"total_size": "oops", "k": "v"})
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 4 * 1024 and idx["metadata"]["k"] == "v"
