"""Object storage: ``s3://bucket/key`` (and ``gs://``, ``az://``) beside the file.

The core moves whole files to and from objects in parallel parts
(``_native.store_upload`` / ``store_download``: a multipart upload whose
completion is the commit; ranged GETs pinned to one version) and puts or gets
small objects, conditionally where asked (``store_put``: a commit record or an
index). This module is the one place that knows what a URL is and what a
call's ``storage_options`` mean; the API modules call :func:`staged_save` and
:func:`staged_load` to run their file code over a local copy, or write a
stream of bytes straight into an object through :class:`ObjectFile`.

Configuration as the ecosystem expects: the standard variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``; ``GOOGLE_*``, ``AZURE_*``), then instance
and container credentials; ``storage_options`` overrides them with the
client's keys (``endpoint``, ``access_key_id``, ``region``, ...) and ckptio's
own: ``max_retries``, ``retry_timeout`` (seconds), ``concurrency`` (parallel
parts, default 8), ``part_size`` (bytes or "64M"; default 16 MiB, grown to stay
under 10,000 parts; at most 5 GiB). Errors: ``ckptio.StoreError`` and its subclasses, each an
``OSError`` naming the URL (docs/objectstore.md).
"""

from __future__ import annotations

import contextlib
import io
import numbers
import os
import re
import secrets
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from ckptio import _native
from ckptio.errors import CommitConflictError
from ckptio.io import liveness, paths
from ckptio.io.units import parse_size

#: The URL schemes that name objects (the client's: S3, GCS, Azure).
SCHEMES = ("s3://", "s3a://", "gs://", "az://", "azure://", "abfs://", "abfss://")

#: Options ckptio reads itself (the rest go to the client).
_OWN = ("concurrency", "part_size")

StorageOptions = Mapping[str, Any] | None
T = TypeVar("T")


def handles(f: Any) -> bool:
    """Whether ckptio reads and writes ``f`` itself: a local path (a ``file://``
    URL too: ``paths.local``), a file object, or an object URL of :data:`SCHEMES`;
    not a URL of another scheme (``memory://``, ``hdfs://``...)."""
    scheme = paths.url_scheme(f)
    return scheme is None or scheme == "file" or f"{scheme}://" in SCHEMES


def is_url(f: Any) -> bool:
    """Whether ``f`` names an object (``s3://...``) rather than a local file.

    Every API asks this first of its path: a URL of a scheme ckptio does not
    handle is a ValueError here, rather than a local path of that name
    (``./memory:/run/x.pt``) that a save would create and a load would not find.
    """
    if not handles(f):
        url = os.fsdecode(os.fspath(f))
        raise ValueError(
            f"{url}: ckptio does not handle {paths.url_scheme(f)}:// URLs; it takes local "
            f"paths ({paths.FILE_URL} URLs too) and object URLs ({', '.join(SCHEMES)})"
        )
    return paths.url_scheme(f) not in (None, "file")


