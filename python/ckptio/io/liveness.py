"""Which process left something behind, and whether it still runs.

A tag ``<boot id>.<pid namespace>.<pid>`` names a process where a pid means one
process: the boot id keeps another host's tags (a disk several hosts share) and
the namespace another container's out of this host's judgement. Used for what
killed processes leave in Python's care (scratch copies, a tiered folder's
drain records); the core's temp files carry a kernel lock instead
(``io::persist``).
"""

from __future__ import annotations

import os
import re

#: A tag's shape (as written by :func:`tag`).
TAG = re.compile(r"[0-9a-f]{8}\.\d+\.\d+")


def _host() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip().replace("-", "")[:8]
        return f"{boot}.{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def tag() -> str | None:
    """This process's tag (None where the host cannot be told: nothing of it is
    judged dead later)."""
    host = _host()
    return f"{host}.{os.getpid()}" if host else None


def is_mine(t: str | None) -> bool:
    """Whether ``t`` names this very process."""
    return t is not None and t == tag()


def gone(t: str | None) -> bool:
    """Whether the process ``t`` names has surely ended (what may be removed):
    a tag of this host and pid namespace whose pid runs no process. A tag of
    elsewhere, a malformed one, or a pid taken again: False (the safe side)."""
    return _pid_state(t) is False


def running(t: str | None) -> bool:
    """Whether the process ``t`` names surely runs (what is left to it): a tag
    of this host and pid namespace whose pid runs a process. A tag of another
    boot or namespace (a reboot, a restarted container) or a malformed one:
    False."""
    return _pid_state(t) is True


def _pid_state(t: str | None) -> bool | None:
    """True: the tag's pid runs here; False: it runs nothing here; None: the tag
    is not this host's and namespace's to judge."""
    host = _host()
    if t is None or host is None or not TAG.fullmatch(t) or not t.startswith(host + "."):
        return None
    pid = int(t.rsplit(".", 1)[1])
    if not 0 < pid < 1 << 22:  # past Linux's pid_max: no process's
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True
