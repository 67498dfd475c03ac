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
- A save is published by one atomic step. Its data files get names of their
  own generation (``__{rank}_{token}_{n}.distcp``, the token picked by the
  coordinator, so every rank's files carry it), each written crash-safely
  (temp file, fsync, rename, fsync of the folder); ``.metadata`` is replaced
  last, the same way, once every data file is durable: a save killed or
  failed at any point leaves the previous checkpoint whole and loadable (its
  files are never touched before that step). After it, the data files of
  earlier generations (ckptio's names and torch's ``__{rank}_{n}.distcp``)
  that the new ``.metadata`` does not name are removed, and so are temp files
  of dead saves; other files are left alone. Readers follow ``.metadata``'s
  relative paths, torch's included. Two saves into one folder at once are not
  supported (as with torch's writer): the later commit wins and may remove the
  other's files.
- Into an object store (a URL), each data file is uploaded part by part
  straight from the tensors' memory, byte for byte the file the local writer
  makes (CRC-32s included); ``.metadata`` is the commit, a conditional PUT.
- The reader maps each item's zip header once and reads tensor bytes straight
  into the destination tensors, GPU included (the planner's tensors, or a
  temporary on the same device when the request is a strided slice); from an
  object store by ranged GETs, each item's zip head predicted from
  ``.metadata`` and checked in the same GETs (no local copy).
- ``DefaultLoadPlanner`` (``dcp.load(..., planner=...)``) makes torch's plans
  (the same reads, in the same order) without torch's per-item checks where
  the state dict's entries are plain tensors stored whole
  (``ckptio.loading.planning``); with torch's default planner too (or a
  subclass that keeps its lookup), the reader finds each read's destination
  straight in the planner's state dict.
- Nothing in the folder is trusted: ``.metadata`` is unpickled with an
  allow-list (DCP's metadata classes, torch sizes, dtypes and layouts, plain
  containers and values; ``FormatError`` naming the file and the global
  otherwise; ``trusted_metadata=True`` for folders whose metadata holds custom
  planner data), every relative path must stay inside the folder (no ``..``,
  no absolute path, no symbolic link out), and with ``verify=True`` every
  item's CRC-32s are checked (in the I/O threads, for the tensor bytes).

Errors: DCP wraps a rank's exception in its ``CheckpointException``; the
original (an ``OSError`` naming the file, a ``ckptio.FormatError`` naming the
file and the item) is ``exc.failures[rank][0]``, for a ``.metadata`` that is
missing, cannot be read or is refused too (on every torch version: see
``FileSystemReader.read_metadata``); ``FileSystemReader(path).read_metadata()``
raises the typed error itself.

torch's ``_extensions`` and ``serialization_format`` are taken too. With
torch's ``ZStandard`` extension alone, each item becomes one zstd frame made in
Rust on the engine's thread count (tensors copied to host memory first), the
frames torch's reader decodes; other stream transforms and
``SerializationFormat.SAFETENSORS`` are written by torch's own code (bytes
through Python), and items with transforms are read by torch's code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import pickle
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem as _fs
from torch.distributed.checkpoint import metadata as _md
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

from ckptio import _native
from ckptio.errors import FormatError, corrupt
from ckptio.formats import dcp as fmt
from ckptio.formats import torchzip
from ckptio.formats.dcp import read_metadata
from ckptio.io import devices, memory, paths, remote, transfer
from ckptio.io.engines import IoOptions
from ckptio.io.paths import inside, open_regular
from ckptio.io.units import align_up
from ckptio.loading import planning, sharing
from ckptio.loading.planning import DefaultLoadPlanner
from ckptio.staging import BlockingAsyncStager

_ZStandard: type[Any] | None  # (None on older torch)
try:  # torch >= 2.7: stream transforms of DCP items
    from torch.distributed.checkpoint._extension import ZStandard as _ZStandard
except ImportError:  # pragma: no cover - older torch
    _ZStandard = None
try:  # torch >= 2.8: the items' serialization format
    from torch.distributed.checkpoint.filesystem import SerializationFormat
except ImportError:  # pragma: no cover - older torch
    SerializationFormat = None  # type: ignore[assignment,misc]

__all__ = ["FileSystemWriter", "FileSystemReader", "DefaultLoadPlanner"]

# What this torch's writer and reader take (the GPU machine runs an older torch).
_WRITER_ARGS = inspect.signature(_FileSystemWriter.__init__).parameters
_READER_ARGS = inspect.signature(_TorchReader.__init__).parameters

_DCP_VERSION: str | None = getattr(_fs, "CURRENT_DCP_VERSION", None)

