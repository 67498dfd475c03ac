"""The ``ckptio`` command: ``ls``, ``inspect``, ``verify``, ``convert``, ``bench``,
``clean``, ``info``.

``ls``, ``inspect`` and ``verify`` take any checkpoint ckptio reads (torch.save
files, safetensors files, sharded safetensors folders or indexes, DCP folders),
recognised from their content (``ckptio.formats.detect``). Every command prints its
output on stdout; an error is one line on stderr and a non-zero exit:

    0  done (verify: the checkpoint is sound)
    1  failed: the path is missing or unreadable, not a checkpoint ckptio reads,
       malformed, refused, or (verify) damaged
    2  the command line is wrong (argparse)

A reader that stops reading (``ckptio verify x | head``) changes none of these:
the command runs on, the rest of its output going nowhere.

Long operations (verify, convert, bench) draw a progress line on stderr when it
is a terminal; ``--quiet`` turns it off with the rest of the chatter, ``--json``
prints what a script reads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import json
import os
import re
import socket
import sys
from typing import Any

from ckptio.errors import FormatError
from ckptio.formats import detect
from ckptio.io import paths, remote
from ckptio.io.units import human_bytes, parse_size, size_text
from ckptio.tools import bench, clean, describe
from ckptio.tools.convert import convert
from ckptio.tools.integrity import verify
from ckptio.tools.progress import Progress, io_bytes
from ckptio.tools.sysinfo import format_info, info

# Exit codes (see the module doc).
OK, FAILED, USAGE = 0, 1, 2


def _size(text: str) -> int:
    """``--size`` / ``--chunk-size``: "1G" (2^30), "500MB" (10^6 each), "4096"."""
    try:
        return parse_size(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bench_size(text: str) -> int:
    """``bench --size``: at least 1 MiB and whole 4 KiB blocks (its raw rows
    read and write with O_DIRECT)."""
    n = _size(text)
    if n < 1 << 20 or n % 4096:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1M or more, in whole 4 KiB blocks")
    return n


def _rounds(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of rounds >= 1")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ckptio",
        description="Fast, crash-safe checkpoint I/O for PyTorch",
        epilog="exit status: 0 done, 1 failed (one line on stderr says why), 2 bad command line",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    what = (
        "PATH: a torch.save file, a safetensors file, a sharded safetensors folder or index, "
        "or a DCP checkpoint folder (recognised from the content)"
    )

    ls = sub.add_parser(
        "ls",
        help="list a checkpoint's records, tensors or items: offsets, sizes, dtypes, shapes",
        description="List a checkpoint: " + what + ".",
    )
    ls.add_argument("path")
    ls.add_argument("--json", action="store_true", help="print the listing as JSON")

    ins = sub.add_parser(
        "inspect",
        help="ls with alignment, CRC-32 state, a summary and the metadata (DCP: tensors, shards)",
        description="Inspect a checkpoint: " + what + ".",
    )
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="print the listing as JSON")

    ver = sub.add_parser(
        "verify",
        help="check every record against its CRC-32 (exit 1 and name the bad ones)",
        description="Verify a checkpoint: "
        + what
        + ". torch.save files and DCP items are checked record by record against their "
        "CRC-32s; safetensors has no checksum: its header, offsets and index are checked.",
    )
    ver.add_argument("path")
    ver.add_argument(
        "-q", "--quiet", action="store_true", help="print only problems (nothing when sound)"
    )
    ver.add_argument("--json", action="store_true", help="print the report as JSON")

    c = sub.add_parser(
        "convert",
        help="convert between torch.save files and safetensors",
        description="Convert a torch.save checkpoint (a flat dict of tensors) into a "
        "safetensors file, or back. The source format is read from the file; the "
        "destination's from --to, else DST's extension (.safetensors, or .pt/.pth/.bin/"
        ".ckpt), else the other format.",
    )
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--to", choices=["safetensors", "torch"], default=None)
    c.add_argument(
        "--duplicate-shared",
        action="store_true",
        help="write tensors that share memory (tied weights, views) as separate copies "
        "instead of refusing them (safetensors) or keeping them shared (torch.save)",
    )
    c.add_argument(
        "--flatten",
        action="store_true",
        help="store the tensors of nested dicts under dotted names ({'model': {'w': t}} -> "
        "'model.w') instead of refusing them",
    )
    c.add_argument(
        "-f",
        "--force",
        action="store_true",
        help="replace DST if it exists (never SRC itself, nor a file through a symbolic link)",
    )
    c.add_argument("-q", "--quiet", action="store_true", help="print only errors")

    b = sub.add_parser("bench", help="save/load side by side with torch.save/torch.load")
    b.add_argument(
        "--size", type=_bench_size, default=2**30, help="state dict size (default 1G; >= 1M)"
    )
    b.add_argument("--dir", default=None, help="folder for the files (default: system temp)")
    b.add_argument("--device", default="cpu", help="where the state dict lives (cpu, cuda)")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--chunk-size", type=_size, default=None)
    b.add_argument("--repeat", type=_rounds, default=3, help="rounds; each row keeps its median")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    b.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="also draw the rows as a bar chart of GiB/s and ratios (needs matplotlib)",
    )
    b.add_argument("-q", "--quiet", action="store_true", help="print only the table")

    cl = sub.add_parser(
        "clean",
        help="remove what dead saves (killed, crashed or failed) left in a folder",
        description="Remove the temp files (.NAME.ckptio-PID-NONCE.tmp) that saves killed or "
        "crashed left in FOLDER, only those no live save holds (each save holds a lock on its "
        "temp file, in any PID namespace or container), and, while no save runs there, the "
        "data files of DCP or sharded safetensors checkpoints that no .metadata or index names "
        "and that a dead ckptio save left: ckptio's own names (with its token), or the "
        "generation a commit of ckptio replaced. Other writers' shards and .distcp files "
        "stay (a save_pretrained or torch's DCP writer before its index, a download).",
    )
    cl.add_argument("folder", help="a folder, or s3://bucket/prefix: abort its dangling uploads")
    cl.add_argument(
        "--older-than",
        type=float,
        default=86400.0,
        help="s3://: abort uploads begun more than this many seconds ago (>= 0; default 1 day)",
    )
    cl.add_argument(
        "--unreferenced",
        action="store_true",
        help="also remove the model*.safetensors shards and __*.distcp files that no index or "
        ".metadata names, whoever wrote them (none while a ckptio save runs there; another "
        "writer's save in progress would lose them)",
    )
    cl.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    cl.add_argument("--json", action="store_true", help="print the removed files as JSON")

    inf = sub.add_parser("info", help="CUDA, cuFile, and what a folder supports (O_DIRECT, cuFile)")
    inf.add_argument("folder", nargs="?", default=".", help="folder to probe (default: .)")
    inf.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    for name in ("path", "src", "dst", "folder"):  # file:// URLs: the local paths they name
        if isinstance(getattr(a, name, None), str):
            setattr(a, name, paths.local(getattr(a, name)))
    stdout = sys.stdout
    if stdout is not None:
        sys.stdout = _PipeSafe(stdout)  # type: ignore[assignment]
    try:
        with contextlib.ExitStack() as stack:
            _local_copies(a, stack)
            return int(_COMMANDS[a.cmd](a))
    except KeyboardInterrupt:
        print(f"ckptio {a.cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # bad input of any kind: one line, no traceback
        print(f"ckptio {a.cmd}: {_one_line(e)}", file=sys.stderr)
        return FAILED
    finally:
        sys.stdout = stdout


class _PipeSafe:
    """stdout, whose reader may stop reading (``ckptio verify x | head``): from the
    first write that finds the pipe closed on, the rest of the output goes nowhere
    and the command runs on, so its outcome, not the reader, decides the exit
    status (a damaged checkpoint exits 1 however little of the report was read)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._broken = False

    def write(self, text: str) -> int:
        if not self._broken:
            try:
                return int(self._stream.write(text))
            except BrokenPipeError:
                self._broke()
        return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._broke()

    def _broke(self) -> None:
        self._broken = True
        _silence_stdout(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _local_copies(a: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    """Object URLs (``s3://...``, configured by the AWS_* variables) among the
    arguments: what is read becomes a scratch copy, what is written a scratch
    file uploaded once the command succeeds."""
    if a.cmd == "clean" and remote.is_url(a.folder):
        return  # clean acts on the store itself
    if a.cmd in ("ls", "inspect", "verify"):
        return  # they read a torch.save object straight, anything else from a scratch copy
    if a.cmd == "convert":
        # Objects read straight from the store, written straight to it; a folder
        # (no format convert takes) refused from its names, nothing downloaded.
        return
    for name in ("path", "src"):
        value = getattr(a, name, None)
        if value is not None and remote.is_url(value):
            setattr(a, name, stack.enter_context(remote.local_tree(value)))
    dst = getattr(a, "dst", None)
    if dst is not None and remote.is_url(dst):
        a.dst = stack.enter_context(remote.staged_save(dst))


def _object_size(url: str) -> int:
    """The size of the object at ``url``; 0 for a folder (or nothing: verify
    then says which)."""
    try:
        return int(remote.head(url)["size"])
    except FileNotFoundError:
        return 0


def _one_line(e: BaseException) -> str:
    """The error's whole message on one line (torch's refusals span several, the
    file named on the last), its colours left out and any other control
    character (of a name in it) written as an escape."""
    text = " ".join(s.strip() for s in _ANSI.sub("", str(e)).splitlines() if s.strip())
    text = describe.printable(text)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _silence_stdout(stream: Any) -> None:
    """Point the file descriptor under ``stream`` at /dev/null: what its buffer
    still holds, flushed at exit, goes there instead of failing again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------- commands


def _cmd_ls(a: argparse.Namespace, crc: bool = False) -> int:
    lst = describe.listing(a.path)  # everything found before anything is printed
    if a.json:
        _print_json(lst.to_json())
    else:
        print("\n".join(describe.lines(lst, crc=crc)))
    return OK


def _cmd_inspect(a: argparse.Namespace) -> int:
    return _cmd_ls(a, crc=True)


def _cmd_verify(a: argparse.Namespace) -> int:
    if remote.is_url(a.path):
        total = _object_size(a.path)
    else:
        try:  # only the progress line's total: what is wrong is verify's to report
            total = describe.checkpoint_bytes(detect.detect(a.path))
        except Exception:
            total = 0  # (a missing path: verify raises its error alone)
    with Progress(
        f"verifying {describe.printable(a.path)}", total, enabled=False if a.quiet else None
    ) as p:
        rep = verify(a.path, progress=p.add)
    if a.json:
        d = dataclasses.asdict(rep)
        d.update(ok=rep.ok, summary=rep.summary())
        _print_json(d)
        return OK if rep.ok else FAILED
    if not a.quiet:
        for r in rep.records:
            extra = (
                f" (stored {r.stored_crc32:08x}, bytes give {r.actual_crc32:08x})"
                if r.state == "mismatch"
                and r.stored_crc32 is not None
                and r.actual_crc32 is not None
                else ""
            )
            print(f"{r.state:>9}  {describe.printable(r.name)}{extra}")
    if rep.ok:
        if not a.quiet:
            print(rep.summary())
        return OK
    print(f"ckptio verify: {rep.summary()}", file=sys.stderr)  # names the bad records
    return FAILED


def _cmd_convert(a: argparse.Namespace) -> int:
    stored = remote.is_url(a.src)
    src = detect.detect_url(a.src) if stored else detect.detect(a.src)
    if src.format not in (detect.TORCH, detect.SAFETENSORS):
        raise FormatError(
            f"{a.src} is a {src.format} checkpoint; convert takes a torch.save file or a "
            "safetensors file"
        )
    # Read once, written once.
    total = 2 * (_object_size(a.src) if stored else describe.checkpoint_bytes(src))
    with Progress(
        f"converting {describe.printable(a.src)}", total, enabled=False if a.quiet else None
    ) as p:
        start = io_bytes()
        p.follow(lambda: io_bytes() - start)
        log = (lambda line: None) if a.quiet else p.print
        convert(
            a.src,
            a.dst,
            to=a.to,
            duplicate_shared=a.duplicate_shared,
            flatten=a.flatten,
            log=log,
            source=src,
            overwrite=a.force,
        )
    return OK


def _cmd_bench(a: argparse.Namespace) -> int:
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError(
                "--plot needs matplotlib, which ckptio does not install: pip install matplotlib"
            ) from None
    # Each round moves the state dict 7 times: the raw write and two raw reads,
    # torch.save, ckptio.save, torch.load, ckptio.load.
    total = 7 * a.size * a.repeat
    with Progress("bench", total, enabled=False if a.quiet else None) as p:
        start = io_bytes()
        p.follow(lambda: io_bytes() - start)
        rows = bench.run(
            a.size,
            a.dir,
            a.threads,
            a.chunk_size,
            a.device,
            a.repeat,
            log=(lambda line: None) if a.quiet else p.print,
            step=p.label,
        )
    print(bench.table(rows))
    if a.json:
        with open(a.json, "w") as f:
            f.write(bench.to_json(rows))
    if a.plot:
        when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        size = size_text(a.size)
        rounds = f"median of {a.repeat} rounds" if a.repeat > 1 else "1 round"
        bench.plot(
            rows,
            a.plot,
            f"ckptio bench: {human_bytes(a.size)} state dict on {a.device}, {rounds}",
            caption=f"{socket.gethostname()}, {when}; ckptio bench --size {size} "
            f"--device {a.device} --repeat {a.repeat}; ratios against rows of the same run",
        )
    return OK


def _cmd_clean(a: argparse.Namespace) -> int:
    if remote.is_url(a.folder):
        removed = clean.abort_uploads(a.folder, a.older_than)
        if a.json:
            _print_json({"url": a.folder, "aborted": removed})
        elif not a.quiet:
            for name in removed:
                print(describe.printable(name))
            print(f"{describe.printable(a.folder)}: {len(removed)} dangling uploads aborted")
        return OK
    removed = clean.clean(a.folder, unreferenced=a.unreferenced)
    if a.json:
        _print_json({"folder": a.folder, "removed": list(removed)})
    elif not a.quiet:
        # A name that is no UTF-8 (or holds a newline) is printed escaped: the
        # files are gone by now, and the report of what went must not fail.
        for name in removed:
            print(describe.printable(name))
        print(f"{describe.printable(a.folder)}: {len(removed)} files of dead saves removed")
    return OK


def _cmd_info(a: argparse.Namespace) -> int:
    if not os.path.isdir(a.folder):  # nothing there to probe: the command failed
        if os.path.exists(a.folder):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder: info probes a folder", a.folder)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), a.folder)
    d = info(a.folder)
    print(json.dumps(d, indent=2, default=str) if a.json else format_info(d))
    return OK


_COMMANDS = {
    "ls": _cmd_ls,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "convert": _cmd_convert,
    "bench": _cmd_bench,
    "clean": _cmd_clean,
    "info": _cmd_info,
}


if __name__ == "__main__":
    sys.exit(main())
