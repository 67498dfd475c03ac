"""Type stubs of the Rust extension ``ckptio._native`` (checked by mypy.stubtest in CI)."""

import os
from collections.abc import Callable
from typing import Any, final

from typing_extensions import Self

__version__: str
__all__ = [
    "_clear_faults",
    "_op_log",
    "_record_ops",
    "_set_fault",
    "cufile_register_buffer",
    "info",
    "map_archive",
    "map_archives",
    "safetensors_header",
    "stage_copy",
    "stage_device_copy",
    "stage_pin",
    "unpickle",
    "AtomicWriter",
    "BufferRegistration",
    "DeviceFile",
    "Engine",
    "HostPin",
    "Reader",
    "StateDictPickler",
    "Unpickled",
    "CkptioError",
    "FormatError",
    "BackendUnavailableError",
    "CudaError",
    "CuFileError",
    "__version__",
]

class CkptioError(Exception):
    """Base class of ckptio's own errors."""

class FormatError(CkptioError):
    """The file is not a usable checkpoint (torch.save archive or safetensors file)."""

class BackendUnavailableError(CkptioError):
    """A library or backend (libcuda, libcufile) is not available."""

class CudaError(CkptioError):
    """A CUDA driver call failed."""

class CuFileError(CkptioError):
    """A cuFile (GPUDirect Storage) call failed."""

_Path = str | os.PathLike[str]
# (file offset, address, nbytes, device); device -1 is host memory
_Segment = tuple[int, int, int, int]

@final
class Engine:
    """A pool of I/O threads and its reusable staging and pinned buffers.

    Defaults: CKPTIO_THREADS, CKPTIO_CHUNK_SIZE ("16M"), CKPTIO_DIRECT (auto|on|off),
    CKPTIO_PREALLOCATE (1|0); for files on tmpfs CKPTIO_MEMORY_THREADS and
    CKPTIO_MEMORY_CHUNK_SIZE ("4M"). ``threads`` and ``chunk_size`` set both kinds;
    ``memory_threads`` then sets the tmpfs one.
    """

    def __new__(
        cls,
        threads: int | None = None,
        chunk_size: int | None = None,
        direct: str | None = None,
        memory_threads: int | None = None,
    ) -> Self: ...
    @property
    def threads(self) -> int: ...
    @property
    def memory_threads(self) -> int: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def memory_chunk_size(self) -> int: ...
    @property
    def direct(self) -> str: ...
    def pooled_bytes(self) -> int:
        """Host memory held by the reusable staging buffers."""
    def pinned_bytes(self) -> int:
        """Pinned host memory held by the bounce buffers (bounded by threads x 2 x chunk)."""

def map_archives(
    addr: int, len: int, spans: list[tuple[int, int]]
) -> list[tuple[int, int, list[tuple[str, int, int]]] | None]:
    """Archives held in host memory: (data.pkl offset, size, [(key, offset, size)]) each."""

def map_archive(path: _Path) -> list[tuple[str, int, int]]:
    """[(record name, data offset, size)] of a torch.save zip archive."""

