"""Resume in place (issue 17): ckptio.load_state_dict against torch's
model.load_state_dict(torch.load(path)), every ratio against a baseline of the
same run.

--device cpu (the development machine): a model of --size float32 parameters in
host memory, already faulted in, loaded from a cold ckptio checkpoint. Each load
runs in a fresh process (a resume), which reports its seconds and its peak RSS
growth (VmHWM after resetting it, less the RSS before). Baseline: a raw O_DIRECT
read of the checkpoint file (8 threads, 64 MiB) into an already-faulted buffer.
Targets: ckptio >= 0.9x the raw read; ckptio's RSS growth <= 10% of the
checkpoint (torch.load + load_state_dict adds 1x).

--device cuda (the GPU machine, scripts/gpu_check.sh inplace): a model of --size
bfloat16 parameters on the GPU, loaded from a cold checkpoint in --dir:
ckptio.load_state_dict against model.load_state_dict(torch.load(path,
map_location="cuda")), and the peak GPU memory each adds
(torch.cuda.max_memory_allocated) against the pinned pool ckptio holds. Then
from /dev/shm (pages in memory, read once before) against a pinned host-to-device
copy of the same bytes. Targets: >= 2x torch; added GPU memory <= the pinned
pool; from /dev/shm >= 0.85x the pinned copy. Bounds printed beside them, from
the same run: the raw O_DIRECT read of the cold file (each round), the /dev/shm
loads' engine read alone (the rest is Python), and the host's CPU copy floor
(the memory path's threads copying the file into pinned slots, no GPU), which
differs from host to host. The cold load runs on the default path and on the
other one (cuFile where it takes the file and the default is the bounce
pipeline, else the bounce pipeline); with --rounds > 1 they take turns going
first, and their cold times are paired by round.

    python benches/bench_inplace.py --device cpu --size 1G --rounds 3 [--dir DIR] [--json OUT]
    python benches/bench_inplace.py --device cuda --size 8G --dir /tmp [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import benchlib
import ckptio
import torch
from ckptio import _native
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench
from torch import nn

GiB = 2**30


# A resume in a fresh process: build the model, then time one load and its peak RSS.
CHILD = """
import json, sys, time, torch, ckptio
sys.path.insert(0, sys.argv[4])
from benchlib import module_of
path, how, spec = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
model = module_of(spec["shapes"], getattr(torch, spec["dtype"]), "cpu")
def status(k):
    for line in open("/proc/self/status"):
        if line.startswith(k):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the peak starts here
base = status("VmRSS")
t0 = time.perf_counter()
if how == "ckptio":
    ckptio.load_state_dict(model, path)
else:
    model.load_state_dict(torch.load(path))
