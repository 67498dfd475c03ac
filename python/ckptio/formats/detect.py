"""The format of a checkpoint, found from its content, never from its name.

- a file that starts as a zip archive: a ``torch.save`` checkpoint;
- a file whose first 8 bytes are a little-endian length N of a header that
  fits in the file: a safetensors file (its header parser judges the rest);
  one whose N runs past its end, with the header's ``{`` after it, is a
  safetensors file cut short: a ``SafetensorError`` says so;
- a JSON object with a ``weight_map`` (a ``*.safetensors.index.json``), or a
  folder holding one (or a single ``model.safetensors``): sharded safetensors;
- a folder holding ``.metadata`` (or that file itself, a pickle of DCP
  ``Metadata``): a ``torch.distributed.checkpoint`` folder.

:func:`detect` is the one place this is decided: loads in place,
``load_state_dict``, ``describe``, ``verify`` and ``convert`` ask it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
from typing import Any

import torch

from ckptio.errors import FormatError
from ckptio.formats import dcp
from ckptio.formats import safetensors as st_format
from ckptio.io import remote
from ckptio.io.paths import open_regular

TORCH = "torch.save"


SAFETENSORS = "safetensors"


SHARDED = "sharded safetensors"


DCP = "DCP"


FORMATS = (TORCH, SAFETENSORS, SHARDED, DCP)


#: JSON files larger than this are no safetensors index (the hub's are kilobytes).
_MAX_INDEX = 64 << 20

#: How much of a file :func:`legacy` and :func:`torch_load_reads` look at: the
#: pickled magic number of torch's legacy format fits (protocol 0 takes 28 bytes).
HEAD = 64


@dataclasses.dataclass(frozen=True)
class Detected:
    """A checkpoint and its format: ``root`` is the file (torch.save, safetensors,
    an index) or the folder (DCP; sharded safetensors given as a folder)."""

    format: str
    path: str
    root: str


def detect(path: str | os.PathLike[str]) -> Detected:
    """The format of the checkpoint at ``path``, from its content.

    FileNotFoundError (and other OSErrors) for a path that cannot be read;
    ``ckptio.FormatError`` naming the path for anything that is no checkpoint
    ckptio reads (a legacy torch.save file included: ``torch.load`` reads those)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, ".metadata")):
            return Detected(DCP, p, p)
        names = os.listdir(p)
        if any(n.endswith(".safetensors.index.json") for n in names) or (
            "model.safetensors" in names
        ):
            return Detected(SHARDED, p, p)
        raise FormatError(
            f"{p}: a folder, but no checkpoint ckptio reads: no .metadata (DCP) nor "
            "*.safetensors.index.json / model.safetensors (sharded safetensors)"
        )
    with open_regular(p) as f:
        head = f.read(HEAD)
        size = os.fstat(f.fileno()).st_size
    single = _single_file(p, head, size)
    if single is not None:
        return Detected(single, p, p)
    if head.lstrip()[:1] == b"{" and size <= _MAX_INDEX:
        if _is_index(p):
            return Detected(SHARDED, p, p)
    if head[:1] == b"\x80" and _is_dcp_metadata(p):
        return Detected(DCP, p, os.path.dirname(p) or ".")
    what = "an empty file" if size == 0 else f"it starts with {head[:8]!r}"
    raise FormatError(
        f"{p}: not a checkpoint ckptio reads ({what}): neither a torch.save zip archive, "
        "a safetensors file or index, nor a DCP checkpoint"
    )


def check_verify(found: Detected, verify: bool) -> None:
    """``verify=True`` asks for stored CRC-32s: only torch.save archives hold them."""
    if verify and found.format != TORCH:
        raise ValueError(
            f"{found.path}: verify=True needs a torch.save archive (a {found.format} "
            "checkpoint holds no CRC-32)"
        )


def _single_file(p: str, head: bytes, size: int) -> str | None:
    """TORCH or SAFETENSORS from a file's first bytes and its size, else None;
    a FormatError for torch's legacy format, a SafetensorError for a safetensors
    file whose header is truncated."""
    if _is_zip(head):
        return TORCH
    if is_legacy(head):
        raise FormatError(
            f"{p}: a legacy torch.save file (torch < 1.6, not a zip archive): torch.load "
            "reads it; ckptio's commands read zip checkpoints"
        )
    if _is_safetensors(head, size):
        return SAFETENSORS
    n = _header_length(head)
    if head[8:9] == b"{" and 2 <= n <= st_format.MAX_HEADER:
        # A header length past the end, its JSON after it: safetensors cut short, said so.
        st_format.header_length(head, size, p)
    return None


