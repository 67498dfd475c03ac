"""Where the time of async_save + ckptio's stage() goes, for N CUDA tensors
(the part of "async_save returns in < 5 ms" that is ours, and torch's part).

    python probes/profile_stage.py --tensors 512
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from ckptio import staging
from ckptio.dcp import FileSystemWriter


class _Instant:
    """A stager that stages nothing: async_save's own cost."""

    should_synchronize_after_execute = False

    def stage(self, sd: Any, **_: Any) -> Future[Any]:
        f: Future[Any] = Future()
        f.set_result(sd)
        return f

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.2f} ms, min {min(xs) * 1e3:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    sd = {"model": {f"l{i}.w": torch.randn(64, 64, device=a.device) for i in range(a.tensors)}}
    for snapshot in (False, True):
        if snapshot and a.device == "cpu":
            continue
        st = staging.DefaultStager(staging.StagingOptions(device_snapshot=snapshot))
        st.stage(sd).result()
        walk, stage = [], []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            st._walk(sd, staging._Plan(), {})
            walk.append(time.perf_counter() - t0)
        for _ in range(a.reps):
            t0 = time.perf_counter()
            f = st.stage(sd)
            stage.append(time.perf_counter() - t0)
            f.result()
        print(f"snapshot={snapshot}: walk {ms(walk)}; stage() {ms(stage)}", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.reps):
            st.stage(sd).result()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(8)
        st.close()
    d = tempfile.mkdtemp()
    ret = []
    for i in range(a.reps):
        w = FileSystemWriter(os.path.join(d, f"c{i}"))
        t0 = time.perf_counter()
        r = dcp.async_save(sd, storage_writer=w, async_stager=_Instant(), no_dist=True)
        ret.append(time.perf_counter() - t0)
        r.upload_completion.result()
    print(f"async_save with a stager that does nothing: {ms(ret)}", flush=True)


if __name__ == "__main__":
    main()