#: Stored bytes of items with stream transforms a store reader fetches into
#: host memory before decoding them (an item larger than this: alone).
CODED_BATCH = 256 << 20


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

    ``path`` (or ``checkpoint_id``) may be an object URL (``s3://bucket/prefix``,
    with ``storage_options``): each rank writes its data files to a local
    scratch folder and uploads them (objects under names of this save's own);
    the coordinator then puts ``.metadata`` in one conditional PUT (If-Match on
    the ``.metadata`` the save started from, If-None-Match for a new
    checkpoint), the commit: a writer that raced this one gets
    ``ckptio.CommitConflictError`` (this save's data objects removed). A 412
    where ``.metadata`` holds this save's own bytes (its PUT landed, the reply
    was lost and the retry found it there) is this save's commit. After the
    commit, data objects that neither the new nor the previous ``.metadata``
    names are removed.
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
        storage_options: remote.StorageOptions = None,
    ) -> None:
        extra = _torch_args(
            _WRITER_ARGS, _extensions=_extensions, serialization_format=serialization_format
        )
        remote.check_options(path, storage_options)
        self._store = _Remote(path, storage_options)
        path = self._store.where(path)
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
        self._io = IoOptions.of(threads, chunk_size, direct, backend)
        self._file_stats: list[dict[str, Any]] = []
        self._file_system()

    # Its own stats under the name a writer's have: the stager's (a dict, set
    # by stage() while a write may be appending here) stay in last_stage_stats.
    @property  # type: ignore[override]  # the stager's is a dict: see above
    def last_stats(self) -> list[dict[str, Any]]:
        """Per data file of the last write: its path and what moving it did."""
        return self._file_stats

    @last_stats.setter
    def last_stats(self, value: list[dict[str, Any]]) -> None:
        self._file_stats = value

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

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(self._store.reset(checkpoint_id))
        self._file_system()

    def _file_system(self) -> None:
        """torch's file system for a folder, or for a store one that makes no
        scratch folder in ``prepare_local_plan``: only what writes into it
        does (a save streamed to the store writes nothing locally)."""
        self.fs = _fs.FileSystem() if self._store.url is None else _StoreScratch()

    def storage_meta(self) -> Any:
        meta = super().storage_meta()
        if self._store.url is not None and meta is not None:
            meta.checkpoint_id = self._store.url
        return meta

    def _metadata_exists(self) -> bool:
        """torch's check before a save (``overwrite=False`` refuses an existing
        checkpoint), of the store where the checkpoint is a URL."""
        if self._store.url is None:
            return bool(super()._metadata_exists())
        name = os.path.basename(
            os.fspath(self._get_metadata_path(None if self.use_collectives else 0))
        )
        try:
            remote.head(self._store.join(name), self._store.options)
        except FileNotFoundError:
            return False
        return True

    def _token(self) -> str:
        """A generation token no file in the folder (or the store) carries yet."""
        try:
            taken = "\n".join(os.listdir(self.path))
        except OSError:
            taken = ""
        if self._store.url is not None:
            taken += "\n".join(
                u for u, _, _, _ in remote.listing(self._store.url, self._store.options)
            )
        while True:
            token = secrets.token_hex(4)
            if f"_{token}_" not in taken:
                return token

    def _metadata_name(self) -> str:
        """What ``finish`` commits: ``.metadata``, or without collectives (as
        torch's writer judges it) this rank's ``__{rank}.metadata``."""
        if self.rank is not None and not self.use_collectives:
            return f"__{self.rank}{fmt.METADATA}"
        return fmt.METADATA

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        if plan.storage_data is not None:  # without collectives: this rank's own names
            rank = self.rank if self.rank is not None else 0
            plan = dataclasses.replace(
                plan, storage_data=_StoragePrefix(f"__{rank}_{self._token()}_")
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator names this generation's files: every rank's prefix carries the token.
        # (Without collectives each rank runs this for itself, and commits its own metadata.)
        name = self._metadata_name()
        self._open_guard(name)
        self._store.remember(name)
        token = self._token()
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{token}_"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def _open_guard(self, name: str) -> None:
        """Before any rank writes: the metadata file's temp, held (locked) until
        :meth:`finish` commits into it, marks the save as in flight; no sweep
        removes a data file while it lives (``formats.dcp.sweep``). Then the
        leftovers of dead or failed saves go (this one's own guard aside): on a
        nearly full disk they would make this save fail too. (Saves to a store
        commit there: their scratch folder needs no guard.)"""
        if self._store.url is not None:
            return
        guard = _guards.take(os.path.join(os.fspath(self.path), name))
        fmt.sweep(os.fspath(self.path), own=guard.tmp_path)

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
        if self._store.url is None:
            return self._write_files(plan, planner)
        if not self._torch_writes():
            return self._upload_files(plan, planner)
        # torch's writer code writes each data file into an object as it goes
        # (no local copy); the store's completion is the durability, no fsync.
        streams = _ObjectStreams(self._store)
        fs, sync = self.fs, self.sync_files
        # (a duck-typed FileSystem: what torch's writer calls of it)
        self.fs, self.sync_files = cast(_fs.FileSystem, streams), False
        try:
            return self._write_files(plan, planner)
        except BaseException:
            self._store.remove(streams.published)
            raise
        finally:
            self.fs, self.sync_files = fs, sync
            shutil.rmtree(self.path, ignore_errors=True)  # the scratch folder, unused

    def _buckets(self, plan: SavePlan) -> list[tuple[str, list[Any]]]:
        """Each data file of this rank's plan: (name, items)."""
        prefix: _StoragePrefix = plan.storage_data
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, plan.items)
        else:
            buckets = [[item] for item in plan.items]
        return [(f"{prefix.prefix}{n}{DEFAULT_SUFFIX}", b) for n, b in enumerate(buckets)]

    def _upload_files(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """``write_data`` into a store with no local copy: each data file
        uploaded straight from memory (``_upload_file``; ``_upload_file_zstd``
        for torch's ZStandard transform); on a failure, the files this rank
        uploaded go before the error does."""
        results: list[WriteResult] = []
        self.last_stats = []
        done: list[str] = []
        upload = self._upload_file_zstd if self._extensions() else self._upload_file
        try:
            for name, items in self._buckets(plan):
                results += upload(name, items, planner)
                done.append(name)
        except BaseException:
            self._store.remove(done)
            raise
        finally:
            shutil.rmtree(self.path, ignore_errors=True)  # the scratch folder, unused
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._torch_writes():
            self.last_stats = []
            fut_torch: Future[list[WriteResult]] = _FileSystemWriter.write_data(self, plan, planner)
            return fut_torch
        write_file = self._write_file_zstd if self._extensions() else self._write_file
        results: list[WriteResult] = []
        self.last_stats = []
        written: list[str] = []
        try:
            for n, (name, items) in enumerate(self._buckets(plan)):
                path = os.path.join(self.path, name)
                # Temp files of dead saves go before this rank's first file, once.
                results += write_file(path, name, items, planner, sweep=n == 0)
                written.append(path)
        except BaseException:
            # The save failed: what it wrote goes before the error does, and its
            # guard (where this rank holds it), so that others' leftovers can go.
            for path in written:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            _guards.drop_folder(os.fspath(self.path))
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _image(
        self, name: str, items: list[Any], planner: SavePlanner
    ) -> tuple[fmt.FileImage, list[WriteResult], list[torch.Tensor]]:
        """The data file ``name`` of ``items`` laid out (``FileImage``), its
        write results, and the tensors made contiguous here (they must live
        until the bytes are written)."""
        image = fmt.FileImage()
        results = []
        keep: list[torch.Tensor] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                offset = align_up(image.end, torchzip.TORCH_ALIGNMENT)
                image.bytes_at(offset, blob)
                length = len(blob)
            else:
                t = cast(torch.Tensor, data).detach()  # not BYTE_IO: a tensor
                if not t.is_contiguous() or t.is_conj() or t.is_neg():
                    t = t.contiguous().resolve_conj().resolve_neg()
                keep.append(t)
                nbytes = t.numel() * t.element_size()
                align = fmt.ALIGN if nbytes >= fmt.PACK_ITEMS else torchzip.TORCH_ALIGNMENT
                z = fmt.item_zip(t.dtype, tuple(t.shape), align)
                offset = align_up(image.end, align)
                image.bytes_at(offset, z.head)
                length = z.length
                if nbytes:
                    dev = devices.device_code(t.untyped_storage(), f"item {item.index.fqn}")
                    tail = offset + z.data_off + nbytes
                    crc_at = [tail + at for at in z.crc_at]
                    image.memory_at(offset + z.data_off, t.data_ptr(), nbytes, dev, crc_at)
                    image.bytes_at(tail, z.tail)
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=length,
                    storage_data=_StorageInfo(name, offset, length),
                )
            )
        return image, results, keep

    def _write_file(
        self, path: str, name: str, items: list[Any], planner: SavePlanner, sweep: bool
    ) -> list[WriteResult]:
        opts = self._io
        engine = opts.engine()
        writer = _native.AtomicWriter(path, opts.direct, opts.backend, sweep)
        try:
            image, results, keep = self._image(name, items, planner)
            buf = torch.frombuffer(image.blob, dtype=torch.uint8) if image.blob else None
            segments = image.segments(buf.data_ptr() if buf is not None else 0)
            # One pass: headers, data and tails; each item's CRC-32 goes into its
            # data descriptor and central directory entry as its bytes pass (0,
            # "unchecked", where cuFile moved them without touching host memory).
            stats = transfer.write(
                writer,
                engine,
                segments,
                [*keep, buf] if buf is not None else keep,
                file_len=image.end,
                patches=image.patches,
            )
            writer.commit()
            self.last_stats.append(dict(stats, path=path))
            del keep, buf
            return results
        except BaseException:
            writer.abort()
            raise

    def _upload_file(self, name: str, items: list[Any], planner: SavePlanner) -> list[WriteResult]:
        """The data file ``name`` of ``items`` uploaded to the store part by part
        straight from the tensors' memory (host or CUDA), its headers and tails
        from the image, each item's CRC-32 put into its zip as the parts pass:
        one multipart upload, whose completion makes the object."""
        image, results, keep = self._image(name, items, planner)
        buf = torch.frombuffer(image.blob, dtype=torch.uint8) if image.blob else None
        segments = image.segments(buf.data_ptr() if buf is not None else 0)
        owners = [*keep, buf] if buf is not None else keep
        url = self._store.join(name)
        stats = transfer.upload_image(
            url, b"", segments, owners, image.end, self._store.options, image.patches
        )
        self.last_stats.append(dict(stats, path=url))
        return results

    def _write_file_zstd(
        self, path: str, name: str, items: list[Any], planner: SavePlanner, sweep: bool
    ) -> list[WriteResult]:
        """A data file of zstd frames, one per item (torch's ZStandard transform),
        compressed and written in Rust; tensors are copied to host memory first."""
        opts = self._io
        engine = opts.engine()
        writer = _native.AtomicWriter(path, opts.direct, opts.backend, sweep)
        try:
            parts, keep = self._zstd_parts(items, planner)
            spans = writer.write_zstd(engine, 0, parts, keep)
            writer.commit()
        except BaseException:
            writer.abort()
            raise
        del keep
        self.last_stats.append(
            {"path": path, "bytes": sum(n for _, n in spans), "compressed": "zstd"}
        )
        return self._zstd_results(name, items, spans)

    def _upload_file_zstd(
        self, name: str, items: list[Any], planner: SavePlanner
    ) -> list[WriteResult]:
        """The data file ``name`` of zstd frames (as ``_write_file_zstd``)
        uploaded to the store as its frames are made, with no local copy: one
        multipart upload, whose completion makes the object."""
        parts, keep = self._zstd_parts(items, planner)
        url = self._store.join(name)
        threads = self._io.engine().threads
        spans, stats = transfer.upload_zstd(url, parts, keep, self._store.options, threads)
        del keep
        self.last_stats.append(dict(stats, path=url, compressed="zstd"))
        return self._zstd_results(name, items, spans)

    def _zstd_parts(
        self, items: list[Any], planner: SavePlanner
    ) -> tuple[list[tuple[bytes, int, int, bytes, list[int]]], list[torch.Tensor]]:
        """Each item as the zstd writers take it (zip head, host address,
        nbytes, zip tail, CRC-32 offsets in the tail; a bytes item whole as its
        head), and the host tensors that hold the data (they must live until
        the frames are made: tensors elsewhere are copied to host memory)."""
        keep = []
        parts: list[tuple[bytes, int, int, bytes, list[int]]] = []
        for item in items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blob = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                parts.append((blob, 0, 0, b"", []))
                continue
            t = cast(torch.Tensor, data).detach().to("cpu")  # not BYTE_IO: a tensor
            if not t.is_contiguous() or t.is_conj() or t.is_neg():
                t = t.contiguous().resolve_conj().resolve_neg()
            keep.append(t)
            z = fmt.item_zip(t.dtype, tuple(t.shape))
            nbytes = t.numel() * t.element_size()
            if nbytes:
                parts.append((z.head, t.data_ptr(), nbytes, z.tail, list(z.crc_at)))
            else:
                parts.append((z.head, 0, 0, b"", []))
        return parts, keep

    def _zstd_results(
        self, name: str, items: list[Any], spans: list[tuple[int, int]]
    ) -> list[WriteResult]:
        descriptors = [ext.get_descriptor() for ext in reversed(self._extensions())]
        return [
            WriteResult(
                index=item.index,
                size_in_bytes=length,
                storage_data=_StorageInfo(name, off, length, transform_descriptors=descriptors),
            )
            for item, (off, length) in zip(items, spans, strict=True)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Publish the save: replace ``.metadata`` (or ``__{rank}.metadata``)
        crash-safely, after every data file is durable (each rank's
        ``write_data`` committed its files before DCP gathered the results),
        then remove the data files of earlier generations."""
        if _DCP_VERSION is not None:
            metadata.version = _DCP_VERSION
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        name = self._metadata_name()
        target = os.path.join(os.fspath(self.path), name)
        data = pickle.dumps(metadata)
        files = {info.relative_path for info in storage_md.values()}
        if self._store.url is not None:
            self._store.commit(name, data, files)
            return
        guard = _guards.pop(target)
        if guard is None:  # no plan made here (a writer driven by hand)
            transfer.replace_file(target, data)
        else:
            transfer.commit_bytes(guard, data)
        # The earlier generations' data files, now named by no metadata. Best
        # effort: what cannot go now goes with the next save.
        fmt.sweep(os.fspath(self.path), written=(data, files))


class _StoreScratch(_fs.FileSystem):
    """torch's file system over a store writer's scratch folder, which
    ``write_data`` makes where files pass through it (torch makes it before
    any write)."""

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        pass


class _ObjectStreams:
    """torch's writer's file system over a store, for one ``write_data``: each
    data file an object written as torch writes it (``remote.ObjectFile``),
    published when torch closes it, aborted where writing it raises."""

    def __init__(self, store: _Remote) -> None:
        self.store = store
        self.published: list[str] = []
        self._lock = threading.Lock()

    def concat_path(self, path: Any, suffix: str) -> str:
        return suffix

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[remote.ObjectFile]:
        name = os.path.basename(os.fspath(path))
        f = remote.ObjectFile(self.store.join(name), self.store.options, publish_on_close=True)
        try:
            yield f
        except BaseException:
            f.abort()
            raise
        f.close()  # published (torch may have closed it already)
        with self._lock:
            self.published.append(name)


class _Remote:
    """A DCP checkpoint in an object store: the URL, the options, the local
    scratch folder the files pass through, and the commit (see the writer's doc)."""

    def __init__(self, path: Any, options: remote.StorageOptions) -> None:
        self.options = options
        self.url: str | None = None
        self._folder: str | None = None
        #: The commit object the save started from: (bytes, ETag), or None.
        self._base: tuple[bytes, str | None] | None = None
        self.point(path)

    def point(self, path: Any) -> None:
        self.url = os.fsdecode(os.fspath(path)).rstrip("/") if remote.is_url(path) else None

    def reset(self, checkpoint_id: Any) -> Any:
        """A new ``checkpoint_id``: what torch's reset gets (:meth:`where`)."""
        if checkpoint_id is None:
            return None
        self.point(checkpoint_id)
        return self.where(checkpoint_id)

    def where(self, path: Any) -> Any:
        """What torch's writer or reader gets as its folder: the scratch folder
        for a URL, the local path of a ``file://`` URL, else ``path`` as it is."""
        if self.url is not None:
            return self.folder()
        if isinstance(path, (str, bytes)) and paths.url_scheme(path) == "file":
            return paths.local(os.fsdecode(path))
        return path

    def folder(self) -> str:
        """The scratch folder the files pass through where they cannot go
        straight (a name of its own, made only by what writes into it: a
        straight save or load needs no writable scratch)."""
        if self._folder is None:
            self._folder = remote.scratch_name("ckptio-dcp-")
        return self._folder

    def join(self, name: str) -> str:
        assert self.url is not None
        return remote.join(self.url, name)

    def remember(self, name: str) -> None:
        """On the coordinator, before any data is written: the commit object now."""
        if self.url is None:
            return
        try:
            data, version = remote.get_bytes(self.join(name), self.options)
            self._base = (data, version["e_tag"])
        except FileNotFoundError:
            self._base = None

    def upload(self, folder: str, names: list[str]) -> None:
        done: list[str] = []
        try:
            for name in names:
                remote.upload(os.path.join(folder, name), self.join(name), self.options)
                done.append(name)
        except BaseException:
            self.remove(done)
            raise

    def download(self, folder: str, names: list[str]) -> None:
        for name in names:
            inside(folder, name, "a DCP checkpoint's file")
            remote.download(self.join(name), os.path.join(folder, name), self.options)

    def remove(self, names: Any) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                remote.delete(self.join(name), self.options)

    def commit(self, name: str, data: bytes, files: set[str]) -> None:
        """Put the commit object ``name`` conditionally (``remote.put_commit``:
        a 412 where it holds ``data`` is this save's commit); on a conflict this
        save's data objects go, but for those the commit object there names.
        Then the objects of neither generation go."""
        base = self._base

        def lost(now: bytes | None) -> None:
            # This save's data objects have names of its own: one that cannot be
            # read (or a .metadata that cannot) is no other save's.
            named = fmt.files_named(now, self.join(name)) if now is not None else None
            self.remove(files - (named or set()))

        committed = remote.put_commit(
            self.join(name), data, self.options,
            create=base is None, if_match=None if base is None else base[1], on_conflict=lost,
        )  # fmt: skip
        previous = fmt.files_named(base[0], self.join(name)) if base is not None else set()
        if previous is None:  # an old .metadata that cannot be read: remove nothing
            return
        keep = set(files) | previous
        assert self.url is not None
        remote.sweep_before(
            self.url, name, committed,
            lambda n: bool(fmt.DATA_FILE.fullmatch(n)) and n not in keep, self.options,
        )  # fmt: skip


class _Guards:
    """The metadata temp files this process's saves in flight hold (see
    ``FileSystemWriter._open_guard``), by target. A save into a folder ends
    the previous one of this process there (two at once are not supported):
    a guard left by a save that failed on another rank goes then."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _native.AtomicWriter] = {}

    def take(self, target: str) -> _native.AtomicWriter:
        self.drop(target)
        guard = _native.AtomicWriter(target, "off", None, False)
        with self._lock:
            self._held[target] = guard
        return guard

    def pop(self, target: str) -> _native.AtomicWriter | None:
        with self._lock:
            return self._held.pop(target, None)

    def drop(self, target: str) -> None:
        guard = self.pop(target)
        if guard is not None:
            guard.abort()

    def drop_folder(self, folder: str) -> None:
        with self._lock:
            targets = [t for t in self._held if os.path.dirname(t) == folder]
        for t in targets:
            self.drop(t)


_guards = _Guards()


class FileSystemReader(_TorchReader):
    """DCP's ``FileSystemReader`` with ckptio's engine under it: reads checkpoints
    written by either writer, tensor bytes straight into the destination tensors.

    ``threads``, ``chunk_size``, ``direct``, ``backend``: as for ``ckptio.load``.
    ``_extension_registry`` is torch's; items written with stream transforms
    (compressed) are read by torch's reader code, the rest by the engine.
    ``verify=True``: check every item read against its CRC-32s (its pickle and
    small records before they are decoded, its tensor bytes as the I/O threads
    read them; a request for part of a tensor then reads the whole item), and
    raise ``ckptio.FormatError`` naming the file and the item on a mismatch.
    ``last_stats`` lists per file the items ``verified`` and ``unchecked`` (no
    CRC-32 stored: cuFile-written, or a torch item without one); items with
    stream transforms, which torch's code reads, are not checked.
    ``trusted_metadata=True``: unpickle ``.metadata`` without the allow-list,
    as torch's reader does (only for folders you trust: a crafted ``.metadata``
    then runs code).

    Read once, share: in a load over a process group (``process_group``: the
    group given to ``dcp.load``, default the world), an item that every rank of
    the group reads in the same plan (a replicated tensor, unsharded state, a
    bytes item) is read from storage by one of them (balanced by bytes) and
    broadcast to the others over the group's collectives (see
    ``ckptio.loading.sharing``); items that only some ranks read (shards) are read by
    each, as before. ``share=False`` reads every item on every rank that needs
    it. ``last_share`` says per load what this rank sent and received.
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
        verify: bool = False,
        trusted_metadata: bool = False,
        share: bool = True,
        process_group: Any = None,
        storage_options: remote.StorageOptions = None,
    ) -> None:
        remote.check_options(path, storage_options)
        self._store = _Remote(path, storage_options)
        path = self._store.where(path)
        super().__init__(path, **_torch_args(_READER_ARGS, _extension_registry=_extension_registry))
        for name, v in (
            ("verify", verify),
            ("trusted_metadata", trusted_metadata),
            ("share", share),
        ):
            if not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool, not {type(v).__name__}")
        self._io = IoOptions.of(threads, chunk_size, direct, backend)
        self.verify = verify
        self.trusted_metadata = trusted_metadata
        self._layouts: dict[Any, tuple[torch.Tensor, int, int | None]] = {}
        # An item's pickle -> (its meta tensor, storage key): DCP items of one
        # dtype and shape pickle alike.
        self._metas: dict[bytes, tuple[torch.Tensor | None, str | None]] = {}
        self.last_stats: list[dict[str, Any]] = []
        self.share = share
        self.process_group = process_group
        self._sizes: dict[str, tuple[torch.dtype, int]] = {}
        self._metadata: Metadata | None = None
        # Why this reader's last read of the global ``.metadata`` failed (see read_metadata).
        self._unread: Exception | None = None
        #: The last load's sharing: items (and bytes) this rank read for the
        #: others, and received from them.
        self.last_share: dict[str, int] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(self._store.reset(checkpoint_id))
        self._layouts = {}
        self._metas = {}
        self._unread = None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if isinstance(metadata, _Unread):
            metadata.refuse()
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata
        self._sizes = {
            fqn: (md.properties.dtype, 0)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, _md.TensorStorageMetadata)
        }

    def _group(self) -> Any:
        if not (self.share and dist.is_available() and dist.is_initialized()):
            return None
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan = super().prepare_local_plan(plan)
        if self._group() is not None:  # the coordinator learns who asks for what
            plan = dataclasses.replace(plan, storage_data=_Asker(dist.get_rank()))
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        plans = super().prepare_global_plan(plans)
        schedule = self._schedule(plans)
        return [
            dataclasses.replace(p, storage_data=schedule)
            if isinstance(p.storage_data, _Asker)
            else p
            for p in plans
        ]

    def _share_key(self, req: Any) -> tuple[Any, ...] | None:
        """What identifies the bytes a request reads (None: not shared: items
        with stream transforms, which torch's code reads)."""
        info: _StorageInfo = self.storage_data[req.storage_index]
        if fmt.transformed(info):
            return None
        idx = req.storage_index
        offset = None if idx.offset is None else tuple(idx.offset)
        return (
            int(req.type.value),
            idx.fqn,
            offset,
            idx.index,
            tuple(req.storage_offsets),
            tuple(req.lengths),
        )

    def _nbytes(self, req: Any) -> int:
        if req.type == LoadItemType.BYTE_IO:
            return int(self.storage_data[req.storage_index].length)
        dtype = self._sizes[req.storage_index.fqn][0]
        n = 1
        for d in req.lengths:
            n *= int(d)
        return n * dtype.itemsize

    def _schedule(self, plans: list[LoadPlan]) -> _Shares | None:
        """On the coordinator: the items every rank of the group reads, each
        given to one of them (the least loaded so far, items largest first)."""
        group = self._group()
        if group is None or len(plans) < 2:
            return None
        askers = [p.storage_data for p in plans]
        if not all(isinstance(a, _Asker) for a in askers):
            return None
        if [a.rank for a in askers] != dist.get_process_group_ranks(group):
            return None  # dcp.load runs over another group than this reader's
        counts: dict[tuple[Any, ...], list[int]] = {}
        load = [0] * len(plans)
        sizes: dict[tuple[Any, ...], int] = {}
        for i, p in enumerate(plans):
            for req in p.items:
                key = self._share_key(req)
                if key is None:
                    continue
                if key not in sizes:
                    sizes[key] = self._nbytes(req)
                ranks = counts.setdefault(key, [])
                if not ranks or ranks[-1] != i:
                    ranks.append(i)
        everyone = list(range(len(plans)))
        shared = []
        for key, ranks in counts.items():
            if ranks == everyone:
                shared.append(key)
            else:
                for i in ranks:
                    load[i] += sizes[key]
        entries = []
        for key in sorted(shared, key=lambda k: (-sizes[k], repr(k))):
            owner = min(everyone, key=lambda i: (load[i], i))
            load[owner] += sizes[key]
            entries.append((key, owner, sizes[key]))
        return _Shares(tuple(a.rank for a in askers), tuple(entries)) if entries else None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata`` (``__{rank}.metadata`` with ``rank=``), unpickled with the
        allow-list and checked (see the module doc).

        torch's ``dcp.load`` catches this call's error, asks for the rank's own
        metadata instead, catches that error too, and then (torch 2.11) says only
        "metadata is None". So where the global read failed and the rank has no
        metadata of its own, the ``rank=`` call returns an :class:`_Unread` that
        raises the global read's error where it is used: as the reader is set up,
        or by a planner that looks at it first."""
        rank = kwargs.get("rank")
        try:
            md = self._read_metadata(rank)
        except Exception as e:
            if rank is None:
                self._unread = e  # (its traceback holds the caller's frames: kept one call)
            elif self._unread is not None and isinstance(e, FileNotFoundError):
                unread, self._unread = self._unread, None
                return _Unread(unread)
            raise
        self._unread = None
        return md

    def _read_metadata(self, rank: int | None) -> Metadata:
        path = os.fspath(self._get_metadata_path(rank))
        if self._store.url is not None:  # one GET, no local copy
            url = self._store.join(os.path.basename(path))
            raw, _ = remote.get_bytes(url, self._store.options)
            metadata = fmt.parse_metadata(raw, url, trusted=self.trusted_metadata)
        else:
            metadata = read_metadata(path, trusted=self.trusted_metadata)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = _md.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._store.url is None:
            return self._read_plan(plan, planner)
        try:  # each rank's own reads: straight from the store (_read_items)
            return self._read_plan(plan, planner)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)

    def _read_stored(
        self, items: list[Any], planner: LoadPlanner, kept: dict[int, Any] | None
    ) -> bool:
        """``read_data`` from a store with no local copy: each data file's
        version pinned by a HEAD, then ranged GETs (in batches of requests, each
        fetched while the next is planned) of each tensor request's bytes
        straight into its destination (as ``_plan_read`` places them: a strided
        or partial request through a temporary of the item's tensor) and of each
        bytes item, with the zip head of every tensor item in the same GETs.
        The head is predicted from the item's dtype and shape (``item_zip``:
        what ckptio's and torch's writers write, at either alignment) and
        compared byte for byte once in: it confirms where the data lies.
        ``verify``: each item's tail is read and compared too (but for the data
        record's CRC-32 fields: the small records' CRC-32s are then the
        predicted ones), and the data's CRC-32, computed as its bytes arrive,
        checked against the directory's (0: none stored); each non-tensor
        value's archive checked against its CRC-32s in the bytes fetched
        (``_checked_values``). False (the caller
        reads the items from a scratch copy, writing every destination again)
        where it does not apply: an item of another layout. Items with stream
        transforms are not given here (``_read_coded``). ``kept`` as for
        ``_read_items``."""
        commits: list[tuple[Any, torch.Tensor, torch.Tensor | None, Any]] = []
        blobs: list[tuple[Any, torch.Tensor]] = []
        self.last_stats = []
        for url, head, reqs in self._stored_files(items):
            values = len(blobs)  # this object's non-tensor values: blobs[values:]
            # Batches (8 items, then four times the last): GETs while the rest
            # is planned, one read at a time, the batches planned meanwhile
            # joining the read that waits (rounds of GETs are fullest so).
            reads = transfer.Pipeline.of_store(url, self._store.options, head["e_tag"], self.verify)
            batches, predicted, size = [], True, head["size"]
            claims = memory.Claims()
            try:
                for lo, hi in transfer.batch_ranges(len(reqs)):
                    batch = reqs[lo:hi]
                    plan = self._plan_stored(url, size, batch, planner, commits, blobs, claims)
                    if plan is None:
                        predicted = False
                        break
                    segments, owners, spans, got, checks = plan
                    batches.append((reads.add(segments, owners), spans, got, checks))
            except BaseException as err:
                reads.abandon(err)
                raise
            reads.wait()  # every read done; the first error raised
            # Not the layout predicted (a request, or the heads read): the
            # scratch copy reads it all again.
            if not predicted:
                return False
            done = []
            for index, spans, got, checks in batches:
                placed = _placed(spans, got.numpy().tobytes())
                if placed is None:
                    return False
                if index is None:
                    continue
                stats = reads.result(index)
                if self.verify:
                    named = [(seg, placed[field], name, at) for seg, field, name, at in checks]
                    stats = dict(stats, **_checked_items(url, named, stats.pop("crc32")))
                done.append(stats)
            if self.verify and len(blobs) > values:  # from the bytes fetched: no second GET
                checked = self._checked_values(url, blobs[values:])
                last = done.pop() if done else transfer.merged([], "store")
                done.append({**last, **{k: [*last.get(k, ()), *v] for k, v in checked.items()}})
            if done:
                self.last_stats.append(dict(transfer.merged(done), path=url))
        for req, buf in blobs:
            blob = buf.numpy().tobytes()
            planner.load_bytes(req, io.BytesIO(blob))
            if kept is not None:
                kept[id(req)] = blob
        _commit(planner, commits, kept)
        return True

    @staticmethod
    def _checked_values(url: str, blobs: list[tuple[Any, torch.Tensor]]) -> dict[str, list[str]]:
        """The non-tensor values of ``url`` read from the store (each a torch.save
        archive, as torch's planners save them, or a BytesIO's bytes as saved)
        checked as ``_value_bytes`` checks a file's: an archive's records
        against their CRC-32s in the bytes already fetched (a FormatError
        naming the object and the item on a mismatch), its name in "verified";
        other bytes in "unchecked"."""
        verified, unchecked = [], []
        for req, buf in blobs:
            name = req.storage_index.fqn
            blob = buf.numpy().tobytes()
            if blob.startswith(b"PK\x03\x04"):
                _native.check_archive(blob, f"{url}, item {name!r}")
                verified.append(name)
            else:
                unchecked.append(name)
        return {"verified": verified, "unchecked": unchecked}

    def _plan_stored(
        self,
        url: str,
        size: int,
        reqs: list[Any],
        planner: LoadPlanner,
        commits: list[tuple[Any, torch.Tensor, torch.Tensor | None, Any]],
        blobs: list[tuple[Any, torch.Tensor]],
        claims: memory.Claims,
    ) -> tuple[list[Any], list[torch.Tensor], list[Any], torch.Tensor, list[Any]] | None:
        """The reads of a batch of one object's requests (see ``_read_stored``):
        (segments, owners, predicted spans, their buffer, CRC-32 checks); None
        where a request does not fit the object or its layout is not predicted.
        ``claims``: the destinations the object's reads fill straight (batches
        may join one read)."""
        segments: list[tuple[int, int, int, int]] = []
        owners: list[torch.Tensor] = []
        # Object offset -> (the bytes predicted there, (offset, length) in them
        # not compared: CRC-32s and what each save makes anew).
        known: dict[int, tuple[bytes, tuple[tuple[int, int], ...]]] = {}
        # (data segment, object offset of the stored CRC-32, item name, item offset)
        checks: list[tuple[int, int, str, int]] = []
        resolve = planning.resolver(planner)
        for req in reqs:
            info = self.storage_data[req.storage_index]
            if info.offset + info.length > size:
                return None
            if req.type == LoadItemType.BYTE_IO:
                buf = torch.empty(info.length, dtype=torch.uint8)
                if info.length:
                    segments.append((info.offset, buf.data_ptr(), info.length, -1))
                    owners.append(buf)
                blobs.append((req, buf))
                continue
            layout = self._predicted_item(req, info)
            if layout is None:
                return None
            meta, item = layout
            known[info.offset] = (item.head, ())
            data_off = info.offset + item.data_off
            seg = self._plan_read(
                url, req, resolve, meta, data_off, segments, owners, commits, claims
            )
            if self.verify and seg is not None and item.crc_at:
                tail = data_off + meta.untyped_storage().nbytes()
                known[tail] = (item.tail, (*((k, 4) for k in item.crc_at), *item.volatile))
                # The directory's CRC-32 (the last field), as the reader takes it.
                checks.append((seg, tail + item.crc_at[-1], req.storage_index.fqn, info.offset))
        spans = sorted(known.items())
        expected, got = _expected_reads(spans)
        return segments + expected, [*owners, got], spans, got, checks

    def _read_coded(self, reqs: list[Any], planner: LoadPlanner) -> None:
        """Items with stream transforms from a store, with no local copy: each
        data file's version pinned by a HEAD, the items' stored bytes fetched
        by ranged GETs into host memory, at most :data:`CODED_BATCH` of them
        at a time, then decoded by torch's reader code (its extension
        registry) from that memory."""
        for url, head, rs in self._stored_files(reqs):
            rel = self.storage_data[rs[0].storage_index].relative_path
            rs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            batch: list[Any] = []
            spans: dict[int, int] = {}  # offset -> length of the items in the batch
            fetched = 0  # their bytes
            for i, req in enumerate(rs):
                info: _StorageInfo = self.storage_data[req.storage_index]
                if info.offset + info.length > head["size"]:
                    raise FormatError(
                        f"{url}: item {req.storage_index.fqn!r} at bytes {info.offset}"
                        f"..+{info.length} lies beyond the object's end ({head['size']} bytes)"
                    )
                batch.append(req)
                grown = info.length - spans.get(info.offset, 0)
                if grown > 0:  # two requests may read one item
                    spans[info.offset] = info.length
                    fetched += grown
                if i + 1 == len(rs) or fetched >= CODED_BATCH:
                    self._decode_fetched(rel, url, head["e_tag"], spans, batch, planner)
                    batch, spans, fetched = [], {}, 0

    def _stored_files(self, reqs: list[Any]) -> Iterator[tuple[str, dict[str, Any], list[Any]]]:
        """Each data file ``reqs`` read in the store: (its URL, its HEAD: the
        size, and the version every GET then pins, the requests that read it)."""
        folder, store = os.fspath(self.path), self._store
        by_file: dict[str, list[Any]] = {}
        for req in reqs:
            by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, rs in by_file.items():
            inside(folder, rel, store.join(fmt.METADATA))  # a name of the checkpoint's folder
            url = store.join(rel)
            yield url, remote.head(url, store.options), rs

    def _decode_fetched(
        self,
        rel: str,
        url: str,
        e_tag: str | None,
        spans: dict[int, int],
        reqs: list[Any],
        planner: LoadPlanner,
    ) -> None:
        bufs = {off: torch.empty(n, dtype=torch.uint8) for off, n in spans.items() if n}
        segments = [(off, b.data_ptr(), b.numel(), -1) for off, b in bufs.items()]
        owners = list(bufs.values())
        stats = transfer.read_from_store(url, segments, owners, self._store.options, e_tag)
        self.last_stats.append(dict(stats, path=url))
        ranges = {off: b.numpy().data for off, b in bufs.items()}  # (memoryview(array))
        ranges.update((off, memoryview(b"")) for off, n in spans.items() if not n)
        # (a duck-typed FileSystem: what torch's reader calls of it)
        fs, self.fs = self.fs, cast(_fs.FileSystem, _Fetched({rel: fmt.SparseSource(url, ranges)}))
        try:
            super().read_data(LoadPlan(reqs), planner).wait()
        finally:
            self.fs = fs

    def _predicted_item(
        self, req: Any, info: _StorageInfo
    ) -> tuple[torch.Tensor, fmt.ItemZip] | None:
        """(the item's tensor on the meta device, its zip as a writer lays it
        out) from ``.metadata``'s dtype and chunk shape: the alignment whose
        item length is the stored one (ckptio's 4 KiB for large items, torch's
        64 bytes); None where neither is."""
        if self._metadata is None:
            return None
        md = self._metadata.state_dict_metadata.get(req.storage_index.fqn)
        if not isinstance(md, _md.TensorStorageMetadata):
            return None
        want = req.storage_index.offset
        chunk = next(
            (c for c in md.chunks if want is None or tuple(c.offsets) == tuple(want)), None
        )
        if chunk is None:
            return None
        shape, dtype = tuple(int(n) for n in chunk.sizes), md.properties.dtype
        for align in (fmt.ALIGN, 64):
            item = fmt.item_zip(dtype, shape, align)
            if item.length == info.length:
                return torch.empty(shape, dtype=dtype, device="meta"), item
        return None

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        shares = plan.storage_data
        self.last_share = {}
        # Objects per item, no cycles: no collection walking the process meanwhile
        # (a full one took 130 ms during a 50 ms read of 1,995 items on the dev VM).
        with memory.gc_paused():
            if isinstance(shares, _Shares) and self._group() is not None:
                what = f"ckptio.dcp.FileSystemReader({os.fspath(self.path)!r}).read_data"
                sharing.run(self._group(), what, lambda: self._read_shared(plan, planner, shares))
            else:
                self._read_items(plan.items, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_shared(self, plan: LoadPlan, planner: LoadPlanner, shares: _Shares) -> None:
        """This rank's items, those it reads for every rank among them; then the
        shared items broadcast from their readers."""
        session = sharing.current()
        assert session is not None
        me = dist.get_rank(session.group)
        if shares.ranks != tuple(dist.get_process_group_ranks(session.group)):
            raise FormatError("the load plan's sharing was made for another group")
        mine: dict[tuple[Any, ...], list[Any]] = {}
        for req in plan.items:
            key = self._share_key(req)
            if key is not None:
                mine.setdefault(key, []).append(req)
        shared = {key for key, _, _ in shares.entries}
        own = {key for key, owner, _ in shares.entries if owner == me}
        missing = [key for key in shared if key not in mine]
        if missing:
            raise FormatError(
                f"the load plan shares item {missing[0][1]!r}, which this rank does not read"
            )
        kept: dict[int, Any] = {}
        # What this rank sends is the stored dtype's bytes, whatever its own
        # destination (the receivers convert into theirs). _SendingPlanner
        # answers all that the reads ask of a planner.
        sent_as = {
            id(mine[key][0]): self._sizes[key[1]][0]
            for key in own
            if mine[key][0].type != LoadItemType.BYTE_IO
        }
        self._read_items(
            [
                r
                for r in plan.items
                if self._share_key(r) not in shared or self._share_key(r) in own
            ],
            cast(LoadPlanner, _SendingPlanner(planner, sent_as)),
            kept,
        )
        pieces = []
        sent = received = 0
        for i, (key, owner, nbytes) in enumerate(shares.entries):
            reqs = mine[key]
            if owner == me:
                sent += nbytes
                pieces.append(_owned(i, owner, nbytes, kept[id(reqs[0])]))
                continue
            received += nbytes
            dtype = self._sizes.get(key[1], (None, 0))[0]
            pieces.append(_received(i, owner, nbytes, reqs, planner, dtype))
        session.read([], pieces, self._io)
        self.last_share = {
            "items_sent": sum(1 for _, o, _ in shares.entries if o == me),
            "bytes_sent": sent,
            "items_received": sum(1 for _, o, _ in shares.entries if o != me),
            "bytes_received": received,
        }

    def _read_items(
        self, items: list[Any], planner: LoadPlanner, kept: dict[int, Any] | None = None
    ) -> None:
        """Read ``items`` (each request's bytes into its destination, committed);
        ``kept``: id(request) -> the destination filled (bytes for BYTE_IO).
        From a store, straight where ``_read_stored`` can (items with stream
        transforms fetched into memory and decoded there), else from a scratch
        copy of the data files they need."""
        if self._store.url is not None:
            coded = [r for r in items if fmt.transformed(self.storage_data[r.storage_index])]
            plain = [r for r in items if not fmt.transformed(self.storage_data[r.storage_index])]
            if self._read_stored(plain, planner, kept):
                self._read_coded(coded, planner)
                return
            names = sorted({self.storage_data[r.storage_index].relative_path for r in items})
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._store.download(os.fspath(self.path), names)
        per_file: dict[str, list[Any]] = {}
        transformed = []
        for req in items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if fmt.transformed(info):
                transformed.append(req)
                continue
            per_file.setdefault(info.relative_path, []).append(req)
        self.last_stats = []
        folder = os.fspath(self.path)
        if transformed:  # decoded by torch's reader code (its extension registry)
            super().read_data(LoadPlan(transformed), planner).wait()
        for rel, reqs in per_file.items():
            where = os.path.join(folder, fmt.METADATA)
            self._read_file(inside(folder, rel, where), reqs, planner, kept)

    def _layout(
        self, f: io.BufferedReader, path: str, info: _StorageInfo
    ) -> tuple[Any, int, int | None]:
        """(meta tensor as saved, absolute file offset of its storage, stored
        CRC-32 of its data when verifying and there is one) of an item."""
        key = (path, info.offset)
        got = self._layouts.get(key)
        if got is None:
            crc = fmt.check_item(path, info, self._engine()) if self.verify else None
            native = self._native_layout(path, info)
            if native is not None:
                got = self._layouts[key] = (*native, crc)
                return got
            try:
                meta = torch.load(
                    # (an IO of bytes: torch's own reader casts it so too)
                    cast(IO[bytes], _fs._create_file_view(f, info.offset, info.length)),
                    map_location="meta",
                    weights_only=True,
                )
            except Exception as e:
                raise FormatError(
                    f"{path}: item at bytes {info.offset}..+{info.length} is not a "
                    f"torch.save archive of a tensor: {e}"
                ) from e
            if not isinstance(meta, torch.Tensor):
                raise FormatError(
                    f"{path}: item at bytes {info.offset} holds {type(meta).__name__}, not a tensor"
                )
            off = meta.untyped_storage()._checkpoint_offset
            if off is None:
                raise FormatError(f"{path}: no data offset for item at {info.offset}")
            got = self._layouts[key] = (meta, info.offset + off, crc)
        return got

    def _native_layout(self, path: str, info: _StorageInfo) -> tuple[torch.Tensor, int] | None:
        """(meta tensor, absolute file offset of its data) of an item that is a
        zip of one plain tensor, its directory mapped and its pickle read
        natively (one pickle per dtype and shape: 6x faster than torch.load's
        reader per item); None for any other item (torch.load then decides)."""
        try:
            r = _native.Reader(path, "off", None, info.offset, info.length)
            pkl = r.read_record(f"{r.prefix}/data.pkl")
        except (FormatError, OSError, KeyError, ValueError):
            return None
        found = self._metas.get(pkl)
        if found is None:
            found = self._metas[pkl] = fmt.meta_of_pickle(path, pkl)
        meta, key = found
        rec = next((x for x in r.records() if x[0] == f"{r.prefix}/data/{key}"), None)
        if meta is None or rec is None or rec[2] != meta.untyped_storage().nbytes():
            return None
        return meta, rec[1]

    def _engine(self) -> _native.Engine:
        return self._io.engine()

    def _read_file(
        self,
        path: str,
        reqs: list[Any],
        planner: LoadPlanner,
        kept: dict[int, Any] | None,
        predict: bool = True,
    ) -> None:
        """Read ``reqs`` of one data file into their destinations, committed.
        The engine starts on the small items' buffer and a first batch of the
        large items, and reads the batches planned meanwhile (``transfer.byte_ranges``,
        joined into one call) while the rest are planned and the small items
        are cut out of their buffer: the Python per item runs beside the reads,
        not before them. ``predict``:
        where each large item's data lies is predicted from its dtype and shape
        (``_predicted_item``, as from a store) and its zip head read in the same
        pass and compared; where one differs, the file is read again with each
        item's zip mapped (``_layout``), which the destinations then hold."""
        opts = self._io
        engine = opts.engine()
        dev_file = _native.DeviceFile(path, False, opts.direct, opts.backend)
        segments: list[tuple[int, int, int, int]] = []
        owners: list[torch.Tensor] = []
        commits: list[tuple[Any, torch.Tensor, torch.Tensor | None, Any]] = []
        small: list[tuple[Any, _StorageInfo]] = []
        large: list[tuple[Any, _StorageInfo]] = []
        blobs: list[tuple[Any, bytes]] = []
        # (segment index, stored CRC-32 or None, request, item offset) when verifying
        checks: list[tuple[int, int | None, Any, int]] = []
        # The predicted zip heads of each batch, and the buffer they are read into.
        heads: list[
            tuple[list[tuple[int, tuple[bytes, tuple[tuple[int, int], ...]]]], torch.Tensor]
        ] = []
        copies: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        claims = memory.Claims()  # the destinations read into straight
        reads = transfer.Pipeline.of_file(dev_file, engine, verify=self.verify, join=True)
        with open_regular(path) as f:
            try:
                for req in reqs:
                    info: _StorageInfo = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO:
                        blobs.append((req, self._value_bytes(f, path, req, info)))
                    elif info.length <= fmt.SMALL_ITEM and not self.verify:
                        small.append((req, info))
                    else:
                        large.append((req, info))
                resolve = planning.resolver(planner)
                box = pending = _SmallBox.of(small, resolve) if small else None
                # Verifying: one read, whose CRC-32s ``checks`` indexes.
                if self.verify:
                    ranges = [(0, len(large))] if large else []
                else:
                    ranges = list(transfer.byte_ranges([info.length for _, info in large]))
                guess = predict and not self.verify
                for lo, hi in ranges or [(0, 0)]:
                    first = len(segments)
                    known: list[tuple[int, tuple[bytes, tuple[tuple[int, int], ...]]]] = []
                    for req, info in large[lo:hi]:
                        layout = self._predicted_item(req, info) if guess else None
                        if layout is not None:
                            meta, item = layout
                            data_off = info.offset + item.data_off
                            known.append((info.offset, (item.head, ())))
                        else:
                            meta, data_off, crc = self._layout(f, path, info)
                        seg = self._plan_read(
                            path, req, resolve, meta, data_off, segments, owners, commits, claims
                        )
                        if self.verify and seg is not None:
                            checks.append((seg, crc, req, info.offset))
                    segs, own = segments[first:], owners[first:]
                    if known:
                        expected, got = _expected_reads(known)
                        segs += expected
                        own.append(got)
                        heads.append((known, got))
                    if box is not None:  # with the first batch: read 0
                        segs, own, box = box.segments + segs, [box.buf, *own], None
                    # The destinations may still be in use by work queued on the
                    # current streams: the engine's copies are ordered after it.
                    # Verifying, it also returns each CRC-32.
                    reads.add(segs, own)
                if pending is not None:
                    reads.result(0)
                    copies = pending.cut(self, path, f, resolve)
            except BaseException as err:
                reads.abandon(err)  # the destinations stay the engine's until then
                raise
            stats = reads.stats(opts.backend)
        if any(_placed(known, got.numpy().tobytes()) is None for known, got in heads):
            # Not the layout predicted: every item's zip mapped, read again.
            return self._read_file(path, reqs, planner, kept, predict=False)
        if self.verify:
            named = [(i, stored, req.storage_index.fqn, at) for i, stored, req, at in checks]
            stats = dict(stats, **_checked_items(path, named, stats.pop("crc32", [])))
            for req, blob in blobs:  # checked by _value_bytes, or none stored
                zipped = blob.startswith(b"PK\x03\x04")
                stats["verified" if zipped else "unchecked"].append(req.storage_index.fqn)
        self.last_stats.append(dict(stats, path=path))
        for req, blob in blobs:
            planner.load_bytes(req, io.BytesIO(blob))
            if kept is not None:
                kept[id(req)] = blob
        # On the current stream, as the destinations' other users run: from a
        # pinned buffer (its allocator keeps it until the copies have run).
        for _, target, src in copies:
            target.copy_(src, non_blocking=True)
        for req, target, _ in copies:
            planner.commit_tensor(req, target)
            if kept is not None:
                kept[id(req)] = target
        _commit(planner, commits, kept)

    def _value_bytes(self, f: Any, path: str, req: Any, info: _StorageInfo) -> bytes:
        """A non-tensor value's bytes (a torch.save archive, as torch's planners
        save them, or a BytesIO's bytes as saved), whole; with verify=True an
        archive's records checked against their CRC-32s, as a tensor's are. A
        FormatError naming the file and item otherwise."""
        f.seek(info.offset)
        blob = f.read(info.length)
        name = req.storage_index.fqn
        if len(blob) != info.length:
            raise corrupt(
                f"{path}, item {name!r}",
                f"{info.length} bytes at offset {info.offset}, the file ends after {len(blob)}",
            )
        if self.verify and blob.startswith(b"PK\x03\x04"):
            item = _native.Reader(path, self._io.direct, None, info.offset, info.length)
            try:
                item.verify(self._io.engine(), None, True)
            except FormatError as e:
                raise FormatError(f"item {name!r}: {e}") from e
        return blob

    def _plan_read(
        self,
        path: str,
        req: Any,
        resolve: Callable[[Any], torch.Tensor],
        meta: torch.Tensor,
        data_off: int,
        segments: list[tuple[int, int, int, int]],
        owners: list[torch.Tensor],
        commits: list[tuple[Any, torch.Tensor, torch.Tensor | None, Any]],
        claims: memory.Claims,
    ) -> int | None:
        """The engine's read of one item into its destination (or a temporary
        on the destination's device, for a strided request, one of another
        dtype (cast by the copy), a conjugate or negative view at either end
        (its bit applied by the copy), one whose memory another read of the file
        fills (tied weights: ``claims``), or a partial one when verifying: a
        CRC-32 covers the whole storage). Returns the index of the segment
        added, None for an empty request (``resolve``: the planner's
        ``resolve_tensor``, see ``planning.resolver``)."""
        target = resolve(req).detach()
        src = _checked(path, req, planning.narrowed(meta, req.storage_offsets, req.lengths), target)
        if target.numel() == 0:
            commits.append((req, target, None, None))
            return None
        isz = src.element_size()
        nbytes = meta.untyped_storage().nbytes()
        whole = src.storage_offset() == 0 and target.numel() * isz == nbytes
        dev = devices.device_code(target.untyped_storage(), f"destination of {req.storage_index}")
        # Else the bits apply at the copy: the source's to the values, the
        # destination's (a conj or neg view) to what lands in its memory.
        plain = not (src.is_conj() or src.is_neg() or target.is_conj() or target.is_neg())
        straight = (
            plain
            and src.dtype == target.dtype  # else copy_ casts, as torch's reader does
            and src.is_contiguous()
            and target.is_contiguous()
            and (whole or not self.verify)
        )
        if straight and claims.claim(dev, target.data_ptr(), target.numel() * isz):
            # Straight into the destination.
            start = data_off + cast(int, src.storage_offset()) * isz
            segments.append((start, target.data_ptr(), target.numel() * isz, dev))
            owners.append(target)
            commits.append((req, target, None, None))
        else:
            # Read the item's storage once into a temporary on the destination
            # device, then copy the slice.
            tmp = torch.empty(nbytes, dtype=torch.uint8, device=target.device)
            segments.append((data_off, tmp.data_ptr(), nbytes, dev))
            owners.append(tmp)
            commits.append((req, target, tmp, src))
        return len(segments) - 1

    def _small_item(
        self,
        path: str,
        f: io.BufferedReader,
        views: _BoxViews,
        at: int,
        span: tuple[int, int],
        got: tuple[int, int, list[tuple[str, int, int]]] | None,
    ) -> torch.Tensor:
        """The tensor an item holds, as a view of its bytes in the small-item
        buffer (``views.buf``, read at ``at``)."""
        meta = key = None
        rec: tuple[str | None, int, int] | None = None
        if got is not None:
            pkl_off, pkl_n, data = got
            pkl = bytes(views.mem[pkl_off : pkl_off + pkl_n])
            found = self._metas.get(pkl)
            if found is None:
                found = self._metas[pkl] = fmt.meta_of_pickle(path, pkl)
            meta, key = found
            rec = next((r for r in data if r[0] == key), None) if key is not None else None
        if meta is None or rec is None or rec[2] != meta.untyped_storage().nbytes():
            # Not a zip of one plain tensor read here: torch reads it (and refuses what is bad).
            meta, data_off, _ = self._layout(f, path, _StorageInfo(path, span[0], span[1]))
            rec = (None, at + data_off - span[0], meta.untyped_storage().nbytes())
        start, nbytes = rec[1], rec[2]
        isz = max(meta.element_size(), 1)
        if start % isz:  # an archive not aligned as torch aligns: realign its bytes
            typed = views.buf[start : start + nbytes].clone().view(meta.dtype)
            offset = meta.storage_offset()
        else:  # one view of the whole buffer per dtype: no slice per item
            typed = views.typed(meta.dtype)
            offset = start // isz + meta.storage_offset()
        return _with_bits(typed.as_strided(meta.shape, meta.stride(), offset), meta)


class _Unread(Metadata):
    """DCP metadata that could not be read, as :meth:`FileSystemReader.read_metadata`
    hands it to torch's loader: using it (any attribute but the special ones)
    raises the read's error, the original exception (typed, naming the file)."""

    def __init__(self, error: Exception) -> None:  # (no fields: none is ever read)
        object.__setattr__(self, "_error", error)

    def refuse(self) -> NoReturn:
        raise object.__getattribute__(self, "_error")

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name == "refuse":  # isinstance, repr, ...
            return object.__getattribute__(self, name)
        object.__getattribute__(self, "refuse")()

    def __repr__(self) -> str:
        return f"<DCP metadata not read: {object.__getattribute__(self, '_error')}>"


class _BoxViews:
    """A small-item buffer's bytes (``mem``) and its views by dtype, made once
    per buffer (its length a multiple of every element size: ``_SmallBox.of``)."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.mem = memoryview(buf.numpy().data)
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        got = self._typed.get(dtype)
        if got is None:
            got = self._typed[dtype] = self.buf.view(dtype)
        return got


class _Fetched:
    """torch's reader's file system, for one read, over data files' ranges
    fetched from a store (a ``SparseSource`` per file)."""

    def __init__(self, sources: dict[str, fmt.SparseSource]) -> None:
        self.sources = sources

    def concat_path(self, path: Any, suffix: str) -> str:
        return suffix

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[fmt.SparseSource]:
        source = self.sources[os.fspath(path)]
        source.seek(0)
        yield source


@dataclasses.dataclass
class _SmallBox:
    """A data file's small items, read whole into one host buffer in the engine
    pass of its first batch (items side by side share I/Os), then cut out: their
    zips mapped and pickles read natively (one per distinct pickle: items of
    one dtype and shape share it)."""

    small: list[tuple[Any, _StorageInfo]]
    #: The first item's destination, resolved before the read: a buffer for
    #: copies to a GPU is pinned (they then run asynchronously).
    first: torch.Tensor
    buf: torch.Tensor
    #: (file offset, length) of each item -> its offset in ``buf``.
    place: dict[tuple[int, int], int]
    segments: list[tuple[int, int, int, int]]

    @classmethod
    def of(
        cls, small: list[tuple[Any, _StorageInfo]], resolve: Callable[[Any], torch.Tensor]
    ) -> _SmallBox:
        first = resolve(small[0][0]).detach()
        spans = sorted({(info.offset, info.length) for _, info in small})
        place, at = {}, 0
        for span in spans:
            at = align_up(at, torchzip.TORCH_ALIGNMENT)  # every item's bytes aligned as in the file
            place[span] = at
            at += span[1]
        # A whole number of elements of every dtype: the buffer is viewed per dtype.
        buf = torch.empty(align_up(at, 16), dtype=torch.uint8, pin_memory=first.is_cuda)
        segs = [(off, buf.data_ptr() + place[(off, n)], n, -1) for off, n in spans]
        return cls(small, first, buf, place, segs)

    def cut(
        self,
        reader: FileSystemReader,
        path: str,
        f: io.BufferedReader,
        resolve: Callable[[Any], torch.Tensor],
    ) -> list[tuple[Any, torch.Tensor, torch.Tensor]]:
        """Once ``buf`` is read: [(request, destination, source view in the
        buffer)] to copy."""
        buf, place = self.buf, self.place
        spans = sorted(place)
        maps = _native.map_archives(
            buf.data_ptr(), buf.numel(), [(place[s], s[1]) for s in spans], [buf]
        )
        items = {}
        views = _BoxViews(buf)
        for span, got in zip(spans, maps, strict=True):
            items[span] = reader._small_item(path, f, views, place[span], span, got)
        out = []
        for k, (req, info) in enumerate(self.small):
            target = self.first if k == 0 else resolve(req).detach()
            item = items[(info.offset, info.length)]
            src = planning.narrowed(item, req.storage_offsets, req.lengths)
            out.append((req, target, _checked(path, req, src, target)))
        return out


def _commit(
    planner: LoadPlanner,
    commits: list[tuple[Any, torch.Tensor, torch.Tensor | None, Any]],
    kept: dict[int, Any] | None,
) -> None:
    """Each read request committed to the planner, after its temporary (where
    it was read into one) is copied into its destination; ``kept`` as for
    ``_read_items``."""
    for req, target, tmp, src in commits:
        if tmp is not None:
            view = tmp.view(src.dtype).as_strided(src.shape, src.stride(), src.storage_offset())
            target.copy_(_with_bits(view, src))
        planner.commit_tensor(req, target)
        if kept is not None:
            kept[id(req)] = target


def _with_bits(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``view`` of an item's stored bytes with the conjugate and negative bits of
    ``like``, the item's tensor (torch's writer stores a conjugate view's storage
    as it is, the bits in the item's pickle; copy_ then resolves them)."""
    if like.is_conj():
        view = view.conj()
    if like.is_neg():
        view = torch._neg_view(view)
    return view


def _expected_reads(
    spans: list[tuple[int, tuple[bytes, tuple[tuple[int, int], ...]]]],
) -> tuple[list[tuple[int, int, int, int]], torch.Tensor]:
    """The reads of the bytes ``spans`` predicts ((offset, (bytes, fields left
    out)) in order), back to back into one host buffer: (the segments, the
    buffer), which :func:`_placed` then compares."""
    got = torch.empty(sum(len(b) for _, (b, _) in spans), dtype=torch.uint8)
    segments, at = [], got.data_ptr()
    for off, (b, _) in spans:
        segments.append((off, at, len(b), -1))
        at += len(b)
    return segments, got


def _placed(
    spans: list[tuple[int, tuple[bytes, tuple[tuple[int, int], ...]]]], got: bytes
) -> dict[int, int] | None:
    """Each 4-byte field left out of the comparison, by object offset -> its
    value, where the bytes read (``got``: the spans back to back) are the
    predicted ones elsewhere; None where they differ."""
    fields: dict[int, int] = {}
    at = 0
    for off, (want, skip) in spans:
        have = got[at : at + len(want)]
        at += len(want)
        if skip:
            masked = bytearray(have)
            for k, n in skip:
                if n == 4:
                    fields[off + k] = int.from_bytes(have[k : k + 4], "little")
                masked[k : k + n] = want[k : k + n]
            have = bytes(masked)
        if have != want:
            return None
    return fields


def _checked_items(
    path: str, checks: Sequence[tuple[int, int | None, str, int]], crcs: list[int | None]
) -> dict[str, list[str]]:
    """Each item's data CRC-32 (``crcs``, per segment; None: not computed, cuFile
    moved the bytes) against the one its zip stores (``checks``: (segment,
    stored CRC-32, item name, item offset); None or 0: none stored): a
    FormatError naming the file and item on a mismatch; "verified" and
    "unchecked" names."""
    verified, unchecked = [], []
    for seg, stored, name, at in checks:
        if not stored or crcs[seg] is None:
            unchecked.append(name)
        elif crcs[seg] != stored:
            raise FormatError(
                f"{path}: item {name!r} at bytes {at}: its tensor bytes have "
                f"CRC-32 {crcs[seg]:08x}, the item stores {stored:08x}"
            )
        else:
            verified.append(name)
    return {"verified": verified, "unchecked": unchecked}


@dataclasses.dataclass(frozen=True)
class _Asker:
    """A local load plan's ``storage_data``: the global rank that made it."""

    rank: int


@dataclasses.dataclass(frozen=True)
class _Shares:
    """A final load plan's ``storage_data``: the group's global ranks, and the
    items every rank reads: (share key, reader (group rank), bytes), in the
    order every rank moves them."""

    ranks: tuple[int, ...]
    entries: tuple[tuple[tuple[Any, ...], int, int], ...]


class _SendingPlanner:
    """``planner`` for a rank's reads in a shared load: an item it reads for
    the others (``sent_as``: id(request) -> the stored dtype) whose destination
    is of another dtype, or a conjugate or negative view, is read into a
    tensor of the stored dtype (sent as it is: its bytes are what the others
    expect), then copied into the destination, casting as torch's reader does."""

    def __init__(self, planner: LoadPlanner, sent_as: dict[int, torch.dtype]) -> None:
        self.planner = planner
        self.sent_as = sent_as
        self.targets: dict[int, torch.Tensor] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.planner, name)

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        target = self.planner.resolve_tensor(req)
        dtype = self.sent_as.get(id(req))
        if dtype is None or (target.dtype == dtype and not (target.is_conj() or target.is_neg())):
            return target
        self.targets[id(req)] = target  # (a read begun again resolves it again)
        return torch.empty(target.shape, dtype=dtype, device=target.device)

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        target = self.targets.pop(id(req), None)
        if target is not None:
            target.detach().copy_(tensor)
            tensor = target
        self.planner.commit_tensor(req, tensor)

    def load_bytes(self, req: Any, value: io.BytesIO) -> None:
        self.planner.load_bytes(req, value)


