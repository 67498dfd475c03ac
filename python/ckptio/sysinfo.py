"""``ckptio.info()``: what this machine offers for checkpoint I/O, and why not."""

from __future__ import annotations

import os
from typing import Any

from ckptio import _native


def info(folder: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """CUDA driver found or not, cuFile found or not (version, nvidia-fs or compat
    mode, /run/udev), the pinned memory ckptio holds and its cap, and for
    ``folder``: whether files there take O_DIRECT and cuFile handles, and why
    not. Never raises for a missing library."""
    return _native.info(os.fspath(folder) if folder is not None else None)


def format_info(d: dict[str, Any]) -> str:
    c, f = d["cuda"], d["cufile"]
    lines = [
        "CUDA driver: "
        + (
            f"found ({c['path']}, version {c['driver_version']}, {c['device_count']} device(s))"
            if c["found"]
            else f"not found: {c['reason']}"
        ),
        "cuFile:      "
        + (
            f"found ({f['path']}, version {f['version']}), driver "
            + ("open" if f["driver_open"] else "not open")
            + (f", nvidia-fs {f['nvfs_version']}" if f["nvfs_version"] else "")
            + (" -> compat mode (no P2P DMA)" if f["compat_mode"] else "")
            if f["found"]
            else f"not found: {f['reason']}"
        ),
        "/run/udev:   "
        + (
            "present"
            if f["run_udev"]
            else "missing (cuFile cannot register files on VMs without it)"
        ),
    ]
    if f["found"] and f["reason"]:
        lines.append(f"             {f['reason']}")
    pin = d.get("pinned")
    if pin is not None:
        limit = pin["limit"]
        lines.append(
            f"Pinned:      {pin['held'] / 2**20:.1f} MiB held by ckptio, limit "
            + (f"{limit / 2**30:.1f} GiB" if limit is not None else "unreadable")
            + " (CKPTIO_PINNED_LIMIT; ckptio.release_buffers() gives idle buffers back)"
        )
    if "folder" in d:
        x = d["folder"]
        lines.append(f"folder {x['path']}:")
        lines.append(
            "  O_DIRECT:      "
            + ("yes" if x["o_direct"] else f"no ({x['o_direct_reason']})")
            + (
                f", alignment offset {x['alignment'][0]} memory {x['alignment'][1]}"
                if x["o_direct"]
                else ""
            )
        )
        lines.append(
            "  cuFile handle: "
            + ("yes" if x["cufile_handle"] else "no")
            + (f" ({x['cufile_reason']})" if x["cufile_reason"] else "")
        )
    return "\n".join(lines)
