"""Which process left something behind, and whether it still runs.

A tag ``<boot id>.<pid namespace>.<pid>.<start>`` names one process: the boot id
keeps another host's tags (a disk several hosts share) out of this host's
judgement, and the process's start time (``/proc/<pid>/stat``, clock ticks since
boot) tells it from a later process that got the same pid, in a namespace made
again with the same number too (a restarted container). Used for what killed
processes leave in Python's care (scratch copies, a tiered folder's drain
records); the core's temp files carry a kernel lock instead (``io::persist``).
"""

from __future__ import annotations

import os
import re

#: A tag's shape (as written by :func:`tag`).
TAG = re.compile(r"[0-9a-f]{8}\.\d{1,20}\.\d{1,7}\.\d{1,20}")


def _host() -> str | None:
    """``<boot id>.<pid namespace>``; None where /proc is not this namespace's
    (``/proc/self`` names another pid than ours: a sandbox that kept its
    parent's /proc), where no pid can be judged."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip().replace("-", "")[:8]
        if int(os.readlink("/proc/self")) != os.getpid():
            return None
        return f"{boot}.{os.stat('/proc/self/ns/pid').st_ino}"
    except (OSError, ValueError):
        return None


def _stat(pid: int | str) -> tuple[str, str] | None:
    """(state, start time) of a process of this namespace, None where none is."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def tag() -> str | None:
    """This process's tag (None where it cannot be told: nothing of it is
    judged later)."""
    host, me = _host(), _stat("self")
    return f"{host}.{os.getpid()}.{me[1]}" if host and me else None


def is_mine(t: object) -> bool:
    """Whether ``t`` names this very process."""
    return isinstance(t, str) and t == tag()


def gone(t: object) -> bool:
    """Whether the process ``t`` names has surely ended (what may be removed): a
    tag of this host and pid namespace whose process is not there (its pid runs
    no process, a later one, or a zombie). Elsewhere's or malformed: False."""
    return _state(t) is False


def running(t: object) -> bool:
    """Whether the process ``t`` names surely runs (what is left to it). A tag
    of another boot or namespace, or a malformed one: False."""
    return _state(t) is True


def _state(t: object) -> bool | None:
    """True: the tag's process runs; False: it has ended; None: not this host's
    and namespace's to judge."""
    host = _host()
    if not isinstance(t, str) or host is None or not TAG.fullmatch(t):
        return None
    if not t.startswith(host + "."):
        return None
    pid, start = t.split(".")[2:]
    st = _stat(int(pid))
    return st is not None and st[1] == start and st[0] not in ("Z", "X")