def _owned(i: int, owner: int, nbytes: int, have: Any) -> sharing.Piece:
    """A shared item this rank read (``have``: its bytes, or its tensor of the
    stored dtype: the destination, or what ``_SendingPlanner`` read it into)."""
    if isinstance(have, bytes):
        t = (
            torch.frombuffer(bytearray(have), dtype=torch.uint8)
            if have
            else torch.empty(0, dtype=torch.uint8)
        )
        return sharing.Piece(None, i, nbytes, torch.device("cpu"), t, splittable=False, owner=owner)
    if have.is_contiguous() and nbytes:
        target = sharing.as_bytes(have, have.data_ptr(), nbytes)
        return sharing.Piece(None, i, nbytes, have.device, target, splittable=False, owner=owner)

    def fill(mem: torch.Tensor) -> None:
        mem.view(have.dtype).view(have.shape).copy_(have)

    return sharing.Piece(None, i, nbytes, have.device, fill=fill, splittable=False, owner=owner)


def _received(
    i: int,
    owner: int,
    nbytes: int,
    reqs: list[Any],
    planner: LoadPlanner,
    dtype: torch.dtype | None,
) -> sharing.Piece:
    """A shared item another rank reads: where its bytes land here, and what
    then commits them to the planner."""
    cpu = torch.device("cpu")
    if reqs[0].type == LoadItemType.BYTE_IO:

        def finish(mem: torch.Tensor) -> None:
            blob = mem.cpu().numpy().tobytes()
            for r in reqs:
                planner.load_bytes(r, io.BytesIO(blob))

        if not nbytes:
            finish(torch.empty(0, dtype=torch.uint8))
        return sharing.Piece(None, i, nbytes, cpu, None, finish, splittable=False, owner=owner)
    targets = [planner.resolve_tensor(r).detach() for r in reqs]
    t = targets[0]
    stored = dtype or t.dtype
    for r, x in zip(reqs, targets, strict=True):
        if tuple(x.shape) != tuple(r.lengths):
            raise FormatError(
                f"item {r.storage_index.fqn!r} has shape {tuple(r.lengths)}, "
                f"the destination {tuple(x.shape)}"
            )
    # Else copy_ casts, as torch's does, and applies a conj or neg view's bit.
    straight = t.is_contiguous() and t.dtype == stored and not (t.is_conj() or t.is_neg())

    def done() -> None:
        for r, x in zip(reqs, targets, strict=True):
            if straight and x is not t:
                x.copy_(t)
            planner.commit_tensor(r, x)

    if not nbytes:
        done()
        return sharing.Piece(None, i, 0, t.device, splittable=False, owner=owner)
    if straight:
        target = sharing.as_bytes(t, t.data_ptr(), nbytes)
        return sharing.Piece(
            None, i, nbytes, t.device, target, splittable=False, owner=owner, done=done
        )

    def finish_t(mem: torch.Tensor) -> None:
        view = mem.view(stored).view(t.shape)
        for x in targets:  # each from the stored values (not cast twice)
            x.copy_(view)

    return sharing.Piece(
        None, i, nbytes, t.device, None, finish_t, splittable=False, owner=owner, done=done
    )


def _checked(path: str, req: Any, src: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``src`` (the requested slice of a saved tensor), refused where it does
    not fit ``target``'s shape; another dtype is cast by the copy into it, as
    torch's reader's ``copy_`` casts."""
    if target.shape != src.shape:  # (torch.Size: tuples)
        raise FormatError(
            f"{path}: item {req.storage_index} has shape {tuple(src.shape)}, "
            f"the destination {tuple(target.shape)}"
        )
    return src


# --------------------------------------------------------------------------- .metadata
