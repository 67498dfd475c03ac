"""Where libcufile writes its log: not the current folder.

libcufile (cuFile, GPUDirect Storage) writes ``cufile.log`` into the current
folder of the process that opens its driver, so a training folder would get one.
Its documented variable ``CUFILE_LOGFILE_PATH`` names the file instead (and wins
over ``logging.dir`` of cufile.json). ckptio sets it, when ckptio is imported and
before anything of ckptio loads libcufile, to ``cufile.log`` under
``$XDG_CACHE_HOME/ckptio`` (``~/.cache/ckptio``), unless the user chose already:
``CUFILE_LOGFILE_PATH`` or ``CUFILE_ENV_PATH_JSON`` (a cufile.json of their own)
is set. Nothing is made at import: the core makes the folder when cuFile first
runs (``src/gpu/cufile.rs``).
"""

from __future__ import annotations

import os


def log_path() -> str:
    """The file ckptio points cuFile's log at."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptio", "cufile.log")


def point_log() -> None:
    """Set CUFILE_LOGFILE_PATH unless the user configured cuFile's logging."""
    if "CUFILE_LOGFILE_PATH" in os.environ or "CUFILE_ENV_PATH_JSON" in os.environ:
        return
    os.environ["CUFILE_LOGFILE_PATH"] = log_path()
