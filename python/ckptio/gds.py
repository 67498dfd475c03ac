"""A drop-in for ``torch.cuda.gds`` that always works.

Same names and signatures as torch.cuda.gds (``is_available``, ``GdsFile``,
``gds_register_buffer``, ``gds_deregister_buffer``), so code written for it (e.g.
the PyTorch GDS tutorial) runs with ``torch.cuda.gds`` replaced by ``ckptio``. Transfers are
synchronous, like cuFileRead/cuFileWrite, and start after the work queued on
the storage's device's current stream. The ``flags`` govern the I/O as in
torch (the file is opened with them: O_SYNC / O_DSYNC writes are durable when
``save_storage`` returns, an O_WRONLY file cannot be loaded from). Where the
semantics differ, ckptio mostly does not raise where torch would:

- Where cuFile cannot take the file (no nvidia-fs, no udev data in a VM or
  container, tmpfs) transfers go through ckptio's pinned bounce pipeline;
  ``GdsFile.device_path`` says which path is in use.
- After ``GdsFile.deregister_handle()`` transfers still work (through the
  bounce pipeline) until ``register_handle()``, and deregistering again does
  nothing; torch's fail. Registering a registered handle raises torch's
  ``AssertionError``.
- ``GdsFile.fd`` is, as in torch, the file's descriptor opened with ``flags``
  (valid until the ``GdsFile`` is deleted: ``os.fsync(f.fd)`` works), but
  without O_DIRECT, which ckptio's second descriptor has.
- ``gds_register_buffer`` without a usable cuFile is a no-op, and
  ``gds_deregister_buffer`` of a storage that is not registered does nothing.
  A registration holds its storage, so the memory cannot be freed (and
  reused by another tensor) while it is registered.
- ``flags``: O_DIRECT changes nothing (ckptio opens a second, O_DIRECT
  descriptor where the filesystem takes it, ``direct=`` decides); O_APPEND
  (on Linux a pwrite on an O_APPEND descriptor appends, whatever the offset)
  and O_PATH are refused with a ``ValueError`` before the file is opened; a
  file O_CREAT makes gets mode 0o644 (torch's: 0o777 less the umask).
"""

from __future__ import annotations

import errno
import operator
import os
import threading

import torch

from ckptio import _native
from ckptio.errors import FormatError, GdsAccessError, GdsValueError
from ckptio.io import devices, engines, transfer

__all__ = ["is_available", "gds_register_buffer", "gds_deregister_buffer", "GdsFile"]

# Keyed by address; each registration holds its storage until deregistered.
_registrations: dict[int, _native.BufferRegistration] = {}
_reg_lock = threading.Lock()


def _untyped(
    s: torch.UntypedStorage | torch.TypedStorage, what: str = "storage"
) -> torch.UntypedStorage:
    if isinstance(s, torch.TypedStorage):
        return s._untyped_storage
    if isinstance(s, torch.UntypedStorage):
        return s
    hint = "; pass tensor.untyped_storage()" if isinstance(s, torch.Tensor) else ""
    raise TypeError(
        f"{what} must be a torch storage (UntypedStorage or TypedStorage), "
        f"not {type(s).__name__}{hint}"
    )


def is_available() -> bool:
    """Whether this API works here, as torch.cuda.gds's (whether torch was built
    with cuFile; without it, torch's calls raise): always True, ckptio's moving
    the bytes through its bounce pipeline where cuFile cannot
    (``GdsFile.device_path`` says which path a file takes)."""
    return True


def gds_register_buffer(s: torch.UntypedStorage | torch.TypedStorage) -> None:
    """Register a CUDA storage with cuFile (cuFileBufRegister) for repeated transfers.

    Without a usable cuFile this is a no-op: the bounce pipeline needs no registration.
    The registration holds ``s`` until ``gds_deregister_buffer(s)``: its memory is
    not freed meanwhile, even when every tensor using it is gone.
    """
    st = _untyped(s)
    if st.device.type != "cuda":
        raise ValueError(f"gds_register_buffer needs a CUDA storage, not one on {st.device}")
    try:
        reg = _native.cufile_register_buffer(st, st.data_ptr(), st.nbytes())
    except _native.BackendUnavailableError:
        return
    with _reg_lock:
        old = _registrations.pop(st.data_ptr(), None)
        _registrations[st.data_ptr()] = reg
    if old is not None:
        old.close()


def gds_deregister_buffer(s: torch.UntypedStorage | torch.TypedStorage) -> None:
    """Undo ``gds_register_buffer`` (cuFileBufDeregister) and let go of the storage."""
    st = _untyped(s)
    with _reg_lock:
        reg = _registrations.pop(st.data_ptr(), None)
    if reg is not None:
        reg.close()


