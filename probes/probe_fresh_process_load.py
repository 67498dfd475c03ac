"""A cold load as a resume makes it: each load in a new process (no memory an
earlier load freed to reuse), from a file whose pages were dropped, torch.load
against ckptio.load and variants, in alternating order round by round. The
time is the load's own, measured inside the process (not its start-up).

usage: PYTHONPATH=python python probes/probe_fresh_process_load.py [--size 1]
       [--rounds 3] [--dir DIR] [--variants default,buffered,t2]

variants: default (ckptio.load as a user calls it), buffered (direct=False),
tN (threads=N), bNxM (N threads, M MiB chunks, buffered), dNxM (the same, O_DIRECT),
recordsN (not ckptio.load: the data records read as torch.load reads them, one
buffered read each, on N threads, into ckptio's host memory; no tensors made).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, torch, ckptio
from ckptio.tools.bench import drop_cache
kind, path = sys.argv[1], sys.argv[2]
kw = {}
if kind in ("torch.load", "default") or kind.startswith("records"):
    pass
elif kind == "buffered":
    kw = dict(direct=False)
elif kind[0] == "t":
    kw = dict(threads=int(kind[1:]))
elif kind[0] in "bd":
    n, mib = kind[1:].split("x")
    kw = dict(threads=int(n), chunk_size=int(mib) << 20, direct=kind[0] == "d")
drop_cache(path)
t0 = time.perf_counter()
if kind.startswith("records"):  # torch's pattern: one buffered read per record
    import ctypes
    import os
    from concurrent.futures import ThreadPoolExecutor
    from ckptio import _native
from ckptio.io import memory as _hostmem
    reader = _native.Reader(path, "off", None)
    data = [(o, n) for name, o, n in reader.records() if "/data/" in name]
    fd = os.open(path, os.O_RDONLY)
    def one(rec):
        o, n = rec
        st = _hostmem.host_storage(n, o % 4096)
        mv = memoryview((ctypes.c_ubyte * n).from_address(st.data_ptr())).cast("B")
        while len(mv):
            k = os.preadv(fd, [mv], o)
            mv, o = mv[k:], o + k
        return st
    with ThreadPoolExecutor(int(kind[len("records"):] or 1)) as pool:
        x = list(pool.map(one, data))
elif kind == "torch.load":
    x = torch.load(path, weights_only=True)
else:
    x = ckptio.load(path, **kw)
print(time.perf_counter() - t0)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=1.0, help="GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="a folder on the disk (default: a temp folder)")
    p.add_argument("--variants", default="default,buffered,t2")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="ckptio-fresh-", dir=args.dir)
    env = dict(os.environ)
    try:
        files = {"torch": os.path.join(tmp, "torch.pt"), "ckptio": os.path.join(tmp, "ckptio.pt")}
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys, torch, ckptio\n"
                "from ckptio.tools.bench import synthetic_state_dict\n"
                "sd = synthetic_state_dict(int(float(sys.argv[1]) * (1 << 30)))\n"
                "torch.save(sd, sys.argv[2]); ckptio.save(sd, sys.argv[3])\n",
                str(args.size),
                files["torch"],
                files["ckptio"],
            ],
            env=env,
            check=True,
        )
        kinds = ["torch.load", *args.variants.split(",")]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        print(f"# {args.size:g} GiB (bench.synthetic_state_dict), files in {tmp}")
        for rnd in range(args.rounds):
            for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                path = files["torch" if kind == "torch.load" else "ckptio"]
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, kind, path],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                times[kind].append(float(out.stdout.split()[-1]))
            print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()))
        base = statistics.median(times["torch.load"])
        for k, v in times.items():
            m = statistics.median(v)
            gib = args.size / m
            print(f"{k:>12}: median {m:.3f} s, {gib:.2f} GiB/s, {base / m:.2f}x torch.load")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
