"""safetensors files through the ckptio engine.

``save_file`` / ``load_file`` / ``save`` / ``load`` have the signatures and
semantics of ``safetensors.torch`` and read and write the same files (the
format: ``ckptio.formats.safetensors``). Files written here start their data
section on a 4 KiB boundary (O_DIRECT and cuFile reads of it need no
shifting); the ``safetensors`` package reads them, and this module reads its
files. Bytes made in memory (``save``) keep safetensors' own 8-byte alignment:
they are byte for byte what ``safetensors.torch.save`` returns.

Arguments mean what they mean in safetensors (``load_file``'s ``backend`` is
safetensors' "mmap" | "pread"; ckptio reads through its engine either way).
ckptio's own knobs are keyword-only: ``threads``, ``chunk_size``, ``direct``
and ``device_backend`` (how CUDA memory moves: "auto", "cufile", "bounce"; the
old spelling ``backend="cufile"`` etc. still works where it cannot be taken
for safetensors' values). Errors about a file's content are
:class:`SafetensorError`, a ``ckptio.FormatError`` (so a RuntimeError) that is
also ``safetensors.SafetensorError`` where that package is installed.

Saves write the header, then each tensor's bytes straight from its data
pointer (host or CUDA memory) with the engine's threads, into a temp file that
replaces the target atomically (fsync, rename, fsync of the folder). Loads
allocate one empty tensor per entry on the target device and read the data
section into them in one parallel engine pass (O_DIRECT; cuFile or the pinned
bounce pipeline for CUDA). Sharded checkpoints as the Hugging Face hub lays them
out (``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``):
``save_sharded`` / ``load_sharded``; a sharded save is published by one atomic
step (the index replaced last), see ``save_sharded``.

Files are not trusted: a header that is not what safetensors writes (bad JSON,
nesting, sizes or offsets that do not add up, dimensions past int64) is a
``FormatError`` naming the file and the tensor, and an index may only name
shards inside its folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckptio import _native
from ckptio.errors import SafetensorError
from ckptio.formats import safetensors as fmt
from ckptio.formats.safetensors import DTYPES, INDEX_NAME, find_shared
from ckptio.io import devices, memory, paths, remote, reports, transfer
from ckptio.io.engines import IoOptions
from ckptio.io.units import parse_size
from ckptio.loading import inplace, sharing, stored

__all__ = [
    "SafetensorError",
    "save_file",
    "load_file",
    "save",
    "load",
    "metadata",
    "save_sharded",
    "load_sharded",
    "find_shared",
    "DTYPES",
    "INDEX_NAME",
]


Device = str | int | torch.device | None  # None: the host, as safetensors takes it


#: safetensors' own values of load_file's ``backend``.
_PEER_BACKENDS = ("mmap", "pread")


#: ckptio's device paths (``device_backend``), once spelled ``backend``.
_DEVICE_BACKENDS = ("auto", "cufile", "posix", "bounce")


def _device_backend(backend: str | None, device_backend: str | None, what: str) -> str | None:
    """ckptio's device path from ``device_backend`` or the old spelling ``backend=``
    (accepted where it cannot be taken for safetensors' "mmap" / "pread")."""
    if backend is None or backend in _PEER_BACKENDS:
        return device_backend
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, not {type(backend).__name__}")
    if backend in _DEVICE_BACKENDS:
        if device_backend is not None:
            raise TypeError(
                f"{what}: backend={backend!r} (ckptio's old spelling of device_backend) and "
                f"device_backend={device_backend!r} given together; pass device_backend only"
            )
        warnings.warn(
            f"{what}(backend={backend!r}): ckptio's device path is now device_backend=; "
            "backend= is safetensors' 'mmap' | 'pread'",
            DeprecationWarning,
            stacklevel=3,
        )
        return backend
    raise SafetensorError(
        f'backend "{backend}" is invalid (expected one of: "mmap", "pread"; ckptio\'s '
        "device path for CUDA memory is device_backend='auto' | 'cufile' | 'bounce')"
    )


def save_file(
    tensors: Mapping[str, torch.Tensor],
    filename: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    backend: str | None = None,
    storage_options: remote.StorageOptions = None,
) -> None:
    """Save ``tensors`` to ``filename`` in safetensors format, like
    ``safetensors.torch.save_file``, crash-safe (temp file, fsync, rename, fsync
    of the folder) and with the bytes written straight from each tensor's memory
    (host or CUDA) by the engine. Tensors must be contiguous and must not share
    memory (RuntimeError / ValueError as safetensors raises). Bytes are copied
    after the work queued on the current CUDA streams. The keyword options are
    ``ckptio.save``'s (``device_backend`` is its ``backend``; the old spelling
    ``backend=`` still works here). Returns None, as safetensors does;
    ``ckptio.last_report()`` says how it ran. ``filename`` may be an object URL
    (``s3://...``, with ``storage_options``), as for ``ckptio.save``.
    """
    remote.check_options(filename, storage_options, single=True)
    if remote.is_url(filename):
        _save_file_remote(tensors, os.fsdecode(os.fspath(filename)), metadata, storage_options)
        return
    t0 = time.perf_counter()
    io = IoOptions.of(
        threads, chunk_size, direct, _device_backend(backend, device_backend, "save_file")
    )
    path = paths.path(filename, "safetensors.save_file")
    stats = _save_file(tensors, path, metadata, io)
    reports.report(path, t0, stats, len(tensors))


def _save_file_remote(
    tensors: Mapping[str, torch.Tensor],
    url: str,
    metadata: Mapping[str, str] | None,
    options: remote.StorageOptions,
) -> None:
    """``save_file`` to an object, uploaded part by part straight from the
    tensors' memory (host or CUDA)."""
    t0 = time.perf_counter()
    lay, segments, keep = _file_segments(tensors, metadata)
    stats = transfer.upload_image(url, lay.header, segments, keep, lay.file_len, options)
    reports.report(url, t0, stats, len(lay.items))


def _file_segments(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
) -> tuple[fmt.Layout, list[tuple[int, int, int, int]], list[torch.Tensor]]:
    """A safetensors file laid out: its layout, the (file offset, address,
    nbytes, device code) of every tensor's bytes, and the tensors that own
    them (other devices' copied to the host, as safetensors does)."""
    lay = fmt.layout(tensors, metadata)
    base = len(lay.header)
    keep, segments = [], []
    for _, t, begin, end in lay.items:
        if end == begin:
            continue
        if not (t.is_cpu or t.is_cuda):
            t = t.to("cpu")  # as safetensors does for other devices
        keep.append(t)
        # get_device(): -1 for host memory, the CUDA ordinal otherwise (device codes)
        segments.append((base + begin, t.data_ptr(), end - begin, t.get_device()))
    return lay, segments, keep


def _save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str,
    metadata: Mapping[str, str] | None,
    io: IoOptions,
    sweep: bool = True,
) -> dict[str, Any]:
    """Write one safetensors file; the transfer's stats. ``sweep``: remove temp
    files of dead saves in the folder first."""
    lay, segments, keep = _file_segments(tensors, metadata)
    writer = _native.AtomicWriter(path, io.direct, io.backend, sweep)
    try:
        writer.write_bytes(0, lay.header)
        stats = transfer.write(writer, io.engine(), segments, keep, file_len=lay.file_len)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    del keep
    return stats


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (``safetensors.torch.save``):
    byte for byte what safetensors makes (its 8-byte alignment, not the 4 KiB of files)."""
    lay = fmt.layout(tensors, metadata, 8)
    buf = bytearray(lay.file_len)
    buf[: len(lay.header)] = lay.header
    for _, t, begin, end in lay.items:
        if end > begin:
            dst = torch.frombuffer(
                buf, dtype=torch.uint8, count=end - begin, offset=len(lay.header) + begin
            )
            src = t.detach().to("cpu")
            # Contiguous, but a size-1 dimension may have any stride, which a byte
            # view refuses: the same elements as one dense row.
            dst.copy_(src.as_strided((src.numel(),), (1,)).view(torch.uint8))
    return bytes(buf)


def _devices(device: Device) -> tuple[torch.device, torch.device | None]:
    """(the requested device, the device the engine fills: it, or cpu to copy from)."""
    if device is None:  # safetensors loads to the host
        device = "cpu"
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a str, int or torch.device, not {type(device).__name__}")
    try:
        if isinstance(device, int):
            if device < 0:
                raise ValueError(device)
            want = torch.device("cuda", device)
        else:
            want = torch.device(device)
    except (RuntimeError, ValueError):  # as safetensors words it
        raise SafetensorError(f"device {device} is invalid") from None
    fill = devices.engine_device(str(want))
    return want, fill


def _on_host(device: Device) -> bool:
    """Whether ``device`` names host memory, however spelled ("cpu", "cpu:0",
    torch.device("cpu"), None): the one device ``out=`` is given with."""
    return _devices(device)[0].type == "cpu"


@dataclasses.dataclass
class _Plan:
    """One file's tensors allocated empty and the reads that fill them."""

    path: str
    file: _native.DeviceFile
    metadata: dict[str, str] | None
    tensors: dict[str, torch.Tensor]
    segments: list[tuple[int, int, int, int]]
    #: What owns the memory of each segment.
    owners: list[torch.Tensor]


