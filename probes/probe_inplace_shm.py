"""Loads from /dev/shm to CUDA, new tensors against in place, with what each
report says (read path, device path, threads): where the in-place load from
memory loses against ckptio.load (bench_inplace: 0.39x the pinned copy).

Usage: python probes/probe_inplace_shm.py [--size 8G] [--tensors 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import ckptio
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402

GiB = 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=float, default=8.0, help="GiB")
    p.add_argument("--tensors", type=int, default=512)
    a = p.parse_args()
    # The model's tensors each their own cudaMalloc (as a model built layer by
    # layer), and the same tensors carved from one segment (as ckptio.load's).
    path, model, nbytes = benchlib.shm_checkpoint(a.size, a.tensors, "cuda")
    n = nbytes // a.tensors // 2
    seg = torch.empty(a.tensors * n, dtype=torch.bfloat16, device="cuda")
    carved = torch.nn.Module()
    for i, t in enumerate(seg.split(n)):
        carved.register_buffer(f"w{i}", t)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    parts = host.split(2 * n)

    def into_model() -> None:
        for src, t in zip(parts, model.buffers(), strict=True):
            t.view(torch.uint8).copy_(src, non_blocking=True)

    cases = {
        "pinned H2D copy": lambda: dev.copy_(host, non_blocking=True),
        "pinned H2D into model": into_model,
        "ckptio.load out= carved": lambda: ckptio.load(path, out=carved.state_dict()),
        "ckptio.load cuda": lambda: ckptio.load(path, map_location="cuda"),
        "ckptio.load out=": lambda: ckptio.load(path, out=model.state_dict()),
        "ckptio.load_state_dict": lambda: ckptio.load_state_dict(model, path),
        "ckptio.lsd bounce": lambda: ckptio.load_state_dict(model, path, backend="bounce"),
    }
    for rnd in range(3):
        for name, fn in cases.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            del out
            r = ckptio.last_report() if name.startswith("ckptio") else None
            how = (
                f"read_path={r.read_path} src={r.read_source} dev={r.device_path} "
                f"pinned={r.pinned_bytes >> 20}MiB"
                if r
                else ""
            )
            print(f"{rnd} {name:<24} {s:7.3f} s {nbytes / GiB / s:6.2f} GiB/s {how}", flush=True)
    shutil.rmtree(os.path.dirname(path))


if __name__ == "__main__":
    main()