@final
class AtomicWriter:
    """A temp file beside ``path``; ``commit`` replaces ``path`` with it, durably."""

    def __new__(
        cls, path: _Path, direct: str | None = None, backend: str | None = None
    ) -> Self: ...
    def fileno(self) -> int: ...
    @property
    def tmp_path(self) -> str: ...
    @property
    def target(self) -> str: ...
    def write_storages(
        self, engine: Engine, storages: list[tuple[str, int, int, int]]
    ) -> dict[str, Any]:
        """Write (key, address, nbytes, device) storages into records ``<prefix>/data/<key>``."""
    def write_archive(
        self,
        engine: Engine,
        entries: list[tuple[str, bytes | tuple[int, int, int], int]],
        prefix: str,
    ) -> dict[str, Any]:
        """Write a whole torch.save archive: (record name, bytes or (address, nbytes,
        device), alignment) in file order, headers and data in one engine pass."""
    def write_segments(
        self,
        engine: Engine,
        segments: list[_Segment],
        file_len: int | None = None,
        checksum: bool = False,
        patches: list[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """Write (file offset, address, nbytes, device) ranges; preallocate ``file_len``;
        with ``checksum``, "crc32" lists each segment's CRC-32 (None: not via host);
        ``patches``: (segment, file offset) where to store a segment's CRC-32."""
    def write_bytes(self, offset: int, data: bytes) -> None:
        """Write a small byte string (a header) at ``offset``."""
    def commit(self) -> None: ...
    def abort(self) -> None: ...

@final
class Reader:
    """An existing checkpoint, mapped and opened for (O_DIRECT where possible) reading."""

    def __new__(
        cls, path: _Path, direct: str | None = None, backend: str | None = None
    ) -> Self: ...
    def records(self) -> list[tuple[str, int, int]]: ...
    @property
    def prefix(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    def fileno(self) -> int: ...
    def read_record(self, name: str) -> bytes: ...
    def read_into(
        self, engine: Engine, segments: list[_Segment], verify: bool = False
    ) -> dict[str, Any]:
        """Read (file offset, address, nbytes, device) ranges; each must lie inside one record.

        With ``verify`` the CRC-32 of each whole record read is checked (FormatError naming
        the record on a mismatch); the result then has "verified" and "unchecked" lists."""
    def checksums(self) -> list[tuple[str, int | None]]:
        """[(record name, stored CRC-32 or None where the archive has none)]."""
    def verify(
        self, engine: Engine, names: list[str] | None = None, strict: bool = False
    ) -> list[tuple[str, str, int | None, int | None]]:
        """[(name, "ok"|"mismatch"|"unchecked", stored CRC-32, actual CRC-32)]; strict raises
        FormatError on the first mismatch."""

@final
class DeviceFile:
    """An open file for storages at given offsets (what ckptio.GdsFile wraps)."""

    def __new__(
        cls, path: _Path, writable: bool, direct: str | None = None, backend: str | None = None
    ) -> Self: ...
    def register_handle(self) -> None: ...
    def deregister_handle(self) -> None: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def gds_mode(self) -> str | None: ...
    @property
    def fallback_reason(self) -> str | None: ...
    def write(self, engine: Engine, offset: int, addr: int, nbytes: int, device: int) -> None: ...
    def read(self, engine: Engine, offset: int, addr: int, nbytes: int, device: int) -> None: ...
    def fileno(self) -> int: ...
    def read_segments(self, engine: Engine, segments: list[_Segment]) -> dict[str, Any]:
        """Read (file offset, address, nbytes, device) ranges in one engine pass."""

@final
class BufferRegistration:
    """A cuFileBufRegister registration."""

    def close(self) -> None: ...

@final
class HostPin:
    """Pinning state of caller-owned host memory, page-locked whole by the first copy."""

    def __new__(
        cls, addr: int, nbytes: int, pin: bool = True, chunk_size: int = 67108864
    ) -> Self: ...
    @property
    def nbytes(self) -> int: ...
    def pinned_bytes(self) -> int: ...
    def close(self) -> None: ...

def stage_copy(
    copies: list[tuple[int, int, HostPin, int, int]], threads: int = 8
) -> dict[str, Any]:
    """Copy (src address, src device, pin, dst offset, nbytes) jobs in parallel."""

def stage_pin(pins: list[HostPin], threads: int = 8) -> int:
    """Pin every one of ``pins`` not yet pinned; returns the bytes now pinned."""

def stage_device_copy(device: int, stream: int, copies: list[tuple[int, int, int]]) -> None:
    """Queue (dst, src, nbytes) device-to-device copies on a raw CUstream; returns at once."""

@final
class Unpickled:
    """A torch.save pickle read natively, waiting for its storages."""

    def storages(self) -> list[tuple[str, str, str, int]]:
        """(key, storage class name in module torch, location, numel), first use first."""
    def tensors(self) -> int: ...
    def build(
        self,
        rebuild_tensor: Callable[..., Any],
        rebuild_parameter: Callable[..., Any],
        ordered_dict: Callable[[], Any],
    ) -> Any:
        """Make the object: ``rebuild_tensor(storage index, offset, size, stride,
        requires_grad, hooks)`` per tensor, ``rebuild_parameter(tensor, requires_grad,
        hooks)`` per Parameter."""

def safetensors_header(
    json: bytes, data_len: int, itemsizes: dict[str, int]
) -> tuple[list[tuple[str, str]] | None, list[tuple[str, str, list[int], int, int]]] | None:
    """A safetensors header read and checked natively; None: the Python reader must."""

def unpickle(data: bytes) -> Unpickled | None:
    """Read a state-dict pickle natively; None where torch.load must read it."""

@final
class StateDictPickler:
    """Writes torch.save's pickle of a state dict natively (None outside its subset)."""

    def __new__(
        cls,
        tensor: type,
        parameter: type,
        ordered_dict: type,
        strided: Any,
        storage_classes: dict[Any, Any],
        tensor_metadata: Callable[[Any], Any],
        location_tag: Callable[[Any], str],
        rebuild_tensor: Callable[..., Any],
        rebuild_parameter: Callable[..., Any],
    ) -> Self: ...
    def dump(self, obj: Any) -> tuple[bytes, list[tuple[str, Any, int]]] | None:
        """(data.pkl's bytes, [(storage key, storage, device or -1)]) or None."""

def cufile_register_buffer(addr: int, nbytes: int) -> BufferRegistration: ...
def info(folder: _Path | None = None) -> dict[str, Any]:
    """libcuda, libcufile and (for ``folder``) O_DIRECT / cuFile handle support."""

def _set_fault(point: str, errno: int, nth: int = 1) -> None:
    """Test only (CKPTIO_TEST_FAULTS=1 at start): fail the nth next hit of a fault point."""

def _clear_faults() -> list[str]:
    """Test only: drop pending faults, stop recording; the points whose fault never fired."""

def _record_ops() -> None:
    """Test only: log every fault point reached, in order."""

def _op_log() -> list[str]:
    """Test only: the points logged since _record_ops ("point file-name")."""
