"""Where a DCP load from an object store spends its time, beside ``ckptio.load`` of
the same tensors from the same store: per round, each load's wall time, and for the
DCP load each batch's GETs (``transfer.read_from_store`` timed on its kept thread)
and the time outside them; then the same DCP load in one batch (``batch_ranges``
made to give one), which shows what reading while planning buys or costs.
A SeaweedFS on the loopback (tests/s3server.py: ``CKPTIO_WEED`` or ``weed`` on PATH).

    python probes/probe_store_dcp.py --size 1G --device cuda --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("benches", "tests")]

import benchlib  # noqa: E402
import ckptio  # noqa: E402
import s3server  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as tdcp  # noqa: E402
from ckptio import dcp as ckdcp  # noqa: E402
from ckptio.io import transfer  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def run(a: argparse.Namespace, srv: s3server.S3Server) -> None:
    opts = srv.options
    sd = benchlib.llm_state_dict(parse_size(a.size), a.device)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    pt, folder = srv.url("sd.pt"), srv.url("sd-dcp")
    ckptio.save(sd, pt, storage_options=opts)
    tdcp.save(sd, storage_writer=ckdcp.FileSystemWriter(folder, storage_options=opts), no_dist=True)
    print(f"# {len(sd)} tensors, {nbytes / 2**30:.3f} GiB on {a.device}", flush=True)

    calls: list[tuple[float, float, int]] = []  # (start, end, bytes) of each GET batch
    plain = transfer.read_from_store

    def timed(url, segments, *rest, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return plain(url, segments, *rest, **kw)
        finally:
            calls.append((t, time.perf_counter(), sum(s[2] for s in segments)))

    transfer.read_from_store = timed  # start_store_read calls it by its module name

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    def dcp_load() -> None:
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        sync()
        reader = ckdcp.FileSystemReader(folder, storage_options=opts)
        tdcp.load(out, storage_reader=reader, no_dist=True)

    batches = transfer.batch_ranges
    for r in range(a.rounds):
        sync()
        t = time.perf_counter()
        ckptio.load(pt, map_location=a.device, storage_options=opts)
        sync()
        print(f"round {r}: ckptio.load {nbytes / 2**30 / (time.perf_counter() - t):.3f} GiB/s")
        for label, first in (("batches", transfer.FIRST_BATCH), ("one batch", 1 << 30)):
            transfer.batch_ranges = lambda n, first=first: batches(n, first)
            calls.clear()
            t0 = time.perf_counter()
            dcp_load()
            sync()
            wall = time.perf_counter() - t0
            gets = sum(e - s for s, e, _ in calls)
            shown = ", ".join(f"{n / 2**20:.0f} MiB {e - s:.3f} s" for s, e, n in calls)
            print(
                f"round {r}: dcp.load ({label}) {nbytes / 2**30 / wall:.3f} GiB/s, {wall:.3f} s:"
                f" GETs {gets:.3f} s in {len(calls)} calls [{shown}], outside {wall - gets:.3f} s"
            )
        transfer.batch_ranges = batches
        sys.stdout.flush()


if __name__ == "__main__":
    benchlib.store_probe(__doc__, 3, run)
