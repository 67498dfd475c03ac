"""Side-by-side benchmark: the disk's raw limit, ckptio, torch.save/torch.load.

Every figure is measured in the same run, so ratios compare like with like.
Reads are cold: each file's cached pages are dropped (fsync, then
POSIX_FADV_DONTNEED) before it is read. Every timed write and read starts on a
settled disk (:func:`settle_disk`).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import shutil
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch

from ckptio import serialization

GiB = 2**30


@dataclasses.dataclass
class Row:
    name: str
    seconds: float
    nbytes: int
    baseline: str  # the row this one is compared with

    @property
    def gib_s(self) -> float:
        return self.nbytes / GiB / self.seconds


def synthetic_state_dict(
    nbytes: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A transformer-shaped state dict of about ``nbytes``: big matrices and small vectors."""
    item = torch.empty((), dtype=dtype).element_size()
    hidden = 2048
    sd: dict[str, torch.Tensor] = {}
    total, layer = 0, 0
    while total < nbytes:
        for name, shape in (
            ("attn.qkv.weight", (3 * hidden, hidden)),
            ("attn.out.weight", (hidden, hidden)),
            ("mlp.up.weight", (4 * hidden, hidden)),
            ("mlp.down.weight", (hidden, 4 * hidden)),
            ("norm.weight", (hidden,)),
            ("norm.bias", (hidden,)),
        ):
            numel = 1
            for s in shape:
                numel *= s
            left = max((nbytes - total) // item, 1)
            if numel > left:  # last tensor: trim to the target size
                shape, numel = (left,), left
            t = torch.empty(shape, dtype=dtype, device=device)
            t.view(-1)[:].uniform_() if dtype.is_floating_point else t.random_()
            sd[f"layers.{layer}.{name}"] = t
            total += numel * item
            if total >= nbytes:
                break
        layer += 1
    return sd


def drop_cache(path: str) -> None:
    """Evict the file's pages so that the next read comes from the disk, and
    let the disk settle (:func:`settle_disk`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    settle_disk(path)


def settle_disk(path: str, quiet: float = 0.3, timeout: float = 30.0) -> float:
    """After os.sync(), wait until the block device under ``path`` (a file or a
    folder) has had nothing in flight and done no I/O for ``quiet`` seconds; the
    seconds waited. With online discard, ext4 trims the blocks of a deleted or
    replaced file in the background after its journal commits: on the GPU
    machine's disk a load timed right after a save ran at 0.68x the raw read,
    0.97x ten seconds later. 0 where the device has no statistics (tmpfs)."""
    os.sync()
    st = os.stat(path)
    stat = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
    t0 = time.monotonic()
    last, since = None, t0
    while (now := time.monotonic()) - t0 < timeout:
        try:
            with open(stat) as f:
                fields = f.read().split()
        except OSError:  # no block device under path
            return 0.0
        in_flight, busy_ms = int(fields[8]), int(fields[9])
        if in_flight or busy_ms != last:
            last, since = busy_ms, now
        elif now - since >= quiet:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_threads(n_threads: int, work: Callable[[Callable[[], bool]], None]) -> None:
    """Run ``work(stopped)`` on ``n_threads`` threads at once; the first error
    makes ``stopped()`` true for the others and is raised once all are done."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work(lambda: bool(errors))
        except BaseException as e:  # report, stop the others
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]


def parallel(n_threads: int, nbytes: int, chunk: int, fn: Callable[[int, int], None]) -> None:
    """``fn(offset, length)`` for every ``chunk`` of ``nbytes``, in order, on
    ``n_threads`` threads (:func:`run_threads`: the first error stops the rest)."""
    offsets = list(range(0, nbytes, chunk))
    lock = threading.Lock()

    def work(stopped: Callable[[], bool]) -> None:
        while not stopped():
            with lock:
                if not offsets:
                    return
                off = offsets.pop(0)
            fn(off, min(chunk, nbytes - off))

    run_threads(n_threads, work)


@dataclasses.dataclass
class RawLimits:
    """Seconds for the disk alone: write + fsync, cold read into a reused
    (already faulted-in) buffer, and cold read into freshly mapped memory, which
    is where every load lands (its page faults are part of any load's cost)."""

    write: float
    read: float
    read_fresh: float
    direct: bool


