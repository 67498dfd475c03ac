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
from test_faults import assert_same

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


def test_zz_outcomes():
    """Prints the outcome counts (run with -s) for the README's figures."""
    print("\n" + "\n".join(f"{v:5d}  {k}" for k, v in sorted(OUTCOMES.items())))
