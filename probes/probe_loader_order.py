"""Whether one loader's time depends on the loader that ran before it in the
same process (issue 37): the LLM shape in /dev/shm loaded to the GPU by
``ckptio.safetensors.load_file`` (st) and ``ckptio.load`` (pt) in a fixed
sequence, each load's time with the CUDA caching allocator's counters over it
(cudaMalloc calls, frees of cached blocks, retries after a failed allocation)
and the full collections of Python's collector during it.

    python probes/probe_loader_order.py [--size 4G] [--seq st,st,st,pt,st,pt,st,st]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "benches")]

import benchlib  # noqa: E402
import ckptio  # noqa: E402
import ckptio.safetensors as cst  # noqa: E402
import torch  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402

COUNTERS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4G")
    ap.add_argument("--seq", default="st,st,st,pt,st,pt,st,st,pt,pt")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    dev = "cuda"
    folder = tempfile.mkdtemp(dir=a.dir)
    full: list[float] = []
    began = [0.0]

    def collected(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                full.append(time.perf_counter() - began[0])

    try:
        sd = benchlib.llm_state_dict(parse_size(a.size), dev)
        nbytes = sum(t.nbytes for t in sd.values())
        pt, st = os.path.join(folder, "m.pt"), os.path.join(folder, "m.safetensors")
        ckptio.save(sd, pt)
        cst.save_file(sd, st)
        del sd
        torch.cuda.synchronize()
        print(f"# {nbytes / 2**30:.2f} GiB, torch {torch.__version__}", flush=True)
        loads = {
            "st": lambda: cst.load_file(st, device=dev),
            "pt": lambda: ckptio.load(pt, map_location=dev),
        }
        gc.callbacks.append(collected)
        for i, which in enumerate(a.seq.split(",")):
            before = torch.cuda.memory_stats()
            full.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = loads[which]()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            after = torch.cuda.memory_stats()
            counts = " ".join(
                f"{k.split('.')[-1]}={after.get(k, 0) - before.get(k, 0)}" for k in COUNTERS
            )
            gcs = f" full gc {sum(full) * 1e3:.0f} ms" if full else ""
            rate = nbytes / dt / 2**30
            print(
                f"{i:2d} {which}  {dt * 1e3:7.1f} ms  {rate:5.1f} GiB/s  {counts}{gcs}", flush=True
            )
            del got
        gc.callbacks.remove(collected)
        print(f"# reserved at the end: {torch.cuda.memory_reserved() / 2**30:.2f} GiB", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
