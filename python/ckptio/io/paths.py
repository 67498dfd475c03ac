"""File arguments and the names checkpoints hold.

A save or load takes a path or a file object, as torch.save and torch.load do:
:func:`path`, :func:`descriptor` (the regular file behind a file object, where
the engine can move its bytes), :func:`file_like`. File names that checkpoints
hold (DCP ``.metadata`` relative paths, sharded safetensors index entries) must
name files inside the checkpoint's folder: :func:`inside`.
"""

from __future__ import annotations

import errno
import fcntl
import io
import os
import re
import stat
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from ckptio import _native
from ckptio.errors import FormatError

#: A save's temp file beside its target, ``.<target>.ckptio-<pid>-<nonce>.tmp``
#: (``src/io/persist.rs``): locked by its writer while the save runs.
TEMP_FILE = re.compile(r"\.(?P<target>.+)\.ckptio-(?P<pid>\d+)-[0-9a-f]{16}\.tmp")


#: ``scheme://`` at the start of a path: a URL (RFC 3986's scheme characters).
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

#: The prefix of URLs that name local files.
FILE_URL = "file://"


def url_scheme(f: Any) -> str | None:
    """The scheme of a path that is a URL (``s3://b/k`` -> ``"s3"``, as written),
    else None (a local path that is no URL, a file object)."""
    if isinstance(f, os.PathLike):
        f = os.fspath(f)
    if isinstance(f, bytes):
        f = os.fsdecode(f)
    m = _URL.match(f) if isinstance(f, str) else None
    return m.group(1) if m else None


def local(p: str) -> str:
    """The local path a ``file://`` URL names (the prefix dropped, as fsspec, and
    so Lightning's own ``TorchCheckpointIO``, reads it: ``file:///tmp/x`` ->
    ``/tmp/x``); any other path as it is. Every API turns a path argument into
    the file it opens here (:func:`path`), so none saves ``file:///tmp/x`` into
    ``./file:/tmp/x``."""
    return p[len(FILE_URL) :] if url_scheme(p) == "file" else p


def is_path(f: Any) -> bool:
    return isinstance(f, (str, bytes, os.PathLike))


def path(f: Any, what: str) -> str:
    if is_path(f):
        return local(os.fsdecode(f))
    raise TypeError(f"ckptio.{what} needs a file path (str or os.PathLike), not {type(f).__name__}")


#: File objects whose bytes are their descriptor's (a buffered one over a FileIO).
_RAW_FILES = (io.BufferedReader, io.BufferedWriter, io.BufferedRandom)


def _bytes_are_the_descriptors(f: Any) -> bool:
    """Whether what ``f`` reads and writes are the bytes of ``f.fileno()``: not a
    compressing stream over it (gzip, bz2, lzma: fileno() is the compressed
    file's) nor any other wrapper; a tempfile wrapper is taken as its file."""
    if type(f).__name__ == "_TemporaryFileWrapper":  # NamedTemporaryFile's
        f = getattr(f, "file", None)
    if type(f) is io.FileIO:
        return True
    return type(f) in _RAW_FILES and type(f.raw) is io.FileIO


def descriptor(f: Any) -> int | None:
    """The descriptor behind a file object where the engine can move its bytes:
    a plain file object (``open(path, "rb")`` and the like, not a compressing
    stream over one) of a regular file, not in append mode, positioned at 0
    (torch.save and torch.load place the archive at the start of the stream).
    None otherwise (BytesIO, gzip, pipes, sockets, a stream past its start):
    then the bytes go through the object itself."""
    if not _bytes_are_the_descriptors(f):
        return None
    try:
        fd = f.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode) or f.tell() != 0:
            return None
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return None
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None
    return int(fd)


def object_name(f: Any, fd: int | None = None) -> str:
    name = getattr(f, "name", None)
    if isinstance(name, (str, bytes)):
        return os.fsdecode(name)
    return f"<{type(f).__name__}>" if fd is None else f"/proc/self/fd/{fd}"


def file_like(f: Any, what: str, method: str) -> None:
    """A save or load target that is neither a path nor a file object is a TypeError."""
    if not is_path(f) and not callable(getattr(f, method, None)):
        raise TypeError(
            f"ckptio.{what} needs a file path (str or os.PathLike) or a file object, "
            f"not {type(f).__name__}"
        )


