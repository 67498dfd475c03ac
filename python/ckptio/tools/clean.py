"""``ckptio.clean`` / ``ckptio clean``: what dead saves left in a folder.

A save writes into a temp file beside its target (``.NAME.ckptio-PID-NONCE.tmp``)
and holds a lock on it while it runs; a save that was killed leaves its temp
file unlocked. :func:`clean` removes those, in any PID namespace, never one a
live writer holds. Every save does the same in its own folder first.
"""

from __future__ import annotations

import os

from ckptio import _native


def clean(folder: str | os.PathLike[str]) -> list[str]:
    """Remove the temp files of dead saves in ``folder``; the names removed."""
    return list(_native.clean_temps(os.fspath(folder)))
