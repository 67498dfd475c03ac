"""PyTorch Lightning ``CheckpointIO`` plugins that save and load through ckptio.

    from ckptio.lightning import CkptioCheckpointIO, AsyncCkptioCheckpointIO
    trainer = Trainer(plugins=[CkptioCheckpointIO()])        # or AsyncCkptioCheckpointIO()

Needs the ``lightning`` package (``pip install 'ckptio[lightning]'``); ckptio
itself never imports it. Checkpoints are regular torch.save files (``ckptio.save``:
crash-safe, parallel I/O), so plain Lightning / ``torch.load`` read them too.

Loading: Lightning checkpoints hold non-tensor state (hyper-parameters, loop and
callback state), so ``load_checkpoint`` unpickles them with ``weights_only=False``
unless Lightning passes ``weights_only=True`` (``Trainer.fit(..., weights_only=True)``):
load only checkpoints you trust. Tensors land in host memory unless a
``map_location`` says otherwise (as Lightning's ``TorchCheckpointIO`` does).

Resuming is in place (``in_place=True``, the default): ``load_checkpoint`` reads
only the small tensors and hands the large ones over unread; when Lightning
restores the model (``LightningModule.load_state_dict``) each is read straight
from the file into its parameter, on the host or the GPU, and when it restores
the optimizers each state tensor is read straight into the optimizer's new one
on the parameter's device. No copy of the checkpoint is held in memory. A large
tensor used any other way (a hook that inspects the checkpoint) is read on
first use. ``in_place=False`` loads the whole checkpoint first (``ckptio.load``).
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

try:
    from lightning.fabric.plugins import CheckpointIO
except ImportError as e:  # pragma: no cover - exercised with lightning hidden
    raise ImportError(
        "ckptio.lightning needs PyTorch Lightning (the 'lightning' package): "
        "pip install 'ckptio[lightning]'"
    ) from e

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
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save(checkpoint, path, **self._opts)

    def load_checkpoint(
        self,
        path: Any,
        map_location: MapLocation = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        where = "cpu" if map_location is None else map_location
        if self._in_place and isinstance(where, (str, torch.device, dict)):
            return lazy_load(  # type: ignore[no-any-return]
                path,
                map_location=where,
                weights_only=bool(weights_only),
                io=IoOptions.of(**self._opts),
            )
        return load(  # type: ignore[no-any-return]
            path, map_location=where, weights_only=bool(weights_only), **self._opts
        )

    def remove_checkpoint(self, path: Any) -> None:
        path = os.fspath(path)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


class AsyncCkptioCheckpointIO(CkptioCheckpointIO):
    """Saves in a background thread, in the manner of Lightning's AsyncCheckpointIO.

    ``save_checkpoint`` copies every tensor of the checkpoint to host memory
    (work queued on CUDA streams is finished by the copy) and returns; training
    may then change its tensors at once. One thread writes the checkpoints in
    order; ``remove_checkpoint`` is queued behind the saves before it, and
    ``load_checkpoint`` first waits for every pending save. A failed save is
    raised by the next call (save, remove, load) or by ``teardown``, which
    waits for all pending work.
    """

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def _submit(self, fn: Any, *args: Any) -> None:
        self._raise_failed()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="ckptio-ckpt")
            self._pending.append(self._executor.submit(fn, *args))

    def _raise_failed(self, wait: bool = False) -> None:
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            if wait or f.done():
                exc = f.exception()
                with self._lock:
                    self._pending.remove(f)
                if exc is not None:
                    raise exc

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        _no_storage_options(self, storage_options)
        snapshot = _to_host(checkpoint, {})
        self._submit(super().save_checkpoint, snapshot, path)

    def remove_checkpoint(self, path: Any) -> None:
        self._submit(super().remove_checkpoint, path)

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
        finally:
            with self._lock:
                ex, self._executor = self._executor, None
            if ex is not None:
                ex.shutdown(wait=True)


def _no_storage_options(io: CheckpointIO, storage_options: Any) -> None:
    if storage_options is not None:
        raise TypeError(
            f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
            f"`{type(io).__name__}`"
        )


def _to_host(obj: Any, memo: dict[int, Any]) -> Any:
    """A copy of ``obj`` whose tensors are host copies (one copy per tensor object)."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            t = obj.detach()
            memo[id(obj)] = t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping type (OrderedDict, AttributeDict...)
        for k, v in obj.items():
            out[k] = _to_host(v, memo)
        return out
    if isinstance(obj, list):
        return [_to_host(v, memo) for v in obj]
    if isinstance(obj, tuple):
        items = [_to_host(v, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
