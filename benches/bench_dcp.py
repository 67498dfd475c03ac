"""Async DCP checkpoints side by side: how long training is blocked, when staging
and upload complete, for torch's stagers/writer and ckptio's, in one run.

    python benches/bench_dcp.py --sizes 2G,8G --saves 5 --dir /tmp --json out.json

Per configuration, ``--saves`` consecutive ``dcp.async_save`` calls of the same
bf16 state dict (on CUDA when there is a GPU): ``return`` (async_save returned:
training blocked), ``staged`` (staging complete: parameters may change again),
``upload`` (checkpoint durable). Baselines measured in the same run: the pinned
device-to-host bandwidth (a plain copy into a pinned buffer) and a synchronous
``ckptio.save`` of the same data. Then ``dcp.load`` with torch's reader and ours
(page cache dropped first), beside the disk's raw read of the same data file, and
the fault-in of fresh buffers laid out as a first staging lays them out: the two
floors that bound the first-save and dcp.load targets on a given machine. Prints
a table and the targets' ratios.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import time
import warnings
from typing import Any

import ckptio
import torch
import torch.distributed.checkpoint as dcp
from benchlib import buffered_cold_read, fresh_memory_fault_s
from ckptio.dcp import FileSystemReader, FileSystemWriter
from ckptio.io.engines import engine as _engine  # noqa: F401  (warms the engine cache)
from ckptio.io.units import parse_size as _size
from ckptio.staging import DefaultStager, StagingOptions
from ckptio.tools.bench import cold_read, drop_cache, settle_disk, synthetic_state_dict

warnings.simplefilter("ignore")
GiB = 1 << 30


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pinned_d2h(sd: dict[str, torch.Tensor]) -> float:
    """GiB/s of plain copies of the state dict into pinned buffers (the PCIe limit)."""
    if not torch.cuda.is_available():
        return float("nan")
    dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}
    best = 0.0
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v, non_blocking=True)
        sync()
        best = max(best, nbytes(sd) / GiB / (time.perf_counter() - t0))
    del dst
    return best


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def drop_dir(d: str) -> None:
    for n in os.listdir(d):
        drop_cache(os.path.join(d, n))


def timed_async_save(sd: Any, writer: Any, stager: Any, **kw: Any) -> dict[str, float]:
    """One ``dcp.async_save``: seconds until it returned (training blocked), until
    staging completed and until the upload completed."""
    sync()
    t0 = time.perf_counter()
    if stager is not None:
        kw["async_stager"] = stager
    r = dcp.async_save(sd, storage_writer=writer, **kw)
    t_ret = time.perf_counter() - t0
    if hasattr(r, "staging_completion"):
        r.staging_completion.result()
        t_stage = time.perf_counter() - t0
        r.upload_completion.result()
    else:
        t_stage = t_ret  # staging ran inside async_save
        r.result()
    return {"return_s": t_ret, "staged_s": t_stage, "upload_s": time.perf_counter() - t0}


def run_saves(name: str, sd: dict, d: str, saves: int, make: Any) -> dict[str, Any]:
    """``make(i)`` -> (storage_writer, async_stager or None); ``sd`` as handed to async_save."""
    rows = []
    closers = []
    for i in range(saves):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        settle_disk(d)
        writer, stager = make(i)
        if stager is not None and stager not in closers:
            closers.append(stager)
        row = timed_async_save(sd, writer, stager, no_dist=True)
        t_ret, t_stage, t_up = row["return_s"], row["staged_s"], row["upload_s"]
        stage_call = getattr(stager, "last_stage_call_s", None)
        rows.append(dict(row, stage_call_s=stage_call))
        inside = f" (stage() {stage_call * 1e3:5.1f} ms)" if stage_call is not None else ""
        print(
            f"  {name:<34} save {i + 1}: return {t_ret * 1e3:8.1f} ms{inside}  "
            f"staged {t_stage:6.3f} s  upload {t_up:6.3f} s",
            flush=True,
        )
    for s in closers:
        s.close()
    return {"name": name, "saves": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2G")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--json")
    ap.add_argument("--only", default="", help="comma list of configs to run")
    ap.add_argument(
        "--layout",
        default="nested",
        choices=["nested", "flat"],
        help='nested: {"model": state dict}, as trainers pass it; flat: the tensors as keys',
    )
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, Any] = {"device": dev, "torch": torch.__version__, "sizes": []}
    for size_s in args.sizes.split(","):
        size = _size(size_s)
        sd = synthetic_state_dict(size, device=dev, dtype=torch.bfloat16)
        n = nbytes(sd)
        d = os.path.join(args.dir, "ckptio_bench_dcp")
        print(f"== {size_s}: {n / GiB:.2f} GiB bf16 on {dev}, {len(sd)} tensors", flush=True)
        res: dict[str, Any] = {"size": size_s, "nbytes": n, "configs": []}
        res["pinned_d2h_gib_s"] = pinned_d2h(sd)
        print(f"  pinned D2H copy: {res['pinned_d2h_gib_s']:.1f} GiB/s", flush=True)
        # The baseline under the same conditions as each async save (fresh folder, synced).
        sync_times = []
        for _ in range(3):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
            settle_disk(d)
            t0 = time.perf_counter()
            ckptio.save(sd, os.path.join(d, "sync.pt"))
            sync_times.append(time.perf_counter() - t0)
        res["ckptio_save_s"] = statistics.median(sync_times)
        print(f"  ckptio.save (sync, median of 3): {res['ckptio_save_s']:.3f} s", flush=True)

        # As trainers call it ({"model": ..., "optim": ...}): torch's async_save
        # spends ~40 us per top-level key logging it (before any stager runs), so
        # a flat dict of 512 tensors adds ~20 ms to every call; one row shows it.
        state = {"model": sd} if args.layout == "nested" else sd
        configs = {
            "torch default": lambda i, d=d: (dcp.FileSystemWriter(d), None),
            "torch FSW(cache_staged=True)": _cached_torch_writer(d),
            "torch DefaultStager (fresh)": lambda i, d=d: (
                dcp.FileSystemWriter(d),
                _torch_default_stager(),
            ),
            "ckptio DefaultStager host": _ours(d, StagingOptions(use_shared_memory=False)),
            "ckptio DefaultStager snapshot": _ours(
                d, StagingOptions(use_shared_memory=False, device_snapshot=dev == "cuda")
            ),
            "ckptio DefaultStager host, prepare()d": _ours(
                d, StagingOptions(use_shared_memory=False), prepare=state
            ),
            "ckptio DefaultStager shared": _ours(d, StagingOptions()),
        }
        flat = "ckptio DefaultStager host, flat dict"
        only = [s for s in args.only.split(",") if s]
        for name, make in configs.items():
            if only and not any(o in name for o in only):
                continue
            try:
                res["configs"].append(run_saves(name, state, d, args.saves, make))
            except Exception as e:  # noqa: BLE001 - e.g. pinned memory without a GPU
                print(f"  {name}: skipped ({type(e).__name__}: {str(e)[:120]})", flush=True)
            if args.json:
                _dump(args.json, out, res)

        if args.layout == "nested" and (not only or any(o in flat for o in only)):
            opts = StagingOptions(use_shared_memory=False)
            d_flat = d + "_flat"  # keeps the nested checkpoint in d for the loads
            res["configs"].append(run_saves(flat, sd, d_flat, args.saves, _ours(d_flat, opts)))
            shutil.rmtree(d_flat, ignore_errors=True)

        # dcp.load, cold, with each reader (the checkpoint of the last config).
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        dst_state = {"model": dst} if state is not sd else dst
        for name, reader in (
            ("torch FileSystemReader", dcp.FileSystemReader),
            ("ckptio", FileSystemReader),
        ):
            times = []
            for _ in range(2):
                drop_dir(d)
                sync()
                t0 = time.perf_counter()
                dcp.load(dst_state, storage_reader=reader(d), no_dist=True)
                sync()
                times.append(time.perf_counter() - t0)
            res[f"load_{name}_s"] = min(times)
            print(f"  dcp.load {name:<24} {n / GiB / min(times):6.2f} GiB/s", flush=True)
        assert all(torch.equal(dst[k], sd[k]) for k in sd)
        # The disk's limit for those loads: its data file read cold, 8 threads,
        # O_DIRECT and buffered (readahead can win on some disks).
        data = max((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize)
        size_ = os.path.getsize(data) // 4096 * 4096
        with mmap.mmap(-1, size_) as m:
            direct = cold_read(data, memoryview(m), getattr(os, "O_DIRECT", 0))
        res["raw_read_gib_s"] = size_ / GiB / min(direct, buffered_cold_read(data, size_))
        print(f"  raw read, cold, best        {res['raw_read_gib_s']:6.2f} GiB/s", flush=True)
        # A first staging into new buffers faults their pages in, whatever else it
        # does: the same buffers, faulted in alone, after the saves (so with pages
        # the guest has used before: the lower figure).
        sizes = [v.untyped_storage().nbytes() for v in sd.values()]
        res["fault_fresh_s"] = fresh_memory_fault_s(sizes)
        print(
            f"  fresh host memory faulted in (16 threads): {res['fault_fresh_s']:.3f} s "
            f"({n / GiB / res['fault_fresh_s']:.1f} GiB/s)",
            flush=True,
        )
        shutil.rmtree(d, ignore_errors=True)
        _summary(res)
        if args.json:
            _dump(args.json, out, res)
        del sd, dst
        if dev == "cuda":
            torch.cuda.empty_cache()


def _cached_torch_writer(d: str) -> Any:
    w = dcp.FileSystemWriter(d, cache_staged_state_dict=True)
    return lambda i: (w, None)


def _torch_default_stager() -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager as TorchStager

    return TorchStager()  # torch 2.11's cannot be reused (pytorch#183413)


def _ours(d: str, opts: StagingOptions, prepare: Any = None) -> Any:
    """One stager for all saves of a config, made at its first save; with
    ``prepare``, its buffers are pinned ahead (untimed, as at a trainer's setup)."""
    made: list[DefaultStager] = []

    def make(i: int) -> Any:
        if not made:
            made.append(DefaultStager(opts))
            if prepare is not None:
                made[0].prepare(prepare).result()
        return FileSystemWriter(d), made[0]

    return make


def _summary(res: dict[str, Any]) -> None:
    n = res["nbytes"]
    pin = res["pinned_d2h_gib_s"]
    sync_s = res["ckptio_save_s"]
    print("  -- targets")
    for c in res["configs"]:
        s = c["saves"]
        later = s[1:] or s
        ret = max(x["return_s"] for x in s) * 1e3
        ret_later = max(x["return_s"] for x in later) * 1e3
        staged_bw = n / GiB / statistics.median(x["staged_s"] for x in later)
        first_ratio = s[0]["staged_s"] / statistics.median(x["staged_s"] for x in later)
        up = statistics.median(x["upload_s"] for x in later) / sync_s
        c["summary"] = {
            "max_return_ms": ret,
            "max_return_later_ms": ret_later,
            "staging_gib_s": staged_bw,
            "staging_vs_pinned": staged_bw / pin if pin == pin else None,
            "first_vs_later": first_ratio,
            "upload_vs_sync_ckptio_save": up,
        }
        print(
            f"  {c['name']:<34} return max {ret:6.1f} ms (later {ret_later:5.1f}) | "
            f"staging {staged_bw:6.1f} GiB/s "
            f"({staged_bw / pin:4.2f}x pinned) | 1st/later {first_ratio:4.2f} | "
            f"upload {up:4.2f}x sync ckptio.save"
        )
    later = [
        statistics.median(x["staged_s"] for x in c["saves"][1:] or c["saves"])
        for c in res["configs"]
        if c["name"].startswith("ckptio") and "snapshot" not in c["name"]
    ]
    if later and "fault_fresh_s" in res:
        floor = res["fault_fresh_s"] / min(later)
        print(f"  a first staging into fresh memory: >= {floor:.2f}x a later one (faults alone)")
    torch_load = res["load_torch FileSystemReader_s"]
    ours = res["load_ckptio_s"]
    print(f"  dcp.load ours vs torch: {torch_load / ours:.2f}x", end="")
    if "raw_read_gib_s" in res:
        raw = res["raw_read_gib_s"]
        print(
            f" | ours {n / GiB / ours / raw:.2f}x the disk's raw read; "
            f"2x torch would need {2 * n / GiB / torch_load / raw:.2f}x it",
            end="",
        )
    print()


def _dump(path: str, out: dict[str, Any], res: dict[str, Any]) -> None:
    sizes = [r for r in out["sizes"] if r["size"] != res["size"]] + [res]
    with open(path, "w") as f:
        json.dump(dict(out, sizes=sizes), f, indent=1)


if __name__ == "__main__":
    main()