def raw_limits(folder: str, nbytes: int, threads: int = 8, chunk: int = 64 << 20) -> RawLimits:
    """O_DIRECT (where the filesystem takes it), several threads, large chunks,
    page-aligned memory: the disk's limit."""
    path = os.path.join(folder, "raw.bin")
    # Private anonymous memory, as malloc's and a load's storages are: mmap's
    # default (MAP_SHARED) is shmem, whose first touch costs more (a GiB read
    # into it fresh by one thread on the dev VM: 2.5 s, private 1.7-2.1 s).
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    buf.write(os.urandom(1 << 20) * (nbytes // (1 << 20)))
    view = memoryview(buf)
    write_s, direct = raw_write(path, view, threads, chunk)
    read_s = cold_read(path, view, direct, threads, chunk)
    view.release()
    buf.close()
    fresh = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    fview = memoryview(fresh)
    read_fresh_s = cold_read(path, fview, direct, threads, chunk)
    fview.release()
    fresh.close()
    os.unlink(path)
    return RawLimits(write_s, read_s, read_fresh_s, bool(direct))


def raw_write(
    path: str, src: memoryview, threads: int = 8, chunk: int = 64 << 20, nbytes: int | None = None
) -> tuple[float, int]:
    """(seconds, the O_DIRECT flag used or 0) to write ``nbytes`` (default
    ``len(src)``) to a new file at ``path`` and fsync it, ``chunk`` per call on
    ``threads`` threads, O_DIRECT where the filesystem takes it. Offset ``o``
    comes from ``o % len(src)``, as in :func:`cold_read`."""
    nbytes = len(src) if nbytes is None else nbytes
    settle_disk(os.path.dirname(os.path.abspath(path)))
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    except OSError:
        direct = 0
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        parallel(threads, nbytes, chunk, lambda o, n: _pwrite_all(fd, src[o % len(src) :][:n], o))
        os.fsync(fd)
        return time.perf_counter() - t0, direct
    finally:
        os.close(fd)


def cold_read(
    path: str,
    into: memoryview,
    flags: int = 0,
    threads: int = 8,
    chunk: int = 64 << 20,
    nbytes: int | None = None,
) -> float:
    """Seconds to read ``nbytes`` (default ``len(into)``) of ``path`` cold,
    ``chunk`` per call on ``threads`` threads. Offset ``o`` lands at
    ``o % len(into)``: a smaller ``into``, a multiple of ``chunk``, is reused round
    and round. Page aligned for ``flags=os.O_DIRECT``."""
    nbytes = len(into) if nbytes is None else nbytes
    drop_cache(path)
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        t0 = time.perf_counter()
        parallel(threads, nbytes, chunk, lambda o, n: _pread_all(fd, into[o % len(into) :][:n], o))
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _pwrite_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, off)
        mv, off = mv[n:], off + n


def _pread_all(fd: int, mv: memoryview, off: int) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], off)
        if n == 0:
            raise EOFError("short read")
        mv, off = mv[n:], off + n


RAW_FRESH = "raw read, cold, fresh memory"


T = TypeVar("T")