def inside(
    folder: str,
    rel: Any,
    where: str,
    *,
    blobs: bool = False,
    error: type[Exception] = FormatError,
) -> str:
    """``folder/rel``, if ``rel`` is a relative path that stays inside ``folder``:
    not absolute, no ``..``, and not a symbolic link (nor under one) that resolves
    out of the folder. ``blobs``: a folder that is a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>``) may also link into ``<repo>/blobs``, as the
    hub's downloads do. ``error`` (a ``FormatError``) naming ``where`` otherwise."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise error(f"{where}: file name {rel!r} is not a relative path")
    parts = PurePosixPath(rel).parts
    if os.path.isabs(rel) or ".." in parts:
        raise error(f"{where}: file name {rel!r} points outside the checkpoint folder {folder}")
    full = os.path.join(folder, rel)
    root = os.path.realpath(folder)
    real = os.path.realpath(full)
    roots = [root]
    if blobs and os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    # Strictly below a root: "." (the folder itself) names no file of it.
    if not any(real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        raise error(f"{where}: {rel!r} resolves to {real}, outside the checkpoint folder {folder}")
    return full


def open_regular(path: str) -> io.BufferedReader:
    """``open(path, "rb")`` of a regular file; anything else refused before a
    byte is read (a read of a FIFO or a device blocks for ever or never ends):
    IsADirectoryError for a folder, OSError naming what it is otherwise. The
    open itself does not block (O_NONBLOCK, cleared once the file is known)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
            raise OSError(errno.EINVAL, f"not a regular file: {kind}, not a checkpoint", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def live_temps(folder: str, own: str | None = None) -> list[str]:
    """Remove the temp files of dead saves in ``folder`` (those no writer holds
    locked, in any PID namespace: ``_native.clean_temps``); the temp files left,
    which live saves hold, but ``own`` (the caller's). A save in flight owns
    what it wrote beside them too: sweeps of a checkpoint's leftovers remove
    nothing while this is not empty."""
    _native.clean_temps(folder)
    mine = None if own is None else os.path.basename(own)
    return [n for n in os.listdir(folder) if TEMP_FILE.fullmatch(n) and n != mine]


def left_by_dead_save(
    folder: str, own: re.Pattern[str], commits: list[int]
) -> Callable[[str], bool]:
    """The ``dead`` of :func:`sweep_unnamed` for ``ckptio clean``: whether a data
    file that nothing names carries the evidence of a dead ckptio save: a name
    only ckptio gives (``own``, with its token), or a file last written before
    the newest of ``commits`` (the mtimes of the indexes or metadata files
    naming ckptio's files, which ``in_use()`` fills): the generation such a
    commit replaced. A file that cannot be read is not judged dead."""

    def dead(name: str) -> bool:
        if own.fullmatch(name):
            return True
        if not commits:
            return False
        try:
            return os.stat(os.path.join(folder, name)).st_mtime_ns < max(commits)
        except OSError:
            return False

    return dead


def sweep_unnamed(
    folder: str,
    pattern: re.Pattern[str],
    own: str | None,
    in_use: Callable[[], set[str] | None],
    dead: Callable[[str], bool] | None = None,
) -> list[str]:
    """Remove what dead saves left in a checkpoint's folder: their temp files
    (:func:`live_temps`), and the files named by ``pattern`` that ``in_use()``
    (the names the current checkpoint uses) does not name, and, where ``dead``
    is given, that it says a dead save left (called after ``in_use()``).
    Nothing of those while a save may be in flight (a temp file some writer
    holds, but ``own``, the caller's) or where ``in_use()`` cannot tell (None).
    The names removed."""
    try:
        mine = [n for n in os.listdir(folder) if pattern.fullmatch(n)]
    except FileNotFoundError:
        return []
    if live_temps(folder, own) or not mine:
        return []
    used = in_use()
    if used is None:
        return []
    removed = []
    for n in mine:
        if n not in used and (dead is None or dead(n)):
            try:
                os.unlink(os.path.join(folder, n))
            except FileNotFoundError:
                continue
            removed.append(n)
    return removed