@memory.gc_paused()
def _plan(path: str, fill: torch.device, io: IoOptions) -> _Plan:
    f = _native.DeviceFile(path, False, io.direct, io.backend)
    meta, entries, base = fmt.read_header(f.fileno(), path)
    tensors, segments, owners = {}, [], []
    dev = -1 if fill.type == "cpu" else fill.index if fill.index is not None else 0
    if fill.type == "cuda":
        memory.reserve_cuda(fill, [e[4] - e[3] for e in entries])
    # An empty tensor per dtype: ``proto.new()`` makes another (as torch.empty(0)
    # does, in a third of the time).
    protos: dict[torch.dtype, torch.Tensor] = {}
    for name, dtype, shape, begin, end in entries:
        nbytes = end - begin
        off = base + begin
        # Host memory starts where the file offset does relative to 4 KiB (when
        # the dtype's alignment allows it): O_DIRECT lands straight in it.
        phase = off % memory.PAGE if off % max(dtype.itemsize, 1) == 0 else 0
        st = memory.empty_storage(nbytes, fill, phase)
        proto = protos.get(dtype)
        if proto is None:
            proto = protos[dtype] = torch.empty(0, dtype=dtype, device=fill)
        # torch's stubs lack set_(source, offset, size) (the stride is optional)
        t = proto.new().set_(st, 0, shape)  # type: ignore[call-overload]
        tensors[name] = t
        if nbytes:
            segments.append((off, st.data_ptr(), nbytes, dev))
            owners.append(t)
    return _Plan(path, f, meta, tensors, segments, owners)


