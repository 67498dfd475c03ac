"""ckptio: fast, crash-safe checkpoint I/O for PyTorch.

``ckptio.save`` writes files that plain ``torch.load`` reads, with storages of
1 MiB or more 4 KiB-aligned (every storage, where torch's
``config.save.storage_alignment`` asks for it), their bytes moved by a pool of
I/O threads straight from tensor memory, and the file replaced atomically
(temp file, fsync, rename, fsync of the folder). ``ckptio.load`` reads any
torch.save zip checkpoint, bytes read in parallel straight into the destination
storages: new ones, or tensors that exist already (``out=``,
``ckptio.load_state_dict``: resuming in place).
``ckptio.safetensors`` does the same for safetensors files
(``save_file``/``load_file``, sharded checkpoints).

Each function that replaces a peer's (torch.save, torch.load,
safetensors.torch.*, DCP's FileSystemWriter/Reader) takes the peer's
arguments with their meaning and returns what the peer returns; ckptio's own
knobs are keyword-only. How a save or load ran is ``ckptio.last_report()``.
Errors: ``ckptio.CkptioError`` (a RuntimeError, as torch.load's are) and its
subclasses, OSError for the operating system's. See docs/api-conventions.md.

The package's layers, each importing only those below it (docs/design.md):
``errors``; ``io`` (engines, transfers, reports, memory); ``formats`` (one
module per format); ``loading`` (in place, group sharing); the modules that
stand in for the peers (``serialization``, ``safetensors``, ``state_dict``,
``dcp``, ``staging``, ``gds``, ``lightning``); ``tools``. This module only
re-exports.
"""

from ckptio import safetensors
from ckptio._native import __version__ as __version__
from ckptio.errors import (
    BackendUnavailableError,
    CkptioError,
    CommitConflictError,
    CudaError,
    CuFileError,
    DestinationError,
    DtypeMismatchError,
    FormatError,
    GroupLoadError,
    GroupMismatchError,
    InPlaceLoadError,
    KeyMismatchError,
    LocationError,
    MapLocationError,
    NotPickleError,
    PartialLoadError,
    PeerLoadError,
    PickleEndError,
    RecordValueError,
    ShapeMismatchError,
    StoreConnectionError,
    StoreCredentialsError,
    StoreError,
    StoreNotFoundError,
    StorePermissionError,
    StoreThrottledError,
)
from ckptio.gds import GdsFile, gds_deregister_buffer, gds_register_buffer, is_available
from ckptio.io.reports import IOReport, last_report
from ckptio.io.transfer import release_buffers
from ckptio.serialization import RecordInfo, TensorInfo, load, records, save
from ckptio.state_dict import load_state_dict
from ckptio.tools.clean import clean
from ckptio.tools.describe import Listing, listing
from ckptio.tools.integrity import RecordCheck, VerifyReport, verify
from ckptio.tools.sysinfo import info

__all__ = [
    "save",
    "load",
    "load_state_dict",
    "records",
    "listing",
    "verify",
    "clean",
    "last_report",
    "release_buffers",
    "info",
    "safetensors",
    "GdsFile",
    "is_available",
    "gds_register_buffer",
    "gds_deregister_buffer",
    "IOReport",
    "RecordInfo",
    "TensorInfo",
    "Listing",
    "VerifyReport",
    "RecordCheck",
    "CkptioError",
    "FormatError",
    "BackendUnavailableError",
    "CudaError",
    "CuFileError",
    "InPlaceLoadError",
    "KeyMismatchError",
    "LocationError",
    "MapLocationError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "DestinationError",
    "PartialLoadError",
    "GroupLoadError",
    "GroupMismatchError",
    "PeerLoadError",
    "NotPickleError",
    "PickleEndError",
    "RecordValueError",
    "StoreError",
    "StoreCredentialsError",
    "StorePermissionError",
    "StoreNotFoundError",
    "CommitConflictError",
    "StoreThrottledError",
    "StoreConnectionError",
]
