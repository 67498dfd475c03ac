"""``ckptio.info()``: what this machine offers for checkpoint I/O, and why not."""

from __future__ import annotations

import os
from typing import Any

from ckptio import _native
from ckptio.tools.describe import printable


def info(folder: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """CUDA driver found or not, cuFile found or not (version, nvidia-fs or compat
    mode, /run/udev), the pinned memory ckptio holds and its cap, huge pages for
    private and shared memory (with what fresh memory costs to fault in with and
    without them, measured on 64 MiB), and for ``folder``: whether files there
    take O_DIRECT and cuFile handles, and why not. Never raises for a missing
    library."""
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
    lines += _huge_pages_lines(d["huge_pages"])
    if "folder" in d:
        x = d["folder"]
        lines.append(f"folder {printable(os.fspath(x['path']))}:")  # a terminal shows it as it is
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
        if x["cufile_handle"] and d["cufile"].get("compat_mode"):
            # src/gpu/path.rs: in compat mode the bounce pipeline reads faster.
            lines.append("  backend auto:  saves through cuFile, loads through the bounce pipeline")
    return "\n".join(lines)


def _huge_pages_lines(h: dict[str, Any]) -> list[str]:
    """Whether fresh host memory gets huge pages, private and shared, and what
    the 4 KiB pages cost where it does not."""
    fix = "/sys/kernel/mm/transparent_hugepage"
    k4, huge, shared = h["private_4k_gib_s"], h["private_huge_gib_s"], h["shared_gib_s"]
    rates = f"huge pages fault in at {huge:.1f} GiB/s, 4 KiB pages at {k4:.1f}"
    if not h["private_huge"]:
        private = (
            f"unavailable (THP {h['enabled']}): 4 KiB pages fault in at {k4:.1f} GiB/s, "
            f"2.4-3.6x slower than huge pages on hosts that have them "
            f"(echo madvise > {fix}/enabled)"
        )
    elif h["advice"]:
        private = f"on (THP {h['enabled']}): {rates} (just freed memory, best case)"
    elif h["free_page_reporting"]:
        private = (
            f"not asked for: this VM hands free 2 MiB blocks back to its host (free page "
            f"reporting), and fresh huge pages then fault in slower than 4 KiB pages "
            f"(CKPTIO_HUGE_PAGES=on asks anyway); {rates} when just freed"
        )
    else:
        private = f"off (CKPTIO_HUGE_PAGES): {rates}"
    if h["shared_huge"]:
        sharedl = f"on (shmem_enabled {h['shmem_enabled']}): {shared:.1f} GiB/s to fault in"
    else:
        sharedl = (
            f"off (shmem_enabled {h['shmem_enabled']}): memfd/tmpfs memory faults in at "
            f"{shared:.1f} GiB/s with 4 KiB pages (echo advise > {fix}/shmem_enabled)"
        )
    return [f"huge pages:  private {private}", f"             shared {sharedl}"]