def _read(plan: _Plan, engine: _native.Engine) -> dict[str, Any]:
    # Memory handed out by the caching allocator may still be in use by work
    # queued on the current stream: the engine's copies are ordered after it.
    return transfer.read(plan.file, engine, plan.segments, plan.owners)


def _finish(
    tensors: dict[str, torch.Tensor], want: torch.device, fill: torch.device | None
) -> dict[str, torch.Tensor]:
    if fill is None:
        return {k: v.to(want) for k, v in tensors.items()}
    return tensors


@sharing.groupable("ckptio.safetensors.load_file")
def load_file(
    filename: str | os.PathLike[str],
    device: Device = "cpu",
    *,
    backend: str = "mmap",
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    strict: bool = True,
    cast: bool = False,
    group: Any = None,
    storage_options: remote.StorageOptions = None,
) -> dict[str, torch.Tensor]:
    """Load a safetensors file like ``safetensors.torch.load_file(filename, device,
    backend=...)``: a dict of tensors in file order, each with its own storage on
    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int for a CUDA index), read
    in parallel straight into that memory (cuFile or pinned bounce buffers for
    CUDA). Other devices are filled through host memory.

    ``backend``: safetensors' "mmap" (default) or "pread"; both read through the
    engine here, into tensors with memory of their own. ckptio's knobs: ``threads``,
    ``chunk_size``, ``direct``, ``device_backend`` ("auto" | "cufile" | "bounce",
    see ``ckptio.save``; the old spelling ``backend="cufile"`` still works).
    ``ckptio.last_report()`` says how it ran; a malformed file is a
    :class:`SafetensorError` naming the file and tensor.

    ``out``: load in place, into the tensors of this dict (name -> tensor, on
    the host or any CUDA device, ``device`` not given), as ``ckptio.load``'s
    ``out`` does (``strict``, ``cast``, errors): returns {name: the filled
    tensor of ``out``} in file order.

    ``group``: a ``torch.distributed`` process group whose ranks all load the
    file together, each byte read by one rank and shared (``ckptio.load``'s
    ``group``).

    ``filename`` may be an object URL (``s3://...``, with ``storage_options``),
    as for ``ckptio.load``.
    """
    if remote.is_url(filename) or storage_options is not None:
        remote.check_options(filename, storage_options, single=True)
        url = os.fsdecode(os.fspath(filename))
        if out is None:  # straight into new tensors (once per group, where there is one)
            return _load_file_remote(url, device, storage_options)
        if _on_host(device) and isinstance(strict, bool) and isinstance(cast, bool):
            got = _load_into_remote(url, [url], out, storage_options)
            if got is not None:
                return got
        kw: dict[str, Any] = dict(
            backend=backend, threads=threads, chunk_size=chunk_size, direct=direct,
            device_backend=device_backend, out=out, strict=strict, cast=cast, group=group,
        )  # fmt: skip
        call = lambda p: load_file(p, device, **kw)  # noqa: E731
        return remote.via_local(url, storage_options, call, write=False)
    io = IoOptions.of(
        threads, chunk_size, direct, _device_backend(backend, device_backend, "load_file")
    )
    t0 = time.perf_counter()
    path = paths.path(filename, "safetensors.load_file")
    if out is not None:
        return _load_into([path], out, device, t0, io, strict, cast)
    want, fill = _devices(device)
    plan = _plan(path, fill or torch.device("cpu"), io)
    shared = sharing.current()
    if shared is not None:
        _read_shared(shared, path, t0, [plan], io)
        return _finish(plan.tensors, want, fill)
    stats = _read(plan, io.engine())
    reports.report(path, t0, stats, len(plan.tensors))
    return _finish(plan.tensors, want, fill)


