"""Cold loads of a synthetic safetensors checkpoint: safetensors.torch.load_file,
ckptio.safetensors.load_file, fastsafetensors (when importable), and the raw
O_DIRECT read of as many bytes (the limit), all measured in the same run.

The file is bf16, transformer-shaped (hidden 1024: about ten tensors of 2 KiB to
8 MiB per layer, plus an embedding with an odd row count so that most tensors
sit off the 4 KiB grid), hundreds of tensors per GiB. It is written once by the
safetensors package (the layout of files from the hub) and once by ckptio (data
section 4 KiB-aligned). A CPU load counts until a byte of every page has been
read (safetensors maps the file and reads lazily). Before every timed load the
file is fsynced and dropped from the page cache (POSIX_FADV_DONTNEED); the
bench checks with fincore that the drop took effect and says so.

Usage: python benches/bench_safetensors.py [--size 1G] [--device cpu|cuda]
       [--dir DIR] [--repeat 3] [--threads N] [--chunk-size 16M] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import benchlib
import ckptio
import ckptio.safetensors as cst
import safetensors.torch as st
import torch
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench

GiB = 2**30


def synthetic(nbytes: int, hidden: int = 1024, vocab: int = 50257) -> dict[str, torch.Tensor]:
    """About ``nbytes`` of bf16 tensors shaped like a small transformer's."""
    sd: dict[str, torch.Tensor] = {}
    total = 0

    def add(name: str, shape: tuple[int, ...]) -> None:
        nonlocal total
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.int16).random_(-(2**15), 2**15 - 1)
        sd[name] = t
        total += t.numel() * 2

    add("embed.weight", (vocab, hidden))
    layer = 0
    while total < nbytes:
        p = f"layers.{layer}."
        for name, shape in (
            ("attn.qkv.weight", (3 * hidden, hidden)),
            ("attn.qkv.bias", (3 * hidden,)),
            ("attn.out.weight", (hidden, hidden)),
            ("attn.out.bias", (hidden,)),
            ("mlp.up.weight", (4 * hidden, hidden)),
            ("mlp.up.bias", (4 * hidden,)),
            ("mlp.down.weight", (hidden, 4 * hidden)),
            ("mlp.down.bias", (hidden,)),
            ("norm1.weight", (hidden,)),
            ("norm2.weight", (hidden,)),
        ):
            add(p + name, shape)
        layer += 1
    add("final_norm.weight", (hidden,))
    return sd


def cached_bytes(path: str) -> int | None:
    """Bytes of ``path`` in the page cache (fincore), None where it cannot tell."""
    try:
        r = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", path],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(r.stdout.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def touch(tensors: dict[str, torch.Tensor]) -> None:
    """Read a byte of every page: a lazy (mmap-backed) load pays for its reads here."""
    for t in tensors.values():
        if t.numel():
            t.view(-1).view(torch.uint8)[::4096].sum()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16).cpu(), b[k].view(torch.int16).cpu()) for k in a
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=_size, default=GiB)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dir", default=None)
    p.add_argument("--repeat", type=int, default=3, help="rounds; rows keep their median")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--chunk-size", type=_size, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = a.device
    tmp = tempfile.mkdtemp(prefix="ckptio-stbench-", dir=a.dir)
    try:
        sd = synthetic(a.size)
        nbytes = sum(t.numel() * 2 for t in sd.values())
        hub, ours = os.path.join(tmp, "hub.safetensors"), os.path.join(tmp, "ckptio.safetensors")
        st.save_file(sd, hub)
        cst.save_file(sd, ours)
        del sd
        print(
            f"# {nbytes / GiB:.2f} GiB bf16 in {tmp}, load to {dev}, median of {a.repeat}",
            flush=True,
        )
        with open(hub, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            head = json.loads(f.read(n))
        head.pop("__metadata__", None)
        aligned = sum(1 for v in head.values() if (8 + n + v["data_offsets"][0]) % 4096 == 0)
        print(
            f"# {len(head)} tensors; {aligned} start on a 4 KiB boundary in the hub file",
            flush=True,
        )
        opts = dict(threads=a.threads, chunk_size=a.chunk_size)
        loaders: dict[str, tuple[str, Callable[[], Any]]] = {
            "safetensors.load_file": (hub, lambda: st.load_file(hub, device=dev)),
            "ckptio (hub file)": (hub, lambda: cst.load_file(hub, device=dev, **opts)),
            "ckptio (ckptio file)": (ours, lambda: cst.load_file(ours, device=dev, **opts)),
        }
        for tag, nogds in (("nogds", True), ("gds", False)):
            if nogds or dev.startswith("cuda"):
                fl = benchlib.fastsafetensors_loader(dev, nogds)
                if fl is not None:
                    loaders[f"fastsafetensors ({tag})"] = (hub, lambda fl=fl: fl(hub))
        if not any(k.startswith("fastsafetensors") for k in loaders):
            print("# fastsafetensors: not importable, skipped", flush=True)
        # Correctness once, untimed.
        ref = st.load_file(hub)
        for name, (_, fn) in loaders.items():
            try:
                ok = same(ref, fn())
            except Exception as e:  # an optional loader that cannot run here
                print(f"# {name}: {type(e).__name__}: {e}; skipped", flush=True)
                loaders[name] = ("", lambda: None)
                continue
            assert ok, f"{name} loaded different tensors"
        loaders = {k: v for k, v in loaders.items() if v[0]}
        del ref
        bench.drop_cache(hub)
        left = cached_bytes(hub)
        print(
            "# page-cache drop: "
            + ("fincore unavailable, not checked" if left is None else f"{left} bytes left cached"),
            flush=True,
        )
        times: dict[str, list[float]] = {}
        reports: dict[str, str] = {}
        for _ in range(a.repeat):
            raw = bench.raw_limits(tmp, nbytes)
            times.setdefault("raw O_DIRECT read (reused buffer)", []).append(raw.read)
            times.setdefault("raw O_DIRECT read (fresh memory)", []).append(raw.read_fresh)
            for name, (path, fn) in loaders.items():
                bench.drop_cache(path)
                t0 = time.perf_counter()
                out = fn()
                if dev.startswith("cuda"):
                    torch.cuda.synchronize()
                else:
                    touch(out)
                times.setdefault(name, []).append(time.perf_counter() - t0)
                if name.startswith("ckptio"):
                    r = ckptio.last_report()
                    reports[name] = f"ran={r.device_path} direct={r.direct} threads={r.threads}"
                del out
        for k, v in reports.items():
            print(f"# {k}: {v}")
        rows = {k: bench.median(v) for k, v in times.items()}
        limit = rows["raw O_DIRECT read (reused buffer)"]
        fresh = rows["raw O_DIRECT read (fresh memory)"]
        base = rows["safetensors.load_file"]
        print(
            f"{'what':<36} {'seconds':>8} {'GiB/s':>7} {'vs raw':>7} {'vs fresh':>8} {'vs st':>6}"
        )
        out_rows = []
        for k, s in rows.items():
            print(
                f"{k:<36} {s:>8.3f} {nbytes / GiB / s:>7.2f} {limit / s:>7.2f} "
                f"{fresh / s:>8.2f} {base / s:>6.2f}"
            )
            out_rows.append(
                dict(
                    name=k,
                    seconds=s,
                    gib_s=nbytes / GiB / s,
                    vs_raw=limit / s,
                    vs_raw_fresh=fresh / s,
                    vs_safetensors=base / s,
                    runs=times[k],
                )
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    dict(
                        size=nbytes, device=dev, tensors=len(head), rows=out_rows, reports=reports
                    ),
                    f,
                    indent=2,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
