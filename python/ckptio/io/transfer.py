"""One way through for every format's loads and saves.

``ckptio.save``/``load``, ``ckptio.safetensors``, the DCP reader and writer and
``GdsFile`` all move bytes the same way, through this module:

1. they list **segments**, ``(file offset, address, nbytes, device)`` with
   device -1 for host memory, and the **owners** of that memory (storages,
   tensors), which the native call holds until it returns;
2. :func:`write`, :func:`write_storages` or :func:`read` hands them to the
   native file (``AtomicWriter``, ``Reader`` or ``DeviceFile``) together with
   the **current CUDA stream** of every device involved: the core records an
   event there and orders its own copies after it (the bounce lanes' streams
   wait for it, cuFile transfers wait for it on the host), so work queued
   before the call is respected without stalling the host, and data loaded is
   ready for any stream when the call returns;
3. the native report (a dict) becomes the call's :class:`~ckptio.io.reports.IOReport`
   (:mod:`ckptio.io.reports`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from ckptio import _native
from ckptio.errors import check_crc
from ckptio.io import remote, reports
from ckptio.io.devices import streams
from ckptio.io.engines import IoOptions

T = TypeVar("T")

#: (file offset, address, nbytes, device); device -1 is host memory.
Segment = tuple[int, int, int, int]


def _streams_of(segments: list[Segment]) -> list[tuple[int, int]]:
    return streams(s[3] for s in segments)


def write(
    target: _native.AtomicWriter | _native.DeviceFile,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    *,
    file_len: int | None = None,
    checksum: bool = False,
    patches: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Write ``segments`` (memory owned by ``owners``) into ``target``, after the
    work queued on the current streams; ``file_len`` is preallocated first, and
    ``checksum`` adds "crc32" (each segment's CRC-32, None where cuFile moved it).
    ``patches`` (an ``AtomicWriter``): [(segment index, file offset)] where the
    engine stores a segment's CRC-32 as its bytes pass (a zip data descriptor)."""
    streams = _streams_of(segments)
    if patches:
        return target.write_segments(  # type: ignore[call-arg]
            engine, segments, owners, streams, file_len, checksum, patches
        )
    return target.write_segments(engine, segments, owners, streams, file_len, checksum)


def write_archive(
    writer: _native.AtomicWriter,
    engine: _native.Engine,
    entries: list[tuple[str, Any, int]],
    prefix: str,
    owners: list[Any],
) -> dict[str, Any]:
    """Write a whole torch.save archive into ``writer``: ``entries`` = [(record
    name, bytes or (address, nbytes, device), alignment)] in file order, the
    storages' memory owned by ``owners``, after the work queued on the current
    streams; headers and data in one engine pass, then the central directory."""
    devices = (e[1][2] for e in entries if isinstance(e[1], tuple))
    return writer.write_archive(engine, entries, prefix, owners, streams(devices))


def write_storages(
    writer: _native.AtomicWriter | _native.DeviceFile,
    engine: _native.Engine,
    storages: list[tuple[str, int, int, int]],
    owners: list[Any],
) -> dict[str, Any]:
    """Write (key, address, nbytes, device) storages into their records of the
    torch.save archive in ``writer``, and fill the records' CRC-32s."""
    return writer.write_storages(engine, storages, owners, streams(s[3] for s in storages))


def read(
    source: _native.Reader | _native.DeviceFile,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    *,
    verify: bool = False,
) -> dict[str, Any]:
    """Fill ``segments`` (memory owned by ``owners``) from ``source``, after the
    work queued on the current streams (which may still use the destinations);
    the data is ready for any stream on return. ``verify`` (a ``Reader``): check
    each whole record read against its CRC-32; (a ``DeviceFile``) return each
    segment's CRC-32 as "crc32", for the caller to check."""
    return read_after(source, engine, segments, owners, _streams_of(segments), verify)


#: Destinations a read from a store plans before its first GETs start; each
#: later batch is four times the last: the store reads a batch while the next
#: is planned.
FIRST_BATCH = 8


def batch_ranges(n: int, first: int = FIRST_BATCH) -> Iterator[tuple[int, int]]:
    """(start, end) of each batch of ``n`` destinations: ``first``, then four
    times the last."""
    at, size = 0, max(first, 1)
    while at < n:
        yield at, min(n, at + size)
        at, size = at + size, size * 4


