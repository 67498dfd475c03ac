"""Tiered checkpoints: a fast local commit, drained to an object store.

``Checkpointer(local, remote)``: ``save(step, state)`` returns at once with three
futures, ``staged`` (the snapshot is taken: training may modify the state
again), ``local`` (the step is durable in the local folder: NVMe or /dev/shm)
and ``remote`` (durable in the store). A step is:

- locally, the folder ``<local>/step-<step>/`` with its files and, written last
  and atomically, ``ckptio-commit.json`` (what the step holds): a folder without
  it is a save that died and is removed by the next ``Checkpointer``;
- remotely, the same files under ``<remote>/step-<step>/`` (each one multipart
  upload, whole or absent) and, put last with If-None-Match,
  ``ckptio-commit.json``: a step is complete in the store once that object
  is there, and never names a missing object. A step leaves the store
  (``keep_remote``) resumably: ``ckptio-removing.json`` put first (from then
  on the step is not complete for any reader), then its commit record, its
  files, and that mark last; a step found marked is removed by whichever
  ``Checkpointer`` comes next (it is idempotent), never one not marked.

The drain runs on one background thread, in step order, retrying transient
store errors (throttling, lost connections, 5xx) with exponential backoff, and
is idempotent per step (an object this step's drain uploaded, whole in the store,
is not sent again; its own commit record already there counts as done; another
save's is a conflict). A local
step is removed only once its own save is complete in the store (``keep_local``
newest kept; one whose drain met another save's stays); a new ``Checkpointer``
on the same folders drains what the last process left. Layout, guarantees and
figures: docs/objectstore.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import re
import secrets
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from ckptio import _native
from ckptio import safetensors as st
from ckptio.dcp import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from ckptio.errors import (
    CkptioError,
    CommitConflictError,
    DrainStoppedError,
    StoreConnectionError,
    StoreError,
    StoreThrottledError,
)
from ckptio.formats import dcp as dcp_format
from ckptio.io import liveness, paths, transfer
from ckptio.io import remote as objstore
from ckptio.serialization import load as _load
from ckptio.serialization import save as _save
from ckptio.staging import DefaultStager, StagingOptions

__all__ = ["Checkpointer", "SaveHandle", "TieredWriter", "FORMATS"]

#: What a step holds, by format: the file name (DCP: a folder of files).
FORMATS = {"torch": "state.pt", "safetensors": "model.safetensors", "dcp": None}
COMMIT = "ckptio-commit.json"
#: In a remote step: put before its removal begins (the commit record, then
#: the files, then this last), so that no reader takes the step as complete
#: and the next Checkpointer finishes what a process that died left.
REMOVING = "ckptio-removing.json"
#: In a step folder being written: the writing process's tag (``io.liveness``),
#: so that a new Checkpointer leaves a live writer's folder alone.
WRITER = ".ckptio-writer"
#: In a local step folder: the ETag of each file as this step's drain uploaded
#: it, so that a resumed drain skips exactly those objects.
UPLOADED = ".ckptio-uploaded.json"
#: In a local step folder: written (atomically) before keep_remote removes the
#: step's own save from the store, so that no later Checkpointer drains it again.
DROPPED = ".ckptio-dropped.json"
_STEP = re.compile(r"step-(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step:010d}"


@dataclass(frozen=True)
class SaveHandle:
    """One ``Checkpointer.save``: ``staged`` (the snapshot is taken), ``local``
    (its result: the local folder), ``remote`` (its result: the step's URL).
    A failure is the exception of the future where it happened (and of the
    ones after it)."""

    step: int
    staged: Future[None]
    local: Future[str]
    remote: Future[str]

    def wait(self, timeout: float | None = None) -> str:
        """Block until the step is durable in the store; its URL."""
        return self.remote.result(timeout)


def _transient(e: BaseException) -> bool:
    if isinstance(e, (StoreThrottledError, StoreConnectionError)):
        return True
    # Other store answers (5xx) are worth another try; refusals and missing
    # buckets, credentials and conflicts are not.
    return type(e) is StoreError


class Checkpointer:
    """Saves to ``local`` (a folder), drained to ``remote`` (``s3://bucket/prefix``).

    ``format``: ``"torch"`` (``ckptio.save`` of any state), ``"safetensors"`` (a
    flat dict of tensors) or ``"dcp"`` (``torch.distributed.checkpoint`` with
    ckptio's writer, one process). ``keep_local``: newest steps kept locally
    (older ones go once their own save is complete in the store: never one
    whose drain met another save's commit record); ``keep_remote``: newest
    steps kept in the store (None: all). Newest in save order: the steps this
    Checkpointer saved (or resumed the drain of), in that order, are newer
    than every step it found in either tier (those by step number), so a run
    restarted from an older step keeps its new saves and the steps of the run
    it left go first. ``storage_options``: the store's
    settings (``ckptio.save``). ``stager``: takes the snapshot (default
    ``ckptio.staging.DefaultStager()``, pinned and reused save after save).
    ``tries``/``backoff``/``max_backoff``: the drain's retries of transient
    errors (seconds, doubled each try, with jitter). A setting of the wrong
    type or out of range is a TypeError or ValueError naming it. One process
    uses it: in a child forked from it, ``save``/``load``/``wait``/``close``
    raise a RuntimeError (its threads are the parent's).
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        remote: str,
        *,
        keep_local: int = 2,
        keep_remote: int | None = None,
        format: str = "torch",
        storage_options: objstore.StorageOptions = None,
        stager: Any = None,
        tries: int = 6,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
    ) -> None:
        _check_tiers(local, remote, storage_options)
        if format not in FORMATS:
            raise ValueError(f"format must be one of {sorted(FORMATS)}, not {format!r}")
        _check_int("keep_local", keep_local, 1)
        if keep_remote is not None:
            _check_int("keep_remote", keep_remote, 1)
        _check_retries(tries, backoff, max_backoff=max_backoff)
        self.local = os.path.abspath(paths.local(os.fsdecode(os.fspath(local))))
        self.remote = remote.rstrip("/")
        self.format = format
        self.keep_local = keep_local
        self.keep_remote = keep_remote
        self._options = dict(storage_options) if storage_options is not None else None
        self._tries, self._backoff, self._max_backoff = tries, backoff, max_backoff
        if stager is None:
            # Each staged tensor a storage of its own: torch.save and
            # safetensors write what they are given, slabs included.
            stager = DefaultStager(StagingOptions(use_shared_memory=False, slabs=False))
            self._own_stager = True
        else:
            self._own_stager = False
        self._stager = stager
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckptio-tier-local")
        self._drainer = ThreadPoolExecutor(1, thread_name_prefix="ckptio-tier-remote")
        self._lock = threading.Lock()
        self._closed = False
        #: The process whose threads drain: a forked child has none of them.
        self._pid = os.getpid()
        #: Set by close(timeout=) once its time is up: drains stop at their next
        #: retry or file (their steps stay local, for the next Checkpointer).
        self._stopping = threading.Event()
        self._last: SaveHandle | None = None
        #: Each drain's future not reported yet (by wait()), and its step.
        self._pending: dict[Future[Any], int] = {}
        #: Steps known complete in the store (filled by listings and drains).
        self._in_store: set[int] = set()
        #: Steps this process removed from the store (keep_remote), or an
        #: earlier one (DROPPED): past both windows, so their local copies go too.
        self._dropped: set[int] = set()
        #: Local steps whose own save is (or was, until keep_remote removed it)
        #: the store's: drained here, or the store's commit record is theirs.
        #: Only these leave the local tier (a step whose drain met another
        #: save's of its number is the only copy of what was saved).
        self._own: set[int] = set()
        #: The steps this Checkpointer queued for a drain (saved, or resumed),
        #: by the order it queued them: retention's save order (see _prune).
        self._order: dict[int, int] = {}
        self._queue_seq = itertools.count(1)
        #: Steps found marked for removal in the store (a process that died
        #: midway left them): the next prune finishes them.
        self._marked: set[int] = set()
        os.makedirs(self.local, exist_ok=True)
        self.resumed: list[int] = self._resume()

    # -- what is where -----------------------------------------------------------------

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.local, step_name(step))

    def _step_url(self, step: int) -> str:
        return objstore.join(self.remote, step_name(step))

    def local_steps(self) -> list[int]:
        """Steps complete in the local folder, oldest first: this remote's only
        (a step another run saved there, for another remote, is not one)."""
        return sorted(s for s, remote in self._committed().items() if remote == self.remote)

    def _committed(self) -> dict[int, str]:
        """Each step committed in the local folder: the remote it was saved for
        (its commit record's; one written before records named it: this one)."""
        found = {}
        for name in os.listdir(self.local):
            m = _STEP.match(name)
            if m and (manifest := _read_manifest(os.path.join(self.local, name))) is not None:
                found[int(m.group(1))] = manifest.get("remote", self.remote)
        return found

    def _check_not_foreign(self, step: int) -> None:
        """A FileExistsError where the local ``step`` is another run's: saved
        for another remote. Its folder is the only copy of that save until
        that run drains it: neither removed nor written over here."""
        folder = self._step_dir(step)
        manifest = _read_manifest(folder)
        if manifest is not None and manifest.get("remote", self.remote) != self.remote:
            raise FileExistsError(
                17,
                f"step {step} is saved in {self.local} for {manifest['remote']}, not "
                f"{self.remote}: another run's local copy, left as it is (give each "
                "remote a local folder of its own)",
                folder,
            )

    def remote_steps(self) -> list[int]:
        """Steps complete in the store (their commit record is there and no
        removal mark), oldest first."""
        found, marked = set(), set()
        for url, _, _, _ in objstore.listing(self.remote, self._options):
            tail = url[len(self.remote) :].strip("/").split("/")
            if len(tail) == 2 and (m := _STEP.match(tail[0])):
                if tail[1] == COMMIT:
                    found.add(int(m.group(1)))
                elif tail[1] == REMOVING:
                    marked.add(int(m.group(1)))
        found -= marked
        with self._lock:
            self._in_store = (self._in_store | found) - marked
            self._marked |= marked
        return sorted(found)

    def latest(self) -> int | None:
        """The newest step complete in any tier (None: no step). Where the store
        cannot be listed, the local tier answers alone (with a warning)."""
        steps = set(self.local_steps())
        try:
            steps |= set(self.remote_steps())
        except StoreError as e:
            warnings.warn(
                f"ckptio.tiered: {self.remote} not listed ({e}); local steps only", stacklevel=2
            )
        return max(steps) if steps else None

    def _local_manifest(self, step: int) -> dict[str, Any] | None:
        """The step's local commit record where it was saved for this remote and
        every file it names is whole."""
        folder = self._step_dir(step)
        manifest = _read_manifest(folder)
        if manifest is None or manifest.get("remote", self.remote) != self.remote:
            return None
        try:
            for name, size in manifest["files"]:
                if os.path.getsize(os.path.join(folder, name)) != size:
                    return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return manifest

    # -- save --------------------------------------------------------------------------

    def save(self, step: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` and save it as ``step`` in both tiers, in the
        background. Waits only for the previous save's local write (the
        snapshot buffers are reused) when it has not finished yet."""
        self._check_process()
        _check_step(step)
        with self._lock:
            if self._closed:
                raise RuntimeError("ckptio.tiered.Checkpointer: save() after close()")
            last = self._last
        if last is not None:
            try:
                last.local.result()
                failed = False
            except BaseException:  # noqa: BLE001 - reported on that save's handle
                failed = True
            # A step whose local write failed may be saved again.
            if step < last.step or (step == last.step and not failed):
                raise ValueError(f"step {step} is not after the last saved step {last.step}")
        self._check_not_foreign(step)
        if os.path.exists(self._step_dir(step)) and self._local_manifest(step) is not None:
            raise ValueError(f"step {step} is saved already in {self.local}")
        staged_copy = self._stager.stage(state)
        staged: Future[None] = Future()
        local: Future[str] = Future()
        remote_done: Future[str] = Future()

        def write_local() -> None:
            try:
                sd = staged_copy.result() if isinstance(staged_copy, Future) else staged_copy
            except BaseException as e:
                staged.set_exception(e)
                local.set_exception(e)
                return
            staged.set_result(None)
            try:
                local.set_result(self._write_local(step, sd))
            except BaseException as e:
                local.set_exception(e)

        def drain() -> None:
            try:
                local.result()
            except BaseException as e:
                remote_done.set_exception(e)
                return
            self._drain_into(step, remote_done)

        handle = SaveHandle(step, staged, local, remote_done)
        with self._lock:  # close() cannot shut the threads down in between
            if self._closed:
                raise RuntimeError("ckptio.tiered.Checkpointer: save() after close()")
            self._last = handle
            self._order[step] = next(self._queue_seq)
            self._pending[remote_done] = step
            self._writer.submit(write_local)
            # Queued now, not once the local write is done: an executor refuses
            # new work at interpreter exit, but runs what was queued before it.
            self._drainer.submit(drain)
        return handle

    def _write_local(self, step: int, state: Any) -> str:
        folder = self._step_dir(step)
        if os.path.exists(folder):  # a save of this step that died
            self._check_not_foreign(step)  # (another run's, saved since save() looked)
            shutil.rmtree(folder)
        os.makedirs(folder)
        try:
            _own(os.path.join(folder, WRITER), {}, liveness.tag())
            _fsync_dir(self.local)
            name = FORMATS[self.format]
            if self.format == "torch":
                _save(state, os.path.join(folder, str(name)))
            elif self.format == "safetensors":
                st.save_file(state, os.path.join(folder, str(name)))
            else:
                with _one_process():
                    dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
            files = sorted(
                (n, os.path.getsize(os.path.join(folder, n)))
                for n in os.listdir(folder)
                if n not in (COMMIT, WRITER) and os.path.isfile(os.path.join(folder, n))
            )
            # The save's own id: a commit record in the store from another save
            # of this step (same files and sizes) is a conflict, not this one.
            manifest = {
                "step": step, "format": self.format, "files": files,
                "remote": self.remote, "save": secrets.token_hex(8),
            }  # fmt: skip
            _write_commit(os.path.join(folder, COMMIT), _manifest_bytes(manifest))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)  # the step may be saved again
            raise
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, WRITER))
        return folder

    # -- drain -------------------------------------------------------------------------

    def _drain_into(self, step: int, done: Future[str]) -> None:
        try:
            url = self._drain(step)
        except BaseException as e:
            done.set_exception(e)
            return
        # Pruned before the future completes: wait() returns on the tiers as kept.
        try:
            self._prune()
        except (OSError, StoreError) as e:  # the next drain prunes again
            warnings.warn(f"ckptio.tiered: pruning old steps failed: {e}", stacklevel=2)
        finally:
            done.set_result(url)

    def _drain(self, step: int) -> str:
        """Upload a locally complete step, then its commit record; retried."""
        manifest = self._local_manifest(step)
        if manifest is None:
            raise FileNotFoundError(f"{self._step_dir(step)}: not a complete local step")
        url = self._step_url(step)
        record = _manifest_bytes(manifest)
        for attempt in range(self._tries):
            self._check_stopping(step)
            try:
                self._upload_step(step, manifest, url, record)
                break
            except BaseException as e:
                if not _transient(e) or attempt + 1 == self._tries:
                    raise
                delay = min(self._max_backoff, self._backoff * 2**attempt)
                # Woken early by close(timeout=): no retry after it.
                self._stopping.wait(delay * (0.5 + random.random() / 2))
        with self._lock:
            self._in_store.add(step)
            self._own.add(step)
        return url

    def _upload_step(self, step: int, manifest: dict[str, Any], url: str, record: bytes) -> None:
        opts = self._options
        there = {u: tag for u, _, tag, _ in objstore.listing(url, opts)}
        commit_url = objstore.join(url, COMMIT)
        mark = objstore.join(url, REMOVING)
        if mark in there:  # an earlier save of the step, on its way out: gone first
            owner = _mark_owner(mark, opts)
            if _drains_it(owner):
                raise CommitConflictError(
                    17, f"step {step} is being removed from the store by {owner}", url
                )
            self._remove_step(step)
            there = {}
        if commit_url in there:
            self._check_record(commit_url, record)
            return
        folder = self._step_dir(step)
        done = _read_uploaded(folder)
        for name, _size in manifest["files"]:
            obj = objstore.join(url, name)
            if done.get(name) is not None and there.get(obj) == done[name]:
                continue  # this save's upload, whole (each is all or nothing)
            self._check_stopping(step)
            done[name] = objstore.upload(os.path.join(folder, name), obj, opts).get("e_tag")
            _write_uploaded(folder, done)
        try:
            objstore.put_bytes(commit_url, record, opts, create=True)
        except CommitConflictError:
            self._check_record(commit_url, record)

    def _check_stopping(self, step: int) -> None:
        if self._stopping.is_set():
            raise DrainStoppedError(
                f"step {step}: close() timed out before its drain to {self.remote} "
                f"ended; it stays in {self._step_dir(step)} for the next Checkpointer",
                step,
            )

    def _check_record(self, commit_url: str, record: bytes) -> None:
        data, _ = objstore.get_bytes(commit_url, self._options)
        if data != record:
            raise CommitConflictError(
                17, "another save committed this step with other contents", commit_url
            )

    def _prune(self) -> None:
        """``keep_local`` and ``keep_remote``, by save order: the steps this
        Checkpointer saved or resumed, in the order it queued them, are newer
        than every step it found (those by step number). The step just drained
        is thus the store's newest, never removed (ranked by number, a run
        restarted from an older step, the store holding 100 and 200, had each
        new save removed from the store right after its drain, then its local
        copy)."""
        with self._lock:
            in_store, dropped = set(self._in_store), set(self._dropped)
            order = dict(self._order)

        def newer(step: int) -> tuple[int, int]:
            return order.get(step, 0), step

        local = sorted(self.local_steps(), key=newer)
        for step in local[: max(0, len(local) - self.keep_local)]:
            if (step in in_store or step in dropped) and self._is_own(step):
                folder = self._step_dir(step)
                os.unlink(os.path.join(folder, COMMIT))  # incomplete first, then gone
                shutil.rmtree(folder, ignore_errors=True)
        if self.keep_remote is not None:
            steps = sorted(in_store, key=newer)
            for step in steps[: max(0, len(steps) - self.keep_remote)]:
                folder = self._step_dir(step)
                # Its local copy, kept (keep_local), is not drained again by
                # every later Checkpointer: it was, and left the store.
                if self._is_own(step) and self._local_manifest(step) is not None:
                    _write_commit(os.path.join(folder, DROPPED), b"{}")
                self._remove_step(step)
        with self._lock:
            marked = sorted(self._marked)
        for step in marked:  # removals a process that died left
            self._remove_step(step)

    def _is_own(self, step: int) -> bool:
        """Whether the store's ``step`` is (or was, until keep_remote removed
        it here) this local step's own save: drained here, or the store's
        commit record is the local one (the save's id in it), not another
        save's of the same step number."""
        with self._lock:
            if step in self._own:
                return True
        manifest = self._local_manifest(step)
        if manifest is None:
            return False
        try:
            data, _ = objstore.get_bytes(objstore.join(self._step_url(step), COMMIT), self._options)
        except FileNotFoundError:
            return False
        if data != _manifest_bytes(manifest):
            return False
        with self._lock:
            self._own.add(step)
        return True

    def _remove_step(self, step: int) -> None:
        """Remove ``step`` from the store, resumably and idempotently: its
        removal mark first (no reader takes the step as complete from then on;
        a process that dies leaves it for the next to finish), then its commit
        record, its other objects, and the mark last."""
        opts, url = self._options, self._step_url(step)
        mark = objstore.join(url, REMOVING)
        objstore.put_bytes(mark, json.dumps({"owner": liveness.tag()}).encode(), opts)
        with self._lock:
            self._in_store.discard(step)
            self._marked.add(step)
        objstore.delete(objstore.join(url, COMMIT), opts)
        for obj, _, _, _ in objstore.listing(url, opts):
            if obj != mark:
                objstore.delete(obj, opts)
        objstore.delete(mark, opts)
        with self._lock:
            self._marked.discard(step)
            self._dropped.add(step)

    def _resume(self) -> list[int]:
        """Remove local step folders of saves that died; finish the removals
        from the store that processes which died left (where the store is
        listed: local steps, or ``keep_remote``); drain the local steps the
        store lacks (oldest first), but those marked for removal and those
        keep_remote removed from it (``DROPPED``). The steps being drained."""
        for name in os.listdir(self.local):
            path = os.path.join(self.local, name)
            if _STEP.match(name) and not os.path.isfile(os.path.join(path, COMMIT)):
                if not liveness.running(_read_owner(os.path.join(path, WRITER))):
                    shutil.rmtree(path, ignore_errors=True)  # a save that died
        committed = self._committed()
        for step, other in sorted(committed.items()):
            if other != self.remote:
                warnings.warn(
                    f"ckptio.tiered: {self._step_dir(step)} was saved for "
                    f"{other}, not {self.remote}: not drained, loaded or pruned here",
                    stacklevel=3,
                )
        local = sorted(s for s, remote in committed.items() if remote == self.remote)
        if not local and self.keep_remote is None:
            return []
        try:
            stored = set(self.remote_steps())  # keep_remote then covers them too
        except StoreError as e:
            warnings.warn(
                f"ckptio.tiered: {self.remote} not listed ({e}); draining all", stacklevel=2
            )
            stored = set()
        with self._lock:
            marked = sorted(self._marked)
        for step in marked:  # past keep_remote when it was marked: not drained again
            try:
                self._remove_step(step)
            except (OSError, StoreError) as e:  # the next prune tries again
                warnings.warn(
                    f"ckptio.tiered: finishing the removal of step {step} from "
                    f"{self.remote} failed: {e}",
                    stacklevel=2,
                )
        todo = []
        for step in (s for s in local if s not in stored and s not in marked):
            if os.path.isfile(os.path.join(self._step_dir(step), DROPPED)):
                with self._lock:  # drained, then removed from the store: not again
                    self._own.add(step)
                    self._dropped.add(step)
                continue
            todo.append(step)
        for step in todo:
            done: Future[str] = Future()
            with self._lock:
                self._order[step] = next(self._queue_seq)
                self._pending[done] = step
            self._drainer.submit(self._drain_into, step, done)
        return todo

    # -- load --------------------------------------------------------------------------

    def load(
        self,
        step: int | None = None,
        *,
        out: Any = None,
        map_location: Any = None,
        group: Any = None,
        **kwargs: Any,
    ) -> Any:
        """What ``save`` saved as ``step`` (default: :meth:`latest`), read from the
        local copy where it is complete and whole, else from the store.
        ``out``: load in place (required for ``"dcp"``, as DCP loads in place);
        ``group``: read once per process group (``ckptio.load``); other keywords
        go to the format's load call. ``step`` is checked as ``save``'s is."""
        self._check_process()
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"no complete step in {self.local} or {self.remote}")
        _check_step(step)  # (True loaded step 1, -1 looked for step--000000001)
        if self._local_manifest(step) is not None:
            try:
                return self._load_from(step, False, out, map_location, group, kwargs)
            # Any failure, not only an OSError: DCP wraps a file gone in its
            # CheckpointException (a BaseException).
            except (Exception, dcp.CheckpointException):
                if self._local_manifest(step) is not None:
                    raise
                # Pruned while it was read (its remote copy is complete): the store.
        return self._load_from(step, True, out, map_location, group, kwargs)

    def _load_from(
        self, step: int, in_store: bool, out: Any, map_location: Any, group: Any, kwargs: Any
    ) -> Any:
        where = self._step_dir(step)
        opts: dict[str, Any] = {}
        if in_store:
            where = self._step_url(step)
            gone = f"step {step} is complete in neither {self.local} nor the store"
            try:
                objstore.head(objstore.join(where, COMMIT), self._options)
            except FileNotFoundError as e:
                raise FileNotFoundError(2, gone, where) from e
            if _exists(objstore.join(where, REMOVING), self._options):
                raise FileNotFoundError(2, f"{gone} (it is being removed from the store)", where)
            opts = {"storage_options": self._options}
        if self.format == "torch":
            path = objstore.join(where, "state.pt") if opts else os.path.join(where, "state.pt")
            return _load(path, map_location, out=out, group=group, **opts, **kwargs)
        if self.format == "safetensors":
            name = str(FORMATS["safetensors"])
            path = objstore.join(where, name) if opts else os.path.join(where, name)
            device = "cpu" if map_location is None else map_location
            if out is not None:
                return st.load_file(path, out=out, group=group, **opts, **kwargs)
            return st.load_file(path, device, group=group, **opts, **kwargs)
        return self._load_dcp(where, bool(opts), out, kwargs)

    def _load_dcp(self, where: str, in_store: bool, out: Any, kw: Any) -> Any:
        if out is None:
            raise ValueError('a "dcp" checkpoint loads in place: pass out= (the state dict)')
        if in_store:  # ckptio's reader takes the URL: .metadata, then the files it needs
            kw = dict(kw, storage_options=self._options)
        reader = FileSystemReader(where, **kw)
        with _one_process():  # torch's plan, made without its per-item checks
            dcp.load(out, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
        return out

    # -- lifetime ----------------------------------------------------------------------

    def _check_process(self) -> None:
        """A RuntimeError in a child forked from the process that made this
        Checkpointer: its threads (and their queues, locks) stayed in the
        parent, so a save there would never complete (checked before any lock:
        one a parent's thread held at the fork is never released here)."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"ckptio.tiered.Checkpointer: made in process {self._pid}, used in "
                f"{os.getpid()}, a child forked from it: make a Checkpointer in the child"
            )

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save (and every resumed drain) is durable in the
        store or has failed; raises the first failure. ``timeout`` (seconds;
        None: no limit) bounds the whole call: a TimeoutError where a drain is
        still under way then."""
        self._check_process()
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or a number >= 0, not {timeout!r}")
        with self._lock:
            pending = list(self._pending)
        # One deadline for them all (it was each future's: n drains, n timeouts).
        _, late = wait_futures(pending, timeout)
        first = next((e for f in pending if f.done() and (e := f.exception()) is not None), None)
        with self._lock:
            self._pending = {f: s for f, s in self._pending.items() if not f.done()}
        if late:
            raise TimeoutError(
                f"ckptio.tiered: {len(late)} of {len(pending)} drains to {self.remote} "
                f"still under way after {timeout} s"
            ) from first
        if first is not None:
            raise first

    def close(self, timeout: float | None = None) -> None:
        """Finish the saves under way (local and remote), then stop the threads.
        A drain that failed for good (its error not raised by :meth:`wait`
        yet) is a warning naming its step and its error: close() itself does
        not raise, so that a training run's exit is not broken by its store
        (:meth:`wait` raises it, also after close()).

        ``timeout`` (seconds; None: no limit) bounds the wait for the drains,
        which retry for long while the store is down: the local writes always
        finish, and once the time is up the drains stop at their next retry or
        file (a store call under way ends first, within the client's own retry
        budget: ``storage_options`` ``retry_timeout``). Their steps stay complete
        in the local folder for the next ``Checkpointer`` on the same folders,
        their ``remote`` futures fail with ``DrainStoppedError``, and a warning
        names them."""
        self._close(timeout, 3)

    def _close(self, timeout: float | None, stacklevel: int) -> None:
        self._check_process()
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or a number >= 0, not {timeout!r}")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = dict(self._pending)
        self._writer.shutdown(wait=True)
        if timeout is not None:
            _, late = wait_futures(pending, timeout)
            if late:
                self._stopping.set()
        self._drainer.shutdown(wait=True)
        if self._stopping.is_set():
            left = sorted(
                e.step for f in pending if isinstance(e := f.exception(), DrainStoppedError)
            )
            if left:
                warnings.warn(
                    f"ckptio.tiered: close() timed out; steps {left} are not in "
                    f"{self.remote} yet and stay in {self.local} for the next Checkpointer",
                    stacklevel=stacklevel,
                )
        # Failed for good (and not a stop above): silent until now but for the
        # handles, which a trainer that only closes never asks.
        failed = {
            step: e
            for f, step in pending.items()
            if (e := f.exception()) is not None and not isinstance(e, DrainStoppedError)
        }
        if failed:
            said = "; ".join(
                f"step {s}: {type(e).__name__}: {e}" for s, e in sorted(failed.items())
            )
            warnings.warn(
                f"ckptio.tiered: steps {sorted(failed)} did not reach {self.remote} ({said}); "
                f"those complete locally stay in {self.local} for the next Checkpointer",
                stacklevel=stacklevel,
            )
        if self._own_stager:
            self._stager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(None, 3)  # the warnings point at the with statement


# --------------------------------------------------------------------------- DCP


#: Where each rank says, in the store, that its files of a save are uploaded.
RANKS_DONE = ".ckptio-ranks"
#: Each rank's files still to upload, in its local folder: ``<this><rank>.json``.
DRAIN_RECORD = ".ckptio-drain-"
#: The coordinator's local record of the last remote commit it made (its ETag).
REMOTE_RECORD = ".ckptio-remote.json"
#: The tag of the process whose local commit ``.metadata`` is (it commits it remotely).
COMMITTER = ".ckptio-committer.json"
_NOW = object()  # TieredWriter._commit: over whatever version is there now


@dataclass
class _Tier:
    """What the writers of one (local folder, store) share in a process: DCP's
    process mode unpickles a writer per save, and a trainer may make one per save."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Generations named here and not committed: a sweep leaves their objects.
    planned: set[str] = field(default_factory=set)
    #: The newest remote commit (each waits for the one before: they land in order).
    committing: Future[str] | None = None
    seq: int = 0  # commits begun
    ready: int = 0  # the newest commit whose files are all in the store
    #: This process's rank's last upload (its next save waits for it).
    uploading: Future[Any] | None = None
    #: This rank's files of its last two uploaded saves, oldest first: the
    #: one before them goes from the local folder (DCP sweeps the coordinator's
    #: folder only; another host's would keep every generation).
    kept: list[list[str]] = field(default_factory=list)
    #: The (rank, coordinator) pairs the last resume in this process ran as.
    resumed_as: set[tuple[int, bool]] = field(default_factory=set)


_TIERS: dict[tuple[str, str], _Tier] = {}
_TIERS_LOCK = threading.Lock()


def _tier_of(local: Any, remote: str) -> tuple[_Tier, bool]:
    """The shared state of these tiers in this process, and whether nothing of
    this process moves them now (no upload or commit under way: a new writer
    may resume what a dead one left)."""
    key = (os.path.realpath(os.fspath(local)), remote)
    with _TIERS_LOCK:
        tier = _TIERS.setdefault(key, _Tier())
    return tier, _idle(tier)


def _idle(tier: _Tier) -> bool:
    """Nothing of this process uploads or commits to these tiers now (a save
    between its plan and its commit included)."""
    with tier.lock:
        moving = (f for f in (tier.uploading, tier.committing) if f is not None)
        return not tier.planned and all(f.done() for f in moving)


class TieredWriter(FileSystemWriter):
    """``ckptio.dcp.FileSystemWriter`` on a local folder, drained to ``remote``.

    For ``dcp.save`` / ``dcp.async_save`` (any number of ranks): the save
    commits locally as the local writer does (``upload_completion`` means
    durable in ``local``); then, in the background, each rank uploads its own
    data files and marks them done in the store, and the coordinator, once every
    rank's mark is there, puts ``.metadata`` conditionally (the remote commit)
    and removes the remote objects of neither generation. ``remote_completion``
    (after a save: ``writer.remote_completion.result()``) is done when the
    checkpoint is durable in the store, on the coordinator (elsewhere: when this
    rank's files are uploaded). A rank's next save waits for its previous
    upload first (the local folder's old files go with the next commit).
    Commits land in save order; one whose marks never come (a rank's upload
    failed) gives way once a later save's have all come.
    Each rank records the files it has still to upload in its local folder
    (``.ckptio-drain-<rank>.json``, removed once they are in the store). A new
    writer where nothing of this process moves these tiers now (every rank's,
    each on its host's folder; where the rank is not known yet, at its first
    save's set-up, and there again as DCP's rank where that save's group gives
    this process another rank than the one it resumed as)
    resumes what the last process left: its rank's recorded files uploaded
    where the store lacks them, and on the coordinator, where the local
    ``.metadata`` is not the store's, the files it names that this host holds
    uploaded, then, once the store holds every file it names (other hosts'
    ranks resume theirs), the remote commit, only over the commit this folder
    made last (else a CommitConflictError: the store moved on). What a process
    that still runs wrote (a drain record, the local commit: DCP's checkpoint
    process beside the trainer that makes writers) is left to it. ``resumed``:
    its future (None where there was nothing to drain); the next save waits
    for its uploads.
    ``tries``/``backoff``: retries of transient errors, as ``Checkpointer``'s;
    ``mark_timeout``: seconds the coordinator waits for the other ranks' files
    (its own rank's upload failing ends the wait at once); checked as
    ``Checkpointer``'s settings are.
    Other keywords: ``ckptio.dcp.FileSystemWriter``'s.

    A process waits at exit for its drains (as for ``Checkpointer``'s), so a
    script whose last line is a save still puts it in the store. With
    ``dcp.async_save``, read ``remote_completion`` once the save's own future is
    done (it is set while the save runs, on DCP's thread); the first save takes
    the future made with the writer. Refused: ``use_collectives=False`` (each
    rank would commit its own metadata) and a ``checkpoint_id`` other than the
    local folder (the tiers are the writer's).
    """

    def __init__(
        self,
        local: str | os.PathLike[str],
        remote: str,
        *,
        storage_options: objstore.StorageOptions = None,
        tries: int = 6,
        backoff: float = 1.0,
        mark_timeout: float = 3600.0,
        **kwargs: Any,
    ) -> None:
        _check_tiers(local, remote, storage_options)
        _check_retries(tries, backoff, mark_timeout=mark_timeout)
        super().__init__(local, **kwargs)
        self.remote = remote.rstrip("/")
        self._options = dict(storage_options) if storage_options is not None else None
        self._tries, self._backoff, self._mark_timeout = tries, backoff, mark_timeout
        self.remote_completion: Future[str] = Future()
        #: Whether ``remote_completion`` is a save's already (else the next save takes it).
        self._claimed = False
        self._tier, idle = _tier_of(self.path, self.remote)
        self._rank: int | None = None
        self._coordinator: bool | None = None
        self._unfinished: set[str] | None = None  # the coordinator's save not at its commit
        #: The drain of what a process that died left in ``local``, resumed in
        #: the background (None: none, or not begun yet: see the class).
        self.resumed: Future[str] | None = None
        self._resume_due = idle
        #: The (rank, coordinator) a resume ran as: a save's set-up over another
        #: group (``process_group=``, ``no_dist=True``) resumes as DCP's too.
        self._resumed_as: tuple[int, bool] | None = None
        if idle and _rank_known():
            self._resume(_rank(), _rank() == 0)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for name in ("_tier", "remote_completion", "resumed"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._tier, _ = _tier_of(self.path, self.remote)
        self.remote_completion = Future()
        self._claimed = False
        self.resumed = None

    def reset(self, checkpoint_id: Any = None) -> None:
        # The tiers are the writer's (local folder, remote prefix): a save's
        # checkpoint_id elsewhere would move the local folder only, or make a
        # store writer without this one's settings.
        if checkpoint_id is not None and (
            objstore.is_url(checkpoint_id)
            or os.path.abspath(os.fspath(checkpoint_id)) != os.path.abspath(os.fspath(self.path))
        ):
            raise ValueError(
                f"TieredWriter saves to {os.fspath(self.path)} and {self.remote}: "
                f"checkpoint_id={os.fspath(checkpoint_id)!r} is not taken (make a writer per "
                "destination)"
            )
        super().reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            # Each rank would commit its own __<rank>.metadata: the store's one
            # .metadata, which the drain commits, would be stale or missing.
            raise ValueError(
                "TieredWriter commits one .metadata for the checkpoint: "
                "dcp.save(..., use_collectives=False) is not supported"
            )
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._rank = int(kwargs.get("rank", _rank()))
        self._coordinator = is_coordinator
        pair = (self._rank, is_coordinator)
        # Made before the process group (its rank known now), or a copy that
        # DCP's process mode unpickled: where nothing here moves these tiers.
        if self._resume_due and _idle(self._tier):
            self._resume(self._rank, is_coordinator)
        elif self._resumed_as not in (None, pair) and pair not in self._tier.resumed_as:
            self._resume(self._rank, is_coordinator, again=True)  # a save over another group

    def _record(self, rank: int) -> str:
        return os.path.join(os.fspath(self.path), f"{DRAIN_RECORD}{rank}.json")

    def _resume(self, rank: int, coordinator: bool, again: bool = False) -> None:
        """Resume in the background what the last process on this folder left
        undrained: this rank's recorded files, and on the coordinator a local
        commit the store lacks (see the class). Sets ``resumed``, and the
        uploads from the local folder as what the next save waits for.
        ``again``: as another rank than the last resume of this process, once
        that one's uploads are done."""
        folder, tier = os.fspath(self.path), self._tier
        self._resume_due = False
        self._resumed_as = (rank, coordinator)
        with tier.lock:
            if not again:  # what a dead process left, found anew
                tier.resumed_as.clear()
            tier.resumed_as.add((rank, coordinator))
        record = self._record(rank)
        # What a process that runs still (DCP's checkpoint process, beside the
        # trainer that made this writer) left is its own to drain.
        pending = _read_record(record)
        if pending is not None and _drains_it(pending[2]):
            pending = None
        meta = os.path.join(folder, ".metadata")
        data = _read_file(meta) if coordinator and os.path.isfile(meta) else None
        if data is not None and _drains_it(_read_owner(os.path.join(folder, COMMITTER))):
            data = None
        files = dcp_format.files_named(data, meta) if data is not None else None
        if pending is None and files is None:
            return
        done: Future[str] = Future()
        uploaded: Future[None] = Future()
        seq, before = 0, None
        with tier.lock:
            prior = tier.uploading  # (a resume as another rank's, still uploading)
            if files is not None:
                tier.seq += 1
                seq, before, tier.committing = tier.seq, tier.committing, done
        meta_url = objstore.join(self.remote, ".metadata")

        def drain() -> None:
            try:
                if prior is not None:
                    with contextlib.suppress(BaseException):
                        prior.result()
                try:
                    raw, version = objstore.get_bytes(meta_url, self._options)
                    current: str | None = version["e_tag"]
                    there = dcp_format.files_named(raw, meta_url) or set()
                except FileNotFoundError:
                    raw, current, there = None, None, set()
                failed: BaseException | None = None
                if pending is not None:
                    token, names, _ = pending
                    try:
                        # Not marked where its commit is in already, nor where a
                        # file is gone (a save that died before its local commit,
                        # whose files the next save's local sweep removes).
                        if not set(names) <= there and self._upload_missing(names):
                            self._uploaded(token, rank, names)
                        _drop_record(record, token)
                    except BaseException as e:  # the commit below goes on
                        failed = e
                if data is not None and raw == data and _read_remote_record(folder) != current:
                    # Killed after its remote commit, before it recorded it: its own.
                    self._record_remote(current)
                if files is not None and data is not None and raw != data:
                    self._upload_missing(sorted(files))
                    uploaded.set_result(None)
                    if _read_remote_record(folder) != current:
                        raise CommitConflictError(
                            f"{meta_url}: the store holds a commit that {folder} did not make; "
                            "its local checkpoint is not put over it (the next save commits anew)"
                        )
                    self._await_files(files, seq)
                    if before is not None:
                        with contextlib.suppress(BaseException):
                            before.result()
                    # No sweep: a process that saves elsewhere (DCP's process
                    # mode) may be uploading a generation this one never planned.
                    self._commit(data, files, set(), expect=current, sweep=False)
                if failed is not None:
                    raise failed
                if not uploaded.done():
                    uploaded.set_result(None)
                done.set_result(self.remote)
            except BaseException as e:
                if not uploaded.done():
                    uploaded.set_exception(e)
                done.set_exception(e)

        self.resumed = done
        with tier.lock:
            tier.uploading = uploaded
        threading.Thread(target=drain, name="ckptio-tier-resume").start()  # (joined at exit)

    def _upload_missing(self, names: list[str]) -> bool:
        """Upload the named local files that the store lacks (each upload is
        all or nothing: an object there is whole); False where one is in
        neither place (gone from the folder, never uploaded)."""
        folder = os.fspath(self.path)
        there = {u for u, _, _, _ in objstore.listing(self.remote, self._options)}
        whole = True
        for name in sorted(names):
            path, url = os.path.join(folder, name), objstore.join(self.remote, name)
            if url in there:
                continue
            if not os.path.isfile(path):
                whole = False
                continue
            try:
                self._retried(lambda p=path, u=url: objstore.upload(p, u, self._options))
            except FileNotFoundError:
                if os.path.exists(path):
                    raise
                whole = False  # removed while read: a dead save's, swept locally
        return whole

    def _superseded(self, seq: int, what: str) -> None:
        """A CommitConflictError where a later commit's files are all in."""
        with self._tier.lock:
            if self._tier.ready > seq:
                raise CommitConflictError(
                    f"{self.remote}: {what}; a later save's commit goes ahead in its place"
                )

    def _await_files(self, files: set[str], seq: int) -> None:
        """Until the store holds every one of ``files`` (other hosts' ranks
        upload theirs)."""

        def missing(listed: list[objstore.Listed]) -> str | None:
            gone = files - {u[len(self.remote) + 1 :] for u, _, _, _ in listed}
            if not gone:
                return None
            return (
                f"{len(gone)} of the {len(files)} files its local .metadata names are not "
                f"in the store (first: {sorted(gone)[0]}; their hosts' writers upload them)"
            )

        self._await_store(self.remote, seq, missing)

    def _await_store(
        self, folder: str, seq: int, missing: Callable[[list[objstore.Listed]], str | None]
    ) -> None:
        """Poll the listing of ``folder`` until ``missing`` finds nothing missing
        (None; else it says what), at most ``mark_timeout`` seconds (then a
        TimeoutError), or until a later commit is ready (a CommitConflictError)."""
        deadline = time.monotonic() + self._mark_timeout
        while True:
            listed = self._retried(lambda: objstore.listing(folder, self._options))
            what = missing(listed)
            if what is None:
                return
            self._superseded(seq, what)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{folder}: {what} after {self._mark_timeout:.0f} s")
            time.sleep(0.2)

    def _retried(self, op: Any) -> Any:
        attempt = 0
        while True:  # ends in op's result or its error, never in None
            try:
                return op()
            except BaseException as e:
                if not _transient(e) or attempt + 1 >= self._tries:
                    raise
                time.sleep(min(60.0, self._backoff * 2**attempt) * (0.5 + random.random() / 2))
                attempt += 1

    def write_data(self, plan: Any, planner: Any) -> Any:
        tier = self._tier
        if tier.uploading is not None:  # this rank's previous save is in the store first
            with contextlib.suppress(BaseException):
                tier.uploading.result()
        fut = super().write_data(plan, planner)
        results = fut.wait()
        names = sorted({wr.storage_data.relative_path for wr in results})
        rank = self._rank if self._rank is not None else _rank()
        coordinator = self._coordinator if self._coordinator is not None else rank == 0
        token = _token_of(names)
        record = self._record(rank)
        if names:  # durable before the local commit: a process that dies leaves it
            _write_commit(
                record,
                json.dumps({"token": token, "names": names, "owner": liveness.tag()}).encode(),
            )
        else:  # an older record names files this save's local commit removes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(record)
        uploading: Future[None] = Future()
        with tier.lock:
            tier.uploading = uploading
        if not coordinator:
            self._next_completion()
        done_for_rank = self.remote_completion if not coordinator else None

        def upload() -> None:
            try:
                if names:  # else nothing of this rank's to upload, nothing to mark
                    for name in names:
                        path = os.path.join(os.fspath(self.path), name)
                        url = objstore.join(self.remote, name)
                        self._retried(lambda p=path, u=url: objstore.upload(p, u, self._options))
                    self._uploaded(token, rank, names)
                    _drop_record(record, token)
                uploading.set_result(None)
                if done_for_rank is not None:
                    done_for_rank.set_result(self.remote)
            except BaseException as e:
                if names and _names_save(record, token):  # the next writer resumes it
                    _own(record, {"token": token, "names": names}, None)
                uploading.set_exception(e)
                if done_for_rank is not None:
                    done_for_rank.set_exception(e)

        threading.Thread(target=upload, name="ckptio-tier-upload").start()  # (joined at exit)
        return fut

    def _uploaded(self, token: str, rank: int, names: list[str]) -> None:
        """``rank``'s files of save ``token`` are in the store: its mark put
        (what the coordinator's commit waits for), older local files forgotten."""
        mark = objstore.join(self.remote, RANKS_DONE, token, str(rank))
        self._retried(lambda: objstore.put_bytes(mark, b"", self._options))
        self._forget_old(names)

    def _forget_old(self, names: list[str]) -> None:
        """Keep this rank's files of its last two uploaded saves in the local
        folder; remove those of the save before them (in the store since), but
        what the folder's ``.metadata`` names (a later save may have failed
        before its local commit)."""
        with self._tier.lock:
            kept = self._tier.kept
            kept.append(names)
            old = set(kept.pop(0) if len(kept) > 2 else []) - {n for k in kept for n in k}
        folder = os.fspath(self.path)
        meta = os.path.join(folder, ".metadata")
        if old and os.path.isfile(meta):  # never what the folder's commit names
            named = dcp_format.files_named(_read_file(meta), meta)
            old = old - named if named is not None else set()
        for name in old:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        if self._unfinished is not None:  # the last save failed before its local commit
            with self._tier.lock:
                self._tier.planned -= self._unfinished
            if not self.remote_completion.done():
                self.remote_completion.set_exception(
                    CkptioError(f"{self.remote}: the save failed before its local commit")
                )
        self._next_completion()
        plans = super().prepare_global_plan(plans)
        tokens = {_token_of([p.storage_data.prefix + "0.distcp"]) for p in plans}
        with self._tier.lock:
            self._tier.planned |= tokens
        self._unfinished = tokens
        return plans

    def _next_completion(self) -> None:
        """This save's ``remote_completion``: the one made with the writer where
        no save took it yet (a caller may hold it already), else a new one."""
        if self._claimed or self.remote_completion.done():
            self.remote_completion = Future()
        self._claimed = True

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        # Before the local commit: a new .metadata never names an older committer
        # (a process that dies between names a dead one: resumed).
        committer = os.path.join(os.fspath(self.path), COMMITTER)
        _own(committer, {}, liveness.tag())
        try:
            super().finish(metadata, results)  # the local commit
        except BaseException:
            _own(committer, {}, None)  # the .metadata there is not this save's to commit
            raise
        self._unfinished = None
        per_rank = [sorted({wr.storage_data.relative_path for wr in r}) for r in results]
        files = {n for names in per_rank for n in names}
        tokens = {_token_of(names) for names in per_rank if names}
        done, tier = self.remote_completion, self._tier
        with tier.lock:
            tier.seq += 1
            seq, before, tier.committing = tier.seq, tier.committing, done
            own_upload = tier.uploading  # this rank's upload of this save (write_data)
        meta = os.path.join(os.fspath(self.path), ".metadata")
        data = _read_file(meta)

        def commit() -> None:
            try:
                for token in tokens:  # ranks without files (nothing to save) mark nothing
                    self._await_marks(token, sum(1 for names in per_rank if names), seq, own_upload)
                with tier.lock:
                    tier.ready = max(tier.ready, seq)
                if before is not None:  # in save order: an older commit never lands last
                    with contextlib.suppress(BaseException):
                        before.result()
                self._commit(data, files, tokens)
                error: BaseException | None = None
            except BaseException as e:
                error = e
            with tier.lock:  # before the future: a writer made once it is done finds idle tiers
                tier.planned -= tokens
            if error is None:
                done.set_result(self.remote)
            else:
                with contextlib.suppress(OSError):  # the next writer resumes it
                    if _read_file(meta) == data:
                        _own(committer, {}, None)
                done.set_exception(error)

        threading.Thread(target=commit, name="ckptio-tier-commit").start()  # (joined at exit)

    def _await_marks(
        self, token: str, ranks: int, seq: int, own: Future[None] | None = None
    ) -> None:
        def missing(listed: list[objstore.Listed]) -> str | None:
            if own is not None and own.done() and own.exception() is not None:
                raise own.exception()  # type: ignore[misc]  # (this rank's own never comes)
            done = len(listed)
            return None if done >= ranks else f"{done} of {ranks} ranks uploaded their files"

        self._await_store(objstore.join(self.remote, RANKS_DONE, token), seq, missing)

    def _commit(
        self,
        data: bytes,
        files: set[str],
        tokens: set[str],
        expect: Any = _NOW,
        sweep: bool = True,
    ) -> None:
        """``.metadata`` put over the version there now (``expect``: over that
        e_tag only, None: only where there is none; else a CommitConflictError)
        and recorded locally, then the rank marks and the data objects that
        neither it nor the previous one names removed, but for generations
        named here and not committed (``tokens``, this save's, are: their ranks
        may be uploading and marking them already)."""
        meta_url = objstore.join(self.remote, ".metadata")

        def current() -> tuple[bytes | None, str | None]:
            try:
                raw, version = objstore.get_bytes(meta_url, self._options)
                return raw, version["e_tag"]
            except FileNotFoundError:
                return None, None

        old, base = self._retried(current)
        previous = dcp_format.files_named(old, meta_url) if old is not None else set()
        if expect is not _NOW and expect != base:
            raise CommitConflictError(f"{meta_url}: committed anew since this drain began")
        try:
            put = self._retried(
                lambda: objstore.put_bytes(
                    meta_url, data, self._options, create=base is None, if_match=base
                )
            )
            e_tag = put.get("e_tag")
        except CommitConflictError:
            now, e_tag = self._retried(current)  # a retried PUT whose first reply was lost
            if now != data:
                raise
        self._record_remote(e_tag)
        if sweep:
            with contextlib.suppress(Exception):  # committed: the next commit sweeps again
                self._sweep(files, tokens, previous)

    def _record_remote(self, e_tag: str | None) -> None:
        """The local record of the last remote commit this folder made."""
        path = os.path.join(os.fspath(self.path), REMOTE_RECORD)
        _write_commit(path, json.dumps({"e_tag": e_tag}).encode())

    def _sweep(self, files: set[str], tokens: set[str], previous: set[str] | None) -> None:
        """The rank marks and the data objects that neither the new ``.metadata``
        (``files``) nor the previous one names, removed, but for generations
        named here and not committed."""
        listed = objstore.listing(self.remote, self._options)
        with self._tier.lock:  # read after the listing: a generation named since is in it
            in_flight = self._tier.planned - tokens
        for url, _, _, _ in listed:
            name = url[len(self.remote) + 1 :]
            if name.startswith(RANKS_DONE + "/"):
                if name.split("/")[1] not in in_flight:  # this save's, and dead saves'
                    objstore.delete(url, self._options)
            elif previous is not None and dcp_format.DATA_FILE.fullmatch(name):
                keep = name in files or name in previous or _token_of([name]) in in_flight
                if not keep:
                    objstore.delete(url, self._options)


def _check_tiers(local: Any, remote: Any, storage_options: objstore.StorageOptions) -> None:
    if not isinstance(remote, str) or not objstore.is_url(remote):
        raise ValueError(f"remote must be an object URL (s3://, gs://, az://), not {remote!r}")
    if objstore.is_url(local):
        raise ValueError(f"local must be a local folder, not the URL {local!r}")
    objstore.check_options(remote, storage_options)
    objstore.client_options(storage_options, remote)  # now, not at the first drain


def _check_step(step: Any) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, not {step!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, not {value!r}")


def _check_retries(tries: Any, backoff: Any, **seconds: Any) -> None:
    """The retry settings of ``Checkpointer`` and ``TieredWriter``: ``tries`` an
    int >= 1 (0 tried nothing and called it done), the others (``backoff``
    and any given: ``max_backoff``, ``mark_timeout``) finite seconds >= 0."""
    _check_int("tries", tries, 1)
    for name, value in {"backoff": backoff, **seconds}.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} must be a number of seconds, not {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, not {value!r}")


def _token_of(names: list[str]) -> str:
    """The generation token in DCP data file names (``__{rank}_{token}_{n}.distcp``)."""
    for name in names:
        parts = name.split("_")
        if len(parts) >= 5 and len(parts[3]) == 8:
            return parts[3]
    return "none"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rank_known() -> bool:
    """Whether this process's rank is known: its group is up, or it runs alone
    (a launcher that starts several sets WORLD_SIZE)."""
    if dist.is_available() and dist.is_initialized():
        return True
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1


def _read_remote_record(folder: str) -> str | None:
    """The ETag of the last remote commit made from ``folder`` (None: none)."""
    try:
        return json.loads(_read_file(os.path.join(folder, REMOTE_RECORD)))["e_tag"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _read_record(path: str) -> tuple[str, list[str], str | None] | None:
    """A rank's drain record (its save's token and files, and the tag of the
    process that wrote it); None where there is none or it cannot be read
    (written atomically: a torn one is not ours)."""
    try:
        rec = json.loads(_read_file(path))
        owner = rec.get("owner")
        return (
            str(rec["token"]),
            [str(n) for n in rec["names"]],
            owner if isinstance(owner, str) else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _read_owner(path: str) -> str | None:
    """The tag of the process a record of :func:`_own`'s names (the committer
    of a folder's ``.metadata``, the writer of a local step), where recorded."""
    try:
        owner = json.loads(_read_file(path))["owner"]
        return owner if isinstance(owner, str) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _names_save(path: str, token: str) -> bool:
    """Whether the drain record at ``path`` still names save ``token`` (a live
    process of the folder may have written its next one meanwhile)."""
    rec = _read_record(path)
    return rec is not None and rec[0] == token


def _drop_record(path: str, token: str) -> None:
    """Remove a drain record once its files are in, unless it names another save by now."""
    if _names_save(path, token):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _own(path: str, rec: dict[str, Any], owner: str | None) -> None:
    """Write the record ``rec`` at ``path`` as ``owner``'s (None: nobody's, left
    to the next writer); advisory: a record that cannot be written is skipped."""
    with contextlib.suppress(OSError):
        _write_commit(path, json.dumps(dict(rec, owner=owner)).encode())


def _drains_it(owner: str | None) -> bool:
    """Whether another process that runs now wrote it (and drains it itself)."""
    return liveness.running(owner) and not liveness.is_mine(owner)


def _exists(url: str, options: objstore.StorageOptions) -> bool:
    try:
        objstore.head(url, options)
    except FileNotFoundError:
        return False
    return True


def _mark_owner(url: str, options: objstore.StorageOptions) -> str | None:
    """The tag of the process that put the removal mark ``url`` (None: not
    recorded, or the mark is gone since)."""
    try:
        owner = json.loads(objstore.get_bytes(url, options)[0])["owner"]
        return owner if isinstance(owner, str) else None
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _read_file(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _read_uploaded(folder: str) -> dict[str, str | None]:
    """What this step's drain uploaded so far: {file name: ETag}."""
    try:
        got = json.loads(_read_file(os.path.join(folder, UPLOADED)))
        return {str(k): v for k, v in got.items() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_uploaded(folder: str, done: dict[str, str | None]) -> None:
    _write_commit(os.path.join(folder, UPLOADED), json.dumps(done).encode())


def _read_manifest(folder: str) -> dict[str, Any] | None:
    """The commit record in a local step folder (None: none, or unreadable)."""
    try:
        with open(os.path.join(folder, COMMIT), "rb") as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def _write_commit(path: str, data: bytes) -> None:
    transfer.commit_bytes(_native.AtomicWriter(path, "off", None, False), data)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
