"""Plain ckptio.save and cold ckptio.load of CUDA tensors on the bounce pipeline
against cuFile, paired by round with the order alternated: whether ``auto``
should prefer the bounce pipeline where cuFile runs in compat mode (no
nvidia-fs, so cuFile bounces through host memory itself). The in-place bench
pairs its cold loads the same way (bench_inplace.py); this pairs the calls
most users make.

usage: python probes/probe_backend_pair.py [--size 8G] [--rounds 4] [--dir /tmp]

Run on the GPU machine with the udev entry (cuFile compat):
    PROBE="probes/probe_backend_pair.py --size 8G --rounds 4" scripts/gpu_check.sh probe
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import ckptio
import torch
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
from bench_gpu import timed  # noqa: E402  (settles the disk, times GPU work too)

GiB = 2**30
BACKENDS = ("bounce", "cufile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="8G")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ckptio-pair-", dir=args.dir)
    sd = bench.synthetic_state_dict(_size(args.size), "cuda", torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"# {nbytes / GiB:.2f} GiB bf16 in {len(sd)} CUDA tensors, {tmp}", flush=True)
    times: dict[str, list[float]] = {}
    paths: dict[str, str] = {}
    try:
        for b in BACKENDS:  # the engine's pinned pool and cuFile's driver, once each
            warm = os.path.join(tmp, f"warm_{b}.pt")
            ckptio.save(sd, warm, backend=b)
            ckptio.load(warm, map_location="cuda", backend=b)
            os.unlink(warm)
        for r in range(args.rounds):
            order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
            files = {b: os.path.join(tmp, f"r{r}_{b}.pt") for b in BACKENDS}
            for b in order:
                t = timed(lambda f=files[b], b=b: ckptio.save(sd, f, backend=b), tmp)
                rep = ckptio.last_report()
                paths[f"save {b}"] = f"{rep.device_path} gds_mode={rep.gds_mode}"
                times.setdefault(f"save {b}", []).append(t)
            for b in order:
                bench.drop_cache(files[b])
                out: dict[str, dict[str, torch.Tensor]] = {}
                t = timed(
                    lambda o=out, f=files[b], b=b: o.update(
                        x=ckptio.load(f, map_location="cuda", backend=b)
                    ),
                    tmp,
                )
                rep = ckptio.last_report()
                paths[f"load {b}"] = f"{rep.device_path} gds_mode={rep.gds_mode}"
                times.setdefault(f"load {b}", []).append(t)
                if r == 0:
                    assert all(torch.equal(out["x"][k], v) for k, v in sd.items()), b
                out.clear()
            for f in files.values():
                os.unlink(f)
            line = "  ".join(f"{k} {v[-1]:.3f}" for k, v in times.items())
            print(f"round {r + 1} ({'/'.join(order)} first): {line}", flush=True)
        print(f"{'what':<14} {'median s':>9} {'GiB/s':>7}  ran  (by round, s)")
        for k, v in times.items():
            m = statistics.median(v)
            by = " ".join(f"{x:.3f}" for x in v)
            print(f"{k:<14} {m:9.3f} {nbytes / GiB / m:7.2f}  {paths[k]}  ({by})")
        for op in ("save", "load"):
            b, c = times[f"{op} bounce"], times[f"{op} cufile"]
            paired = statistics.median(x / y for x, y in zip(b, c, strict=True))
            wins = sum(x < y for x, y in zip(b, c, strict=True))
            print(
                f"{op}: bounce time / cuFile time, median of rounds {paired:.3f} "
                f"(< 1: bounce faster; faster in {wins} of {len(b)} rounds)"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