def _load_file_remote(
    url: str, device: Device, options: remote.StorageOptions
) -> dict[str, torch.Tensor]:
    """``load_file`` of an object, with no local copy (``_plan_remote``)."""
    t0 = time.perf_counter()
    want, fill = _devices(device)
    plan = _plan_remote(url, fill or torch.device("cpu"), options)
    stats = _read_remote([plan], options)
    reports.report(url, t0, stats, len(plan.tensors))
    return _finish(plan.tensors, want, fill)


@dataclasses.dataclass
class _RemotePlan:
    """One object's tensors made empty, and the ranged reads that fill them."""

    url: str
    size: int
    e_tag: str | None
    tensors: dict[str, torch.Tensor]
    #: (object offset, address, nbytes, device), and the tensor owning each.
    segments: list[tuple[int, int, int, int]]
    owners: list[torch.Tensor]
    #: (name, object offset, nbytes) of every tensor: what ranks compare.
    rows: list[tuple[str, int, int]]


def _plan_remote(url: str, dest: torch.device, options: remote.StorageOptions) -> _RemotePlan:
    """The safetensors object ``url``'s tensors made on ``dest`` (cpu or
    CUDA): the header in one ranged GET (a second where it is longer than
    1 MiB), of the version later reads pin."""
    size, e_tag, _, entries, base = fmt.read_stored_header(url, options)
    plan = _RemotePlan(url, size, e_tag, {}, [], [], [])
    code = -1 if dest.type == "cpu" else dest.index
    for name, dtype, shape, begin, end in entries:
        nbytes = end - begin
        st = memory.empty_storage(nbytes, dest, 0)
        # torch's stubs lack set_(source, offset, size) (the stride is optional)
        t = torch.empty(0, dtype=dtype, device=dest).set_(st, 0, shape)  # type: ignore[call-overload]
        plan.tensors[name] = t
        plan.rows.append((name, base + begin, nbytes))
        if nbytes:
            plan.segments.append((base + begin, st.data_ptr(), nbytes, code))
            plan.owners.append(t)
    return plan


def _load_into_remote(
    name: str, urls: list[str], out: Any, options: remote.StorageOptions, wm: Any = None
) -> dict[str, torch.Tensor] | None:
    """``load_file`` / ``load_sharded`` with ``out`` from a store, with no
    local copy, for the usual case: the objects' tensors and ``out``'s names
    the same, each read straight into its destination (``loading.stored``;
    in a group, once over it). None otherwise: the scratch copy loads it, with
    the in-place checks and errors."""
    t0 = time.perf_counter()
    if not isinstance(out, Mapping):
        return None
    tensors, files = stored.open_safetensors(name, urls, options, wm)
    if len(tensors) != len(out) or any(k not in out for k in tensors):
        return None
    pairs = [(k, src, out[k]) for k, src in tensors.items()]
    got = stored.read_pairs(name, files, pairs, options)
    if got is None:
        return None
    stats, _, _ = got
    reports.report(name, t0, stats, len(tensors))
    return {k: out[k] for k in tensors}


