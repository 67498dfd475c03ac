"""ckptio's exceptions, and the one way to say that a checkpoint is damaged.

``CkptioError`` is a ``RuntimeError`` (what torch.load raises on a corrupt
archive); ``FormatError`` says the file is not a usable checkpoint. The
operating system's errors stay ``OSError`` subclasses chosen by errno.
"""

from __future__ import annotations

from ckptio._native import (
    CORRUPT_HINT,
    BackendUnavailableError,
    CkptioError,
    CudaError,
    CuFileError,
    FormatError,
)

__all__ = [
    "CORRUPT_HINT",
    "BackendUnavailableError",
    "CkptioError",
    "CudaError",
    "CuFileError",
    "FormatError",
    "corrupt",
]


def corrupt(where: str, what: str) -> FormatError:
    """A ``FormatError`` for a damaged checkpoint: ``where`` (the file, and the
    record where known), ``what`` is wrong, then torch's words for it (the core's
    format errors read the same way)."""
    hint = "" if "high likelihood" in what else f"; {CORRUPT_HINT}"
    return FormatError(f"{where}: not a usable checkpoint: {what}{hint}")
