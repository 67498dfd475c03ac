"""PyTorch Lightning ``CheckpointIO`` plugins that save and load through ckptio.

    from ckptio.lightning import CkptioCheckpointIO, AsyncCkptioCheckpointIO
    trainer = Trainer(plugins=[CkptioCheckpointIO()])        # or AsyncCkptioCheckpointIO()

Needs the ``lightning`` package (``pip install 'ckptio[lightning]'``); ckptio
itself never imports it. Checkpoints are regular torch.save files (``ckptio.save``:
crash-safe, parallel I/O), so plain Lightning / ``torch.load`` read them too.

Loading: ``weights_only`` as Lightning passes it (``Trainer.fit(..., weights_only=)``),
and where it passes None, torch.load's default (True, and the
``TORCH_FORCE_*WEIGHTS_ONLY_LOAD`` variables), as Lightning's ``TorchCheckpointIO``:
a checkpoint that pickles other objects than Lightning's own state needs
``weights_only=False`` (only for checkpoints you trust). Tensors land in host
memory unless a ``map_location`` says otherwise (as ``TorchCheckpointIO`` does).

Paths may be object URLs (``s3://bucket/key``; the store's settings from the
standard AWS variables, see docs/objectstore.md): saved and loaded as single
objects, removed from the store. ``file://`` URLs are local paths. A URL of
another scheme (``memory://``, ``hdfs://``, ...), which ckptio cannot write, is
handed to Lightning's ``TorchCheckpointIO`` (fsspec), whole: a Trainer that
worked with Lightning's plugin keeps working with this one, where an error
would stop a run that switched plugins for speed (``ckptio.save`` and
``ckptio.load`` themselves refuse such URLs with a ValueError).

Resuming is in place (``in_place=True``, the default): ``load_checkpoint`` reads
only the small tensors and hands the large ones over unread; when Lightning
restores the model (``LightningModule.load_state_dict``) each is read straight
from the file into its parameter, on the host or the GPU, and when it restores
the optimizers each state tensor is read straight into the optimizer's new one
on the parameter's device. No copy of the checkpoint is held in memory. A large
tensor used any other way (a hook that inspects the checkpoint) is read on
first use; one handed to ``nn.Parameter`` (``load_state_dict(..., assign=True)``)
is refused by torch, being of another type: read it first (``t.clone()``) or use
``in_place=False``, which loads the whole checkpoint first (``ckptio.load``).
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
except ImportError as e:  # pragma: no cover - exercised with lightning hidden
    raise ImportError(
        "ckptio.lightning needs PyTorch Lightning (the 'lightning' package): "
        "pip install 'ckptio[lightning]'"
    ) from e

from ckptio.formats.torchzip import resolve_weights_only
from ckptio.io import objects, paths, remote
from ckptio.io.devices import MapLocation
from ckptio.io.engines import IoOptions
from ckptio.serialization import load, save
from ckptio.state_dict import lazy_load

__all__ = ["CkptioCheckpointIO", "AsyncCkptioCheckpointIO"]


class CkptioCheckpointIO(CheckpointIO):
    """Saves with ``ckptio.save`` and loads with ``ckptio.load``, resuming in place.

    The keyword options (threads, chunk_size, direct, backend) are those of
    ``ckptio.save`` / ``ckptio.load``; ``in_place`` (default True): see the module
    documentation.
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        chunk_size: int | None = None,
        direct: bool | str | None = None,
        backend: str | None = None,
        in_place: bool = True,
    ) -> None:
        self._opts: dict[str, Any] = dict(
            threads=threads, chunk_size=chunk_size, direct=direct, backend=backend
        )
        self._in_place = in_place

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        _no_storage_options(self, storage_options)
        path = os.fspath(path)
        if not remote.handles(path):
            return TorchCheckpointIO().save_checkpoint(checkpoint, path)
        if not remote.is_url(path):
            path = paths.path(path, "save")  # (a file:// URL: its local path)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save(checkpoint, path, **self._opts)

    def load_checkpoint(
        self,
        path: Any,
        map_location: MapLocation = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = os.fspath(path)
        where = "cpu" if map_location is None else map_location
        if not remote.handles(path):
            # (torch.load takes what Lightning's annotation, a callable, leaves out)
            return TorchCheckpointIO().load_checkpoint(path, cast(Any, where), weights_only)
        url = remote.is_url(path)
        if not url:
            path = paths.path(path, "load")
            if not os.path.exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if (
            self._in_place
            and not url  # (an object is read whole, straight into its tensors)
            and isinstance(where, (str, torch.device, dict))
            and not _to_meta(where)  # (nothing to read: a plain load makes them)
        ):
            return lazy_load(  # type: ignore[no-any-return]
                path,
                map_location=where,
                weights_only=resolve_weights_only(weights_only, None, stacklevel=3),
                io=IoOptions.of(**self._opts),
            )
        return load(  # type: ignore[no-any-return]
            path, map_location=where, weights_only=weights_only, **self._opts
        )

    def remove_checkpoint(self, path: Any) -> None:
        path = os.fspath(path)
        if not remote.handles(path):
            TorchCheckpointIO().remove_checkpoint(path)
            return
        if remote.is_url(path):
            remote.delete(path)
            return
        path = paths.path(path, "remove_checkpoint")
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


class AsyncCkptioCheckpointIO(CkptioCheckpointIO):
    """Saves in a background thread, in the manner of Lightning's AsyncCheckpointIO.

    ``save_checkpoint`` copies every tensor of the checkpoint to host memory
    (work queued on CUDA streams is finished by the copy) and returns; training
    may then change its tensors at once. One thread writes the checkpoints in
    order; ``remove_checkpoint`` is queued behind the saves before it (and
    skipped where the save just before it failed: the file it would remove is
    then the newest checkpoint, as with a synchronous save that raised), and
    ``load_checkpoint`` first waits for every pending save. A failed save is
    raised by the next call (save, remove, load), by ``wait()`` or by
    ``teardown``, which waits for all pending work (Lightning calls it at the
    end of ``fit``; after it, a ``trainer.save_checkpoint`` is written in the
    background too: call ``wait()`` before reading it); one that no call
    reported is printed to stderr at interpreter exit. As with Lightning's
    ``AsyncCheckpointIO``, a save or removal that raises an earlier failure is
    queued first (the failure must not cost the next checkpoint too), and a
    failure raised before ``teardown`` is raised again by it (the end of
    ``fit`` fails, whoever caught the first one), once.

    ``ModelCheckpoint`` picks a ``-v1``, ``-v2`` name by what is on disk: with
    saves in flight, give each checkpoint a name of its own (``{step}`` in
    ``filename``), as with Lightning's ``AsyncCheckpointIO``.
    """

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        #: Whether the last save the worker ran failed (removals behind it wait).
        self._last_save_failed = False
        #: A failure some call raised, which ``teardown`` raises again.
        self._reported: BaseException | None = None
        _unreported.add(self)

    def _submit(self, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckptio-ckpt")
            new = self._executor.submit(fn, *args)
            self._pending.append(new)
        self._raise_failed(skip=new)

    def _save(self, snapshot: dict[str, Any], path: Any) -> None:
        try:
            super().save_checkpoint(snapshot, path)
        except BaseException:
            self._last_save_failed = True
            raise
        self._last_save_failed = False

    def _remove(self, path: Any) -> None:
        if not self._last_save_failed:
            super().remove_checkpoint(path)

    def _raise_failed(self, wait: bool = False, skip: Future[None] | None = None) -> None:
        """Raise the first failure of the work done (``wait``: of all work, once
        ended); ``skip``: work just queued, left pending."""
        with self._lock:
            pending = [f for f in self._pending if f is not skip]
        for f in pending:
            if wait or f.done():
                exc = f.exception()
                with self._lock:
                    self._pending.remove(f)
                if exc is not None:
                    with self._lock:
                        self._reported = self._reported or exc
                    raise exc

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        _no_storage_options(self, storage_options)
        self._submit(self._save, _to_host(checkpoint), path)

    def remove_checkpoint(self, path: Any) -> None:
        self._submit(self._remove, path)

    def load_checkpoint(
        self,
        path: Any,
        map_location: MapLocation = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def wait(self) -> None:
        """Wait for every pending save and removal; raise the first failure."""
        self._raise_failed(wait=True)

    def teardown(self) -> None:
        try:
            self.wait()
            if self._reported is not None:
                raise self._reported
        finally:
            with self._lock:
                ex, self._executor = self._executor, None
                self._reported = None
            if ex is not None:
                ex.shutdown(wait=True)


def _no_storage_options(io: CheckpointIO, storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
            f"`{type(io).__name__}`"
        )


def _to_meta(where: Any) -> bool:
    if isinstance(where, dict):
        return any(_to_meta(v) for v in where.values())
    try:
        return torch.device(where).type == "meta"
    except (RuntimeError, TypeError):
        return False


def _to_host(checkpoint: Any) -> Any:
    """A deep copy of ``checkpoint`` whose tensors are host copies taken now
    (one per tensor object), wherever they are held: containers, dataclasses,
    a callback's state object."""
    memo: dict[int, Any] = {}
    for t in objects.reachable_tensors(checkpoint):
        d = t.detach()
        if d.device.type == "meta":  # no data to copy, none that training changes
            objects.memoize(memo, t, t)
            continue
        objects.memoize(memo, t, d.to("cpu", copy=True) if d.device.type != "cpu" else d.clone())
    return copy.deepcopy(checkpoint, memo)


#: Async plugins alive: their failures that no call reported are printed at exit.
_unreported: weakref.WeakSet[AsyncCkptioCheckpointIO] = weakref.WeakSet()


@atexit.register
def _report_at_exit() -> None:
    # (concurrent.futures has joined the workers by now: every save has ended.)
    for io in list(_unreported):
        for f in list(io._pending):
            exc = f.exception() if f.done() else None
            if exc is not None:
                print(f"ckptio.lightning: a background save failed: {exc!r}", file=sys.stderr)
