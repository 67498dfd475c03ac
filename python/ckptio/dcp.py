"""``torch.distributed.checkpoint`` storage through the ckptio engine.

:class:`FileSystemWriter` and :class:`FileSystemReader` are drop-in
replacements for DCP's: same constructor arguments, same files
(``__{rank}_{n}.distcp`` plus ``.metadata``), same item encoding (each tensor
item is a complete ``torch.save`` zip of that tensor), so checkpoints move
freely between them and torch's own reader and writer. What changes is how the
bytes move:

- Each item starts at a 4 KiB boundary of its file and its data at a 4 KiB
  boundary too, so tensor bytes go straight from tensor memory (host or CUDA)
  to the file with O_DIRECT or cuFile, in parallel chunks on the engine's
  threads; no host copy of the whole shard, no per-item Python write loop.
- Data files and ``.metadata`` are written crash-safely (temp file, fsync,
  rename, fsync of the folder): the metadata of a checkpoint only appears once
  every data file it names is durable.
- The reader maps each item's zip header once and reads tensor bytes straight
  into the destination tensors, GPU included (the planner's tensors, or a
  temporary on the same device when the request is a strided slice).

torch's ``_extensions`` and ``serialization_format`` are taken too. With
torch's ``ZStandard`` extension alone, each item becomes one zstd frame made in
Rust on the engine's thread count (tensors copied to host memory first), the
frames torch's reader decodes; other stream transforms and
``SerializationFormat.SAFETENSORS`` are written by torch's own code (bytes
through Python), and items with transforms are read by torch's code.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import os
import pickle
import struct
from typing import Any, NamedTuple

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    _FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader as _TorchReader,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptio import _native, _transfer
from ckptio.serialization import (
    _CONFIG_LOCK,
    STORAGE_ALIGNMENT,
    _device_code,
    _direct_arg,
    _engine,
    _storage_alignment,
)
from ckptio.staging import BlockingAsyncStager

try:  # torch >= 2.7: stream transforms of DCP items
    from torch.distributed.checkpoint._extension import ZStandard as _ZStandard
except ImportError:  # pragma: no cover - older torch
    _ZStandard = None
try:  # torch >= 2.8: the items' serialization format
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - older torch
    SerializationFormat = None  # type: ignore[assignment,misc]

__all__ = ["FileSystemWriter", "FileSystemReader"]

# What this torch's writer and reader take (the GPU machine runs an older torch).
_WRITER_ARGS = inspect.signature(_FileSystemWriter.__init__).parameters
_READER_ARGS = inspect.signature(_TorchReader.__init__).parameters

_ALIGN = STORAGE_ALIGNMENT
_DCP_VERSION: str | None = getattr(_fs, "CURRENT_DCP_VERSION", None)
_METADATA = ".metadata"


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _torch_args(accepted: Any, **given: Any) -> dict[str, Any]:
    """The given (torch) arguments this torch's class takes; a value set for one
    it lacks is an error rather than silently dropped."""
    out = {}
    for k, v in given.items():
        if k in accepted:
            if v is not None:
                out[k] = v
        elif v is not None:
            raise TypeError(f"{k} needs a newer torch (torch {torch.__version__} lacks it)")
    return out


class _SparseSink(io.RawIOBase):
    """A write-only stream that keeps what is written and skips what is seeked
    over: torch.save under skip_data seeks over each record's data, which a
    BytesIO would fill with zeros (GiBs of them for a large item)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.parts: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.parts.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


class _Item(NamedTuple):
    head: bytes  # the zip up to the data
    data_off: int
    tail: bytes  # the zip after the data
    length: int
    crc_at: tuple[int, ...]  # offsets in ``tail`` of the data record's CRC-32 fields


def _crc_fields(tail: bytes, name: bytes) -> tuple[int, ...]:
    """Where the CRC-32 of record ``name`` sits in a record's tail: its data
    descriptor (first) and its central-directory entry."""
    at = []
    if tail[:4] == b"PK\x07\x08":
        at.append(4)
    i = tail.find(b"PK\x01\x02")
    while i >= 0:
        n, x, c = struct.unpack_from("<HHH", tail, i + 28)
        if tail[i + 46 : i + 46 + n] == name:
            at.append(i + 16)
            break
        i = tail.find(b"PK\x01\x02", i + 46 + n + x + c)
    return tuple(at)


