"""Sweep ckptio's knobs (threads, chunk size, preallocation) for GPU state dicts.

Each configuration runs in a fresh process (the knobs are read from the
environment), saving a bf16 GPU state dict twice (the second save is timed:
pinned pool warm) and loading it cold once. Prints one line per configuration.
Usage: python benches/bench_tune_gpu.py [--size 4G] [--dir /tmp]
       [--configs "8,16M,1 8,64M,0 ..."]
"""

import argparse
import os
import subprocess
import sys

CHILD = r"""
import os, sys, time, torch, ckptio
from ckptio.tools import bench
size, folder = int(sys.argv[1]), sys.argv[2]
sd = bench.synthetic_state_dict(size, "cuda", torch.bfloat16)
n = sum(t.numel() * 2 for t in sd.values())
p = os.path.join(folder, "tune.pt")
ckptio.save(sd, p)
torch.cuda.synchronize(); t0 = time.perf_counter(); ckptio.save(sd, p)
ws = time.perf_counter() - t0
bench.drop_cache(p)
torch.cuda.synchronize(); t0 = time.perf_counter(); out = ckptio.load(p, map_location="cuda")
torch.cuda.synchronize(); rs = time.perf_counter() - t0
r = ckptio.last_report()
os.unlink(p)
print(f"save {n / 2**30 / ws:6.2f} GiB/s  load {n / 2**30 / rs:6.2f} GiB/s  ran={r.device_path}")
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default=str(4 << 30))
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--configs", default="8,16M,1 8,16M,0 8,64M,1 8,64M,0 4,64M,0 16,16M,0 16,8M,1")
    a = ap.parse_args()
    for cfg in a.configs.split():
        threads, chunk, prealloc = cfg.split(",")
        env = dict(
            os.environ, CKPTIO_THREADS=threads, CKPTIO_CHUNK_SIZE=chunk, CKPTIO_PREALLOCATE=prealloc
        )
        p = subprocess.run(
            [sys.executable, "-c", CHILD, a.size, a.dir], env=env, capture_output=True, text=True
        )
        out = p.stdout.strip() or p.stderr.strip().splitlines()[-1]
        print(
            f"{a.dir:<9} threads={threads:<3} chunk={chunk:<4} prealloc={prealloc}  {out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
