"""``ckptio convert``: torch.save checkpoints <-> safetensors files.

A safetensors file holds one flat mapping of str -> tensor, each tensor
contiguous and in memory of its own. A torch.save file that holds anything
else is refused with the key that does not fit:

- a value that is not a tensor (int, str, list, optimizer state...);
- a nested dict, unless ``flatten``: then ``{"model": {"w": t}}`` is stored as
  ``"model.w"`` (keys joined with ".", depth first; a joined name that
  collides with another key is refused);
- tensors that share memory (tied weights, overlapping views) and
  non-contiguous views, unless ``duplicate_shared``: then each is written as a
  copy of its own (loading the file back gives independent tensors).

A torch.save destination takes the same flat mapping (convert moves tensors),
but keeps what torch.save keeps: tied tensors and views stay shared (copies
only with ``duplicate_shared``).

safetensors -> torch.save writes the tensors as a plain dict (ckptio.save); the
safetensors header metadata has no place in a torch.save file and is dropped
(the command says so).

A torch.save source is read with ``verify=True``: a record whose bytes do not
match its CRC-32 fails the conversion (safetensors stores no checksum: its
header and offsets are checked as ``load_file`` checks them).

The destination is never the source itself, nor written through a symbolic
link (the file it points to may be anything: a cache's blob, another model); an
existing destination is replaced only with ``overwrite`` (``--force``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ckptio import safetensors as cst
from ckptio.errors import ConversionError, FormatError
from ckptio.formats import detect
from ckptio.formats import safetensors as st_format
from ckptio.io import paths, remote
from ckptio.serialization import last_report, load, save
from ckptio.tools.describe import printable

FORMATS = ("safetensors", "torch")
_TORCH_EXT = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def target_format(dst: str, src_format: str, to: str | None) -> str:
    if to is not None:
        if to not in FORMATS:
            raise ValueError(f"--to must be one of {FORMATS}, not {to!r}")
        return to
    if dst.endswith(".safetensors"):
        return "safetensors"
    if dst.endswith(_TORCH_EXT):
        return "torch"
    return "torch" if src_format == "safetensors" else "safetensors"


def flat_tensors(
    obj: Any, *, flatten: bool = False, where: str = "", fmt: str = "safetensors"
) -> dict[str, torch.Tensor]:
    """The str -> tensor mapping in ``obj``, or ConversionError naming what does
    not fit and why: what ``fmt`` (the destination's format) holds."""
    holds = "safetensors holds" if fmt == "safetensors" else "convert moves"
    if not isinstance(obj, dict):
        raise ConversionError(
            f"{where}holds a {type(obj).__name__}, not a dict of tensors: "
            f"{holds} one flat str -> tensor mapping"
        )
    out: dict[str, torch.Tensor] = {}

    def walk(d: dict[Any, Any], prefix: str) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise ConversionError(f"{where}key {k!r} is a {type(k).__name__}, not a str")
            name = prefix + k
            if isinstance(v, torch.Tensor):
                if name in out:
                    raise ConversionError(f"{where}flattened name {name!r} is there twice")
                out[name] = v
            elif isinstance(v, dict) and flatten:
                if not v:  # nothing to flatten into: it would vanish from the file
                    raise ConversionError(
                        f"{where}{name!r} is an empty dict: a flat file of tensors cannot hold it"
                    )
                walk(v, name + ".")
            else:
                hint = " (a nested dict: --flatten stores its tensors as 'key.sub')"
                raise ConversionError(
                    f"{where}{name!r} is a {type(v).__name__}, not a tensor: {holds} "
                    "only tensors" + (hint if isinstance(v, dict) else "")
                )

    walk(obj, "")
    return out


def check_convertible(tensors: dict[str, torch.Tensor], fmt: str, where: str = "") -> None:
    """ConversionError naming the first tensor ``fmt`` cannot hold, or that holds
    no data to move: sparse and other layouts, the meta device, dtypes
    safetensors lacks (complex128, quantized...)."""
    for k, t in tensors.items():
        if t.layout != torch.strided:
            raise ConversionError(
                f"{where}{k!r} is a {t.layout} tensor: convert moves dense tensors "
                "(make it dense with .to_dense() first)"
            )
        if t.is_meta:
            raise ConversionError(f"{where}{k!r} is on the meta device: it holds no data")
        if fmt == "safetensors" and not st_format.holds(t.dtype):
            raise ConversionError(f"{where}{k!r} has dtype {t.dtype}, which safetensors lacks")


def unshare(
    tensors: dict[str, torch.Tensor], duplicate: bool, where: str = ""
) -> dict[str, torch.Tensor]:
    """Refuse (or with ``duplicate``, copy) shared and non-contiguous tensors."""
    groups = cst.find_shared(tensors)
    views = [k for k, v in tensors.items() if not v.is_contiguous()]
    if not duplicate:
        if groups:
            names = "; ".join(", ".join(repr(n) for n in g) for g in groups)
            raise ConversionError(
                f"{where}tensors share memory ({names}): safetensors stores each tensor on "
                "its own; pass --duplicate-shared to write each as a separate copy"
            )
        if views:
            raise ConversionError(
                f"{where}{views[0]!r} is a non-contiguous view: pass --duplicate-shared to "
                "write a contiguous copy of it"
            )
        return tensors
    out = dict(tensors)
    for g in groups:
        for k in g[1:]:
            out[k] = tensors[k].clone(memory_format=torch.contiguous_format)
    for k in views:
        out[k] = out[k].contiguous()
    return out


def check_destination(src: str, dst: str, overwrite: bool) -> None:
    """Refuse ``dst`` where convert must not write it: the source itself (the same
    file under any name, or the same URL), a symbolic link (convert writes
    nothing through one), a folder, or, unless ``overwrite``, anything that exists."""
    # file:// URLs as the local paths they name: the save writes there.
    src, dst = paths.local(os.fsdecode(src)), paths.local(os.fsdecode(dst))
    if remote.is_url(dst):
        if remote.is_url(src) and src.rstrip("/") == dst.rstrip("/"):
            raise ValueError(f"{dst} is the source itself: convert writes another object")
        if not overwrite:
            try:
                remote.head(dst)
            except FileNotFoundError:
                return
            raise FileExistsError(f"{dst} exists: convert replaces it only with --force")
        return
    if os.path.islink(dst):
        raise ValueError(
            f"{dst} is a symbolic link (to {os.readlink(dst)}): convert writes nothing through "
            "a link; remove it or name another path"
        )
    # Before the source is read, and whatever --force says: no file replaces a folder.
    if os.path.isdir(dst) or dst.endswith(os.sep):
        raise IsADirectoryError(
            f"{dst} is a folder: convert writes one file; name the file (a path inside it)"
        )
    if not os.path.lexists(dst):
        return
    if not remote.is_url(src) and os.path.exists(src) and os.path.samefile(src, dst):
        raise ValueError(f"{dst} is the source itself ({src}): convert writes another file")
    if not overwrite:
        raise FileExistsError(f"{dst} exists: convert replaces it only with --force")


def convert(
    src: str,
    dst: str,
    *,
    to: str | None = None,
    duplicate_shared: bool = False,
    flatten: bool = False,
    log: Callable[[str], None] = print,
    source: detect.Detected | None = None,
    overwrite: bool = True,
) -> str:
    """Convert ``src`` into ``dst``; returns the format written. ``source``: what
    ``formats.detect`` found ``src`` to be, where the caller asked already.
    Either may be an object URL (configured by the AWS_* variables): the
    tensors are then read straight from the store and streamed to it, with no
    local copy. ``dst`` is never ``src`` itself nor a symbolic link; an
    existing ``dst`` is replaced (as ``ckptio.save`` replaces) unless
    ``overwrite`` is False (``ckptio convert`` without ``--force``): then
    FileExistsError."""
    src, dst = paths.local(os.fsdecode(src)), paths.local(os.fsdecode(dst))
    check_destination(src, dst, overwrite)
    if source is not None:
        found = source
    elif remote.is_url(src):
        found = detect.detect_url(os.fsdecode(os.fspath(src)))
    else:
        found = detect.detect(src)
    formats = {detect.TORCH: "torch", detect.SAFETENSORS: "safetensors"}
    if found.format not in formats:
        raise FormatError(
            f"{src} is a {found.format} checkpoint; convert takes a torch.save file or a "
            "safetensors file"
        )
    src_format = formats[found.format]
    fmt = target_format(os.fspath(dst), src_format, to)
    where = f"{src}: "
    meta: dict[str, str] = {}
    if src_format == "torch":
        # Every record against its CRC-32 as it is read: a damaged source fails here,
        # not copied into a file whose fresh CRC-32s would vouch for it.
        obj = load(src, map_location="cpu", weights_only=True, verify=True)
        tensors = flat_tensors(obj, flatten=flatten, where=where, fmt=fmt)
    else:
        tensors = cst.load_file(src)
        meta = cst.metadata(src) or {}
        if fmt == "torch" and meta:
            log(f"note: the safetensors metadata {meta} is not kept in a torch.save file")
    check_convertible(tensors, fmt, where)
    if fmt == "safetensors" or duplicate_shared:  # torch.save keeps ties and views as they are
        tensors = unshare(tensors, duplicate_shared, where)
    if fmt == "safetensors":  # a safetensors source's metadata kept
        cst.save_file(tensors, dst, metadata={"format": "pt", **meta})
    else:
        save(tensors, dst)
    rep = last_report()
    assert rep is not None
    log(  # paths escaped: a name that is no UTF-8 must not fail the report of a done write
        f"{printable(os.fsdecode(src))} ({src_format}) -> {printable(os.fsdecode(dst))} ({fmt}): "
        f"{len(tensors)} tensors, {rep.nbytes / 2**20:.1f} MiB"
    )
    return fmt
