"""Saves of the same tensors to an object store in one process, by format: per
round, the wall time of ``ckptio.save`` (torch.save's zip, CRC-32s in data
descriptors), ``ckptio.safetensors.save_file`` (no CRC-32s) and a raw upload of
a file of the same size, and for the two saves the time inside the native upload
(``transfer.upload_archive`` / ``upload_image``) against the time before it
(pickling, planning). Rounds alternate the order. A SeaweedFS on the loopback
(tests/s3server.py: ``CKPTIO_WEED`` or ``weed`` on PATH).

    python probes/probe_store_save.py --size 1G --device cuda --rounds 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", d) for d in ("benches", "tests")]

import benchlib  # noqa: E402
import ckptio  # noqa: E402
import s3server  # noqa: E402
import torch  # noqa: E402
from ckptio.io import remote, transfer  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def run(a: argparse.Namespace, srv: s3server.S3Server) -> None:
    opts = srv.options
    sd = benchlib.llm_state_dict(parse_size(a.size), a.device)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    raw = os.path.join(tempfile.mkdtemp(dir="/dev/shm"), "raw.bin")
    with open(raw, "wb") as f:
        f.write(os.urandom(1 << 20) * (nbytes >> 20))
    print(f"# {len(sd)} tensors, {nbytes / 2**30:.3f} GiB on {a.device}", flush=True)

    inside: list[float] = []

    def timed(fn: Callable) -> Callable:  # type: ignore[type-arg]
        def wrapper(*args, **kw):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                inside.append(time.perf_counter() - t)

        return wrapper

    # Both save paths call these by their module name.
    transfer.upload_archive = timed(transfer.upload_archive)
    transfer.upload_image = timed(transfer.upload_image)
    rows: list[tuple[str, Callable[[], object]]] = [
        ("ckptio.save", lambda: ckptio.save(sd, srv.url("sd.pt"), storage_options=opts)),
        (
            "safetensors.save_file",
            lambda: ckptio.safetensors.save_file(sd, srv.url("sd.st"), storage_options=opts),
        ),
        ("raw upload", lambda: remote.upload(raw, srv.url("raw.bin"), opts)),
    ]
    try:
        for r in range(a.rounds):
            for label, fn in rows if r % 2 == 0 else rows[::-1]:
                if a.device == "cuda":
                    torch.cuda.synchronize()
                inside.clear()
                t = time.perf_counter()
                fn()
                wall = time.perf_counter() - t
                native = f", upload call {sum(inside):.3f} s" if inside else ""
                print(
                    f"round {r}: {label} {nbytes / 2**30 / wall:.3f} GiB/s, {wall:.3f} s"
                    f"{native}, before it {wall - sum(inside):.3f} s",
                    flush=True,
                )
    finally:
        os.unlink(raw)
        os.rmdir(os.path.dirname(raw))


if __name__ == "__main__":
    benchlib.store_probe(__doc__, 4, run)