sec = time.perf_counter() - t0
print(json.dumps({"seconds": sec, "rss_growth": status("VmHWM") - base}))
"""


def child(path: str, how: str, shapes_file: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, path, how, shapes_file, os.path.dirname(__file__)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{how} child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu(args: argparse.Namespace) -> dict:
    size = _size(args.size)
    tmp = tempfile.mkdtemp(prefix="ckptio-inplace-", dir=args.dir)
    try:
        sd = benchlib.shaped_state_dict(args.shape, size, "cpu", torch.float32)
        dtype = next(iter(sd.values())).dtype
        nbytes = sum(t.nbytes for t in sd.values())
        shapes = {k: list(v.shape) for k, v in sd.items()}
        shapes_file = os.path.join(tmp, "shapes.json")
        with open(shapes_file, "w") as f:
            json.dump({"dtype": str(dtype).removeprefix("torch."), "shapes": shapes}, f)
        path = os.path.join(tmp, "model.pt")
        ckptio.save(sd, path)
        del sd
        print(
            f"# {nbytes / GiB:.2f} GiB {dtype} {args.shape} model in host memory, "
            f"{len(shapes)} tensors, "
            f"checkpoint {path}, {args.rounds} rounds (median), a fresh process per load",
            flush=True,
        )
        raw_n = nbytes // 4096 * 4096
        buf = mmap.mmap(-1, raw_n)
        view = memoryview(buf)
        chunk = b"\x01" * (64 << 20)
        for off in range(0, raw_n, len(chunk)):  # fault every page in
            view[off : off + len(chunk)] = chunk[: raw_n - off]
        rows: dict[str, list[dict]] = {"raw": [], "ckptio": [], "torch": []}
        for _ in range(args.rounds):
            s = bench.cold_read(path, view, getattr(os, "O_DIRECT", 0), 8, 64 << 20)
            rows["raw"].append({"seconds": s})
            for how in ("ckptio", "torch"):
                bench.drop_cache(path)
                rows[how].append(child(path, how, shapes_file))
        view.release()
        buf.close()
        med = {k: statistics.median(r["seconds"] for r in v) for k, v in rows.items()}
        rss = {
            k: statistics.median(r["rss_growth"] for r in v) for k, v in rows.items() if k != "raw"
        }
        names = {
            "raw": "raw O_DIRECT read, faulted buffer",
            "ckptio": "ckptio.load_state_dict",
            "torch": "load_state_dict(torch.load)",
        }
        print(f"{'what':<36} {'seconds':>8} {'GiB/s':>7} {'peak RSS growth':>18}")
        for k, name in names.items():
            g = f"{rss[k] / 2**20:9.0f} MiB ({rss[k] / nbytes:.2f}x)" if k in rss else ""
            gbs = (raw_n if k == "raw" else nbytes) / GiB / med[k]
            print(f"{name:<36} {med[k]:8.3f} {gbs:7.2f} {g:>18}")
        raw_gbs = raw_n / med["raw"]
        ratio = nbytes / med["ckptio"] / raw_gbs
        # Each round's own ratio: the disk drifts between rounds on a shared VM.
        paired = [
            (nbytes / c["seconds"]) / (raw_n / r["seconds"])
            for r, c in zip(rows["raw"], rows["ckptio"], strict=True)
        ]
        print(
            f"paired ckptio/raw read by round: {', '.join(f'{x:.2f}' for x in paired)} "
            f"(median {statistics.median(paired):.2f})"
        )
        print(
            f"targets: ckptio/raw read = {ratio:.2f} (>= 0.9); ckptio RSS growth = "
            f"{rss['ckptio'] / nbytes:.3f} of the checkpoint (<= 0.10); torch's = "
            f"{rss['torch'] / nbytes:.2f}; ckptio/torch = {med['torch'] / med['ckptio']:.2f}x",
            flush=True,
        )
        return {
            "nbytes": nbytes,
            "rows": rows,
            "median_s": med,
            "rss_growth": rss,
            "ratio": ratio,
            "paired": paired,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pinned_copy_s(nbytes: int, timed_gpu) -> float:
    """Seconds of the fastest of 3 pinned host-to-device copies of ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    return min(timed_gpu(lambda: dev.copy_(host, non_blocking=True))[0] for _ in range(3))


def other_backend(model: nn.Module, path: str, device: str) -> str:
    """The path to pair with the default one: cuFile where it takes the file
    (a load with it here, which also warms its driver and the file's handle)
    and the default did not, else the bounce pipeline."""
    if device == "cpu":
        return "bounce"
    ckptio.load_state_dict(model, path)
    default = ckptio.last_report().device_path
    try:
        ckptio.load_state_dict(model, path, backend="cufile")
    except (ckptio.BackendUnavailableError, ckptio.CuFileError):
        return "bounce"
    return "cufile" if default == "bounce" else "bounce"