def _read_remote(plans: list[_RemotePlan], options: remote.StorageOptions) -> dict[str, Any]:
    """Fill the plans' tensors by ranged GETs of each object's version
    (neighbours sharing GETs; CUDA memory through a bounded host buffer); in
    a group, once over it: each rank GETs its share, the collectives bring
    the rest. The merged stats."""
    shared = sharing.current()
    if shared is None:
        stats = [
            transfer.read_from_store(p.url, p.segments, p.owners, options, p.e_tag) for p in plans
        ]
        return reports.merged(stats, "store")
    files = [
        sharing.SharedFile(p.url, transfer.StoredObject(p.url, options, p.e_tag, p.rows), p.size)
        for p in plans
    ]
    pieces = [
        piece
        for i, p in enumerate(plans)
        for piece in sharing.segment_pieces(i, p.segments, p.owners)
    ]
    return shared.read(files, pieces, IoOptions.of(None, None, None, None))


def _load_sharded_remote(
    url: str, device: Device, options: remote.StorageOptions
) -> dict[str, torch.Tensor]:
    """``load_sharded`` of a folder (or index) in a store, with no local copy:
    the index in one GET, every shard's header, then their tensors read as
    ``load_file`` reads an object (a single model.safetensors where there is
    no index)."""
    t0 = time.perf_counter()
    want, fill = _devices(device)
    base, _, _, wm, files = fmt.stored_shards(url, options)
    plans = [
        _plan_remote(remote.join(base, f), fill or torch.device("cpu"), options) for f in files
    ]
    tensors = fmt.gather(url, files, [p.tensors for p in plans], wm)
    stats = _read_remote(plans, options)
    reports.report(url, t0, stats, len(tensors))
    return _finish(tensors, want, fill)