class GdsFile:
    """``torch.cuda.gds.GdsFile``: storages saved to and loaded from given offsets.

    ``flags`` are ``os.open`` flags (e.g. ``os.O_RDWR``) and govern the I/O as
    in torch: the file is opened with them (mode 0o644 where O_CREAT or
    O_TMPFILE makes it), and the second descriptor that ckptio opens with
    O_DIRECT where the filesystem takes it (``direct``: None for
    CKPTIO_DIRECT, else "auto"; "off" never; "on" or an error) has the same
    access mode and O_SYNC, O_DSYNC and O_NOATIME. So with O_SYNC or O_DSYNC
    each ``save_storage`` is durable when it returns, and loading from a file
    opened O_WRONLY, or saving to one opened O_RDONLY, raises
    ``GdsAccessError`` (an ``OSError``, EBADF; a ``RuntimeError`` as torch's
    error is) before anything moves. O_DIRECT in ``flags`` changes
    nothing (``direct`` decides); O_APPEND and O_PATH are refused with a
    ``ValueError`` before the file is opened (see the module's notes). ``fd``
    is that first descriptor (no O_DIRECT), open until the GdsFile is deleted.

    ``backend``: "auto" (cuFile where it can register
    the file, else bounce buffers; a file opened read-only takes bounce buffers
    where cuFile runs in compat mode), "cufile" (or an error) or "bounce"
    (pinned bounce buffers). ``device_path`` says which runs. Every argument
    (and, for "cufile", that cuFile's driver opens) is checked before the file
    is opened: one refused leaves the file as it was (no O_CREAT, no O_TRUNC).
    """

    def __init__(
        self,
        filename: str | os.PathLike[str],
        flags: int,
        *,
        backend: str | None = None,
        direct: bool | str | None = None,
        threads: int | None = None,
        chunk_size: int | None = None,
    ) -> None:
        self.filename = os.fsdecode(os.fspath(filename))  # (bytes too: os.open's)
        self.flags = flags
        # Every argument is checked before the file is opened (and maybe
        # created or truncated): the engine's here, backend and direct (and,
        # for "cufile", the driver) by DeviceFile.open, which then opens the
        # file with ``flags``.
        mode = engines.direct_arg(direct)
        self._engine = engines.engine(threads, chunk_size, mode)
        self._file = _native.DeviceFile.open(self.filename, flags, mode, backend)
        # torch's attribute: the descriptor opened with ``flags`` (owned by _file).
        self.fd: int = self._file.fileno()
        self.handle: int | None = None
        self.register_handle()

    @property
    def backend(self) -> str:
        """The backend asked for: "auto", "cufile" or "bounce"."""
        return self._file.backend

    @property
    def device_path(self) -> str | None:
        """The path in use: "cufile", "bounce", or None once the handle is deregistered."""
        return self._file.device_path

    @property
    def gds_mode(self) -> str | None:
        """With cuFile: "p2p" or "compat"."""
        return self._file.gds_mode

    @property
    def fallback_reason(self) -> str | None:
        """Why the path in use is not cuFile, when it is not."""
        return self._file.fallback_reason

    def register_handle(self) -> None:
        """Pick the path (cuFileHandleRegister where it works); registering a
        registered handle raises ``AssertionError``, as torch's does."""
        if self.handle is not None:
            raise AssertionError("Cannot register a handle that is already registered.")
        self._file.register_handle()
        self.handle = id(self._file)

    def deregister_handle(self) -> None:
        """cuFileHandleDeregister (once transfers in flight on other threads end);
        unlike torch's, later transfers still work, through the bounce pipeline,
        until ``register_handle``, and a second call does nothing."""
        self._file.deregister_handle()
        self.handle = None

    def _args(self, storage: torch.UntypedStorage | torch.TypedStorage, offset: int, write: bool):
        # What the system gives for a read of a write-only descriptor (and the
        # reverse), on every path, before anything moves.
        if (self.flags & os.O_ACCMODE) == (os.O_RDONLY if write else os.O_WRONLY):
            how = "O_RDONLY" if write else "O_WRONLY"
            raise GdsAccessError(
                errno.EBADF,
                f"{os.strerror(errno.EBADF)}: {'save_storage' if write else 'load_storage'} "
                f"on a file opened {how}",
                self.filename,
            )
        st = _untyped(storage)
        offset = _offset(offset)
        dev = devices.device_code(st, "storage")
        return st, offset, dev

    def save_storage(
        self, storage: torch.UntypedStorage | torch.TypedStorage, offset: int = 0
    ) -> None:
        """Write all of ``storage`` to the file at ``offset`` (synchronous)."""
        st, offset, dev = self._args(storage, offset, write=True)
        transfer.write(self._file, self._engine, [(offset, st.data_ptr(), st.nbytes(), dev)], [st])

    def load_storage(
        self, storage: torch.UntypedStorage | torch.TypedStorage, offset: int = 0
    ) -> None:
        """Fill all of ``storage`` from the file at ``offset`` (synchronous); a
        range past the end of the file is a ``FormatError`` saying so (an empty
        storage reads nothing: fine anywhere, as an empty save is)."""
        st, offset, dev = self._args(storage, offset, write=False)
        n = st.nbytes()
        if n == 0:
            return
        size = os.fstat(self.fd).st_size
        if offset + n > size:
            raise FormatError(
                f"{self.filename}: read of {n} bytes at offset {offset} runs past the end "
                f"of the file ({size} bytes)"
            )
        transfer.read(self._file, self._engine, [(offset, st.data_ptr(), st.nbytes(), dev)], [st])

    def __del__(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.deregister_handle()


def _offset(offset: object) -> int:
    """An offset as torch's binding takes it: an int or what stands for one
    (``__index__``: numpy integers, a 0-d integer tensor), not a bool; >= 0."""
    is_bool = isinstance(offset, bool) or (
        isinstance(offset, torch.Tensor) and offset.dtype == torch.bool
    )
    try:
        if is_bool:
            raise TypeError
        value = operator.index(offset)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"offset must be an int, not {type(offset).__name__}") from None
    if value < 0:
        raise GdsValueError(f"offset must be >= 0, not {value}")
    return value
