"""DCP saves with torch's ZStandard stream transform: ckptio.dcp.FileSystemWriter (one zstd
frame per item, compressed in Rust on the engine's threads) against torch's own
FileSystemWriter (python-zstandard, one item at a time), same state dict, same run.

    python benches/bench_dcp_zstd.py [--size 256M] [--dir /tmp] [--repeat 3] [--threads N]

Prints seconds, GiB/s of state dict per second, compressed size, and the ratio to torch.
The state dict is bf16 weights drawn from a normal distribution (they compress to ~80%)
plus a zero tensor of a quarter of the size (compresses to nothing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter
from ckptio.io.units import parse_size
from torch.distributed.checkpoint._extension import ZStandard


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="256M")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if not ZStandard.is_available():
        raise SystemExit("torch's ZStandard needs the zstandard (or pyzstd) package")
    n = parse_size(a.size)
    g = torch.Generator().manual_seed(0)
    per = n // 2 // 8
    sd = {f"w{i}": torch.randn(per, generator=g).bfloat16() for i in range(6)}
    sd["zeros"] = torch.zeros(n // 4, dtype=torch.uint8)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    writers = {
        "torch FileSystemWriter + ZStandard": lambda p: dcp.FileSystemWriter(
            p, _extensions=[ZStandard()]
        ),
        "ckptio FileSystemWriter + ZStandard": lambda p: FileSystemWriter(
            p, _extensions=[ZStandard()], threads=a.threads
        ),
    }
    best: dict[str, float] = {}
    size: dict[str, int] = {}
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for _ in range(a.repeat):
            for name, make in writers.items():
                p = os.path.join(tmp, name.split()[0])
                shutil.rmtree(p, ignore_errors=True)
                t0 = time.perf_counter()
                dcp.save(sd, storage_writer=make(p), no_dist=True)
                dt = time.perf_counter() - t0
                best[name] = min(best.get(name, dt), dt)
                size[name] = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=FileSystemReader(os.path.join(tmp, "torch")), no_dist=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(
            out, storage_reader=dcp.FileSystemReader(os.path.join(tmp, "ckptio")), no_dist=True
        )
        assert all(torch.equal(out[k], sd[k]) for k in sd)
    base = best["torch FileSystemWriter + ZStandard"]
    print(f"# {nbytes / 2**20:.0f} MiB state dict, best of {a.repeat}, cores {os.cpu_count()}")
    for name, dt in best.items():
        print(
            f"{name:40s} {dt:7.3f} s {nbytes / 2**30 / dt:6.2f} GiB/s "
            f"{size[name] / nbytes:6.1%} of the bytes  x{base / dt:.2f} vs torch"
        )


if __name__ == "__main__":
    main()
