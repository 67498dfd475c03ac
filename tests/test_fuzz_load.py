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
import struct
import zipfile
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
# What a refusal may be: ckptio's, the pickle's, torch's own (RuntimeError for a zip it cannot
# read), a bad value in the metadata. Never SystemError, MemoryError, RecursionError.
TYPED = (
    ckptio.FormatError,
    pickle.UnpicklingError,
    RuntimeError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    EOFError,
    OSError,
    UnicodeDecodeError,
    OverflowError,
    zipfile.BadZipFile,
    struct.error,  # torch's weights_only unpickler on a cut pickle
    AssertionError,  # torch's persistent_load on a persistent id that is not a tuple
)
OUTCOMES: collections.Counter[str] = collections.Counter()
SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("CKPTIO_FUZZ_EXAMPLES", "500")),
    deadline=datetime.timedelta(seconds=5),  # a hang fails the example
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
