"""Hypothesis on ckptio.load of mutated checkpoints (tests/fixtures/corpus): never a crash,
never a hang, never wrong data without an error when verify=True.

Mutations anywhere in the file (data included): bit flips, byte sets, truncation, splices
from the same or another corpus file. With verify=True ckptio.load returns the original
tensors exactly or raises a typed error (a flipped data bit is caught by its CRC-32).
Without verify it returns what torch.load reads from the same bytes, or raises.
"""

from __future__ import annotations

import collections
import datetime
import faulthandler
import pickle
from pathlib import Path

import ckptio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_faults import assert_same, tensor_bytes

CORPUS = sorted((Path(__file__).parent / "fixtures" / "corpus").glob("*.pt"))
ORIGINAL = {p.name: p.read_bytes() for p in CORPUS}
EXPECTED = {p.name: torch.load(p, weights_only=True) for p in CORPUS}
# What a refusal may be: ckptio's typed errors (FormatError naming the file and record,
# LocationError, InPlaceLoadError), torch's refusal of a pickle (UnpicklingError, its
# message kept), the system's (OSError). Never another type (KeyError, TypeError,
# torch's RuntimeError...), never SystemError, MemoryError, RecursionError.
TYPED = (ckptio.CkptioError, pickle.UnpicklingError, OSError)
OUTCOMES: collections.Counter[str] = collections.Counter()
SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("CKPTIO_FUZZ_EXAMPLES", "500")),
    # A hang fails the example; a loaded 2-core CI machine took 7 s for one that takes ms.
    deadline=datetime.timedelta(seconds=60),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(ORIGINAL)))
    b = bytearray(ORIGINAL[name])
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "splice", "splice_other"]))
        if not b:
            break
        at = draw(st.integers(0, len(b) - 1))
        if kind == "flip":
            b[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            b[at] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del b[at:]
        else:
            other = ORIGINAL[draw(st.sampled_from(sorted(ORIGINAL)))]
            src = bytes(b) if kind == "splice" else other
            start = draw(st.integers(0, len(src) - 1))
            n = draw(st.integers(1, 64))
            piece = src[start : start + n]
            b[at : at + len(piece)] = piece
    return name, bytes(b)


@pytest.fixture(autouse=True)
def watchdog():
    """A real hang (no Python frame to interrupt) aborts the run with a traceback."""
    faulthandler.dump_traceback_later(600, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_corpus_loads_and_verifies():
    for p in CORPUS:
        assert_same(ckptio.load(p, verify=True), EXPECTED[p.name])
        assert ckptio.verify(p).ok


@SETTINGS
@given(case=mutated())
def test_mutated_with_verify_is_exact_or_an_error(tmp_path, case):
    name, data = case
    p = tmp_path / name  # torch takes the archive prefix from the file name
    p.write_bytes(data)
    try:
        got = ckptio.load(p, verify=True)
    except TYPED as e:
        OUTCOMES[f"verify: {type(e).__name__}"] += 1
        return
    try:
        assert_same(got, EXPECTED[name])
        OUTCOMES["verify: exact data"] += 1
    except AssertionError:
        OUTCOMES["verify: changed, file has no CRC-32s"] += 1
        # Only a file without CRC-32s (torch.save with compute_crc32 off) can change unseen,
        # and load says so.
        assert ckptio.last_report().unchecked, "changed data passed verification"
        assert name == "torch_nocrc.pt"


@SETTINGS
@given(case=mutated())
def test_mutated_without_verify_is_what_torch_reads_or_an_error(tmp_path, case):
    name, data = case
    p = tmp_path / name
    p.write_bytes(data)
    try:
        got = ckptio.load(p)
    except TYPED as e:
        OUTCOMES[f"plain: {type(e).__name__}"] += 1
        return
    # ckptio returned data: torch reads the very same from these bytes.
    assert_same(got, torch.load(p, weights_only=True))
    OUTCOMES["plain: same data as torch.load"] += 1


@SETTINGS
@given(case=mutated())
def test_mutated_in_place_is_what_torch_reads_or_an_error(tmp_path, case):
    """ckptio.load(out=) of a mutated file (its tensors decoded as placeholders, read
    straight into the destinations): a typed error, or every destination it filled holds
    what torch.load reads from the same bytes at that key."""
    from ckptio.loading import inplace

    name, data = case
    p = tmp_path / name
    p.write_bytes(data)
    dests = inplace._index(EXPECTED[name])
    out = inplace.replace_tensors(
        __import__("copy").copy(EXPECTED[name]), lambda k, t: torch.zeros_like(dests[k])
    )
    try:
        ckptio.load(p, out=out, strict=False)
    except TYPED as e:
        OUTCOMES[f"in place: {type(e).__name__}"] += 1
        return
    want = inplace._index(torch.load(p, weights_only=True))
    missing = set(ckptio.last_report().missing_keys)
    for k, t in inplace._index(out).items():
        if inplace.key_name(k) not in missing:  # its values (NaN bits included), not its strides
            w = want[k]
            assert (t.dtype, t.shape) == (w.dtype, w.shape), inplace.key_name(k)
            assert tensor_bytes(t) == tensor_bytes(w.contiguous()), inplace.key_name(k)
    OUTCOMES["in place: same data as torch.load"] += 1


def test_zz_outcomes():
    """Prints the outcome counts (run with -s) for the README's figures."""
    print("\n" + "\n".join(f"{v:5d}  {k}" for k, v in sorted(OUTCOMES.items())))


# --------------------------------------------------------------------------- hostile corpus

HOSTILE = sorted(
    p for p in (Path(__file__).parent / "fixtures" / "hostile").iterdir() if p.suffix != ".py"
)


@pytest.mark.parametrize("src", HOSTILE, ids=[p.name for p in HOSTILE])
def test_hostile_corpus_is_refused_with_a_typed_error_and_no_side_effect(
    tmp_path, monkeypatch, src
):
    """Every crafted file (tests/fixtures/hostile/make_hostile.py) is refused by every reader
    that takes it with ckptio.FormatError naming the file (torch's weights-only refusal,
    pickle.UnpicklingError, for a pickle that would run code), and nothing it asks for
    happens (no folder created, no class changed)."""
    import torch.distributed.checkpoint as dcp
    from ckptio import safetensors as cst
    from ckptio.dcp import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    monkeypatch.chdir(tmp_path)
    repr_before = Metadata.__repr__
    refused = (ckptio.FormatError,)
    if src.suffix == ".metadata":
        folder = tmp_path / "ck"
        folder.mkdir()
        (folder / ".metadata").write_bytes(src.read_bytes())
        with pytest.raises(refused, match=".metadata"):
            FileSystemReader(folder).read_metadata()
        rep = ckptio.verify(folder)
        assert not rep.ok and ".metadata" in rep.error, rep
        with pytest.raises(BaseException, match="FormatError|not a DCP|refused|outside"):
            dcp.load({"w": torch.zeros(10)}, storage_reader=FileSystemReader(folder), no_dist=True)
    elif src.name.endswith(".index.json"):
        folder = tmp_path / "ck"
        folder.mkdir()
        (folder / "model.safetensors.index.json").write_bytes(src.read_bytes())
        with pytest.raises(refused, match="index.json"):
            cst.load_sharded(folder)
    elif src.suffix == ".safetensors":
        p = tmp_path / src.name
        p.write_bytes(src.read_bytes())
        for fn in (cst.load_file, cst.metadata):
            with pytest.raises(refused, match=src.name):
                fn(p)
        with pytest.raises(refused):
            cst.load(src.read_bytes())
    else:
        p = tmp_path / src.name
        p.write_bytes(src.read_bytes())
        if src.name == "pickle_runs_code.pt":
            refused = (pickle.UnpicklingError,)
        else:
            assert not ckptio.verify(p).ok, src.name
        for fn in (lambda: ckptio.load(p, verify=True), lambda: ckptio.load(p), ckptio.records):
            with pytest.raises(refused, match=src.name):
                fn(p) if fn is ckptio.records else fn()
    assert not (tmp_path / "ckptio_pwned").exists(), "the file ran code"
    assert Metadata.__repr__ is repr_before, "the file changed a class"


def good_metadata() -> bytes:
    import tempfile
    import warnings

    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = {"w": torch.ones(10), "n": {"x": torch.arange(3)}, "step": 3}
        dcp.save(sd, storage_writer=FileSystemWriter(d), no_dist=True)
        return (Path(d) / ".metadata").read_bytes()


GOOD_METADATA = good_metadata()


def byte_edits(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` with 1 to 4 bytes set to other values, maybe cut short."""
    edits = st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), min_size=1)

    def apply(e: list[tuple[int, int]], cut: int | None) -> bytes:
        b = bytearray(data)
        for at, v in e[:4]:
            b[at] = v
        return bytes(b[:cut])

    return st.builds(apply, edits, st.one_of(st.none(), st.integers(0, len(data))))


@SETTINGS
@given(data=byte_edits(GOOD_METADATA))
def test_mutated_dcp_metadata_is_metadata_or_formaterror(tmp_path, data):
    """Bytes of a real .metadata changed or cut: the reader returns checked Metadata or raises
    FormatError naming the file; nothing else (no other exception type, no code run)."""
    from ckptio.dcp import read_metadata

    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    p = folder / ".metadata"
    p.write_bytes(data)
    try:
        md = read_metadata(p)
    except ckptio.FormatError as e:
        assert ".metadata" in str(e)
        OUTCOMES[f"metadata: {str(e).split(': ')[1][:30]}"] += 1
        return
    OUTCOMES["metadata: read"] += 1
    assert isinstance(md.storage_data, dict)


def good_safetensors() -> bytes:
    from ckptio import safetensors as cst

    g = torch.Generator().manual_seed(0)
    return cst.save({"a": torch.randn(5, 3, generator=g), "b": torch.arange(4)}, {"k": "v"})


GOOD_SAFETENSORS = good_safetensors()


@SETTINGS
@given(data=byte_edits(GOOD_SAFETENSORS))
def test_mutated_safetensors_header_is_exact_or_formaterror(tmp_path, data):
    """Bytes changed anywhere in a safetensors file, or cut: load_file returns tensors of the
    header it read (as the safetensors package would) or raises FormatError; nothing else."""
    from ckptio import safetensors as cst

    p = tmp_path / "m.safetensors"
    p.write_bytes(data)
    try:
        got = cst.load_file(p)
    except ckptio.FormatError as e:
        assert "m.safetensors" in str(e)
        OUTCOMES["safetensors: FormatError"] += 1
        return
    OUTCOMES["safetensors: loaded"] += 1
    assert all(isinstance(t, torch.Tensor) for t in got.values())


# --------------------------------------------------------------------------- crafted geometry
# CRC-valid archives whose pickle names views, keys and locations that no torch.save
# writes: every loader refuses them typed (naming the file and the record), and
# ckptio.verify judges them as the loaders do: if verify says ok, the file loads.


class _Ref:
    def __init__(self, key, location="cpu", numel=16, cls="FloatStorage"):
        self.key, self.location, self.numel, self.cls = key, location, numel, cls


class _View:
    def __init__(self, ref, offset, size, stride):
        self.args = (ref, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Ref):
            return ("storage", getattr(torch, obj.cls), obj.key, obj.location, obj.numel)
        return None


def _crafted(path, views, records=None):
    import io
    import zipfile

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(views)
    records = {"0": bytes(range(64))} if records is None else records  # 16 floats
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for k, data in records.items():
            z.writestr(f"archive/data/{k}", data)
        z.writestr("archive/version", "3\n")


_R = _Ref("0")
HOSTILE_GEOMETRY = {
    "negative size": _View(_R, 0, (-4, 4), (4, 1)),
    "negative stride": _View(_R, 0, (4, 4), (-4, 1)),
    "negative offset": _View(_R, -2, (4,), (1,)),
    "past its storage": _View(_R, 10, (4, 4), (4, 1)),
    "huge stride": _View(_R, 0, (4, 4), (1 << 40, 1)),
    "overflowing sizes": _View(_R, 0, (1 << 62, 1 << 62), (1, 1)),
    "a str size": _View(_R, 0, ("a",), (1,)),
    "a float size": _View(_R, 0, (4.0,), (1,)),
    "a str offset": _View(_R, "x", (4,), (1,)),
    "strides and sizes differ in length": _View(_R, 0, (4, 4), (1,)),
    "a missing key": _View(_Ref("1"), 0, (4,), (1,)),
    "a ../0 key": _View(_Ref("../0"), 0, (4,), (1,)),
    "an absolute key": _View(_Ref("/etc/passwd"), 0, (4,), (1,)),
    "an unknown location": _View(_Ref("0", "bogus:7"), 0, (4,), (1,)),
    "a location that is no str": _View(_Ref("0", 7), 0, (4,), (1,)),
    "cpu with an index": _View(_Ref("0", "cpu:1"), 0, (4,), (1,)),
    "a count past the record": _View(_Ref("0", numel=1 << 40), 0, (4,), (1,)),
    "a negative count": _View(_Ref("0", numel=-1), 0, (4,), (1,)),
    "a storage type of another size": _View(_Ref("0", cls="UntypedStorage"), 0, (4,), (1,)),
}


@pytest.mark.parametrize("what", sorted(HOSTILE_GEOMETRY))
def test_hostile_geometry_is_refused_typed_by_every_loader_and_by_verify(tmp_path, what):
    p = tmp_path / "hostile.pt"
    _crafted(p, {"w": HOSTILE_GEOMETRY[what]})
    loads = {
        "load": lambda: ckptio.load(p),
        "load(verify=True)": lambda: ckptio.load(p, verify=True),
        "load(out=)": lambda: ckptio.load(p, out={"w": torch.zeros(4)}, strict=False),
        "load_state_dict": lambda: ckptio.load_state_dict(torch.nn.Linear(2, 2), p),
    }
    for how, fn in loads.items():
        with pytest.raises(ckptio.FormatError) as e:
            fn()
        assert str(p) in str(e.value) and "record" in str(e.value), (how, str(e.value))
    report = ckptio.verify(p)
    assert not report.ok, what
    assert "record" in report.error


@pytest.mark.parametrize("location", ["cuda:0", "cuda:9"])
def test_a_device_this_machine_lacks_is_a_locationerror(tmp_path, location):
    """A file saved on a GPU this machine lacks is sound (verify says so); loading it
    where it was saved is refused with torch's message, typed; map_location moves it."""
    if torch.cuda.is_available() and torch.cuda.device_count() > int(location[-1]):
        pytest.skip(f"{location} exists here")
    p = tmp_path / "gpu.pt"
    _crafted(p, {"w": _View(_Ref("0", location), 0, (4,), (1,))})
    with pytest.raises(RuntimeError) as want:
        torch.load(p)
    with pytest.raises(ckptio.LocationError) as got:
        ckptio.load(p)
    assert str(got.value).startswith(str(want.value).splitlines()[0]) and str(p) in str(got.value)
    assert ckptio.verify(p).ok
    assert torch.equal(
        ckptio.load(p, map_location="cpu")["w"], torch.load(p, map_location="cpu")["w"]
    )


@st.composite
def geometry(draw):
    ints = st.one_of(st.integers(-3, 20), st.sampled_from([1 << 40, 1 << 62, -(1 << 62)]))
    odd = st.one_of(ints, st.sampled_from(["a", 1.0, None, True]))
    n = draw(st.integers(0, 3))
    size = tuple(draw(st.lists(odd, min_size=n, max_size=n)))
    stride = tuple(
        draw(st.lists(odd, min_size=draw(st.sampled_from([n, n, max(n - 1, 0)])), max_size=n))
    )
    key = draw(st.sampled_from(["0", "0", "1", "../0", ""]))
    location = draw(st.sampled_from(["cpu", "cpu", "bogus:1", 3]))
    numel = draw(st.sampled_from([16, 16, 4, 1 << 40, -1]))
    return _View(_Ref(key, location, numel), draw(odd), size, stride)


@settings(SETTINGS, max_examples=min(SETTINGS.max_examples, 300))
@given(view=geometry())
def test_verify_ok_means_the_loaders_load_and_every_refusal_is_typed(tmp_path, view):
    p = tmp_path / "g.pt"
    _crafted(p, {"w": view})
    ok = ckptio.verify(p).ok
    outcomes = []
    for fn in (
        lambda: ckptio.load(p),
        lambda: ckptio.load(p, out={"w": torch.zeros(16)}, strict=False),
    ):
        try:
            fn()
            outcomes.append(True)
        except ckptio.InPlaceLoadError:
            outcomes.append(True)  # a sound file whose tensor does not fit this destination
        except TYPED:
            outcomes.append(False)
    assert not ok or outcomes[0], "verify said ok, load refused"
    OUTCOMES[
        f"geometry: verify {'ok' if ok else 'bad'}, load {'ok' if outcomes[0] else 'refused'}"
    ] += 1
