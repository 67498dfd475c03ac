"""Every exception ckptio raises, and the one way to say that a checkpoint is damaged.

``CkptioError`` is a ``RuntimeError`` (what torch.load raises on a corrupt
archive and for CUDA failures), so ``except RuntimeError`` written for torch
catches ckptio's errors too; its subclasses single them out:

- ``FormatError``: not a usable checkpoint (names the file and the record);
  ``SafetensorError`` is one too, and ``safetensors.SafetensorError`` where that
  package is installed;
- ``InPlaceLoadError`` and its kinds: a load into existing tensors refused
  (nothing written) or failed midway (``PartialLoadError``);
- ``GroupLoadError``: a load with ``group=`` failed on every rank together;
- ``LocationError``: a storage saved on a device this machine lacks;
- ``RecordValueError``: a ``FormatError`` that is also the ``ValueError`` torch.load
  raises for the same record (an unknown byte order);
- ``NotPickleError``: a ``FormatError`` that is also the ``pickle.UnpicklingError``
  torch.load raises for a file that is neither a zip archive nor a pickle;
- ``BackendUnavailableError``, ``CudaError``, ``CuFileError``: the device path;
- ``StoreError`` (an ``OSError`` naming the URL, and a ``CkptioError``) and its
  kinds: ``StoreCredentialsError`` / ``StorePermissionError``
  (``PermissionError``), ``StoreNotFoundError`` (``FileNotFoundError``),
  ``CommitConflictError`` (``FileExistsError``: another writer committed first,
  or the object changed while read), ``StoreThrottledError`` /
  ``StoreConnectionError`` (``ConnectionError``), after the client's retries;
- ``DrainStoppedError`` (a ``TimeoutError``): a tiered drain stopped by
  ``Checkpointer.close(timeout=)``, its step kept locally;
- ``SaveFolderNotFoundError`` (``FileNotFoundError``), ``SaveIsADirectoryError``
  (``IsADirectoryError``), ``SaveNameError`` (``ValueError``): a save to a path
  that cannot be a file, where torch.save raises ``RuntimeError``;
- ``GdsValueError`` (``ValueError``), ``GdsAccessError`` (``OSError``, EBADF): a
  ``GdsFile`` call torch.cuda.gds refuses with ``RuntimeError``.

The operating system's errors stay ``OSError`` subclasses chosen by errno,
naming the file. See docs/api-conventions.md.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

from ckptio._native import (
    CORRUPT_HINT,
    BackendUnavailableError,
    CkptioError,
    CommitConflictError,
    CudaError,
    CuFileError,
    FormatError,
    StoreConnectionError,
    StoreCredentialsError,
    StoreError,
    StoreNotFoundError,
    StorePermissionError,
    StoreThrottledError,
)

__all__ = [
    "CORRUPT_HINT",
    "BackendUnavailableError",
    "CkptioError",
    "CommitConflictError",
    "ConversionError",
    "CudaError",
    "CuFileError",
    "DestinationError",
    "DrainStoppedError",
    "DtypeMismatchError",
    "FormatError",
    "GdsAccessError",
    "GdsValueError",
    "GroupLoadError",
    "GroupMismatchError",
    "InPlaceLoadError",
    "KeyMismatchError",
    "LocationError",
    "NotPickleError",
    "PartialLoadError",
    "PeerLoadError",
    "RecordValueError",
    "SafetensorError",
    "SaveFolderNotFoundError",
    "SaveIsADirectoryError",
    "SaveNameError",
    "ShapeMismatchError",
    "StoreConnectionError",
    "StoreCredentialsError",
    "StoreError",
    "StoreNotFoundError",
    "StorePermissionError",
    "StoreThrottledError",
    "corrupt",
]


def corrupt(where: str, what: str, kind: type[FormatError] = FormatError) -> FormatError:
    """A ``FormatError`` (or its subclass ``kind``) for a damaged checkpoint:
    ``where`` (the file, and the record where known), ``what`` is wrong, then
    torch's words for it (the core's format errors read the same way)."""
    hint = "" if "high likelihood" in what else f"; {CORRUPT_HINT}"
    return kind(f"{where}: not a usable checkpoint: {what}{hint}")


def check_crc(where: str, name: str, declared: int | None, actual: int) -> None:
    """A record whose bytes do not have the CRC-32 its archive declares is a
    FormatError naming both (None: the archive declares none to check)."""
    if declared is not None and declared != actual:
        raise corrupt(
            where,
            f"record {name!r} is corrupt: its bytes have CRC-32 {actual:#010x}, "
            f"the archive stores {declared:#010x}",
        )


class LocationError(CkptioError):
    """A storage of the checkpoint was saved on a device this machine lacks (a CUDA
    device where there is none, or not that many): torch.load's own message, the
    file after it. ``map_location`` sends the storages elsewhere."""


class MapLocationError(TypeError, CkptioError):
    """A ``map_location`` callable returned what torch.load cannot use (no
    storage): the caller's error, a ``TypeError`` as torch.load raises it,
    not a damaged file."""


class PickleEndError(FormatError, EOFError):
    """A pickle that ends before its end mark (an empty file, one cut short):
    torch.load raises ``EOFError`` ("Ran out of input")."""


class RecordValueError(FormatError, ValueError):
    """A record holds a value torch.load refuses with ``ValueError`` (a byte order
    other than little or big): a ``FormatError`` naming the file and the record,
    so that ``except ValueError`` written for torch.load catches it too."""


class NotPickleError(FormatError, pickle.UnpicklingError):
    """A file that is no zip archive, which torch.load reads as its legacy format,
    and that is no pickle of it either: torch.load raises ``UnpicklingError``;
    this names the file too, and is a ``FormatError``."""


# --------------------------------------------------------------------------- safetensors

try:  # where the safetensors package is installed, its error class is a base of ours
    from safetensors import SafetensorError as _PeerError

    _ST_BASES: tuple[type[BaseException], ...] = (FormatError, _PeerError)
except ImportError:  # pragma: no cover - safetensors is a test dependency
    _ST_BASES = (FormatError,)


class SafetensorError(*_ST_BASES):  # type: ignore[misc]
    """A file or argument safetensors would refuse with its ``SafetensorError``.

    A ``ckptio.FormatError`` (so a ``ckptio.CkptioError`` and a ``RuntimeError``)
    and, where the ``safetensors`` package is installed, a
    ``safetensors.SafetensorError``: code written for either catches it.
    """


SafetensorError.__module__ = "ckptio.safetensors"


# --------------------------------------------------------------------------- loads in place


class InPlaceLoadError(CkptioError, RuntimeError):
    """A load into existing tensors failed.

    ``problems``: ``[(kind, key, text)]``, kind one of "missing", "unexpected",
    "shape", "dtype", "destination" or "error" (another message of torch's
    ``load_state_dict``). ``missing_keys`` / ``unexpected_keys`` as torch
    reports them. ``partial``: whether destinations were written before the
    load failed (False: none was).
    """

    def __init__(
        self,
        message: str,
        problems: Sequence[tuple[str, str, str]] = (),
        *,
        missing_keys: Sequence[str] = (),
        unexpected_keys: Sequence[str] = (),
        partial: bool = False,
    ) -> None:
        super().__init__(message)
        self.problems = list(problems)
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        self.partial = partial


class KeyMismatchError(InPlaceLoadError):
    """strict=True: destinations the checkpoint has no tensor for, or checkpoint
    tensors without a destination."""


class ShapeMismatchError(InPlaceLoadError):
    """A checkpoint tensor's shape differs from its destination's."""


class DtypeMismatchError(InPlaceLoadError):
    """A checkpoint tensor's dtype differs from its destination's (``cast=True``
    converts instead)."""


class DestinationError(InPlaceLoadError):
    """A destination that cannot be written: read-only memory, an inference
    tensor, the meta device, a sparse tensor, or memory another destination
    overlaps."""


class PartialLoadError(InPlaceLoadError):
    """Reading into the destinations failed midway (an I/O error, a truncated
    file, a failed CRC-32 check): they are partially filled. The cause is
    chained (``__cause__``)."""


# --------------------------------------------------------------------------- group loads


class GroupLoadError(CkptioError, RuntimeError):
    """A load with ``group=`` failed on every rank of the group together.
    ``rank``: the rank (in the group) whose file or failure it was."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class GroupMismatchError(GroupLoadError):
    """The ranks see different checkpoints (a file's size or records differ)
    or load them differently (other destinations, keys or devices): raised on
    every rank before any data moves, naming the rank and the difference."""