def load(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Tensors (on cpu) from the bytes of a safetensors file (``safetensors.torch.load``)."""
    mv = memoryview(data).cast("B")
    where = "<bytes>"
    if len(mv) < 8:
        raise fmt.fail(where, f"{len(mv)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(mv[:8], "little")
    if n > fmt.MAX_HEADER:
        raise fmt.fail(
            where, f"header length {n} is over safetensors' limit of {fmt.MAX_HEADER} bytes"
        )
    if 8 + n > len(mv):
        raise fmt.fail(where, f"header length {n} runs past the end of the data ({len(mv)} bytes)")
    _, entries = fmt.parse_header(bytes(mv[8 : 8 + n]), len(mv) - 8 - n, where)
    out = {}
    with warnings.catch_warnings():
        # frombuffer warns that the buffer is read-only: it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        for e in entries:
            t = torch.empty(e.shape, dtype=e.dtype)
            if e.end > e.begin:
                src = torch.frombuffer(
                    mv, dtype=torch.uint8, count=e.end - e.begin, offset=8 + n + e.begin
                )
                t.view(-1).view(torch.uint8).copy_(src)
            out[e.name] = t
    return out


def metadata(
    filename: str | os.PathLike[str], *, storage_options: remote.StorageOptions = None
) -> dict[str, str] | None:
    """The ``__metadata__`` of a safetensors file (the header is validated as
    safetensors validates it to read it: tensors of a dtype or size torch here
    cannot hold pass, a load refuses them; no data is read); of an object URL,
    its header in one ranged GET."""
    remote.check_options(filename, storage_options, single=True)
    if remote.is_url(filename):
        url = os.fsdecode(os.fspath(filename))
        return fmt.read_stored_header(url, storage_options, tensors=False)[2]
    path = paths.path(filename, "safetensors.metadata")
    with paths.open_regular(path) as f:
        return fmt.read_header(f.fileno(), path, tensors=False)[0]


def save_sharded(
    tensors: Mapping[str, torch.Tensor],
    folder: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    *,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    backend: str | None = None,
    storage_options: remote.StorageOptions = None,
) -> None:
    """Save ``tensors`` into ``folder`` as the Hugging Face hub lays checkpoints out.

    Tensors go to shards in dict order, a new shard when the next tensor would
    push the current one past ``max_shard_size`` (a larger tensor gets a shard of
    its own), as ``huggingface_hub.split_torch_state_dict_into_shards`` splits.
    One shard: ``model.safetensors``, no index. Several:
    ``model-00001-of-0000n.safetensors`` ... and ``model.safetensors.index.json``
    (``{"metadata": {**metadata, "total_size": ...}, "weight_map": {name: shard}}``).
    Each shard carries ``{"format": "pt", **metadata}`` as its header metadata.

    The folder switches from the previous checkpoint to this one in one atomic
    step: every shard is written crash-safely (temp file, fsync, rename, fsync
    of the folder) under a name the previous checkpoint does not use (the hub's
    names when they are free, else ``model-<token>-0000k-of-0000n.safetensors``),
    then the index is replaced the same way; only then are the previous
    checkpoint's files (``model*.safetensors`` that the new index does not name,
    or the index when there is now a single ``model.safetensors``) removed.
    The shards another ``*.safetensors.index.json`` of the folder names are
    that checkpoint's: the shards take other names and nothing removes them.
    A save that fails or is killed leaves the previous checkpoint loadable and
    unchanged; its leftovers go with the next save. (Between the single-file and
    sharded layouts, a reader that prefers ``model.safetensors`` to the index, as
    transformers does, switches when the other layout's files are removed.)
    Returns None like ``save_file``; ``ckptio.last_report()`` sums the shards.

    ``folder`` may be an object URL (``s3://bucket/prefix``, with
    ``storage_options``): the shards are written locally, uploaded under names
    the store's current index does not use, then the index is put in one
    conditional PUT (If-Match on the index the save started from, or
    If-None-Match for a new checkpoint): a writer that raced this one makes it
    fail with ``ckptio.CommitConflictError`` (its shards removed), never a mix.
    A 412 where the index holds this save's own bytes (its PUT landed, the reply
    was lost and the retry found it there) is this save's commit. After the
    commit, shards that neither the new index nor the previous one (nor another
    ``*.safetensors.index.json`` of the folder) names are removed (the previous
    generation stays for readers that hold its index).
    """
    if remote.is_url(folder) or storage_options is not None:
        remote.check_options(folder, storage_options)
        kw: dict[str, Any] = dict(
            threads=threads, chunk_size=chunk_size, direct=direct,
            device_backend=device_backend, backend=backend,
        )  # fmt: skip
        url = os.fsdecode(os.fspath(folder))
        save = lambda p: save_sharded(tensors, p, max_shard_size, metadata, **kw)  # noqa: E731
        _save_sharded_remote(url, storage_options, save)
        return
    io = IoOptions.of(
        threads, chunk_size, direct, _device_backend(backend, device_backend, "save_sharded")
    )
    t0 = time.perf_counter()
    out = paths.path(folder, "safetensors.save_sharded")
    limit = parse_size(max_shard_size, "max_shard_size")
    meta = fmt.check_metadata(metadata) or {}
    fmt.check_tensors(tensors)
    shards: list[dict[str, torch.Tensor]] = []
    cur: dict[str, torch.Tensor] = {}
    cur_size = total = 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        total += n
        if n > limit:
            shards.append({k: t})
            continue
        if cur and cur_size + n > limit:
            shards.append(cur)
            cur, cur_size = {}, 0
        cur[k] = t
        cur_size += n
    if cur or not shards:
        shards.append(cur)
    os.makedirs(out, exist_ok=True)
    # The index's temp file, held (locked) until the index is committed into it,
    # marks the save as in flight: no sweep removes a shard meanwhile. Then the
    # leftovers of dead or failed saves go (this one's guard aside): on a nearly
    # full disk they would make this save fail too.
    guard = _native.AtomicWriter(os.path.join(out, fmt.INDEX_NAME), "off", None, False)
    written: list[str] = []
    try:
        fmt.sweep(out, own=guard.tmp_path)
        # What the clean-up below may remove: the files of the checkpoint this
        # save replaces (every model*.safetensors, where its index cannot be read).
        previous = fmt.generation(out)
        if previous is None:
            previous = {f for f in os.listdir(out) if fmt.SHARD_FILE.fullmatch(f)}
        names = fmt.shard_names(out, len(shards))
        stats = []
        for name, shard in zip(names, shards, strict=True):
            path = os.path.join(out, name)
            stats.append(_save_file(shard, path, {"format": "pt", **meta}, io, sweep=False))
            written.append(path)
        keep = set(names)
        if len(shards) > 1:
            index = {
                "metadata": {**meta, "total_size": total},  # ours: the bytes it holds
                "weight_map": {t: n for n, shard in zip(names, shards, strict=True) for t in shard},
            }
            # The commit point: every shard above is durable.
            guard.write_bytes(0, (json.dumps(index, indent=2) + "\n").encode())
            guard.commit()
            keep.add(fmt.INDEX_NAME)
        else:
            # model.safetensors is in place: the old index (if any) goes first, so
            # that an index-first reader never pairs it with removed shards.
            guard.abort()
            _remove(os.path.join(out, fmt.INDEX_NAME))
    except BaseException:
        # The save failed: what it wrote goes before the error does (the single
        # model.safetensors, replaced atomically, needs nothing of this).
        guard.abort()
        if len(shards) > 1:
            for path in written:
                _remove(path)
        raise
    # No save in flight: the previous checkpoint's files go, but those another
    # index names (that writer's checkpoint; one that cannot be read may name any).
    if not paths.live_temps(out) and (foreign := fmt.foreign_shards(out)) is not None:
        for f in sorted(previous - keep - foreign):
            if fmt.SHARD_FILE.fullmatch(f):
                _remove(os.path.join(out, f))
    reports.report(out, t0, reports.merged(stats, io.backend), len(tensors))


def _index_of(url: str, options: remote.StorageOptions) -> tuple[bytes, str | None] | None:
    """The store's current index at ``url`` (a folder) and its ETag, or None."""
    try:
        data, version = remote.get_bytes(remote.join(url, fmt.INDEX_NAME), options)
    except FileNotFoundError:
        return None
    return data, version["e_tag"]