def _in_turn(rows: list[T], rnd: int) -> list[T]:
    """``rows`` (two measurements) in round ``rnd``'s order, reversed every other
    round: neither always runs right after the other freed its memory or wrote
    its file (a VM may hand freed memory back to its host, to be backed again
    on the next fault)."""
    return rows if rnd % 2 == 0 else rows[::-1]


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def run(
    size: int = GiB,
    folder: str | None = None,
    threads: int | None = None,
    chunk_size: int | None = None,
    device: str = "cpu",
    repeat: int = 3,
    log: Callable[[str], None] = print,
    step: Callable[[str], None] | None = None,
) -> list[Row]:
    """Measure everything ``repeat`` times on a synthetic state dict of ``size``
    bytes, interleaved round by round, and keep each row's median. ``step(what)``
    is told each measurement before it starts (the command's progress line)."""
    tmp = tempfile.mkdtemp(prefix="ckptio-bench-", dir=folder)
    try:
        log(
            f"# {size / GiB:.2f} GiB state dict on {device}, files in {tmp}, "
            f"median of {repeat} rounds"
        )
        sd = synthetic_state_dict(size, device)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        times: dict[str, list[float]] = {}
        p_torch = os.path.join(tmp, "torch.pt")
        p_ck = os.path.join(tmp, "ckptio.pt")
        raw_w = raw_r = ""

        def timed(name: str, fn: Callable[[], object]) -> object:
            if step is not None:
                step(f"round {rnd + 1}/{repeat}: {name}")
            settle_disk(tmp)  # each measurement starts on a quiet disk
            t0 = time.perf_counter()
            out = fn()
            _sync(device)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            return out

        for rnd in range(repeat):
            # Every round writes fresh files, as the raw limit does: no row pays
            # for freeing an earlier round's file.
            for p in (p_torch, p_ck):
                if os.path.exists(p):
                    os.unlink(p)
            if step is not None:
                step(f"round {rnd + 1}/{repeat}: the disk's raw write and reads")
            raw = raw_limits(tmp, nbytes)
            tag = " (O_DIRECT)" if raw.direct else ""
            raw_w, raw_r = "raw write + fsync" + tag, "raw read, cold" + tag
            times.setdefault(raw_w, []).append(raw.write)
            times.setdefault(raw_r, []).append(raw.read)
            times.setdefault(RAW_FRESH, []).append(raw.read_fresh)

            def torch_save() -> None:
                torch.save(sd, p_torch)
                fsync_path(p_torch)

            saves: list[tuple[str, Callable[[], object]]] = [
                ("torch.save + fsync", torch_save),
                (
                    "ckptio.save (durable)",
                    lambda: serialization.save(sd, p_ck, threads=threads, chunk_size=chunk_size),
                ),
            ]
            for name, fn in _in_turn(saves, rnd):
                timed(name, fn)
                if name.startswith("ckptio"):
                    # (never None: the save just reported)
                    rep = cast("serialization.IOReport", serialization.last_report())
            loads: list[tuple[str, str, Callable[[], object]]] = [
                (
                    "torch.load, cold",
                    p_torch,
                    lambda: torch.load(p_torch, map_location=device, weights_only=True),
                ),
                (
                    "ckptio.load, cold",
                    p_ck,
                    lambda: serialization.load(
                        p_ck, map_location=device, threads=threads, chunk_size=chunk_size
                    ),
                ),
            ]
            for name, p, fn in _in_turn(loads, rnd):
                drop_cache(p)
                timed(name, fn)
        log(f"# ckptio.save: backend={rep.backend} direct={rep.direct} threads={rep.threads}")
        for name in (
            "torch.save + fsync",
            "ckptio.save (durable)",
            "torch.load, cold",
            "ckptio.load, cold",
        ):
            log(f"# {name} by round (s): {' '.join(f'{t:.3f}' for t in times[name])}")
        base = {
            raw_w: "",
            raw_r: "",
            RAW_FRESH: raw_r,
            "torch.save + fsync": raw_w,
            "ckptio.save (durable)": raw_w,
            "torch.load, cold": raw_r,
            "ckptio.load, cold": raw_r,
        }
        return [Row(name, median(ts), nbytes, base[name]) for name, ts in times.items()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def table(rows: list[Row]) -> str:
    by_name = {r.name: r for r in rows}
    lines = [
        f"{'what':<28} {'seconds':>8} {'GiB/s':>7}  ratio",
        f"{'-' * 28} {'-' * 8} {'-' * 7}  {'-' * 24}",
    ]
    for r in rows:
        ratio = ""
        if r.baseline in by_name:
            ratio = f"{by_name[r.baseline].seconds / r.seconds:.2f}x {by_name[r.baseline].name}"
        lines.append(f"{r.name:<28} {r.seconds:>8.3f} {r.gib_s:>7.2f}  {ratio}")
    return "\n".join(lines)


def to_json(rows: list[Row]) -> str:
    """The rows as JSON: name, seconds, nbytes, gib_s, and ``ratio`` (the baseline's
    seconds over the row's: above 1 is faster) against ``baseline`` where it has one."""
    by_name = {r.name: r for r in rows}
    return json.dumps(
        [
            dict(
                dataclasses.asdict(r),
                gib_s=r.gib_s,
                ratio=by_name[r.baseline].seconds / r.seconds if r.baseline in by_name else None,
            )
            for r in rows
        ],
        indent=2,
    )


# --------------------------------------------------------------------------- charts


@dataclasses.dataclass(frozen=True)
class Bar:
    """One bar of a chart: a label, its value, and a note printed beside it."""

    label: str
    value: float
    note: str = ""


#: Bar colours by the label's first word: the limit grey, ckptio blue, peers apart.
_COLOURS = {
    "raw": "#b8b8b8",
    "pinned": "#b8b8b8",
    "ckptio": "#1f5fbf",
    "torch": "#e8833a",
    "torch.save": "#e8833a",
    "torch.load": "#e8833a",
    "KvikIO": "#5b9e4d",
    "safetensors": "#9a5fb5",
    "dcp.load": "#e8833a",
}


def _colour(label: str) -> str:
    first = label.replace(",", " ").split()[0] if label.strip() else ""
    for key in (first, first.split(".")[0]):
        if key in _COLOURS:
            return _COLOURS[key]
    return "#8a8a8a"


def _value(v: float, unit: str) -> str:
    return f"{v:.1f} {unit}" if v >= 10 else f"{v:.2f} {unit}" if v >= 0.1 else f"{v:.2g} {unit}"


def plot_bars(
    path: str,
    title: str,
    panels: Sequence[tuple[str, list[Bar]] | tuple[str, list[Bar], str]],
    *,
    unit: str = "GiB/s",
    caption: str = "",
) -> None:
    """A horizontal bar chart, one panel per (title, bars[, unit]), each bar labelled
    with its value and note, saved as PNG at ``path``. Needs matplotlib (an optional
    dependency: ImportError naming it otherwise)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "charts need matplotlib, which ckptio does not install: pip install matplotlib"
        ) from e
    heights = [max(len(panel[1]), 1) for panel in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(9, 0.34 * sum(heights) + 0.75 * len(panels) + 0.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (name, bars, *rest) in zip(axes[:, 0], panels, strict=True):
        u = rest[0] if rest else unit
        top = max((b.value for b in bars), default=1.0) or 1.0
        ys = list(range(len(bars)))[::-1]
        ax.barh(ys, [b.value for b in bars], color=[_colour(b.label) for b in bars], height=0.7)
        ax.set_yticks(ys, [b.label for b in bars], fontsize=8.5)
        longest = 0
        for y, b in zip(ys, bars, strict=True):
            text = f" {_value(b.value, u)}" + (f"   {b.note}" if b.note else "")
            bold = "bold" if b.label.startswith("ckptio") else "normal"
            ax.text(b.value, y, text, va="center", fontsize=8, fontweight=bold)
            longest = max(longest, len(text))
        # Room on the right for the longest value and note (about 1.2% of the width a character).
        ax.set_xlim(0, top / max(1 - 0.0125 * longest, 0.3))
        ax.set_title(name, loc="left", fontsize=9.5, fontweight="bold")
        ax.tick_params(axis="x", labelsize=7.5)
        ax.set_xlabel(u, fontsize=7.5, loc="right")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=10.5)
    lines = textwrap.wrap(caption, 150)
    if lines:
        fig.text(0.01, 0.002, "\n".join(lines), fontsize=7, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, 0.022 * len(lines), 1, 1))
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def plot(rows: list[Row], path: str, title: str, caption: str = "") -> None:
    """The chart of a ``run``: saves and cold loads in GiB/s, each ckptio bar with its
    ratio to torch's and to the disk's raw limit measured in the same run."""
    by = {r.name: r for r in rows}

    def bars(names: list[str], peer: str) -> list[Bar]:
        out = []
        for name in names:
            r = by.get(name)
            if r is None:
                continue
            note = ""
            if name.startswith("ckptio") and peer in by:
                note = f"{by[peer].seconds / r.seconds:.2f}x {peer.split(' ')[0].rstrip(',')}"
                if r.baseline in by:
                    note += f", {by[r.baseline].seconds / r.seconds:.2f}x the raw limit"
            elif r.baseline in by and not name.startswith("raw"):
                note = f"{by[r.baseline].seconds / r.seconds:.2f}x the raw limit"
            out.append(Bar(name, r.gib_s, note))
        return out

    raw = [r.name for r in rows if r.name.startswith("raw")]
    saves = [n for n in raw if "write" in n] + ["torch.save + fsync", "ckptio.save (durable)"]
    loads = [n for n in raw if "read" in n] + ["torch.load, cold", "ckptio.load, cold"]
    plot_bars(
        path,
        title,
        [
            ("save (durable: fsync included)", bars(saves, "torch.save + fsync")),
            ("load (cold: page cache dropped)", bars(loads, "torch.load, cold")),
        ],
        caption=caption,
    )