def _is_zip(head: bytes) -> bool:
    return head[:4] in (b"PK\x03\x04", b"PK\x05\x06")


def _header_length(head: bytes) -> int:
    """The safetensors header length a file's first 8 bytes state (0: fewer)."""
    return int.from_bytes(head[:8], "little") if len(head) >= 8 else 0


def _is_safetensors(head: bytes, size: int) -> bool:
    n = _header_length(head)
    return 2 <= n <= size - 8  # a header length that fits (its parser judges the rest)


class _MagicOnly(pickle.Unpickler):
    """Reads a pickle of plain values only: no global, no persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")


def is_legacy(head: bytes) -> bool:
    """Whether a file starting with ``head`` (:data:`HEAD` bytes) is torch's legacy
    format: its first pickle is torch's magic number, in any protocol (0-3 start
    with it, 4 and 5 with a FRAME, 0 and 1 write it as text). Nothing of the
    pickle runs: it may name no global."""
    try:
        first = _MagicOnly(io.BytesIO(head)).load()
    except Exception:  # noqa: BLE001 - whatever does not read as the magic number is not it
        return False
    return type(first) is int and first == torch.serialization.MAGIC_NUMBER


def torch_load_reads(head: bytes, size: int) -> str | None:
    """Why ``torch.load`` must read a file that starts with ``head`` (:data:`HEAD`
    bytes) of ``size`` bytes, or None (a zip archive, or what has the shape of
    a safetensors file: ckptio reads or refuses those). torch reads every file
    that is no zip archive as its legacy format, raising its own errors for
    one that is not (``torch.serialization._is_zipfile``)."""
    if _is_zip(head) or _is_safetensors(head, size):
        return None
    return LEGACY if is_legacy(head) else NOT_LEGACY


#: :func:`torch_load_reads` of a file in torch's legacy format (torch < 1.6).
LEGACY = "torch's legacy format"


#: :func:`torch_load_reads` of a file that is no zip archive and does not start
#: as torch's legacy format: torch.load refuses it (UnpicklingError, mostly).
NOT_LEGACY = "no zip archive nor torch's legacy format"


def detect_stored(url: str, options: remote.StorageOptions = None) -> Detected:
    """:func:`detect` of a single object in a store (a torch.save archive or a
    safetensors file), from its first bytes: one ranged GET.
    FileNotFoundError where there is no such object (a folder included);
    FormatError naming the URL for any other content."""
    head, info = remote.read(url, 0, HEAD, options)
    found = _single_file(url, head, info["size"])
    if found is None:
        what = "an empty object" if info["size"] == 0 else f"it starts with {head[:8]!r}"
        raise FormatError(f"{url}: not a torch.save archive nor a safetensors file ({what})")
    return Detected(found, url, url)


def detect_url(url: str, options: remote.StorageOptions = None) -> Detected:
    """What a store URL names: an object judged from its first bytes
    (:func:`detect_stored`), else a folder from its names
    (:func:`detect_stored_folder`); nothing is downloaded. Where neither is
    there: the store's error for the object (a StoreNotFoundError)."""
    try:
        return detect_stored(url, options)
    except FileNotFoundError as missing:
        try:
            return detect_stored_folder(url, options)
        except FileNotFoundError:
            raise missing from None


def detect_stored_folder(url: str, options: remote.StorageOptions = None) -> Detected:
    """:func:`detect` of a folder in a store, from the names right in it (one
    listing, nothing downloaded), as a local folder is judged: ``.metadata``
    (DCP), else a ``*.safetensors.index.json`` or ``model.safetensors``
    (sharded safetensors). FileNotFoundError where nothing is there;
    FormatError naming the URL for a folder of neither."""
    url = url.rstrip("/")
    names = st_format.stored_names(url, options)
    if ".metadata" in names:
        return Detected(DCP, url, url)
    if any(n.endswith(".safetensors.index.json") for n in names) or "model.safetensors" in names:
        return Detected(SHARDED, url, url)
    if not names:
        raise FileNotFoundError(2, "no object, nor any under it as a folder", url)
    raise FormatError(
        f"{url}: a folder, but no checkpoint ckptio reads: no .metadata (DCP) nor "
        "*.safetensors.index.json / model.safetensors (sharded safetensors)"
    )


def _is_index(path: str) -> bool:
    try:
        with open_regular(path) as f:
            doc = json.loads(f.read())
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("weight_map"), dict)


def _is_dcp_metadata(path: str) -> bool:
    try:
        dcp.read_metadata(path)
    except FormatError:
        return False
    return True