def gpu(args: argparse.Namespace) -> dict:
    size = _size(args.size)
    tmp = tempfile.mkdtemp(prefix="ckptio-inplace-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="ckptio-inplace-", dir="/dev/shm")
    out: dict = {}
    try:
        sd = benchlib.shaped_state_dict(args.shape, size, "cuda")
        nbytes = sum(t.nbytes for t in sd.values())
        shapes = {k: list(v.shape) for k, v in sd.items()}
        path = os.path.join(tmp, "model.pt")
        ckptio.save(sd, path)
        del sd
        model = benchlib.module_of(shapes, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
        print(
            f"# {nbytes / GiB:.2f} GiB bfloat16 {args.shape} model on "
            f"{torch.cuda.get_device_name()}, "
            f"{len(shapes)} tensors, checkpoint in {tmp}",
            flush=True,
        )

        def timed_gpu(fn) -> tuple[float, int]:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - base

        res: dict[str, list[tuple[float, int]]] = {"torch": [], "ckptio": [], "other": []}
        paths: dict[str, str | None] = {}
        pinned = 0
        # The disk's limit, each round: the checkpoint read cold with O_DIRECT into a
        # faulted 1 GiB host buffer used round and round (no loader beats it).
        raw_n = nbytes // 4096 * 4096
        ring = mmap.mmap(-1, 1 << 30)
        ring.write(b"\x01" * (1 << 30))
        view = memoryview(ring)
        raw: list[float] = []
        # ckptio's default path and the other one take turns going first (the
        # disk drifts within a round): their ratio is paired by round.
        other = other_backend(model, path, args.device)
        backends = (("ckptio", None), ("other", other))
        for rnd in range(args.rounds):
            raw.append(bench.cold_read(path, view, getattr(os, "O_DIRECT", 0), 8, 64 << 20, raw_n))
            bench.drop_cache(path)
            s, g = timed_gpu(lambda: model.load_state_dict(torch.load(path, map_location="cuda")))
            res["torch"].append((s, g))
            torch.cuda.empty_cache()
            for k, backend in backends if rnd % 2 == 0 else backends[::-1]:
                bench.drop_cache(path)
                s, g = timed_gpu(lambda b=backend: ckptio.load_state_dict(model, path, backend=b))
                res[k].append((s, g))
                rep = ckptio.last_report()
                paths[k] = f"device_path={rep.device_path} gds_mode={rep.gds_mode}"
                pinned = max(pinned, rep.pinned_bytes)
        view.release()
        ring.close()
        med = {k: statistics.median(x[0] for x in v) for k, v in res.items()}
        peak = {k: max(x[1] for x in v) for k, v in res.items()}
        raw_s = statistics.median(raw) * nbytes / raw_n
        print(f"{'what':<44} {'seconds':>8} {'GiB/s':>7} {'GPU added':>10}")
        disk = "raw O_DIRECT read, cold (the disk)"
        print(f"{disk:<44} {raw_s:8.3f} {nbytes / GiB / raw_s:7.2f}")
        for k, name in (
            ("torch", "load_state_dict(torch.load(cuda)), cold"),
            ("ckptio", "ckptio.load_state_dict, cold"),
            ("other", f"ckptio.load_state_dict {other}, cold"),
        ):
            print(
                f"{name:<44} {med[k]:8.3f} {nbytes / GiB / med[k]:7.2f} "
                f"{peak[k] / 2**20:7.0f} MiB  {paths.get(k, '')}"
            )
        print(f"# ckptio's pinned pool: {pinned / 2**20:.0f} MiB")
        if args.rounds > 1:
            paired = [b[0] / c[0] for c, b in zip(res["ckptio"], res["other"], strict=True)]
            print(
                f"# by round (s), default: {' '.join(f'{x[0]:.3f}' for x in res['ckptio'])}; "
                f"{other}: {' '.join(f'{x[0]:.3f}' for x in res['other'])}; {other} time / "
                f"default time, median of rounds: {statistics.median(paired):.3f} "
                f"(< 1: {other} is faster)"
            )
        # /dev/shm: the pages are in memory (read once first); baseline: pinned H2D copy.
        spath = os.path.join(shm, "model.pt")
        shutil.copyfile(path, spath)
        ckptio.load_state_dict(model, spath)
        # Loads from memory vary by round on the H200 host: every round shown, the median kept.
        # Each round's engine read timed alone too: the rest is Python (open, walk, plan).
        # And the Python side's steps (open, walk, plan, execute less the read).
        reads, steps = benchlib.EngineReads(), benchlib.LoadPhases(ckptio)
        shm_all, shm_read, shm_steps = [], [], []
        try:
            for _ in range(5):
                reads.reset()
                steps.reset()
                shm_all.append(timed_gpu(lambda: ckptio.load_state_dict(model, spath))[0])
                shm_read.append(reads.seconds)
                own = dict(steps.seconds)
                own["execute"] = own.get("execute", 0.0) - reads.seconds
                shm_steps.append(own)
        finally:
            reads.close()
            steps.close()
        shm_s = statistics.median(shm_all)
        read_s = statistics.median(shm_read)
        rest = statistics.median(a - b for a, b in zip(shm_all, shm_read, strict=True))
        by_step = {k: statistics.median(r.get(k, 0.0) for r in shm_steps) for k in shm_steps[0]}
        if args.profile:  # where an in-place load's time outside the engine goes
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                ckptio.load_state_dict(model, spath)
            torch.cuda.synchronize()
            prof.disable()
            for key in ("tottime", "cumulative"):
                pstats.Stats(prof).sort_stats(key).print_stats(20)
        h2d = pinned_copy_s(nbytes, timed_gpu)
        # The host's own bound on any copy-based load (it differs from host to host):
        # the memory path's threads copying the file into pinned slots, no engine, no GPU.
        from ckptio.io.engines import engine as _engine

        eng = _engine(None, None, None)
        # A probe hook: only in a build with the cargo feature probes (scripts/build_gpu_bundle.sh).
        copy_floor = getattr(_native, "memory_copy_floor", None)
        floor = statistics.median(
            copy_floor(spath, "map", eng.memory_threads, eng.memory_chunk_size)[0]
            if copy_floor
            else float("nan")
            for _ in range(3)
        )
        print(
            f"{'ckptio.load_state_dict, /dev/shm':<44} {shm_s:8.3f} {nbytes / GiB / shm_s:7.2f}"
            f"  median of 5 back to back: {', '.join(f'{nbytes / GiB / x:.1f}' for x in shm_all)}"
        )
        print(
            f"{'  its engine read alone':<44} {read_s:8.3f} {nbytes / GiB / read_s:7.2f}"
            f"  ({h2d / read_s:.2f}x pinned; the rest, Python: median {rest * 1e3:.1f} ms)"
        )
        print(
            f"{'  the rest by step (median ms)':<44} "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in by_step.items())
            + " (execute: less the engine's read)"
        )
        print(f"{'pinned H2D copy':<44} {h2d:8.3f} {nbytes / GiB / h2d:7.2f}")
        print(
            f"{'CPU copy floor (a) of this host':<44} {floor:8.3f} {nbytes / GiB / floor:7.2f}"
            f"  ({h2d / floor:.2f}x pinned; {eng.memory_threads} threads, "
            f"{eng.memory_chunk_size >> 20} MiB chunks, median of 3)"
        )
        print(
            f"targets: ckptio/torch = {med['torch'] / med['ckptio']:.2f}x (>= 2; {other} "
            f"{med['torch'] / med['other']:.2f}x; the disk's raw read / torch = "
            f"{med['torch'] / raw_s:.2f}x bounds any loader; ckptio/raw read = "
            f"{raw_s / med['ckptio']:.2f}, {other} {raw_s / med['other']:.2f}); "
            "ckptio's added GPU memory "
            f"{max(peak['ckptio'], peak['other']) / 2**20:.0f} MiB <= pinned pool "
            f"{pinned / 2**20:.0f} MiB: {max(peak['ckptio'], peak['other']) <= pinned}; "
            f"/dev/shm vs pinned copy = {h2d / shm_s:.2f} (>= 0.85; engine read alone "
            f"{h2d / read_s:.2f}, this host's CPU copy floor {h2d / floor:.2f})",
            flush=True,
        )
        out = {
            "nbytes": nbytes,
            "median_s": med,
            "gpu_added": peak,
            "pinned_pool": pinned,
            "shm_s": shm_s,
            "shm_rounds_s": shm_all,
            "shm_engine_read_s": shm_read,
            "shm_python_steps_s": shm_steps,
            "raw_read_s": raw,
            "h2d_s": h2d,
            "cpu_copy_floor_s": floor,
            "paths": paths,
            "other_backend": other,
        }
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="even", choices=["even", "llm"], help="llm: issue 37's")
    p.add_argument("--size", default=None, help="default 1G (cpu), 8G (cuda)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (cpu), 1 (cuda)")
    p.add_argument("--profile", action="store_true", help="cuda: cProfile 3 loads from /dev/shm")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.device == "cpu":
        a.size, a.rounds = a.size or "1G", a.rounds or 3
        result = cpu(a)
    else:
        a.size, a.rounds = a.size or "8G", a.rounds or 1
        result = gpu(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