def _names(index: bytes | None) -> set[str]:
    if index is None:
        return set()
    try:
        wm = json.loads(index).get("weight_map") or {}
        return {str(v) for v in wm.values()}
    except (ValueError, AttributeError):
        return set()


def _save_sharded_remote(
    url: str, options: remote.StorageOptions, save: Callable[[str], None]
) -> None:
    """``save`` into a scratch folder that holds the store's current index, the
    shards named with a token of this save's own (a save racing on the folder
    never uploads over them), uploaded, the index put conditionally (the
    commit), then the shards no save can still commit and no other index
    names removed (``remote.sweep_before``)."""
    old = _index_of(url, options)
    folder = remote.scratch_folder()
    uploaded: list[str] = []
    committed: str | None = None
    try:
        if old is not None:
            with open(os.path.join(folder, fmt.INDEX_NAME), "wb") as fh:
                fh.write(old[0])
        with fmt.own_shard_names():
            save(folder)
        files = sorted(f for f in os.listdir(folder) if fmt.SHARD_FILE.fullmatch(f))
        for name in files:
            obj = remote.join(url, name)
            remote.upload(os.path.join(folder, name), obj, options)
            uploaded.append(obj)
        index_path = os.path.join(folder, fmt.INDEX_NAME)
        new: bytes | None = None
        if os.path.exists(index_path) and files != ["model.safetensors"]:
            with open(index_path, "rb") as src:
                new = src.read()

            def lost(now: bytes | None) -> None:
                # Another save's index is there: this save's shards go (its own
                # names: no other save's), but for any that index names.
                named = _names(now)
                for obj in uploaded:
                    if obj.rsplit("/", 1)[-1] not in named:
                        remote.delete(obj, options)

            committed = remote.put_commit(
                remote.join(url, fmt.INDEX_NAME), new, options,
                create=old is None, if_match=None if old is None else old[1], on_conflict=lost,
            )  # fmt: skip
        elif old is not None:  # now one model.safetensors: the old index goes
            remote.delete(remote.join(url, fmt.INDEX_NAME), options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    foreign = fmt.stored_foreign_shards(url, options) if new is not None else None
    if foreign is not None:
        # Shards named by neither generation (readers holding the previous index
        # still read its own) nor another index (another writer's checkpoint);
        # never a single model.safetensors beside them (a single-file save
        # commits without the index).
        keep = _names(new) | _names(None if old is None else old[0]) | {"model.safetensors"}
        keep |= foreign
        remote.sweep_before(
            url, fmt.INDEX_NAME, committed,
            lambda n: "/" not in n and bool(fmt.SHARD_FILE.fullmatch(n)) and n not in keep,
            options,
        )  # fmt: skip


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@sharing.groupable("ckptio.safetensors.load_sharded")
def load_sharded(
    index_path_or_folder: str | os.PathLike[str],
    device: Device = "cpu",
    *,
    backend: str = "mmap",
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    device_backend: str | None = None,
    out: Mapping[str, torch.Tensor] | None = None,
    strict: bool = True,
    cast: bool = False,
    group: Any = None,
    storage_options: remote.StorageOptions = None,
) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint (``*.safetensors.index.json`` + shards, or a
    folder: read through its ``model.safetensors.index.json``, else its
    ``model.safetensors``, else its one other ``*.safetensors.index.json``, as
    ``save_sharded`` keeps them) to ``device`` in one call: the shards read one
    by one, each by the engine while the next one's tensors are allocated.
    Every tensor the index's weight_map names must
    be in the shard it names (FormatError otherwise); a tensor name in two
    shards is a FormatError. Returns all tensors of the shards, shard by shard
    in file order. The keywords are ``load_file``'s (``out``, ``strict``,
    ``cast``: load in place; ``group``: read once, share over a process
    group). ``index_path_or_folder`` may be an object URL (of the folder or the
    index, with ``storage_options``): the index in one GET (a listing first
    where a folder has no model.safetensors.index.json), each shard's tensors
    read straight into memory by ranged GETs (with ``out``: the index and
    shards go through a local scratch copy).
    """
    if remote.is_url(index_path_or_folder) or storage_options is not None:
        remote.check_options(index_path_or_folder, storage_options)
        kw: dict[str, Any] = dict(
            backend=backend, threads=threads, chunk_size=chunk_size, direct=direct,
            device_backend=device_backend, out=out, strict=strict, cast=cast, group=group,
        )  # fmt: skip
        url = os.fsdecode(os.fspath(index_path_or_folder))
        if out is None:  # straight (once per group, where there is one)
            return _load_sharded_remote(url, device, storage_options)
        if _on_host(device) and isinstance(strict, bool) and isinstance(cast, bool):
            base, _, _, wm, files = fmt.stored_shards(url, storage_options)
            shards = [remote.join(base, f) for f in files]
            got = _load_into_remote(url, shards, out, storage_options, wm)
            if got is not None:
                return got
        with fmt.stored_copy(url, storage_options) as local:
            return load_sharded(local, device, **kw)
    io = IoOptions.of(
        threads, chunk_size, direct, _device_backend(backend, device_backend, "load_sharded")
    )
    t0 = time.perf_counter()
    src = paths.path(index_path_or_folder, "safetensors.load_sharded")
    folder, wm = fmt.shard_files(src)
    files = ["model.safetensors"] if wm is None else list(dict.fromkeys(wm.values()))
    if out is not None:
        shards = [os.path.join(folder, f) for f in files]
        return _load_into(shards, out, device, t0, io, strict, cast, src, wm)
    want, fill = _devices(device)
    home = fill or torch.device("cpu")
    shared = sharing.current()
    if shared is not None:
        plans = [_plan(os.path.join(folder, f), home, io) for f in files]
        tensors = fmt.gather(src, files, [p.tensors for p in plans], wm)
        _read_shared(shared, src, t0, plans, io)
        return _finish(tensors, want, fill)
    # Each file queued for the engine as soon as its tensors are made, while the
    # next file's are; the files read one after another, each by the whole engine.
    reads = transfer.Pipeline.of_files(io.engine())
    plans = []
    try:
        for f in files:
            plan = _plan(os.path.join(folder, f), home, io)
            plans.append(plan)
            reads.add(plan.segments, plan.owners, plan.file)
        tensors = fmt.gather(src, files, [p.tensors for p in plans], wm)
    except BaseException as err:
        reads.abandon(err)  # the destinations stay the engine's until then
        raise
    reports.report(src, t0, reads.stats(io.backend), len(tensors))
    return _finish(tensors, want, fill)


def _read_shared(
    shared: sharing.Session, name: str, t0: float, plans: list[_Plan], io: IoOptions
) -> None:
    """The reads of ``plans`` (their files' data), once over the group."""
    files = [sharing.SharedFile(p.path, p.file, os.fstat(p.file.fileno()).st_size) for p in plans]
    pieces = [
        piece
        for i, p in enumerate(plans)
        for piece in sharing.segment_pieces(i, p.segments, p.owners)
    ]
    stats = shared.read(files, pieces, io)
    reports.report(name, t0, stats, sum(len(p.tensors) for p in plans))


def _load_into(
    shards: list[str],
    out: Any,
    device: Device,
    t0: float,
    io: IoOptions,
    strict: bool,
    cast: bool,
    src: str | None = None,
    wm: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """load_file / load_sharded with ``out``: the files' tensors read into ``out``'s."""
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a dict of name -> tensor, not {type(out).__name__}")
    if not _on_host(device):
        raise TypeError("out= and device= cannot be combined: the destinations decide")
    inplace.check_flags(strict=strict, cast=cast)
    opened = [fmt.open_file(p, direct=io.direct, backend=io.backend) for p in shards]
    names = [os.path.basename(p) for p in shards]
    tensors = fmt.gather(src or shards[0], names, [o[0] for o in opened], wm)
    what = f"ckptio.safetensors.{'load_sharded' if src else 'load_file'}(out=): {src or shards[0]}"
    result: dict[str, torch.Tensor] = inplace.fill_structure(
        what, tensors, out, [o[2] for o in opened], io, strict=strict, cast=cast, t0=t0
    )
    return result