#: A load that plans its destinations one by one (the DCP reader) hands them
#: to the engine in batches of this many bytes (or BATCH_ITEMS destinations),
#: the first as soon as it is planned; batches planned while the engine reads
#: join its next call (:class:`Pipeline` with ``join``), so no read waits for
#: a batch larger than the time it leaves. (Batches of four times the last, 8,
#: 32, 128, 512 items, left the engine idle while the last was planned: DCP's
#: read_data of the LLM shape took 121 ms, now 116, beside a 95 ms raw read on
#: an H100, ``probes/probe_llm_setup.py``.)
BATCH_BYTES = 64 << 20
BATCH_ITEMS = 64


def byte_ranges(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(start, end) of each batch of destinations of ``sizes`` bytes: a batch
    ends once it holds BATCH_BYTES or BATCH_ITEMS."""
    start, held = 0, 0
    for i, n in enumerate(sizes):
        held += n
        if held >= BATCH_BYTES or i + 1 - start >= BATCH_ITEMS:
            yield start, i + 1
            start, held = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


def read_while(
    source: _native.Reader,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    meanwhile: Callable[[], T],
    *,
    verify: bool = False,
) -> tuple[dict[str, Any], T]:
    """:func:`read`, with ``meanwhile()`` run on the calling thread while the
    engine reads on another (the native read holds no GIL): (the read's stats,
    ``meanwhile``'s result). ``meanwhile`` must not touch the destinations'
    bytes: making the tensors of a load over its storages is what it is for.
    An error of the read comes first, then one of ``meanwhile``."""
    return read_batches(source, engine, iter([(segments, owners)]), meanwhile, verify=verify)


def read_batches(
    source: _native.Reader,
    engine: _native.Engine,
    batches: Iterator[tuple[list[Segment], list[Any]]],
    meanwhile: Callable[[], T],
    *,
    verify: bool = False,
    join: bool = False,
) -> tuple[dict[str, Any], T]:
    """:func:`read_while` of the (segments, owners) batches ``batches`` yields,
    each read (a :class:`Pipeline`) as soon as it is yielded and the one before
    is read: the engine reads a batch while the next is made (its destinations
    allocated, say) on the calling thread, then ``meanwhile()`` runs. ``join``:
    the batches yielded while a read runs are read together, in one call,
    once it is done. Stats merged over the batches (with ``verify``,
    "verified" and "unchecked" joined)."""
    reads = Pipeline.of_file(source, engine, verify=verify, join=join)
    try:
        for segments, owners in batches:
            reads.add(segments, owners)
        result = meanwhile()
    except BaseException as err:
        reads.abandon(err)
        raise
    return reads.stats(), result


class Pipeline:
    """A load's reads of one file (or one object's version; or of several files,
    :meth:`of_files`), handed to the
    engine (or the store's GETs) in order, one at a time (each engine call takes
    its threads' lanes: calls side by side would take more, pinned for GPU
    memory; each store read its concurrency's requests and buffers), on kept
    threads: a read queued behind the one before starts the moment that one is
    done, while the caller goes on making the next (it never waits for a read
    to queue one). With ``join``, batches added while the last read waits for
    its turn join it: one read of them all, not one per batch (a store read's
    rounds of GETs are fullest so). Until :meth:`stats`, :meth:`wait` or
    :meth:`abandon` returns, the destinations are the reads'."""

    def __init__(
        self,
        read: Callable[[Any, list[Segment], list[Any], list[tuple[int, int]]], dict[str, Any]],
        *,
        source: Any = None,
        join: bool = False,
        verify: bool = False,
    ) -> None:
        self._read = read  # (source, segments, owners, streams) -> stats
        self._source = source  # what add() reads from unless it names another
        self._join = join
        self._verify = verify  # its stats name the records checked, even of no read
        self._lock = threading.Lock()
        self._last: _Batches | None = None
        self.jobs: list[Job[dict[str, Any]]] = []
        self._reads: list[_Batches] = []  # what each of jobs reads
        # Per batch added: (its read's index in jobs, first segment there, segments).
        self._parts: list[tuple[int, int, int]] = []

    @classmethod
    def of_file(
        cls,
        source: _native.Reader | _native.DeviceFile,
        engine: _native.Engine,
        *,
        verify: bool,
        join: bool = False,
    ) -> Pipeline:
        """Engine reads of ``source`` (:func:`read_after`)."""
        return cls.of_files(engine, verify=verify, source=source, join=join)

    @classmethod
    def of_files(
        cls,
        engine: _native.Engine,
        *,
        verify: bool = False,
        source: _native.Reader | _native.DeviceFile | None = None,
        join: bool = False,
    ) -> Pipeline:
        """Engine reads of the file each :meth:`add` names: files read one after
        another, each by the whole engine. (Side by side, the engine's threads
        split among them, the threads of a file read first idle while the others
        are read: load_sharded of the LLM shape from /dev/shm took 1.30x as long
        on an H100, ``probes/probe_sharded_workers.py``.)"""

        def read(
            src: Any, segs: list[Segment], owners: list[Any], st: list[tuple[int, int]]
        ) -> dict[str, Any]:
            return read_after(src, engine, segs, owners, st, verify)

        return cls(read, source=source, verify=verify, join=join)

    @classmethod
    def of_store(
        cls, url: str, options: remote.StorageOptions, e_tag: str | None, crc: bool
    ) -> Pipeline:
        """Ranged GETs of version ``e_tag`` of ``url`` (:func:`read_from_store`),
        batches joining the read that waits."""
        return cls(
            lambda _, segs, owners, st: read_from_store(url, segs, owners, options, e_tag, crc, st),
            join=True,
        )

    def add(self, segments: list[Segment], owners: list[Any], source: Any = None) -> int | None:
        """Read ``segments`` (of ``source``, else the pipeline's) once the reads
        before are done (after one fails, this one is not made and fails with its
        error); the index of its stats, None for no segments."""
        if not segments:
            return None
        source = self._source if source is None else source
        streams = _streams_of(segments)  # the caller's current streams (thread-local)
        with self._lock:
            last = self._last
            if self._join and last is not None and not last.started and last.source is source:
                self._parts.append((len(self.jobs) - 1, len(last.segments), len(segments)))
                last.add(segments, owners, streams)
                return len(self._parts) - 1
        batches = self._last = _Batches(source, list(segments), list(owners), streams)
        before = self.jobs[-1] if self.jobs else None
        self._parts.append((len(self.jobs), 0, len(segments)))
        job = submit(functools.partial(self._run, before, batches))
        self.jobs.append(job)
        self._reads.append(batches)
        # Let the read reach the engine (which lets go of the GIL) before the
        # caller's Python holds the GIL for up to a switch interval (5 ms).
        job.started.wait()
        return len(self._parts) - 1

    def _run(self, before: Job[Any] | None, batches: _Batches) -> dict[str, Any]:
        if before is not None:
            before.result()  # its error instead, where it failed
        with self._lock:
            batches.started = True  # no batch joins it now
        return self._read(batches.source, batches.segments, batches.owners, batches.streams)

    def result(self, index: int) -> dict[str, Any]:
        """The stats of batch ``index`` once its read is done (of a read that
        batches joined: its "bytes" and "crc32" those of the batch's segments)."""
        job, first, count = self._parts[index]
        stats = self.jobs[job].result()
        if sum(p[0] == job for p in self._parts) == 1:
            return stats
        mine = self._reads[job].segments[first : first + count]
        out = dict(stats, bytes=sum(s[2] for s in mine))
        if "crc32" in stats:
            out["crc32"] = stats["crc32"][first : first + count]
        return out

    def wait(self) -> None:
        """Every read done; the first error raised after that."""
        wait_all(self.jobs)

    def stats(self, backend: str | None = None) -> dict[str, Any]:
        """Every read done: their stats merged (bytes summed; with ``verify``,
        "verified" and "unchecked" joined, "crc32" concatenated; ``backend``:
        the one asked for, said where nothing was read)."""
        return merged(wait_all(self.jobs), backend, verify=self._verify)

    def abandon(self, err: BaseException) -> None:
        """:func:`settle` the reads after ``err`` (the caller's)."""
        settle(self.jobs, err)


class _Batches:
    """The batches of one read of a :class:`Pipeline`: their source, segments,
    owners and the streams the read is ordered after; ``started`` once it reads."""

    __slots__ = ("source", "segments", "owners", "streams", "started")

    def __init__(
        self,
        source: Any,
        segments: list[Segment],
        owners: list[Any],
        streams: list[tuple[int, int]],
    ) -> None:
        self.source = source
        self.segments, self.owners, self.streams = segments, owners, streams
        self.started = False

    def add(
        self, segments: list[Segment], owners: list[Any], streams: list[tuple[int, int]]
    ) -> None:
        self.segments += segments
        self.owners += owners
        self.streams += [s for s in streams if s not in self.streams]


def merged(
    done: list[dict[str, Any]], backend: str | None = None, *, verify: bool = False
) -> dict[str, Any]:
    """Reads' stats as one read's (see :meth:`Pipeline.stats`). ``verify``:
    "verified" and "unchecked" are there even where nothing was read (a
    checkpoint without a byte of tensor data checks no record)."""
    if len(done) == 1:
        return done[0]
    out = reports.merged(done, backend)
    for key in ("verified", "unchecked", "crc32"):
        if any(key in st for st in done) or (verify and key != "crc32"):
            out[key] = [x for st in done for x in st.get(key, ())]
    return out


def settle(jobs: Sequence[Job[Any]], err: BaseException) -> None:
    """Wait for every job after ``err`` (the caller's: their destinations stay
    the engine's until then), and raise a job's error first, chained to it;
    return where the jobs went well (the caller raises ``err``)."""
    failed: BaseException | None = None
    for job in jobs:
        try:
            job.result()
        except BaseException as e:  # noqa: BLE001 - raised below
            failed = failed or e
    if failed is not None and failed is not err:
        raise failed from err


def wait_all(jobs: Sequence[Job[T]]) -> list[T]:
    """Every job's result once all are done (each waited for, whatever the
    others did); the first error raised after that."""
    results: list[Any] = []
    error: BaseException | None = None
    for job in jobs:
        try:
            results.append(job.result())
        except BaseException as e:  # noqa: BLE001 - raised once all are done
            error = error or e
    if error is not None:
        raise error
    return results


class Job(Generic[T]):
    """A call running on a kept thread; :meth:`result` waits for it."""

    __slots__ = ("fn", "started", "done", "value", "error")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.started = threading.Event()
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        self.started.set()
        try:
            self.value = self.fn()
        except BaseException as e:  # re-raised by result() on the caller's thread
            self.error = e

    def result(self) -> T:
        """The call's value or its error, once it is done. An interrupt
        (KeyboardInterrupt) meanwhile is raised only then: the call uses memory
        the caller owns."""
        interrupted: BaseException | None = None
        while not self.done.is_set():
            try:
                self.done.wait()
            except BaseException as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


class _Workers:
    """Threads kept between calls for the reads that run beside the caller.

    A thread started per load maps its stack and unmaps it at its end, and both
    wait for the process's memory-map lock: behind the unmapping of a large file
    mapping (the last load's) that cost up to 90 ms per load on the H200 host.
    Idle threads wait for work; one is started only when none is idle (so never
    more than the loads that ever ran at once). A forked child starts its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Job[Any]]] = []
        self._pid = os.getpid()
        # A fork while another thread holds the lock would leave it held in the child.
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._idle = []
        self._pid = os.getpid()

    def submit(self, fn: Callable[[], T]) -> Job[T]:
        job = Job(fn)
        with self._lock:
            if self._pid != os.getpid():  # the parent's threads are not here
                self._idle.clear()
                self._pid = os.getpid()
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(inbox,), name="ckptio-read", daemon=True
            ).start()
        inbox.put(job)
        return job

    def _serve(self, inbox: queue.SimpleQueue[Job[Any]]) -> None:
        while True:
            job = inbox.get()
            job.run()
            job.fn = None  # type: ignore[assignment]  # drop the call's references now
            with self._lock:
                if self._pid == os.getpid():
                    self._idle.append(inbox)
            job.done.set()
            # An idle thread keeps nothing: a failed job's error holds the frames
            # of its read, and through them its destinations and file.
            del job


_workers = _Workers()


def submit(fn: Callable[[], T]) -> Job[T]:
    """Run ``fn()`` on a kept thread (see :class:`_Workers`); ``.result()`` waits."""
    return _workers.submit(fn)


def read_after(
    source: _native.Reader | _native.DeviceFile,
    engine: _native.Engine,
    segments: list[Segment],
    owners: list[Any],
    streams: list[tuple[int, int]],
    verify: bool,
) -> dict[str, Any]:
    """:func:`read`, ordered after the work queued on ``streams`` ((device,
    stream) pairs: those current on the thread the read is for)."""
    if verify:
        stats = source.read_segments(engine, segments, owners, streams, True)  # type: ignore[call-arg]
    else:
        stats = source.read_segments(engine, segments, owners, streams)
    stats["bytes_read"] = stats["bytes"]
    return stats


class File(Protocol):
    """A file of a read of several files: its name in reports, the native file
    (or an object in a store). Read-only members: a :class:`~ckptio.formats.mapped.Mapped`
    (whose ``file`` is never a ``StoredObject``) is one."""

    @property
    def path(self) -> str: ...

    @property
    def file(self) -> _native.Reader | _native.DeviceFile | StoredObject: ...


@dataclasses.dataclass
class StoredObject:
    """An object in a store read as a file of a group's read: its URL, the
    store's settings, the version every read pins (``version``: its ETag) and
    its records (name, data offset, size) for the ranks to compare."""

    url: str
    options: remote.StorageOptions
    version: str | None
    rows: list[tuple[str, int, int]]
    #: A torch.save archive's storage records by data offset: (name, size,
    #: declared CRC-32 or None), what a verifying read checks whole reads against.
    declared: dict[int, tuple[str, int, int | None]] = dataclasses.field(default_factory=dict)

    def records(self) -> list[tuple[str, int, int]]:
        return self.rows


def read_files(
    files: Sequence[File],
    per_file: dict[int, tuple[list[Segment], list[Any]]],
    io: IoOptions,
    verify: bool,
) -> list[dict[str, Any]]:
    """Read ``per_file`` ({index in ``files``: (segments, owners)}), the files one
    after another, each by the whole engine (see :meth:`Pipeline.of_files`); one
    stats dict per file, with
    "path". ``verify``: each whole record read from a ``Reader`` (or of an
    object's ``declared`` records) is checked against its CRC-32 ("verified",
    "unchecked": the records' names). Objects in a store are read by ranged
    GETs of their pinned version (no engine: the store's client has threads of
    its own)."""
    stored = [fi for fi in per_file if isinstance(files[fi].file, StoredObject)]
    got_stored = {}
    for fi in stored:
        obj = files[fi].file
        assert isinstance(obj, StoredObject)
        check = verify and bool(obj.declared)
        segs, owners = per_file[fi]
        stats = read_from_store(obj.url, segs, owners, obj.options, obj.version, check)
        if check:
            stats.update(check_records(obj.url, obj.declared, segs, stats.pop("crc32")))
        got_stored[fi] = dict(stats, path=files[fi].path, bytes_read=stats["bytes"])
    if len(stored) == len(per_file):
        return [got_stored[fi] for fi in per_file]
    return _read_local_files(files, per_file, io, verify, got_stored)


def check_records(
    url: str,
    declared: dict[int, tuple[str, int, int | None]],
    segments: Sequence[Segment],
    crcs: list[int],
) -> dict[str, list[str]]:
    """The CRC-32s (``crcs``, one per segment) of the segments of ``url`` that
    read a whole record of ``declared`` (data offset -> (name, size, CRC-32 or
    None)) checked, a FormatError naming the first that differs: "verified"
    and "unchecked" (none declared) record names."""
    verified: list[str] = []
    unchecked: list[str] = []
    for (off, _, n, _), crc in zip(segments, crcs, strict=True):
        rec = declared.get(off)
        if rec is None or rec[1] != n:
            continue  # not a whole record (a header, a piece another rank reads)
        name, _, want = rec
        check_crc(url, name, want, crc)
        (unchecked if want is None else verified).append(name)
    return {"verified": verified, "unchecked": unchecked}


def _read_local_files(
    files: Sequence[File],
    per_file: dict[int, tuple[list[Segment], list[Any]]],
    io: IoOptions,
    verify: bool,
    done: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    """``read_files`` of the local files (those not in ``done``), one after another."""
    engine = io.engine()
    got: dict[int, dict[str, Any]] = dict(done)
    for fi, (segs, owners) in per_file.items():
        if fi in done:
            continue
        f = files[fi]
        local = cast("_native.Reader | _native.DeviceFile", f.file)  # objects are in done
        check = verify and isinstance(local, _native.Reader)
        got[fi] = dict(read(local, engine, segs, owners, verify=check), path=f.path)
    return [got[fi] for fi in per_file]


def release_buffers() -> int:
    """Give back the memory every ckptio engine keeps between transfers (staging
    and pinned bounce buffers); they are allocated again on need. Stagers free
    theirs on ``close()``. Returns the bytes given back."""
    return _native.release_buffers()


def replace_file(path: str, data: bytes) -> None:
    """A small file (an index, DCP's ``.metadata``) replaced atomically: a temp
    file beside it, fsync, rename, fsync of the folder."""
    commit_bytes(_native.AtomicWriter(path, "off", None, False), data)


def commit_bytes(writer: _native.AtomicWriter, data: bytes) -> None:
    """``data`` as the whole new file of ``writer``, committed (the file
    replaced); the temp file aborted on any error, interrupts included."""
    try:
        writer.write_bytes(0, data)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def destinations_overlap(segments: Sequence[Segment]) -> bool:
    """Whether two of ``segments`` write the same memory (tied weights, views
    of one tensor): a read into them would be two writers of one byte."""
    spans = sorted((s[3], s[1], s[1] + s[2]) for s in segments if s[2])
    return any(a[0] == b[0] and a[2] > b[1] for a, b in zip(spans, spans[1:], strict=False))


def read_from_store(
    url: str,
    segments: list[tuple[int, int, int, int]],
    owners: list[Any],
    options: remote.StorageOptions = None,
    e_tag: str | None = None,
    crc: bool = False,
    streams: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """(object offset, address, nbytes, device) segments of the object ``url``
    read straight into memory that ``owners`` own (checked by the core, held
    until the call returns) by parallel ranged GETs (``concurrency`` x
    ``part_size``; neighbouring segments share GETs) of the version ``e_tag``
    where given: host memory (device -1) from the GETs, CUDA memory through a
    host buffer of concurrency x part_size, after the work queued on the
    current streams (``streams``: those of the thread this read is for). The
    object's size and version, and the stats of a report
    (``reports.report``); with ``crc``, "crc32": each segment's CRC-32."""
    client, n, part = remote.client_options(options, url)
    if streams is None:
        streams = _streams_of(segments)
    info = _native.store_read_into(url, segments, owners, client, n, part, e_tag, streams, crc)
    return _store_stats(info, sum(s[2] for s in segments), n)


def upload_zstd(
    url: str,
    items: list[tuple[bytes, int, int, bytes, list[int]]],
    owners: list[Any],
    options: remote.StorageOptions = None,
    workers: int = 4,
) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """Each item (zip head, host address, nbytes, zip tail, CRC-32 offsets in
    the tail; memory ``owners`` own) compressed into one zstd frame on
    ``workers`` threads and uploaded to ``url`` as the frames are made (parts
    of ``part_size``, ``concurrency`` uploads at once): one multipart upload,
    committed by its completion. (each item's (offset, length), the stats)."""
    client, n, part = remote.client_options(options, url)
    info = _native.store_upload_zstd(url, items, owners, client, n, part, workers)
    spans = [tuple(s) for s in info.pop("spans")]
    return spans, _store_stats(info, info["size"], n)


def upload_archive(
    url: str,
    entries: list[tuple[str, Any, int]],
    owners: list[Any],
    options: remote.StorageOptions = None,
) -> dict[str, Any]:
    """A torch.save archive (``entries`` as for ``write_archive``, storages in
    host or CUDA memory that ``owners`` own) uploaded to ``url`` part by part
    straight from memory, after the work queued on the current streams: one
    multipart upload, committed by its completion. The object's size and
    version, and the stats of a report."""
    client, n, part = remote.client_options(options, url)
    devices = (e[1][2] for e in entries if isinstance(e[1], tuple))
    info = _native.store_upload_archive(url, entries, owners, client, n, part, streams(devices))
    return _store_stats(info, info["size"], n)


def upload_image(
    url: str,
    head: bytes,
    segments: list[tuple[int, int, int, int]],
    owners: list[Any],
    total: int,
    options: remote.StorageOptions = None,
    patches: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """An object of ``total`` bytes, ``head`` at offset 0 and (object offset,
    address, nbytes, device) segments of host or CUDA memory that ``owners``
    own, uploaded to ``url`` part by part straight from memory, after the work
    queued on the current streams: one multipart upload. ``patches``: [(segment
    index, object offset)] where a segment's CRC-32 goes (after it: a zip's
    data descriptor), as for ``write``. The object's size and version, and
    the stats of a report."""
    client, n, part = remote.client_options(options, url)
    info = _native.store_upload_image(
        url, head, segments, owners, total, client, n, part, _streams_of(segments), patches or []
    )
    return _store_stats(info, info["size"], n)


def _store_stats(info: dict[str, Any], nbytes: int, threads: int) -> dict[str, Any]:
    """A store transfer's stats: GPU memory moved through host buffers, pinned
    ("bounce") unless the pinned-memory cap had no room (``fallback_reason``)."""
    host = info.pop("host_buffers", None)
    info.update(
        bytes=nbytes, backend="store", direct=False, direct_reason="an object store",
        threads=threads, device_path=None if host is None else "bounce",
    )  # fmt: skip
    if host == "pageable":
        info["fallback_reason"] = (
            "the pinned-memory cap had no room: GPU memory moved through pageable host buffers"
        )
    return info
