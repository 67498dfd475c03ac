"""Many tensors: save and load time against the tensor count, ckptio against
torch.save / torch.load and the safetensors package, measured in one run.

Two sweeps (issue 23): a fixed total size (1 GiB in 64, 2,000, 20,000 and
100,000 float32 tensors) and a fixed tensor size (4 KiB tensors x 1,000,
10,000, 20,000 and 100,000). For every shape, in interleaved rounds: torch.save
+ fsync and torch.load, safetensors.torch.save_file + fsync and load_file,
ckptio.save and ckptio.load, ckptio.safetensors save_file and load_file. Every
write starts on a settled disk into a new file; every load is cold (the file
fsynced and dropped from the page cache, ``ckptio.tools.bench.drop_cache``). Rows
keep the best round (the disk of a shared machine drifts; the issue compared
best of 2) and the median of each round's ratio. A table per sweep, a JSON
file, and a PNG chart of microseconds per tensor (``--png``, with matplotlib).

Other modes:
  --threshold   saves and loads of a mixed state dict (sizes 1 KiB .. 4 MiB)
                with ckptio's packing threshold (PACK_BELOW) at several values:
                time and file size, to choose it.
  --async N     torch.distributed.checkpoint.async_save of a nested dict of N
                tensors, ckptio's DefaultStager + FileSystemWriter against
                torch's: the time until async_save returns, until staging is
                done, until the upload is done.
  --device cuda the state dicts on the GPU, loads to CUDA (torch.load with
                map_location="cuda"), for the GPU machine.

Usage: python benches/bench_tensors.py [--rounds 2] [--dir DIR] [--json OUT]
       [--png OUT] [--fixed-total 64,2000,20000,100000] [--fixed-size 1000,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ckptio
import ckptio.safetensors as cst
import safetensors.torch as sft
import torch
from ckptio import serialization as ser
from ckptio.tools import bench

GiB = 2**30
KiB = 2**10

# (label, library, direction) in the order rounds run them.
OPS = [
    ("torch.save + fsync", "torch", "save"),
    ("ckptio.save", "ckptio", "save"),
    ("safetensors.save_file + fsync", "safetensors", "save"),
    ("ckptio.safetensors.save_file", "ckptio.safetensors", "save"),
    ("torch.load", "torch", "load"),
    ("ckptio.load", "ckptio", "load"),
    ("safetensors.load_file", "safetensors", "load"),
    ("ckptio.safetensors.load_file", "ckptio.safetensors", "load"),
]
# Which row each ckptio row is compared with.
BASE = {
    "ckptio.save": "torch.save + fsync",
    "ckptio.load": "torch.load",
    "ckptio.safetensors.save_file": "safetensors.save_file + fsync",
    "ckptio.safetensors.load_file": "safetensors.load_file",
}


def state(count: int, nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of ``nbytes`` each (random bytes)."""
    g = torch.Generator().manual_seed(count)
    n = max(nbytes // 4, 1)
    return {
        f"layers.{i // 8}.p{i % 8}": torch.randn(n, generator=g).to(device) for i in range(count)
    }


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def touch_lazy(out: dict[str, torch.Tensor]) -> None:
    """A load counts until its bytes are in memory: where tensors share few
    storages (a mapping read lazily), read a byte of every page of each."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in out.values():
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st)
    if len(seen) * 2 < len(out):
        for st in seen.values():
            if st.nbytes() and st.device.type == "cpu":
                torch.tensor(st, dtype=torch.uint8)[::4096].sum()


def ops(folder: str, sd: dict[str, torch.Tensor], device: str) -> dict[str, Callable[[], Any]]:
    p = {lib: os.path.join(folder, f"{lib}.file") for _, lib, _ in OPS}
    loc = device if device.startswith("cuda") else "cpu"
    return {
        "torch.save + fsync": lambda: (torch.save(sd, p["torch"]), bench.fsync_path(p["torch"])),
        "ckptio.save": lambda: ckptio.save(sd, p["ckptio"]),
        "safetensors.save_file + fsync": lambda: (
            sft.save_file(sd, p["safetensors"]),
            bench.fsync_path(p["safetensors"]),
        ),
        "ckptio.safetensors.save_file": lambda: cst.save_file(sd, p["ckptio.safetensors"]),
        "torch.load": lambda: torch.load(p["torch"], map_location=loc, weights_only=True),
        "ckptio.load": lambda: ckptio.load(p["ckptio"], map_location=loc),
        "safetensors.load_file": lambda: sft.load_file(p["safetensors"], device=loc),
        "ckptio.safetensors.load_file": lambda: cst.load_file(p["ckptio.safetensors"], device=loc),
    }


def measure(count: int, nbytes: int, rounds: int, folder: str, device: str) -> dict[str, Any]:
    """Every op on one shape, ``rounds`` interleaved rounds: seconds per round,
    file sizes."""
    sd = state(count, nbytes, device)
    work = tempfile.mkdtemp(prefix="bench-tensors-", dir=folder)
    try:
        fns = ops(work, sd, device)
        times: dict[str, list[float]] = {name: [] for name, _, _ in OPS}
        sizes: dict[str, int] = {}
        for _ in range(rounds):
            for name, lib, kind in OPS:
                path = os.path.join(work, f"{lib}.file")
                if kind == "save":
                    if os.path.exists(path):
                        os.unlink(path)
                    bench.settle_disk(work)
                else:
                    bench.drop_cache(path)
                t0 = time.perf_counter()
                out = fns[name]()
                if kind == "load":
                    touch_lazy(out)
                sync(device)
                times[name].append(time.perf_counter() - t0)
                if kind == "save":
                    sizes[lib] = os.path.getsize(path)
                del out
        check = ckptio.load(os.path.join(work, "ckptio.file"))
        assert check.keys() == sd.keys() and all(torch.equal(check[k], v) for k, v in sd.items())
        return {"count": count, "tensor_bytes": nbytes, "times": times, "sizes": sizes}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(title: str, results: list[dict[str, Any]]) -> str:
    lines = [f"## {title}", ""]
    head = (
        f"{'tensors':>8} {'tensor':>9} {'what':<32} {'best s':>8} {'us/tensor':>10} {'vs base':>16}"
    )
    lines += [head, "-" * len(head)]
    for r in results:
        t = r["times"]
        best = {k: min(v) for k, v in t.items()}
        for name, _, _ in OPS:
            ratio = ""
            if name in BASE:
                paired = [b / c for b, c in zip(t[BASE[name]], t[name], strict=True)]
                ratio = f"{best[BASE[name]] / best[name]:.2f}x ({statistics.median(paired):.2f}x)"
            size = _human(r["tensor_bytes"])
            lines.append(
                f"{r['count']:>8} {size:>9} {name:<32} {best[name]:>8.3f} "
                f"{best[name] / r['count'] * 1e6:>10.1f} {ratio:>16}"
            )
        s = r["sizes"]
        lines.append(
            f"{'':>8} {'':>9} file size ckptio / torch: {s['ckptio'] / s['torch']:.3f}  "
            f"ckptio.safetensors / safetensors: {s['ckptio.safetensors'] / s['safetensors']:.3f}"
        )
    lines.append(
        "(best of the rounds; vs base: the base row's best over this row's best, "
        "in brackets the median of each round's own ratio)"
    )
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"


def chart(path: str, sweeps: dict[str, list[dict[str, Any]]]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no chart"
    fig, axes = plt.subplots(1, len(sweeps), figsize=(7 * len(sweeps), 5), squeeze=False)
    for ax, (title, results) in zip(axes[0], sweeps.items(), strict=True):
        counts = [r["count"] for r in results]
        for name, lib, kind in OPS:
            us = [min(r["times"][name]) / r["count"] * 1e6 for r in results]
            style = "-" if lib.startswith("ckptio") else "--"
            marker = "o" if kind == "save" else "s"
            ax.plot(counts, us, style, marker=marker, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensors")
        ax.set_ylabel("microseconds per tensor (best round)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"chart: {path}"


def threshold_sweep(rounds: int, folder: str, values: list[int]) -> str:
    """ckptio.save / load of a mixed state dict with PACK_BELOW at each value."""
    g = torch.Generator().manual_seed(1)
    sizes = [int(2 ** (10 + 12 * (i % 97) / 96)) for i in range(2000)]  # 1 KiB .. 4 MiB
    sd = {f"t{i}": torch.randn(max(n // 4, 1), generator=g) for i, n in enumerate(sizes)}
    total = sum(t.nbytes for t in sd.values())
    work = tempfile.mkdtemp(prefix="bench-threshold-", dir=folder)
    lines = [
        f"## packing threshold: {len(sd)} tensors of 1 KiB..4 MiB ({total / GiB:.2f} GiB), "
        f"best of {rounds}",
        "",
        f"{'PACK_BELOW':>10} {'save s':>8} {'load s':>8} {'file / data':>11}",
    ]
    old = ser.PACK_BELOW
    try:
        times: dict[int, tuple[list[float], list[float]]] = {v: ([], []) for v in values}
        size: dict[int, int] = {}
        for _ in range(rounds):
            for v in values:
                ser.PACK_BELOW = v
                p = os.path.join(work, f"t{v}.pt")
                if os.path.exists(p):
                    os.unlink(p)
                bench.settle_disk(work)
                t0 = time.perf_counter()
                ckptio.save(sd, p)
                times[v][0].append(time.perf_counter() - t0)
                size[v] = os.path.getsize(p)
                bench.drop_cache(p)
                t0 = time.perf_counter()
                ckptio.load(p)
                times[v][1].append(time.perf_counter() - t0)
        for v in values:
            s, ld = times[v]
            lines.append(f"{_human(v):>10} {min(s):>8.3f} {min(ld):>8.3f} {size[v] / total:>11.4f}")
    finally:
        ser.PACK_BELOW = old
        shutil.rmtree(work, ignore_errors=True)
    return "\n".join(lines)


def async_save(count: int, rounds: int, folder: str, device: str) -> str:
    """async_save of {"model": {count tensors}}: ckptio's DefaultStager and
    FileSystemWriter against torch's (torch's default options where CUDA is
    there; without it, no pinned memory and blocking copies, which torch then
    requires), ckptio's saves then torch's; the time until async_save returns, until
    staging and the upload are done."""
    import resource
    import warnings

    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter
    from ckptio.staging import DefaultStager
    from torch.distributed.checkpoint.staging import DefaultStager as TorchStager
    from torch.distributed.checkpoint.staging import StagingOptions

    warnings.simplefilter("ignore")
    # torch's stager holds a shared-memory descriptor per storage: give it the
    # hard limit of open files (it failed with "Too many open files" at 20,000
    # storages under the H200 machine's soft limit).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sd = {"model": state(count, 4 * KiB, device)}
    work = tempfile.mkdtemp(prefix="bench-async-", dir=folder)
    saves = max(10, 5 * rounds)
    cuda = torch.cuda.is_available()  # torch's pinned / non-blocking options need it
    kinds = {
        "ckptio": (DefaultStager(), FileSystemWriter),
        "torch": (TorchStager(StagingOptions(cuda, cuda, True, cuda)), dcp.FileSystemWriter),
    }
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in kinds}
    failed: dict[str, str] = {}
    try:
        # One library after the other, not alternating: torch's stager keeps a
        # shared-memory descriptor per staged storage open (20,000 here) and
        # left none for ckptio's saves once it had staged.
        for name, (stager, writer) in kinds.items():
            for i in range(saves):
                if name in failed:
                    break
                w = writer(os.path.join(work, f"{name}{i % 2}"))
                time.sleep(0.05)  # the previous upload's threads wound down
                try:
                    t0 = time.perf_counter()
                    r = dcp.async_save(sd, storage_writer=w, async_stager=stager, no_dist=True)
                    t1 = time.perf_counter()
                    r.staging_completion.result()
                    t2 = time.perf_counter()
                    r.upload_completion.result()
                    t3 = time.perf_counter()
                # DCP's CheckpointException is a BaseException.
                except BaseException as e:  # a peer that cannot: its failure is the row
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    failed[name] = f"save {i + 1} failed: {type(e).__name__}: {e}"
                    continue
                times[name].append(((t1 - t0) * 1e3, t2 - t0, t3 - t0))
                # The response holds DCP's Metadata of every item: freeing it
                # (tens of ms for 20,000 items) is not async_save's time.
                del r
    finally:
        for stager, _ in kinds.values():
            stager.close()
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"## dcp.async_save of a nested dict of {count} tensors of 4 KiB on {device}: "
        f"{saves} saves each, ckptio then torch",
        "",
        f"{'stager + writer':<16} {'first ms':>9} {'then: median ms':>16} {'p75 ms':>7} "
        f"{'max ms':>7} {'staged s':>9} {'uploaded s':>11}",
    ]
    for name, v in times.items():
        if len(v) < 2:
            lines.append(f"{name:<16} {failed.get(name, 'too few saves')}")
            continue
        if name in failed:
            lines.append(f"{name:<16} (then {failed[name]})")
        rest = sorted(x[0] for x in v[1:])
        lines.append(
            f"{name:<16} {v[0][0]:>9.2f} {statistics.median(rest):>16.2f} "
            f"{rest[3 * len(rest) // 4]:>7.2f} {rest[-1]:>7.2f} "
            f"{statistics.median(x[1] for x in v[1:]):>9.3f} "
            f"{statistics.median(x[2] for x in v[1:]):>11.3f}"
        )
    lines.append("(returns: async_save's call; staged / uploaded: from the call, medians)")
    return "\n".join(lines)


def _counts(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fixed-total", default="64,2000,20000,100000", help="tensor counts for 1 GiB")
    p.add_argument("--total", default="1G", help="the fixed total size")
    p.add_argument("--fixed-size", default="1000,10000,20000,100000", help="counts of 4 KiB")
    p.add_argument("--threshold", default=None, help="PACK_BELOW values to sweep, e.g. 4K,64K,1M")
    p.add_argument("--async", dest="async_count", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    a = p.parse_args()
    from ckptio.io.units import parse_size as _size

    folder = a.dir or tempfile.gettempdir()
    out: dict[str, Any] = {"device": a.device, "rounds": a.rounds}
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')} torch {torch.__version__}, {os.cpu_count()} cores, "
        f"files in {folder}, {a.rounds} interleaved rounds, device {a.device}",
        flush=True,
    )
    sweeps: dict[str, list[dict[str, Any]]] = {}
    total = _size(a.total)
    for title, shapes in (
        (f"{_human(total)} in N tensors", [(n, total // n) for n in _counts(a.fixed_total)]),
        ("4 KiB tensors x N", [(n, 4 * KiB) for n in _counts(a.fixed_size)]),
    ):
        if not shapes:
            continue
        results = []
        for count, nbytes in shapes:
            results.append(measure(count, nbytes, a.rounds, folder, a.device))
            print(table(title, results[-1:]), flush=True)
        sweeps[title] = results
        print(table(title, results), flush=True)
    out["sweeps"] = sweeps
    if a.png and sweeps:
        print(chart(a.png, sweeps), flush=True)
    if a.threshold:
        text = threshold_sweep(a.rounds, folder, [_size(v) for v in a.threshold.split(",")])
        print(text, flush=True)
        out["threshold"] = text
    if a.async_count:
        text = async_save(a.async_count, a.rounds, folder, a.device)
        print(text, flush=True)
        out["async"] = text
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
