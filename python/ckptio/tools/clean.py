"""``ckptio.clean`` / ``ckptio clean``: what dead saves left in a folder.

A save writes into a temp file beside its target (``.NAME.ckptio-PID-NONCE.tmp``)
and holds a lock on it while it runs; a save that was killed leaves its temp
file unlocked. A multi-file save (DCP, sharded safetensors) that died or failed
before its ``.metadata`` or index may also leave data files that nothing names.
:func:`clean` removes both, using the temp files' locks as the liveness rule, in
any PID namespace: nothing while a save into the folder may still be running.
Every save does the same in its own folder first.
"""

from __future__ import annotations

import os

from ckptio import _native
from ckptio.formats import dcp
from ckptio.formats import safetensors as st_format


def clean(folder: str | os.PathLike[str]) -> list[str]:
    """Remove what dead saves left in ``folder``: temp files no live save holds, and
    the data files of DCP or sharded safetensors checkpoints that no ``.metadata``
    or index names while no save is in flight. The names removed."""
    path = os.fspath(folder)
    removed = list(_native.clean_temps(path))
    removed += dcp.sweep(path)
    removed += st_format.sweep(path)
    return removed
