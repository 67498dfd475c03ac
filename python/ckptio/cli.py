"""The ``ckptio`` command: ``bench``, ``ls``, ``inspect``, ``verify``, ``clean``, ``info``,
``convert``."""

from __future__ import annotations

import argparse
import sys


def _size(s: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    s = s.strip().lower().removesuffix("ib").removesuffix("b")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ckptio", description="Fast, crash-safe checkpoint I/O for PyTorch"
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bench", help="save/load side by side with torch.save/torch.load")
    b.add_argument("--size", type=_size, default=2**30, help="state dict size (default 1G)")
    b.add_argument("--dir", default=None, help="folder for the files (default: system temp)")
    b.add_argument("--device", default="cpu", help="where the state dict lives (cpu, cuda)")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--chunk-size", type=_size, default=None)
    b.add_argument("--repeat", type=int, default=3, help="rounds; each row keeps its median")
    b.add_argument("--json", default=None, help="also write the rows to this JSON file")

    ls = sub.add_parser("ls", help="list a checkpoint's records: offsets, sizes, dtypes, shapes")
    ls.add_argument("path")

    ins = sub.add_parser(
        "inspect", help="records: offsets, alignment, sizes, CRC-32 state, dtypes, shapes"
    )
    ins.add_argument("path")

    ver = sub.add_parser(
        "verify",
        help="check every record against its CRC-32 (exit 1 and name the bad ones); a file, "
        "or a DCP checkpoint folder",
    )
    ver.add_argument("path")
    ver.add_argument("-q", "--quiet", action="store_true", help="print only problems")

    cl = sub.add_parser(
        "clean",
        help="remove the temp files of dead saves (killed or crashed) from a folder",
        description="Remove the temp files (.NAME.ckptio-PID-NONCE.tmp) that saves killed or "
        "crashed left in FOLDER. Only files of that pattern, and only those no live save holds "
        "(each save holds a lock on its temp file, in any PID namespace or container).",
    )
    cl.add_argument("folder")

    inf = sub.add_parser("info", help="CUDA, cuFile, and what a folder supports (O_DIRECT, cuFile)")
    inf.add_argument("folder", nargs="?", default=".", help="folder to probe (default: .)")
    inf.add_argument("--json", action="store_true")

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
        "instead of refusing them",
    )
    c.add_argument(
        "--flatten",
        action="store_true",
        help="store the tensors of nested dicts under dotted names ({'model': {'w': t}} -> "
        "'model.w') instead of refusing them",
    )

    a = p.parse_args(argv)
    if a.cmd == "convert":
        import pickle

        from ckptio import FormatError
        from ckptio.convert import ConversionError, convert

        try:
            convert(a.src, a.dst, to=a.to, duplicate_shared=a.duplicate_shared, flatten=a.flatten)
        except (ConversionError, FormatError, OSError, pickle.UnpicklingError) as e:
            print(f"ckptio convert: error: {e}", file=sys.stderr)
            return 2
        return 0
    if a.cmd == "info":
        import json

        from ckptio.sysinfo import format_info, info

        d = info(a.folder)
        print(json.dumps(d, indent=2, default=str) if a.json else format_info(d))
        return 0
    if a.cmd == "bench":
        from ckptio import bench

        rows = bench.run(a.size, a.dir, a.threads, a.chunk_size, a.device, a.repeat)
        print(bench.table(rows))
        if a.json:
            with open(a.json, "w") as f:
                f.write(bench.to_json(rows))
        return 0
    if a.cmd in ("inspect", "verify", "ls", "clean"):
        try:
            return _file_command(a)
        except Exception as e:  # bad input of any kind: one line, no traceback
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"ckptio {a.cmd}: {type(e).__name__}: {first}", file=sys.stderr)
            return 1
    return 2


def _file_command(a: argparse.Namespace) -> int:
    if a.cmd == "clean":
        from ckptio import _native

        removed = _native.clean_temps(a.folder)
        for name in removed:
            print(name)
        print(f"{a.folder}: {len(removed)} temp files of dead saves removed")
        return 0
    if a.cmd == "inspect":
        from ckptio.integrity import inspect_lines

        print("\n".join(inspect_lines(a.path)))
        return 0
    if a.cmd == "verify":
        from ckptio.integrity import verify

        rep = verify(a.path)
        if not a.quiet:
            for r in rep.records:
                extra = (
                    f" (stored {r.stored_crc32:08x}, bytes give {r.actual_crc32:08x})"
                    if r.state == "mismatch"
                    and r.stored_crc32 is not None
                    and r.actual_crc32 is not None
                    else ""
                )
                print(f"{r.state:>9}  {r.name}{extra}")
        print(rep.summary(), file=sys.stdout if rep.ok else sys.stderr)
        return 0 if rep.ok else 1
    if a.cmd == "ls":
        import ckptio

        print(f"{'offset':>12} {'bytes':>12} {'align':>5}  record / tensors")
        for r in ckptio.records(a.path):
            print(f"{r.offset:>12} {r.nbytes:>12} {r.alignment:>5}  {r.name}")
            for t in r.tensors:
                shape = "x".join(map(str, t.shape)) or "scalar"
                print(
                    f"{'':>33}  - {t.name}: {str(t.dtype).removeprefix('torch.')} [{shape}]"
                    + (f" at element {t.storage_offset}" if t.storage_offset else "")
                )
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