@functools.lru_cache(maxsize=4096)
def _item_zip(dtype: torch.dtype, shape: tuple[int, ...]) -> _Item:
    """The torch.save zip of a contiguous CPU tensor of this dtype and shape, at
    4 KiB storage alignment: byte for byte what torch.save writes, but for the
    data and its CRC-32 (filled in by the writer). The same for every tensor of
    that dtype and shape, hence the cache."""
    shell = torch.empty(shape, dtype=dtype)  # untouched pages: costs nothing
    sink = _SparseSink()
    with _CONFIG_LOCK, _storage_alignment(_ALIGN), torch.serialization.skip_data():
        torch.save(shell, sink)
    nbytes = shell.numel() * shell.element_size()
    head, tail = bytearray(), bytearray()
    for pos, data in sink.parts:
        if pos == len(head):
            head += data
        else:
            tail += data
    data_off = len(head)
    if nbytes == 0:
        return _Item(bytes(head + tail), data_off, b"", len(head) + len(tail), ())
    if sink.parts and sink.parts[-1][0] + len(sink.parts[-1][1]) != data_off + nbytes + len(tail):
        raise AssertionError("unexpected torch.save layout under skip_data")
    crc_at = _crc_fields(bytes(tail), b"archive/data/0")
    return _Item(bytes(head), data_off, bytes(tail), data_off + nbytes + len(tail), crc_at)