def bucket_and_key(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> (bucket, key), the key as written (as the core
    takes it: ``Store::parse_key``)."""
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def check_options(f: Any, storage_options: StorageOptions, *, single: bool = False) -> None:
    """``storage_options`` goes with a URL: refused for a local path. ``single``:
    ``f`` must name one object (a URL of a bucket or a folder is refused)."""
    if single and is_url(f):
        url = os.fsdecode(os.fspath(f))
        key = bucket_and_key(url)[1]
        if not key or key.endswith("/"):
            raise ValueError(
                f"{url}: names a bucket or a folder, not an object: give the object's "
                "key (s3://bucket/run/model.pt)"
            )
    if storage_options is not None and not is_url(f):
        raise ValueError(
            f"storage_options applies to object-store URLs (s3://, gs://, az://), not {f!r}"
        )
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a mapping, not {type(storage_options).__name__}")


#: The most bytes a part of a multipart upload may hold (S3's limit, the core's).
MAX_PART = 5 << 30


def client_options(options: StorageOptions, url: str) -> tuple[dict[str, Any], int, int]:
    """(the client's options, ``concurrency``, ``part_size``) of ``storage_options``
    for a call on ``url``: a value out of range is a ValueError naming the
    option and the URL (as the client's own are)."""
    # A None value is unset: the environment's value or the default.
    client = {k: v for k, v in (options or {}).items() if v is not None}
    given = client.pop("concurrency", 8)
    try:  # a whole number (numpy's too), or its digits (the client's options are strings)
        if isinstance(given, bool) or not isinstance(given, (numbers.Integral, str)):
            raise ValueError
        concurrency = int(given)
    except ValueError:
        concurrency = 0
    if concurrency < 1:
        raise ValueError(
            f"{url}: bad value {given!r} for concurrency: a whole number >= 1 is expected"
        )
    try:
        part = parse_size(client.pop("part_size", 16 << 20), "part_size")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{url}: storage_options {e}") from None
    # Every upload's parts are at least this: over S3's limit, none could go.
    if part > MAX_PART:
        raise ValueError(
            f"{url}: storage_options part_size {part} is over 5 GiB, the most a part "
            "of a multipart upload may hold"
        )
    return client, concurrency, part


def join(url: str, *names: str) -> str:
    """``url`` with ``names`` appended as path segments."""
    return "/".join([url.rstrip("/"), *(n.strip("/") for n in names)])


def upload(path: str | os.PathLike[str], url: str, options: StorageOptions = None) -> dict:
    """Upload the local file ``path`` to ``url``: the object appears whole, or
    not at all (a failed upload is aborted and the old object stays)."""
    client, n, part = client_options(options, url)
    return _native.store_upload(url, os.fspath(path), client, n, part)


def download(url: str, path: str | os.PathLike[str], options: StorageOptions = None) -> dict:
    """Download ``url`` into a new local file ``path`` (not fsynced: a copy to read)."""
    client, n, part = client_options(options, url)
    return _native.store_download(url, os.fspath(path), client, n, part)


def put_bytes(
    url: str,
    data: bytes,
    options: StorageOptions = None,
    *,
    create: bool = False,
    if_match: str | None = None,
) -> dict[str, Any]:
    """One PUT of a small object; ``create``: only where none is (else
    ``CommitConflictError``); ``if_match``: only over that ETag."""
    client, _, _ = client_options(options, url)
    return _native.store_put(url, data, client, create=create, if_match=if_match)


def put_commit(
    url: str,
    data: bytes,
    options: StorageOptions,
    *,
    create: bool,
    if_match: str | None,
    on_conflict: Callable[[bytes | None], None],
) -> str | None:
    """The commit PUT of a multi-object checkpoint (an index, a ``.metadata``):
    ``data`` put at ``url`` conditionally (``create`` / ``if_match`` as for
    :func:`put_bytes`); its ETag.

    A conflict is not taken at its word: where the PUT landed but its reply was
    lost, the client's retry of it gets a 412 of its own making. So the commit
    object is read back: where it holds ``data`` (the object names this save's
    own data objects, so no other save puts the same bytes), the save is
    committed and its ETag returned. Else ``on_conflict`` gets what the commit
    object holds now (None where there is none), to remove what this save
    uploaded but what that names, and the ``CommitConflictError`` is raised.
    Where the commit object cannot be read, that error is raised (chained to
    the conflict) and ``on_conflict`` is not called: the save may have
    committed, so nothing of it may go."""
    try:
        return put_bytes(url, data, options, create=create, if_match=if_match)["e_tag"]
    except CommitConflictError as conflict:
        try:
            now: bytes | None
            now, version = get_bytes(url, options)
        except FileNotFoundError:
            now, version = None, {}
        except OSError as e:
            raise e from conflict
        if now == data:
            return version["e_tag"]
        on_conflict(now)
        raise


def read(
    url: str, offset: int, length: int, options: StorageOptions = None, e_tag: str | None = None
) -> tuple[bytes, dict[str, Any]]:
    """``length`` bytes of ``url`` from ``offset`` (fewer at its end), of the
    version ``e_tag`` where given (``CommitConflictError`` if it changed); and
    the object's size and version."""
    client, _, _ = client_options(options, url)
    return _native.store_read(url, offset, length, client, e_tag)


def map_torch(
    url: str, options: StorageOptions = None
) -> tuple[
    dict[str, Any],
    str,
    list[tuple[str, int, int, int | None]],
    dict[str, bytes],
    list[tuple[str, int, int]],
]:
    """The torch.save archive at ``url`` mapped in few requests
    (``_native.store_torch_map``): the object's size and version, the archive's
    prefix, its records (name, data offset, size, declared CRC-32 or None where
    the archive says it computed none), the bytes of every record
    but the storages, and (storage record, local header offset, predicted data
    offset) for the reader to confirm (``_native.zip_headers_match``)."""
    client, n, part = client_options(options, url)
    return _native.store_torch_map(url, client, max(n, 16), part)


def crc32_ranges(
    url: str,
    ranges: list[tuple[int, int]],
    options: StorageOptions = None,
    e_tag: str | None = None,
) -> list[int]:
    """The CRC-32 of each (offset, length) range of ``url`` (of the version
    ``e_tag`` where given), read by ranged GETs through a buffer of
    ``concurrency`` x ``part_size``: nothing kept, memory bounded."""
    client, n, part = client_options(options, url)
    return _native.store_crc32(url, ranges, client, n, part, e_tag)


def get_bytes(url: str, options: StorageOptions = None) -> tuple[bytes, dict[str, Any]]:
    """A small object's bytes and version (``e_tag``)."""
    client, _, _ = client_options(options, url)
    return _native.store_get(url, client)


def head(url: str, options: StorageOptions = None) -> dict[str, Any]:
    client, _, _ = client_options(options, url)
    return _native.store_head(url, client)


#: An object of a listing: (URL, size, ETag, the store's time of its last
#: change in seconds since the epoch; for a multipart upload, when it began).
Listed = tuple[str, int, str | None, float]


def listing(url: str, options: StorageOptions = None) -> list[Listed]:
    """Every object under the folder ``url`` (:data:`Listed`)."""
    client, _, _ = client_options(options, url)
    return _native.store_list(url, client)


#: Seconds of the store's clock an object must predate a commit for
#: :func:`sweep_before` to remove it (listings give whole seconds).
CLOCK_SLACK = 2.0


def sweep_before(
    folder: str,
    commit: str,
    committed: str | None,
    removable: Callable[[str], bool],
    options: StorageOptions = None,
) -> None:
    """After a save put the commit object ``commit`` (a name in ``folder``: an
    index, a ``.metadata``) at ETag ``committed``: remove the objects of the
    folder whose name ``removable(name)`` accepts and that began before the
    commit by the store's clock. A save commits only over the commit object it
    read, so one that began before this commit can no longer commit, while one
    that began after it may: its objects stay. Nothing is removed where the
    commit object is no longer this save's (the newer save sweeps)."""
    base = folder.rstrip("/") + "/"
    listed = listing(folder, options)
    mark = [x for x in listed if x[0] == base + commit]
    if committed is None or not mark or mark[0][2] != committed:
        return
    cutoff = mark[0][3] - CLOCK_SLACK
    for obj, _, _, modified in listed:
        if modified < cutoff and removable(obj[len(base) :]):
            delete(obj, options)


def delete(url: str, options: StorageOptions = None) -> None:
    client, _, _ = client_options(options, url)
    _native.store_delete(url, client)


#: Memory-backed folder for copies that fit (see :func:`scratch_dir`).
SHM = "/dev/shm"


def scratch_dir(nbytes: int | None = None) -> str:
    """Where staged copies live: ``CKPTIO_SCRATCH``; else, for a copy of
    ``nbytes`` known in advance (a load), ``/dev/shm`` where it takes at most half
    of both its free space and the memory available (the copy is then never
    written to a disk); else the temp folder."""
    chosen = os.environ.get("CKPTIO_SCRATCH")
    if chosen:
        return chosen
    if nbytes is not None and nbytes <= _memory_room() // 2:
        return SHM
    return tempfile.gettempdir()


def _memory_room() -> int:
    """The smaller of /dev/shm's free space and MemAvailable (0 where unknown)."""
    try:
        st = os.statvfs(SHM)
        with open("/proc/meminfo", "rb") as fh:
            avail = next(
                int(line.split()[1]) * 1024 for line in fh if line.startswith(b"MemAvailable:")
            )
    except (OSError, StopIteration, ValueError):
        return 0
    return min(st.f_bavail * st.f_frsize, avail)


def scratch_folder(nbytes: int | None = None, prefix: str = "ckptio-stage-") -> str:
    """A new folder for staged copies (of ``nbytes`` where known), in
    :func:`scratch_dir`; the caller removes it. Folders that killed processes
    left go first (:func:`sweep_scratch`), before /dev/shm's room is judged."""
    sweep_scratch()
    return tempfile.mkdtemp(prefix=f"{prefix}{_owner()}-", dir=scratch_dir(nbytes))


def scratch_name(prefix: str) -> str:
    """A path for a scratch folder that whoever writes into it makes (in the temp
    folder, named for this process as :func:`scratch_folder`'s are)."""
    sweep_scratch()
    return os.path.join(scratch_dir(), f"{prefix}{_owner()}-{secrets.token_hex(8)}")


#: ckptio's scratch folders: prefix, then the tag of their process.
_SCRATCH = re.compile(rf"^ckptio-(?:stage|dcp)-({liveness.TAG.pattern})-")


def _owner() -> str:
    """The name part that says which process a scratch folder belongs to
    (``none`` where that cannot be told: never swept)."""
    return liveness.tag() or "none"


def sweep_scratch() -> list[str]:
    """Remove the scratch folders whose process is gone, in every place
    :func:`scratch_dir` picks from (a save or load SIGKILLed midway leaves its
    staged copy: GiBs in /dev/shm or the temp folder); the paths removed.
    Judged: this user's own directories (not links, FIFOs or others' entries
    in a shared /tmp) whose tag :func:`liveness.gone` says ended. Never fails:
    a folder it cannot judge stays."""
    removed = []
    for where in {scratch_dir(), SHM, tempfile.gettempdir()}:
        try:
            names = os.listdir(where)
        except OSError:
            continue
        for name in names:
            m = _SCRATCH.match(name)
            if m is None or not liveness.gone(m.group(1)):
                continue
            path = os.path.join(where, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                shutil.rmtree(path, ignore_errors=True)
            except OSError:
                continue
            if not os.path.lexists(path):
                removed.append(path)
    return removed


def _scratch_path(url: str, nbytes: int | None = None) -> tuple[str, str]:
    folder = scratch_folder(nbytes)
    name = url.rstrip("/").rsplit("/", 1)[-1] or "object"
    return folder, os.path.join(folder, name)


def via_local(
    f: Any, storage_options: StorageOptions, call: Callable[[Any], T], *, write: bool
) -> T:
    """``call(f)``, where ``f`` is a URL ``call`` gets a local copy of the
    object (``write=False``) or a local file uploaded once ``call`` returns
    (``write=True``). ``storage_options`` is refused for anything but a URL."""
    check_options(f, storage_options)
    if not is_url(f):
        return call(f)
    url = os.fsdecode(os.fspath(f))
    staged = staged_save if write else staged_load
    with staged(url, storage_options) as local:
        return call(local)


@contextlib.contextmanager
def local_tree(f: Any, options: StorageOptions = None) -> Iterator[str]:
    """``f`` itself where it is local; for a URL, a scratch copy of what it names:
    the object, else every object under the folder (a sharded or DCP
    checkpoint), removed after the block."""
    check_options(f, options)
    if not is_url(f):
        yield os.fspath(f)
        return
    url = os.fsdecode(os.fspath(f)).rstrip("/")
    try:
        size = head(url, options)["size"]
        objects = None
    except FileNotFoundError:
        objects = listing(url, options)
        if not objects:
            raise
        size = sum(n for _, n, _, _ in objects)
    folder, path = _scratch_path(url, size)
    try:
        if objects is None:
            download(url, path, options)
        else:
            for obj, n, _, _ in objects:
                if n == 0 and _folder_marker(obj, options):
                    continue
                rel = obj[len(url) + 1 :]
                if not rel or rel.startswith("/") or ".." in rel.split("/"):
                    raise ValueError(f"{obj}: not a name inside {url}")
                dst = os.path.join(path, *rel.split("/"))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                download(obj, dst, options)
        with named_for(path, url):
            yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def named_for(local: str, url: str) -> Iterator[None]:
    """An error raised in the block on ``local``, the scratch copy of ``url``,
    names ``url`` instead (:func:`named_as`): the copy is gone once the block
    ends, and the caller asked for ``url``."""
    try:
        yield
    except Exception as e:
        named = named_as(e, local, url)
        if named is e:
            raise
        raise named from e.__cause__


def named_as(e: BaseException, local: str, url: str) -> BaseException:
    """``e``, raised on the scratch copy ``local`` of ``url``, naming ``url``
    instead (the same type, the same traceback); ``e`` itself where it does
    not name the copy or cannot be made again."""

    def sub(v: Any) -> Any:
        return v.replace(local, url) if isinstance(v, str) else v

    if local not in str(e):
        return e
    try:
        if isinstance(e, OSError) and e.errno is not None:
            new: BaseException = type(e)(e.errno, sub(e.strerror), sub(e.filename))
        else:
            new = type(e)(*map(sub, e.args))
        # What the error's class keeps beside its args (a step, the keys).
        new.__dict__.update({k: sub(v) for k, v in vars(e).items()})
    except Exception:
        return e
    if local in str(new):
        return e
    return new.with_traceback(e.__traceback__)


def _folder_marker(url: str, options: StorageOptions) -> bool:
    """Whether the empty object a listing gave as ``url`` is a folder marker
    (its key ``url`` + "/": the client's listing takes the "/" off, so no object
    has the key it gives). The listing leaves out the markers it can tell
    (``Store::list``); the marker of an empty subfolder only a HEAD tells."""
    try:
        head(url, options)
    except FileNotFoundError:
        return True
    return False


class ObjectFile(io.RawIOBase):
    """A write-only file object whose bytes become the object ``url``: they go
    up in parts as they come (``_native.ObjectWriter``: ``concurrency`` uploads,
    ``part_size`` parts), with no local copy. :meth:`commit` publishes the
    object whole; :meth:`close` without a commit aborts the upload, the key
    keeping what it had. As a context manager: committed where the block
    completes, aborted where it raises."""

    #: Writes below this many bytes are copied once into a bytes object; larger
    #: ones are read in place (a storage's bytes from torch.save, say).
    COPY_BELOW = 1 << 20

    def __init__(
        self, url: str, options: StorageOptions = None, *, publish_on_close: bool = False
    ) -> None:
        super().__init__()
        client, n, part = client_options(options, url)
        self.name = url
        self._w = _native.ObjectWriter(url, client, n, part)
        #: close() publishes (for writers that close what they wrote: torch's
        #: DCP writer); an error is then ended with :meth:`abort`.
        self.publish_on_close = publish_on_close
        self.committed: dict[str, Any] | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if not mv.c_contiguous:
            mv = memoryview(mv.tobytes())
        mv = mv.cast("B")
        if mv.nbytes < self.COPY_BELOW:
            return self._w.write(mv.tobytes())
        with warnings.catch_warnings():  # read only: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mv, dtype=torch.uint8)
        return self._w.write_memory(view.data_ptr(), view.numel(), [view])

    def tell(self) -> int:
        return self._w.tell()

    def commit(self) -> dict[str, Any]:
        """Publish the object (the last part, then the completion): the
        transfer's size, parts and version."""
        self.committed = self._w.commit()
        super().close()
        return self.committed

    def close(self) -> None:
        try:
            if not self.closed and self.publish_on_close:
                self.commit()
        finally:  # a failed commit aborts the upload and closes: no second try at exit
            self.abort()

    def abort(self) -> None:
        """Abort the upload (the key keeps what it had); closes. Idempotent."""
        if not self.closed:
            self._w.abort()
        super().close()

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        if kind is None and not self.closed:
            self.commit()
        else:
            self.abort()


@contextlib.contextmanager
def staged_save(url: str, options: StorageOptions = None) -> Iterator[str]:
    """A local path to write ``url``'s bytes to; once the block completes, the
    file is uploaded (the object replaced whole) and the local copy removed.
    A block that raises uploads nothing."""
    folder, path = _scratch_path(url)
    try:
        with named_for(path, url):
            yield path
        upload(path, url, options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def staged_load(url: str, options: StorageOptions = None) -> Iterator[str]:
    """A local copy of ``url`` (one version, read in parallel ranges) for the
    block to read; removed after it."""
    size = head(url, options)["size"]
    folder, path = _scratch_path(url, size)
    try:
        download(url, path, options)
        with named_for(path, url):
            yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)
