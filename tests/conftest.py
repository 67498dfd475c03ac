"""Shared test set-up: GPU tests skip cleanly where there is no CUDA device."""

import functools

import pytest
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