class PeerLoadError(GroupLoadError):
    """Another rank's part of the load failed: raised on every rank but that
    one (which raises its own error). ``error_type``: that error's class name."""

    def __init__(self, message: str, rank: int | None = None, error_type: str = "") -> None:
        super().__init__(message, rank)
        self.error_type = error_type


# --------------------------------------------------------------------------- tiered


class DrainStoppedError(CkptioError, TimeoutError):
    """``tiered.Checkpointer.close(timeout=)`` stopped the drain of ``step`` before
    it ended: the step stays complete in the local folder, and the next
    Checkpointer on the same folders drains it."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


# --------------------------------------------------------------------------- save destinations
# torch.save raises RuntimeError where its writer cannot open the path: ckptio's
# class stays the system's (or ValueError), and is a CkptioError (a RuntimeError)
# too, so that ``except RuntimeError`` written for torch.save catches it.


class SaveFolderNotFoundError(FileNotFoundError, CkptioError):
    """A save to a path whose folder does not exist."""


class SaveIsADirectoryError(IsADirectoryError, CkptioError):
    """A save to a path that is a folder."""


class SaveNameError(ValueError, CkptioError):
    """A save to a path that names no file (an empty one)."""


def save_destination_error(e: Exception, path: str) -> Exception:
    """The error of opening ``path`` to save into, as one of the classes above
    where torch.save raises RuntimeError for it; else ``e`` itself (a ValueError
    for an argument other than the path, a full disk...)."""
    if isinstance(e, ValueError):
        return SaveNameError(*e.args) if not path else e
    kind = {FileNotFoundError: SaveFolderNotFoundError, IsADirectoryError: SaveIsADirectoryError}
    if isinstance(e, OSError) and type(e) in kind:
        return kind[type(e)](e.errno, e.strerror, e.filename)
    return e


# --------------------------------------------------------------------------- GdsFile
# torch.cuda.gds.GdsFile raises RuntimeError (its C++ checks) where ckptio's raises
# the class that says what is wrong; each is a CkptioError (a RuntimeError) too, so
# that ``except RuntimeError`` written for torch catches it.


class GdsValueError(ValueError, CkptioError):
    """A ``GdsFile`` argument out of range (a negative offset)."""


class GdsAccessError(OSError, CkptioError):
    """A ``GdsFile`` transfer its access mode forbids (a save to a file opened
    O_RDONLY, a load from one opened O_WRONLY): ``errno`` EBADF, as the system
    says for such a read or write."""


# --------------------------------------------------------------------------- conversion


class ConversionError(ValueError):
    """``ckptio convert``: the source holds something the destination format cannot."""
