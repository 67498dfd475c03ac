"""File names that checkpoints hold (DCP ``.metadata`` relative paths, sharded
safetensors index entries) must name files inside the checkpoint's folder."""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from typing import Any

from ckptio import _native


def inside(
    folder: str,
    rel: Any,
    where: str,
    *,
    blobs: bool = False,
    error: type[Exception] = _native.FormatError,
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
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
        raise error(f"{where}: {rel!r} resolves to {real}, outside the checkpoint folder {folder}")
    return full
