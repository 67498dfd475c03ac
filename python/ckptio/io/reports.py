"""What a save or load did: :class:`IOReport`, one per call, and ``last_report()``.

A native transfer returns its stats as a dict (bytes, threads, O_DIRECT, the
device path, the read path...); :func:`merged` sums the dicts of a call's
several transfers (shards, files read side by side), :func:`report` makes the
call's one report and keeps it as this thread's last.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class IOReport:
    """What one save or load did: how many bytes, how fast, through which path."""

    path: str
    nbytes: int
    seconds: float
    #: The device path *asked for* (the ``backend`` argument, else CKPTIO_BACKEND,
    #: else "auto": cuFile where it takes the file, else bounce buffers; reads take
    #: bounce buffers where cuFile runs in compat mode), "cufile" or "bounce".
    #: The path that *ran* is ``device_path``.
    backend: str
    direct: bool
    direct_reason: str | None
    threads: int
    storages: int
    #: With cuFile: "p2p" (true GPUDirect) or "compat" (cuFile bounces through host memory).
    gds_mode: str | None = None
    #: Why device memory did not go through cuFile, when it did not.
    fallback_reason: str | None = None
    #: load(verify=True): every record's CRC-32 was checked (but those in ``unchecked``).
    verified: bool = False
    #: Records whose bytes could not be checked: no CRC-32 stored, or read by cuFile.
    unchecked: tuple[str, ...] = ()
    #: The device path that *ran* (``backend`` is the one asked for): "cufile",
    #: "bounce" (pinned host buffers), or None when only host memory moved.
    device_path: str | None = None
    #: Page-locked host memory ckptio holds after the call, all engines and
    #: stagers together (``ckptio.release_buffers()`` gives the engines' back).
    pinned_bytes: int = 0
    #: Loads into existing tensors (``out=``, ``load_state_dict``) with
    #: strict=False: destinations the checkpoint had no tensor for, and
    #: checkpoint tensors without a destination (not read).
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    #: Loads: "memory" (the file's bytes were in memory: tmpfs, or cached pages)
    #: or "disk"; ``read_reason`` says why ("tmpfs", "page cache: 100% of ...
    #: sampled pages", "cold: ..."), ``read_source`` how ("map": copied from a
    #: mapping of the page cache, "pread", "direct": O_DIRECT, "buffered").
    read_path: str | None = None
    read_source: str | None = None
    read_reason: str | None = None
    #: Loads: bytes this process read from storage, and (``group=``, read once
    #: and shared) bytes it received from the other ranks of the group.
    bytes_read: int = 0
    bytes_received: int = 0

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds > 0 else float("inf")


_last = threading.local()


def last_report() -> IOReport | None:
    """The report of this thread's last ckptio.save or ckptio.load."""
    return getattr(_last, "report", None)


def report(
    path: str,
    t0: float,
    stats: dict[str, Any],
    storages: int,
    verified: bool = False,
    unchecked: tuple[str, ...] = (),
    missing: tuple[str, ...] = (),
    unexpected: tuple[str, ...] = (),
) -> IOReport:
    """The IOReport of a call whose transfers' stats are ``stats`` (one dict, or
    :func:`merged`), kept as this thread's ``last_report()``."""
    rep = IOReport(
        path=path,
        nbytes=stats["bytes"],
        seconds=time.perf_counter() - t0,
        backend=stats["backend"],
        direct=stats["direct"],
        direct_reason=stats["direct_reason"],
        threads=stats["threads"],
        storages=storages,
        gds_mode=stats.get("gds_mode"),
        fallback_reason=stats.get("fallback_reason"),
        verified=verified,
        unchecked=unchecked,
        device_path=stats.get("device_path"),
        pinned_bytes=stats.get("pinned_bytes", 0),
        read_path=stats.get("read_path"),
        read_source=stats.get("read_source"),
        read_reason=stats.get("read_reason"),
        bytes_read=stats.get("bytes_read", 0),
        bytes_received=stats.get("bytes_received", 0),
        missing_keys=missing,
        unexpected_keys=unexpected,
    )
    return set_last(rep)


def set_last(rep: IOReport) -> IOReport:
    """Keep ``rep`` as this thread's last report."""
    _last.report = rep
    return rep


def merged(stats: list[dict[str, Any]], backend: str | None = None) -> dict[str, Any]:
    """One stats dict of several transfers of one call: bytes summed, O_DIRECT if
    every one was, the device path of the first that moved device memory.
    ``backend``: the one asked for, said where nothing was moved."""
    if not stats:
        return {
            "bytes": 0,
            "backend": backend or os.environ.get("CKPTIO_BACKEND") or "auto",
            "direct": False,
            "direct_reason": "nothing to read",
            "threads": 0,
        }
    dev = [s for s in stats if s.get("device_path")]
    out = dict((dev or stats)[0])
    out["bytes"] = sum(s["bytes"] for s in stats)
    out["direct"] = all(s["direct"] for s in stats)
    out["direct_reason"] = next((s["direct_reason"] for s in stats if s["direct_reason"]), None)
    out["threads"] = max(s["threads"] for s in stats)
    out["pinned_bytes"] = stats[-1].get("pinned_bytes", 0)
    out["bytes_read"] = sum(s.get("bytes_read", 0) for s in stats)
    out["bytes_received"] = sum(s.get("bytes_received", 0) for s in stats)
    return out


def torch_stats(nbytes: int, why: str) -> dict[str, Any]:
    """A report's stats where torch moved the bytes itself (``why``: when and why)."""
    return {
        "bytes": nbytes,
        "backend": "auto",
        "device_path": None,
        "direct": False,
        "direct_reason": why,
        "threads": 1,
    }