class FileSystemWriter(_FileSystemWriter, BlockingAsyncStager):  # type: ignore[misc]
    """DCP's ``FileSystemWriter`` with ckptio's engine under it (see the module doc).

    Takes torch's arguments (``path, single_file_per_rank=True, sync_files=True,
    thread_count=1, per_thread_copy_ahead, cache_staged_state_dict=False,
    overwrite=True, _extensions=None, serialization_format=TORCH_SAVE``, the last
    two where this torch has them) plus ckptio's ``threads``, ``chunk_size``,
    ``direct`` and ``backend`` (see ``ckptio.save``). ``thread_count`` still sets
    files per rank; the engine's threads move the bytes of each file in
    parallel. Data files are always fsynced (``sync_files`` is kept for
    compatibility). ``_extensions=[ZStandard()]``: each item one zstd frame,
    compressed in Rust; other transforms and ``SerializationFormat.SAFETENSORS``
    are written by torch's own writer code (see the module doc).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Any = None,
        serialization_format: Any = None,
        *,
        threads: int | None = None,
        chunk_size: int | None = None,
        direct: bool | str | None = None,
        backend: str | None = None,
    ) -> None:
        extra = _torch_args(
            _WRITER_ARGS, _extensions=_extensions, serialization_format=serialization_format
        )
        _FileSystemWriter.__init__(
            self,
            path,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            overwrite=overwrite,
            **extra,
        )
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self._io = (threads, chunk_size, _direct_arg(direct), backend)
        self.last_stats: list[dict[str, Any]] = []

    # The writer travels to DCP's checkpoint process (PROCESS mode): the stager's
    # buffers and threads stay behind.
    def __getstate__(self) -> dict[str, Any]:
        keep = ("_cache", "_executor", "_future", "_side_streams", "_lock", "_work_lock")
        return {k: v for k, v in self.__dict__.items() if k not in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=self.cache_staged_state_dict)

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        return BlockingAsyncStager.stage(self, state_dict)

    def _extensions(self) -> tuple[Any, ...]:
        transforms = getattr(self, "transforms", None)
        return tuple(getattr(transforms, "extensions", None) or ())

    def _torch_writes(self) -> bool:
        """Whether torch's own writer code writes the data files: a serialization
        format other than torch.save, or stream transforms other than ZStandard alone."""
        fmt = getattr(self, "serialization_format", None)
        if SerializationFormat is not None and fmt not in (None, SerializationFormat.TORCH_SAVE):
            return True
        exts = self._extensions()
        return bool(exts) and not (len(exts) == 1 and type(exts[0]) is _ZStandard)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._torch_writes():
            self.last_stats = []
            fut_torch: Future[list[WriteResult]] = _FileSystemWriter.write_data(self, plan, planner)
            return fut_torch
        write_file = self._write_file_zstd if self._extensions() else self._write_file
        prefix: _StoragePrefix = plan.storage_data
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, plan.items)
        else:
            buckets = [[item] for item in plan.items]
        results: list[WriteResult] = []
        self.last_stats = []
        for n, items in enumerate(buckets):
            name = f"{prefix.prefix}{n}{DEFAULT_SUFFIX}"
            results += write_file(os.path.join(self.path, name), name, items, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self, path: str, name: str, items: list[Any], planner: SavePlanner
    ) -> list[WriteResult]:
        threads, chunk_size, direct, backend = self._io
        engine = _engine(threads, chunk_size, direct)
        writer = _native.AtomicWriter(path, direct, backend)
        try:
            offset = 0
            segments: list[tuple[int, int, int, int]] = []
            tails: list[tuple[int, _Item]] = []  # written after the data, with its CRC
            results = []
            keep = []  # tensors made contiguous here live until the write is done
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    writer.write_bytes(offset, blob)
                    length = len(blob)
                else:
                    t = data.detach()
                    if not t.is_contiguous() or t.is_conj() or t.is_neg():
                        t = t.contiguous().resolve_conj().resolve_neg()
                    keep.append(t)
                    z = _item_zip(t.dtype, tuple(t.shape))
                    nbytes = t.numel() * t.element_size()
                    writer.write_bytes(offset, z.head)
                    length = z.length
                    if nbytes:
                        dev = _device_code(t.untyped_storage(), f"item {item.index.fqn}")
                        segments.append((offset + z.data_off, t.data_ptr(), nbytes, dev))
                        tails.append((offset + z.data_off + nbytes, z))
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=length,
                        storage_data=_StorageInfo(name, offset, length),
                    )
                )
                offset = _align(offset + length)
            stats = _transfer.write(writer, engine, segments, keep, file_len=offset, checksum=True)
            # Each item's tail follows its data in the same page: write it once the
            # data is down (never a buffered and a direct write of one page at once),
            # with the CRC-32 computed as the bytes went (0, "unchecked", where
            # cuFile moved them without touching host memory).
            for (at, z), crc in zip(tails, stats.pop("crc32"), strict=True):
                tail = bytearray(z.tail)
                for pos in z.crc_at if crc is not None else ():
                    struct.pack_into("<I", tail, pos, crc)
                writer.write_bytes(at, bytes(tail))
            writer.commit()
            self.last_stats.append(dict(stats, path=path))
            del keep
            return results
        except BaseException:
            writer.abort()
            raise

    def _write_file_zstd(
        self, path: str, name: str, items: list[Any], planner: SavePlanner
    ) -> list[WriteResult]:
        """A data file of zstd frames, one per item (torch's ZStandard transform),
        compressed and written in Rust; tensors are copied to host memory first."""
        threads, chunk_size, direct, backend = self._io
        engine = _engine(threads, chunk_size, direct)
        descriptors = [ext.get_descriptor() for ext in reversed(self._extensions())]
        writer = _native.AtomicWriter(path, direct, backend)
        try:
            keep = []  # host copies live until the frames are written
            parts: list[tuple[bytes, int, int, bytes, list[int]]] = []
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    parts.append((blob, 0, 0, b"", []))
                    continue
                t = data.detach().to("cpu")
                if not t.is_contiguous() or t.is_conj() or t.is_neg():
                    t = t.contiguous().resolve_conj().resolve_neg()
                keep.append(t)
                z = _item_zip(t.dtype, tuple(t.shape))
                nbytes = t.numel() * t.element_size()
                if nbytes:
                    parts.append((z.head, t.data_ptr(), nbytes, z.tail, list(z.crc_at)))
                else:
                    parts.append((z.head, 0, 0, b"", []))
            spans = writer.write_zstd(engine, 0, parts, keep)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        del keep
        self.last_stats.append(
            {"path": path, "bytes": sum(n for _, n in spans), "compressed": "zstd"}
        )
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(name, off, length, transform_descriptors=descriptors),
            )
            for item, (off, length) in zip(items, spans, strict=True)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` (or ``__{rank}.metadata``) crash-safely: it appears, in
        full, only after every data file is durable."""
        if _DCP_VERSION is not None:
            metadata.version = _DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None
        name = f"__{self.rank}{_METADATA}" if per_rank else _METADATA
        w = _native.AtomicWriter(os.path.join(self.path, name), "off")
        try:
            w.write_bytes(0, pickle.dumps(metadata))
            w.commit()
        except BaseException:
            w.abort()
            raise


class FileSystemReader(_TorchReader):
    """DCP's ``FileSystemReader`` with ckptio's engine under it: reads checkpoints
    written by either writer, tensor bytes straight into the destination tensors.

    ``threads``, ``chunk_size``, ``direct``, ``backend``: as for ``ckptio.load``.
    ``_extension_registry`` is torch's; items written with stream transforms
    (compressed) are read by torch's reader code, the rest by the engine.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        _extension_registry: Any = None,
        *,
        threads: int | None = None,
        chunk_size: int | None = None,
        direct: bool | str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(path, **_torch_args(_READER_ARGS, _extension_registry=_extension_registry))
        self._io = (threads, chunk_size, _direct_arg(direct), backend)
        self._layouts: dict[Any, tuple[torch.Tensor, int]] = {}
        self.last_stats: list[dict[str, Any]] = []

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self._layouts = {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        transformed = []
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                transformed.append(req)
                continue
            per_file.setdefault(info.relative_path, []).append(req)
        self.last_stats = []
        if transformed:  # decoded by torch's reader code (its extension registry)
            super().read_data(dataclasses.replace(plan, items=transformed), planner).wait()
        for rel, reqs in per_file.items():
            self._read_file(os.path.join(self.path, rel), reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _layout(self, f: io.BufferedReader, path: str, info: _StorageInfo) -> tuple[Any, int]:
        """(meta tensor as saved, absolute file offset of its storage) of an item."""
        key = (path, info.offset)
        got = self._layouts.get(key)
        if got is None:
            try:
                meta = torch.load(
                    _fs._create_file_view(f, info.offset, info.length),
                    map_location="meta",
                    weights_only=True,
                )
            except Exception as e:
                raise _native.FormatError(
                    f"{path}: item at bytes {info.offset}..+{info.length} is not a "
                    f"torch.save archive of a tensor: {e}"
                ) from e
            if not isinstance(meta, torch.Tensor):
                raise _native.FormatError(
                    f"{path}: item at bytes {info.offset} holds {type(meta).__name__}, not a tensor"
                )
            off = meta.untyped_storage()._checkpoint_offset
            if off is None:
                raise _native.FormatError(f"{path}: no data offset for item at {info.offset}")
            got = self._layouts[key] = (meta, info.offset + off)
        return got

    def _read_file(self, path: str, reqs: list[Any], planner: LoadPlanner) -> None:
        threads, chunk_size, direct, backend = self._io
        engine = _engine(threads, chunk_size, direct)
        dev_file = _native.DeviceFile(path, False, direct, backend)
        segments: list[tuple[int, int, int, int]] = []
        owners: list[torch.Tensor] = []
        commits: list[tuple[Any, torch.Tensor, torch.Tensor | None, Any]] = []
        with open(path, "rb") as f:
            for req in reqs:
                info: _StorageInfo = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    f.seek(info.offset)
                    planner.load_bytes(req, io.BytesIO(f.read(info.length)))
                    continue
                meta, data_off = self._layout(f, path, info)
                target = planner.resolve_tensor(req).detach()
                src = narrow_tensor_by_index(meta, req.storage_offsets, req.lengths)
                if tuple(target.shape) != tuple(src.shape):
                    raise _native.FormatError(
                        f"{path}: item {req.storage_index} has shape {tuple(src.shape)}, "
                        f"the destination {tuple(target.shape)}"
                    )
                if target.dtype != src.dtype:
                    raise _native.FormatError(
                        f"{path}: item {req.storage_index} is {src.dtype}, "
                        f"the destination {target.dtype}"
                    )
                isz = src.element_size()
                dev = _device_code(target.untyped_storage(), f"destination of {req.storage_index}")
                if src.is_contiguous() and target.is_contiguous() and target.numel():
                    # Straight into the destination.
                    start = data_off + src.storage_offset() * isz
                    segments.append((start, target.data_ptr(), target.numel() * isz, dev))
                    owners.append(target)
                    commits.append((req, target, None, None))
                elif target.numel() == 0:
                    commits.append((req, target, None, None))
                else:
                    # A strided request: read the item's storage once into a
                    # temporary on the destination device, then copy the slice.
                    nbytes = meta.untyped_storage().nbytes()
                    tmp = torch.empty(nbytes, dtype=torch.uint8, device=target.device)
                    segments.append((data_off, tmp.data_ptr(), nbytes, dev))
                    owners.append(tmp)
                    commits.append((req, target, tmp, src))
            # The destinations may still be in use by work queued on the current
            # streams: the engine's copies are ordered after it.
            stats = _transfer.read(dev_file, engine, segments, owners) if segments else {}
        self.last_stats.append(dict(stats, path=path))
        for req, target, tmp, src in commits:
            if tmp is not None:
                view = tmp.view(src.dtype).as_strided(src.shape, src.stride(), src.storage_offset())
                target.copy_(view)
            planner.commit_tensor(req, target)
