"""The engine knobs of a call and the engines that serve them.

An engine (``_native.Engine``: I/O threads, their lanes and pinned buffers) is
cached per configuration (``threads``, ``chunk_size``, ``direct``,
``memory_threads``), so a training run reuses its buffers save after save.
"""

from __future__ import annotations

import dataclasses
import functools

from ckptio import _native


def direct_arg(direct: bool | str | None) -> str | None:
    """``direct`` as the core takes it: None (the environment's), "on", "off", "auto"."""
    if direct is None or isinstance(direct, str):
        return direct
    if isinstance(direct, bool):
        return "on" if direct else "off"
    raise TypeError(
        f"direct must be None, a bool or 'auto'/'on'/'off', not {type(direct).__name__}"
    )


@functools.lru_cache(maxsize=8, typed=True)
def engine(
    threads: int | None,
    chunk_size: int | None,
    direct: str | None,
    memory_threads: int | None = None,
) -> _native.Engine:
    """The engine of one configuration: its threads' buffers are reused call after call."""
    for name, v in (
        ("threads", threads),
        ("chunk_size", chunk_size),
        ("memory_threads", memory_threads),
    ):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise TypeError(f"{name} must be an int, not {type(v).__name__}")
        if v is not None and v < 1:
            raise ValueError(f"{name} must be a positive int, not {v!r}")
    return _native.Engine(threads, chunk_size, direct, memory_threads)


@dataclasses.dataclass(frozen=True)
class IoOptions:
    """The engine knobs of a save or load: ``threads``, ``chunk_size``,
    ``direct`` (as :func:`direct_arg` gives it) and ``backend`` (how CUDA
    memory moves: "auto", "cufile", "bounce"; None: CKPTIO_BACKEND or auto)."""

    threads: int | None = None
    chunk_size: int | None = None
    direct: str | None = None
    backend: str | None = None

    @staticmethod
    def of(
        threads: int | None, chunk_size: int | None, direct: bool | str | None, backend: str | None
    ) -> IoOptions:
        return IoOptions(threads, chunk_size, direct_arg(direct), backend)

    def engine(self) -> _native.Engine:
        return engine(self.threads, self.chunk_size, self.direct)
