"""Progress of long command-line operations: one line on a terminal with the bytes
done, the rate and the time left, redrawn in place and cleared at the end.

Nothing is drawn unless the stream is a terminal (and the command was not asked
to be quiet): logs, pipes and scripts see only the command's own output.
Where the bytes move inside one native call (a save, a load), :func:`io_bytes`
(the process's read and write counters) stands in for the count.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from ckptio.io.units import human_bytes

GiB = 2**30


def io_bytes() -> int:
    """Bytes this process has moved through read and write calls so far
    (``rchar + wchar`` of /proc/self/io; every thread, the engine's included).
    Copies from a mapping (files in memory) and cuFile transfers do not count:
    there the display moves on when the call returns. 0 where there is no /proc."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return 0


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


class Progress:
    """``with Progress("verifying x.pt", total) as p: ... p.add(n)``.

    ``enabled``: draw or not (default: whether ``stream`` is a terminal).
    ``follow(fn)``: a background thread sets the bytes done to ``fn()`` (capped
    at ``total``) every ``interval`` seconds, for work that reports nothing itself.
    """

    def __init__(
        self,
        what: str,
        total: int,
        *,
        stream: IO[str] | None = None,
        enabled: bool | None = None,
        interval: float = 0.2,
    ) -> None:
        self.what = what
        self.total = max(int(total), 0)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.interval = interval
        self._t0 = time.monotonic()
        self._drawn = 0.0
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self._draw(force=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
        self._draw()

    def label(self, what: str) -> None:
        self.what = what
        self._draw(force=True)

    def follow(self, fn: Callable[[], int]) -> None:
        """Take the bytes done from ``fn()`` until :meth:`close` (drawn every ``interval``)."""
        if not self.enabled or self._thread is not None:
            return

        def poll() -> None:
            while not self._stop.wait(self.interval):
                with self._lock:
                    self.done = max(self.done, min(fn(), self.total))
                self._draw(force=True)

        self._thread = threading.Thread(target=poll, name="ckptio-progress", daemon=True)
        self._thread.start()

    def print(self, line: str, file: IO[str] | None = None) -> None:
        """Print ``line`` (to ``file``, default stdout) above the progress line."""
        with self._lock:
            self._clear()
            print(line, file=file if file is not None else sys.stdout, flush=True)
        self._draw(force=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._clear()
        self.enabled = False

    def line(self) -> str:
        """The progress line as drawn now."""
        elapsed = time.monotonic() - self._t0
        done, total = min(self.done, self.total), self.total
        parts = [f"{self.what}: {human_bytes(done)} / {human_bytes(total)}"]
        if total:
            parts[0] += f" ({100 * done // total}%)"
        rate = done / elapsed if elapsed > 0 else 0.0
        if rate > 0 and elapsed >= 0.5:
            parts.append(f"{rate / GiB:.2f} GiB/s")
            parts.append(f"{_clock((total - done) / rate)} left")
        else:
            parts.append(f"{_clock(elapsed)} elapsed")
        return ", ".join(parts)

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn < self.interval:
            return
        with self._lock:
            self._drawn = now
            cols = shutil.get_terminal_size((80, 24)).columns
            text = self.line()[: max(cols - 1, 10)]
            self.stream.write("\r" + text + " " * max(self._width - len(text), 0))
            self.stream.flush()
            self._width = len(text)

    def _clear(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
