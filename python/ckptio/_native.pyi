"""Type stubs of the Rust extension ``ckptio._native`` (checked by mypy.stubtest in CI)."""

import os
from collections.abc import Callable
from typing import Any, final

from typing_extensions import Self

__version__: str
CORRUPT_HINT: str
# The test hooks (_set_fault, ...) are importable by name but not in __all__; the
# probe hooks (host_memory, memory_copy_floor) exist only in a build with the
# cargo feature "probes" (scripts/dev_build.sh, scripts/build_gpu_bundle.sh) and
# are not declared here: reach them with getattr(_native, name, None).
__all__ = [
    "advise_huge",
    "check_archive",
    "clean_temps",
    "detach_mapping",
    "cufile_register_buffer",
    "env_threads",
    "info",
    "map_archive",
    "map_archives",
    "safetensors_header",
    "pinned_memory",
    "release_buffers",
    "stage_copy",
    "stage_device_copy",
    "stage_pin",
    "unpickle",
    "verify_zstd_item",
    "zip_headers_match",
    "AtomicWriter",
    "BufferRegistration",
    "DeviceFile",
    "Engine",
    "HostMemory",
    "HostPin",
    "Reader",
    "StateDictPickler",
    "Unpickled",
    "store_delete",
    "store_download",
    "store_get",
    "store_head",
    "store_list",
    "store_put",
    "store_read",
    "store_crc32",
    "store_read_into",
    "store_torch_map",
    "store_upload",
    "store_upload_archive",
    "store_upload_image",
    "store_upload_zstd",
    "ObjectWriter",
    "CkptioError",
    "FormatError",
    "BackendUnavailableError",
    "CudaError",
    "CuFileError",
    "StoreError",
    "StoreCredentialsError",
    "StorePermissionError",
    "StoreNotFoundError",
    "CommitConflictError",
    "StoreThrottledError",
    "StoreConnectionError",
    "__version__",
    "CORRUPT_HINT",
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
# (device, raw CUstream, e.g. torch.cuda.current_stream(d).cuda_stream): device memory
# is touched only after the work queued there before the call (0: the legacy stream)
_Streams = list[tuple[int, int]]
# Objects owning the memory behind a call's addresses (torch.UntypedStorage,
# torch.Tensor, HostMemory): held until the call returns, so no other thread can free
# that memory meanwhile. Every address range of the call must lie inside one owner's
# memory (its own data_ptr/nbytes/device), checked before any byte moves: ValueError
# naming the range otherwise (TypeError for an owner of another type)
_Owners = list[Any]

class StoreError(OSError, CkptioError): ...
class StoreCredentialsError(PermissionError, StoreError): ...
class StorePermissionError(PermissionError, StoreError): ...
class StoreNotFoundError(FileNotFoundError, StoreError): ...
class CommitConflictError(FileExistsError, StoreError): ...
class StoreThrottledError(ConnectionError, StoreError): ...
class StoreConnectionError(ConnectionError, StoreError): ...

@final
class Engine:
    """A pool of I/O threads and its reusable staging and pinned buffers.

    Defaults: CKPTIO_THREADS, CKPTIO_CHUNK_SIZE ("16M"), CKPTIO_DIRECT (auto|on|off),
    CKPTIO_PREALLOCATE (1|0), CKPTIO_IDLE_RELEASE (seconds an idle thread's buffers
    are kept, default 60, or "off"); for files in memory (tmpfs, cached pages)
    CKPTIO_MEMORY_THREADS and CKPTIO_MEMORY_CHUNK_SIZE ("4M"). ``threads`` and
    ``chunk_size`` set both kinds; ``memory_threads`` then sets the memory one.
    ``memory_path`` (CKPTIO_MEMORY_PATH): how files in memory are read, "map"
    (default, "auto"), "map-nt" (the same with non-temporal stores), "pread", or
    "off" (no page-cache check).
    """

    def __new__(
        cls,
        threads: int | None = None,
        chunk_size: int | None = None,
        direct: str | None = None,
        memory_threads: int | None = None,
        idle_release: float | None = None,
        memory_path: str | None = None,
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
    @property
    def idle_release(self) -> float | None: ...
    @property
    def memory_path(self) -> str: ...
    def pooled_bytes(self) -> int:
        """Host memory held by the idle staging buffers."""
    def pinned_bytes(self) -> int:
        """Pinned host memory held by the idle bounce buffers (bounded by threads x 2 x chunk)."""
    def release_buffers(self) -> int:
        """Give back the idle buffers' memory (the engine stays usable); returns the bytes."""
    def close(self) -> int:
        """release_buffers, and keep no buffers between transfers from now on."""

def release_buffers() -> int:
    """Give back the idle buffers of every engine in the process; returns the bytes."""

def pinned_memory() -> dict[str, Any]:
    """{"held": bytes ckptio has pinned now, "limit": the cap (CKPTIO_PINNED_LIMIT)}."""

def env_threads() -> int | None:
    """CKPTIO_THREADS as the engine reads it (ValueError when malformed), None where unset."""

def map_archives(
    addr: int, len: int, spans: list[tuple[int, int]], owners: _Owners
) -> list[tuple[int, int, list[tuple[str, int, int]]] | None]:
    """Archives held in host memory of ``owners``: (data.pkl offset, size, [(key,
    offset, size)]) each."""

def map_archive(path: _Path) -> list[tuple[str, int, int]]:
    """[(record name, data offset, size)] of a torch.save zip archive."""

def verify_zstd_item(
    path: str | os.PathLike[str], offset: int, length: int, limit: int
) -> tuple[str, list[tuple[str, str, int | None, int | None]] | None, list[int] | None]:
    """Verify the DCP item at bytes ``[offset, offset + length)`` of ``path``, zstd
    frames (torch's ZStandard transform) of a torch.save zip, streamed and decoded
    in memory (at most ``limit`` bytes): ("checked", its records judged as
    ``Reader.verify`` rows, None), ("large", None, None) where it decodes to more,
    ("other", None, its first decoded bytes) where it decodes to no zip.
    FormatError naming the item where it lies past the file's end, its frames are
    damaged or the zip inside is."""

def check_archive(blob: bytes, where: str) -> None:
    """Check every record of the zip archive ``blob`` (a torch.save archive held in
    memory) against the CRC-32 it declares, as ``Reader.verify`` checks one in a file
    (a CRC-32 the archive says it did not compute is not judged). A FormatError naming
    ``where`` and the record on a mismatch, or ``where`` when the bytes are no zip of
    stored records."""

@final
class AtomicWriter:
    """A temp file beside ``path``; ``commit`` replaces ``path`` with it, durably."""

    def __new__(
        cls,
        path: _Path,
        direct: str | None = None,
        backend: str | None = None,
        sweep: bool = True,
    ) -> Self: ...
    def fileno(self) -> int: ...
    @property
    def tmp_path(self) -> str: ...
    @property
    def target(self) -> str: ...
    def write_storages(
        self,
        engine: Engine,
        storages: list[tuple[str, int, int, int]],
        owners: _Owners,
        streams: _Streams,
    ) -> dict[str, Any]:
        """Write (key, address, nbytes, device) storages into records ``<prefix>/data/<key>``."""
    def write_archive(
        self,
        engine: Engine,
        entries: list[tuple[str, bytes | tuple[int, int, int], int]],
        prefix: str,
        owners: _Owners,
        streams: _Streams,
    ) -> dict[str, Any]:
        """Write a whole torch.save archive: (record name, bytes or (address, nbytes,
        device), alignment) in file order, headers and data in one engine pass."""
    def write_segments(
        self,
        engine: Engine,
        segments: list[_Segment],
        owners: _Owners,
        streams: _Streams,
        file_len: int | None = None,
        checksum: bool = False,
        patches: list[tuple[int, int]] | None = None,
    ) -> dict[str, Any]:
        """Write (file offset, address, nbytes, device) ranges; preallocate ``file_len``;
        with ``checksum``, "crc32" lists each segment's CRC-32 (None: not via host);
        ``patches``: (segment, file offset) where to store a segment's CRC-32."""
    def write_zstd(
        self,
        engine: Engine,
        start: int,
        items: list[tuple[bytes, int, int, bytes, list[int]]],
        owners: _Owners,
        level: int = 3,
    ) -> list[tuple[int, int]]:
        """Each (head, address, nbytes, tail, CRC-32 offsets in tail) as one zstd frame,
        written back to back from ``start``: [(offset, length)]; ``owners`` held meanwhile."""
    def write_bytes(self, offset: int, data: bytes) -> None:
        """Write a small byte string (a header) at ``offset``."""
    def commit(self) -> None: ...
    def abort(self) -> None: ...

@final
class Reader:
    """An existing checkpoint, mapped and opened for (O_DIRECT where possible) reading;
    with ``length``, the archive in bytes [offset, offset + length) of the file."""

    def __new__(
        cls,
        path: _Path,
        direct: str | None = None,
        backend: str | None = None,
        offset: int = 0,
        length: int | None = None,
    ) -> Self: ...
    def records(self) -> list[tuple[str, int, int]]: ...
    @property
    def prefix(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    def fileno(self) -> int: ...
    def read_record(self, name: str) -> bytes: ...
    def read_segments(
        self,
        engine: Engine,
        segments: list[_Segment],
        owners: _Owners,
        streams: _Streams,
        verify: bool = False,
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
    @staticmethod
    def open(
        path: _Path, flags: int, direct: str | None = None, backend: str | None = None
    ) -> DeviceFile:
        """Open ``path`` with os.open ``flags`` once ``direct`` and ``backend`` are checked."""
    def register_handle(self) -> None:
        """Open the device path now (cuFile where it takes the file, else bounce)."""
    def deregister_handle(self) -> None:
        """Close it: device memory then takes the bounce pipeline until register_handle."""
    @property
    def backend(self) -> str:
        """The backend asked for: "auto", "cufile" or "bounce"."""
    @property
    def device_path(self) -> str | None:
        """The device path open now: "cufile", "bounce", or None."""
    @property
    def gds_mode(self) -> str | None: ...
    @property
    def fallback_reason(self) -> str | None: ...
    def fileno(self) -> int: ...
    def read_segments(
        self,
        engine: Engine,
        segments: list[_Segment],
        owners: _Owners,
        streams: _Streams,
        checksum: bool = False,
    ) -> dict[str, Any]:
        """Read (file offset, address, nbytes, device) ranges in one engine pass; with
        ``checksum``, "crc32" lists each segment's CRC-32 (None: not via host)."""
    def write_segments(
        self,
        engine: Engine,
        segments: list[_Segment],
        owners: _Owners,
        streams: _Streams,
        file_len: int | None = None,
        checksum: bool = False,
    ) -> dict[str, Any]:
        """Write (file offset, address, nbytes, device) ranges in one engine pass."""
    def write_storages(
        self,
        engine: Engine,
        storages: list[tuple[str, int, int, int]],
        owners: _Owners,
        streams: _Streams,
    ) -> dict[str, Any]:
        """Into a torch.save archive torch wrote here under skip_data: each storage's
        bytes into its record, then the records' CRC-32s."""

@final
class BufferRegistration:
    """A cuFileBufRegister registration; holds the object owning its memory."""

    def close(self) -> None: ...

@final
class HostMemory:
    """Fresh private anonymous memory, advised MADV_HUGEPAGE before its first touch
    (unless CKPTIO_HUGE_PAGES=0); unmapped when the object goes."""

    def __new__(cls, nbytes: int, huge: bool = True) -> Self: ...
    @property
    def addr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def huge(self) -> bool: ...
    def huge_bytes(self) -> int | None:
        """Bytes of it now in huge pages (/proc/self/smaps)."""

def advise_huge(addr: int, nbytes: int, shared: bool) -> bool:
    """MADV_HUGEPAGE on untouched memory where the host allows it; whether it asked."""

def detach_mapping(addr: int, nbytes: int, path: str | os.PathLike[str], fd: int) -> None:
    """Make torch's private mapping ``[addr, addr + nbytes)`` of ``path`` (open as
    ``fd``) anonymous memory with the same bytes at the same address (FormatError:
    the file shrank; ValueError: the range is not private writable mappings of it)."""

@final
class HostPin:
    """Pinning state of host memory of ``owner`` (held), page-locked whole by the first copy;
    ``[addr, addr + nbytes)`` must lie inside ``owner``'s host memory (ValueError)."""

    def __new__(
        cls, owner: Any, addr: int, nbytes: int, pin: bool = True, chunk_size: int = 67108864
    ) -> Self: ...
    @property
    def nbytes(self) -> int: ...
    def pinned_bytes(self) -> int: ...
    def close(self) -> None: ...

def stage_copy(
    copies: list[tuple[int, int, HostPin, int, int]], owners: _Owners, threads: int = 8
) -> dict[str, Any]:
    """Copy (src address, src device, pin, dst offset, nbytes) jobs in parallel; sources
    inside ``owners``, destinations disjoint from each other and from host sources."""

def stage_pin(pins: list[HostPin], threads: int = 8) -> int:
    """Pin every one of ``pins`` not yet pinned; returns the bytes now pinned."""

def stage_device_copy(
    device: int, stream: int, copies: list[tuple[int, int, int]], owners: _Owners
) -> None:
    """Queue (dst, src, nbytes) device-to-device copies on a raw CUstream; returns at once
    (the caller keeps both ranges alive until the stream has run them). Both ranges must
    lie in CUDA memory of ``owners`` on ``device``."""

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
        made: tuple[list[Callable[[], Any]], list[Any], list[int]] | None = None,
    ) -> Any:
        """Make the object: ``rebuild_tensor(storage index, offset, size, stride,
        requires_grad, hooks, need, contiguous)`` per tensor (the storage elements
        the view needs, -1 for a view no checkpoint holds, and whether it is
        row-major), ``rebuild_parameter(tensor, requires_grad, hooks)`` per Parameter.
        ``made``: (per storage, a maker of an empty tensor of its dtype and device;
        the storages; the elements each holds): the tensors that fit their storage
        are made natively (``new().set_(...)``), the rest by ``rebuild_tensor``."""

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
    def dump(self, obj: Any) -> tuple[bytes, list[tuple[str, int, int, int, Any]]] | None:
        """(data.pkl's bytes, [(storage key, address, nbytes, device or -1, storage)]) or None."""

def clean_temps(folder: _Path) -> list[str]:
    """Remove the temp files of dead saves in ``folder``; the names removed."""

def cufile_register_buffer(owner: Any, addr: int, nbytes: int) -> BufferRegistration:
    """Register ``[addr, addr + nbytes)``, inside ``owner``'s CUDA memory, with cuFile."""

def info(folder: _Path | None = None) -> dict[str, Any]:
    """libcuda, libcufile, pinned memory held and its cap, huge pages, and (for
    ``folder``) O_DIRECT / cuFile handle support."""

def _set_fault(point: str, errno: int, nth: int = 1) -> None:
    """Test only (CKPTIO_TEST_FAULTS=1 at start): fail the nth next hit of a fault point."""

def _set_truncation(point: str, length: int, nth: int = 1) -> None:
    """Test only: at the nth next hit of a fault point, truncate the file to ``length``."""

def _clear_faults() -> list[str]:
    """Test only: drop pending faults, stop recording; the points whose fault never fired."""

def _record_ops() -> None:
    """Test only: log every fault point reached, in order."""

def _op_log() -> list[str]:
    """Test only: the points logged since _record_ops ("point file-name")."""

# Object storage (src/binding/store.rs): URLs s3:// gs:// az://; options are the
# client's keys (and max_retries, retry_timeout) over the standard variables.
def store_upload(
    url: str,
    path: _Path,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
) -> dict[str, Any]:
    """Upload the file at ``path`` as one multipart upload (its completion is the commit)."""

def store_download(
    url: str,
    path: _Path,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
) -> dict[str, Any]:
    """Download ``url`` into a new file at ``path`` by ranged GETs of one version."""

def store_put(
    url: str,
    data: bytes,
    options: dict[str, Any] | None = None,
    *,
    create: bool = False,
    if_match: str | None = None,
) -> dict[str, Any]:
    """One PUT, conditional where asked (else CommitConflictError)."""

def store_get(url: str, options: dict[str, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
    """A small object's bytes and version."""

def store_head(url: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Size and version (e_tag) of an object."""

def store_list(
    url: str, options: dict[str, Any] | None = None
) -> list[tuple[str, int, str | None, float]]:
    """Every object under the folder ``url``: (URL, size, ETag, the store's
    time of its last change in seconds since the epoch)."""

def store_read(
    url: str,
    offset: int,
    length: int,
    options: dict[str, Any] | None = None,
    e_tag: str | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """``length`` bytes from ``offset`` (of the version ``e_tag``), and size and version."""

def store_crc32(
    url: str,
    ranges: list[tuple[int, int]],
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
    e_tag: str | None = None,
) -> list[int]:
    """The CRC-32 of each (offset, length) range of an object, in bounded memory."""

def store_read_into(
    url: str,
    segments: list[_Segment],
    owners: _Owners,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
    e_tag: str | None = None,
    streams: list[tuple[int, int]] = ...,
    crc: bool = False,
) -> dict[str, Any]:
    """(object offset, address, nbytes, device) segments read straight into host or CUDA
    memory; "host_buffers": "pinned" or "pageable" where CUDA memory was read, else None."""

def store_upload_archive(
    url: str,
    entries: list[tuple[str, bytes | tuple[int, int, int], int]],
    owners: _Owners,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
    streams: list[tuple[int, int]] = ...,
) -> dict[str, Any]:
    """A torch.save archive uploaded part by part straight from host or CUDA memory;
    "host_buffers" as for ``store_read_into``."""

def store_upload_image(
    url: str,
    head: bytes,
    segments: list[_Segment],
    owners: _Owners,
    total: int,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
    streams: list[tuple[int, int]] = ...,
    patches: list[tuple[int, int]] = ...,
) -> dict[str, Any]:
    """An object of header bytes and host or CUDA memory segments uploaded part by
    part; ``patches``: (segment index, object offset) where a segment's CRC-32 goes."""

@final
class ObjectWriter:
    """An object written as a byte stream of a size not known ahead: parts uploaded
    as they fill, ``commit`` completes the multipart upload, ``abort`` removes it."""

    def __new__(
        cls,
        url: str,
        options: dict[str, Any] | None = None,
        threads: int = 8,
        chunk: int = 16777216,
    ) -> Self: ...
    def write(self, data: bytes) -> int: ...
    def write_memory(self, address: int, nbytes: int, owners: _Owners) -> int: ...
    def tell(self) -> int: ...
    def commit(self) -> dict[str, Any]: ...
    def abort(self) -> None: ...
    @property
    def closed(self) -> bool: ...

def store_upload_zstd(
    url: str,
    items: list[tuple[bytes, int, int, bytes, list[int]]],
    owners: _Owners,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
    workers: int = 4,
    level: int = 3,
) -> dict[str, Any]:
    """Each item (as ``AtomicWriter.write_zstd`` takes them) as one zstd frame, the
    frames uploaded back to back as they are made; with "spans": [(offset, length)]."""

def store_torch_map(
    url: str,
    options: dict[str, Any] | None = None,
    threads: int = 8,
    chunk: int = 16777216,
    tail: int = 1048576,
) -> tuple[
    dict[str, Any],
    str,
    list[tuple[str, int, int, int | None]],
    dict[str, bytes],
    list[tuple[str, int, int]],
]:
    """A torch.save archive in a store mapped in few requests: size and version,
    prefix, (record, data offset, size), the small records' bytes, and
    (storage record, local header offset, predicted data offset)."""

def zip_headers_match(heads: list[tuple[str, int, int]], bytes: bytes) -> list[str]:
    """The records of ``heads`` whose local header (in ``bytes``, back to back)
    does not put their data at the predicted offset."""

def store_delete(url: str, options: dict[str, Any] | None = None) -> None:
    """Remove an object (a missing one is not an error)."""
