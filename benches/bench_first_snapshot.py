"""The first snapshot of a run (issue 37): ``dcp.async_save`` with ckptio's
``DefaultStager`` and no ``prepare()``, as a trainer calls it, each
measurement in a fresh process, against the floor measured in the same
process: the fault-in and pinning of the staging memory.

    python benches/bench_first_snapshot.py [--size 8G] [--tensors 512] [--rounds 2] [--json F]
    python benches/bench_first_snapshot.py --device cpu --size 64M --rounds 1   # a smoke test

The state dict is ``{"model": sd}`` with ``sd`` ``--tensors`` equal bf16 tensors
of ``--size`` in all on the GPU (``--shape synthetic``: the transformer-shaped
dict of ``ckptio.tools.bench.synthetic_state_dict``, small norms included). Every
save goes through ``dcp.async_save(state, storage_writer=ckptio.dcp.FileSystemWriter
(d), async_stager=stager)`` (README's call), ``d`` in ``--dir`` (/dev/shm).

Cases, each a fresh process per round (``--cases``; order reversed every round):

- ``new`` / ``old``: a new ``DefaultStager()`` (``--memory shared``, its default,
  or ``private``), no ``prepare()``: seconds from the call to
  ``staging_completion`` of the first save and of ``--saves`` - 1 later ones.
  ``new`` runs the pipelined first staging, ``old`` the design before it
  (``CKPTIO_STAGING_PIPELINE=off``): one run gives before and after.
- ``prepare`` / ``prepare-old``: first a stager that copies nothing (the
  process's first ``async_save``: what DCP itself costs), then ``prepare()``
  timed, then a save after it.
- ``snapshot`` (not by default): ``StagingOptions(device_snapshot=True)``, the
  first save staged by a device-to-device copy, for comparison.

The floor, in every process but ``snapshot``'s: the buffers the stager's first
save would make (its own plan: same kinds, sizes and slabs), timed while
allocated, faulted in on the stager's threads (MADV_POPULATE_WRITE, 64 MiB per
call) and registered with cuMemHostRegister one buffer per call, as the stager
registers them (a buffer is never registered in pieces: a copy spanning two
registrations fails). floor = fault-in + registration. The floor runs before the
saves in odd rounds and after them (the stager closed) in even ones, so each
order gets the other's freed memory, and the table shows both. Before the
rounds the parent touches and frees the memory it can spare (``--warm``): a
VM backs guest memory on its first touch, which would otherwise land on
whichever process touched it first.

Per save the stager's ``last_stats`` says where the time went: the walk, the
allocation of new buffers, and the native copy (when its last registration
ended; thread-seconds faulting in, registering, queueing copies, waiting for
them, idle). Target: first snapshot without ``prepare()`` <= 1.2x the floor.
The JSON (``--json``, else ``$OUT/bench_first_snapshot.json`` where ``OUT`` is
set) holds every process's figures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import Future
from typing import Any

import benchlib
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemWriter
from ckptio.io.units import parse_size
from ckptio.staging import DefaultStager, StagingOptions, _default_threads, _HostSlot
from ckptio.tools.bench import GiB, synthetic_state_dict
from torch.distributed.checkpoint.staging import AsyncStager

warnings.simplefilter("ignore")

CASES = ("new", "old", "prepare", "prepare-old", "snapshot")
#: CKPTIO_STAGING_PIPELINE per case.
PIPELINE = {"old": "off", "prepare-old": "off"}
TARGET = 1.2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="8G")
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--shape", default="equal", choices=["equal", "synthetic"])
    ap.add_argument("--memory", default="shared", choices=["shared", "private"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--saves", type=int, default=3, help="saves per new/old process (first included)"
    )
    ap.add_argument("--cases", default="new,old,prepare,prepare-old")
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoints go")
    ap.add_argument("--budget", type=float, default=165, help="seconds: no process starts past it")
    ap.add_argument("--warm", default="auto", help="touch spare memory first: on, off, auto (CUDA)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--json")
    ap.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--floor-first", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    parent(a)


# -- the parent: fresh processes, the table ------------------------------------------


def parent(a: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"unknown cases {bad}; choose from {CASES}")
    out: dict[str, Any] = {"args": vars(a), "host": host_facts(), "runs": []}
    print(f"# host: {json.dumps(out['host'])}", flush=True)

    def stopped(signum: int, frame: Any) -> None:  # a timeout: the table of what ran
        print(f"# signal {signum}: stopping", flush=True)
        out["summary"] = summarize(out["runs"])
        dump(a, out)
        os._exit(1)

    signal.signal(signal.SIGTERM, stopped)
    if a.warm == "on" or (a.warm == "auto" and a.device == "cuda"):
        w = benchlib.warm_spare_memory(limit_s=20.0, threads=os.cpu_count() or 16)
        out["warm_up"] = w
        print(
            f"# warm-up: {w['gib']} of {w['spare_gib']} spare GiB touched and freed "
            f"in {w['seconds']:.1f} s",
            flush=True,
        )
    longest = 0.0
    for r in range(a.rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        for case in order:
            left = a.budget - (time.perf_counter() - t_start)
            if left < 1.2 * longest:
                print(f"# budget: {case} of round {r + 1} not started ({left:.0f} s left)")
                continue
            t0 = time.perf_counter()
            res = run_child(a, case, floor_first=r % 2 == 1, timeout=max(left, 30))
            longest = max(longest, time.perf_counter() - t0)
            res.update(round=r + 1, wall_s=time.perf_counter() - t0)
            out["runs"].append(res)
            print(describe(res), flush=True)
            dump(a, out)
    out["summary"] = summarize(out["runs"])
    dump(a, out)
    print(f"# total {time.perf_counter() - t_start:.0f} s", flush=True)


def run_child(a: argparse.Namespace, case: str, floor_first: bool, timeout: float) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", case]
    for k in ("size", "tensors", "shape", "memory", "saves", "dir", "device"):
        argv += [f"--{k}", str(getattr(a, k))]
    if floor_first:
        argv.append("--floor-first")
    env = dict(os.environ, CKPTIO_STAGING_PIPELINE=PIPELINE.get(case, "on"))
    root = tempfile.mkdtemp(prefix="ckptio_first_snapshot_", dir=a.dir)
    argv[argv.index("--dir") + 1] = root
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
    return {"case": case, "error": f"exit {p.returncode}: " + " | ".join(tail)}


def describe(res: dict) -> str:
    head = f"round {res.get('round')} {res['case']:<11}"
    if "error" in res:
        return f"{head} FAILED: {res['error']}"
    parts = [f"pipeline {res['pipeline']}"]
    fl = res.get("floor")
    if fl:
        parts.append(
            f"floor {fl['floor_s']:.3f} s ({'before' if res['floor_first'] else 'after'} saves: "
            f"alloc {fl['alloc_s']:.3f}, fault-in {fl['fault_s']:.3f}, register "
            f"{fl['register_s']:.3f} [first call {fl['first_register_s'] * 1e3:.1f} ms], "
            f"{fl['buffers']} buffers)"
        )
    if "nocopy_s" in res:
        parts.append(f"no-copy stager's first snapshot {res['nocopy_s'] * 1e3:.1f} ms")
    if "prepare_s" in res:
        parts.append(f"prepare() {res['prepare_s']:.3f} s ({res['prepared_gib']:.2f} GiB pinned)")
    saves = res.get("saves", [])
    if saves:
        first = saves[0]["staged_s"]
        ratio = f" = {first / fl['floor_s']:.2f}x floor" if fl and fl["floor_s"] > 0 else ""
        later = " ".join(f"{s['staged_s']:.3f}" for s in saves[1:])
        label = "first after prepare()" if "prepare_s" in res else "first"
        parts.append(f"{label} {first:.3f} s{ratio}; later {later or '-'} s")
        parts.append(f"exact {res.get('exact')}")
    lines = [head + " " + "; ".join(parts)]
    for i, s in enumerate(saves):
        st = s.get("stats", {})
        if "seconds" not in st:
            continue
        lines.append(
            f"    save {i + 1}: returned {s['return_s'] * 1e3:.1f} ms, "
            f"staged {s['staged_s']:.3f} s = walk {st.get('walk_s', 0):.3f} "
            f"+ alloc {st.get('alloc_s', 0):.3f} + copy "
            f"{st['seconds']:.3f} (last registration done at {st['pinned_at_s']:.3f}, "
            f"{st['registrations']} made; thread-s: fault-in {st['fault_s']:.2f}, register "
            f"{st['register_s']:.2f}, queue {st['copy_s']:.2f}, wait {st['sync_s']:.2f}, "
            f"idle {st['idle_s']:.2f}; {st['threads']} threads, {st['pieces']} pieces, "
            f"unpinned {st['unpinned_device_bytes'] / GiB:.2f} GiB)"
        )
    return "\n".join(lines)


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Medians per case, printed as the table; the ratios are taken per process."""
    ok = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {}
    print("\n== summary: medians over the fresh processes (n), seconds")
    print(
        f"{'case':<12} {'n':>2} {'first':>7} {'later':>7} {'floor':>7} {'first/floor':>12} "
        f"{'floor before / after':>21} {'prepare()':>9} {'no-copy':>8}"
    )
    for case in CASES:
        rs = [r for r in ok if r["case"] == case]
        if not rs:
            continue

        def med(xs: list[float]) -> float:
            return statistics.median(xs) if xs else float("nan")

        first = [r["saves"][0]["staged_s"] for r in rs if r.get("saves")]
        later = [s["staged_s"] for r in rs for s in r.get("saves", [])[1:]]
        floors = [r["floor"]["floor_s"] for r in rs if r.get("floor")]
        ratio = {
            fb: [
                r["saves"][0]["staged_s"] / r["floor"]["floor_s"]
                for r in rs
                if r.get("floor") and r.get("saves") and r["floor_first"] == fb
            ]
            for fb in (True, False)
        }
        both = ratio[True] + ratio[False]
        row = {
            "n": len(rs),
            "first_s": med(first),
            "later_s": med(later),
            "floor_s": med(floors),
            "first_over_floor": med(both),
            "first_over_floor_floor_before": ratio[True],
            "first_over_floor_floor_after": ratio[False],
            "prepare_s": med([r["prepare_s"] for r in rs if "prepare_s" in r]),
            "nocopy_s": med([r["nocopy_s"] for r in rs if "nocopy_s" in r]),
        }
        out[case] = row
        by_order = " / ".join(
            ",".join(f"{x:.2f}" for x in ratio[fb]) or "-" for fb in (True, False)
        )
        print(
            f"{case:<12} {row['n']:>2} {row['first_s']:>7.3f} {row['later_s']:>7.3f} "
            f"{row['floor_s']:>7.3f} {row['first_over_floor']:>11.2f}x {by_order:>21} "
            f"{row['prepare_s']:>9.3f} {row['nocopy_s'] * 1e3:>6.1f}ms"
        )
    for case in ("new", "old"):
        if case in out and out[case]["first_over_floor"] == out[case]["first_over_floor"]:
            x = out[case]["first_over_floor"]
            verdict = "met" if x <= TARGET else "MISSED"
            print(f"target ({case}): first snapshot / floor {x:.2f}x <= {TARGET}x: {verdict}")
    if "new" in out and "old" in out:
        out["old_over_new_first"] = out["old"]["first_s"] / out["new"]["first_s"]
        out["new_over_old_later"] = out["new"]["later_s"] / out["old"]["later_s"]
        print(
            f"before/after: first snapshot old / new {out['old_over_new_first']:.2f}x; "
            f"later saves new / old {out['new_over_old_later']:.2f}x (no regression: ~1.0)"
        )
    if "prepare" in out and "new" in out:
        p = out["prepare"]
        print(
            f"prepare(): {p['prepare_s']:.3f} s; the first save after it {p['first_s']:.3f} s; "
            f"without it the first save takes {out['new']['first_s'] - p['first_s']:.3f} s "
            f"more than with it"
        )
    return out


def dump(a: argparse.Namespace, out: dict) -> None:
    path = a.json
    if path is None and os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_first_snapshot.json")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1, default=str)


def host_facts() -> dict[str, Any]:
    def read(p: str) -> str | None:
        try:
            with open(p) as f:
                return f.read().strip()
        except OSError:
            return None

    thp = "/sys/kernel/mm/transparent_hugepage/"
    return {
        "cores": os.cpu_count(),
        "mem_total_gib": round(benchlib.meminfo("MemTotal") / GiB, 1),
        "thp_enabled": read(thp + "enabled"),
        "thp_shmem_enabled": read(thp + "shmem_enabled"),
        "page_reporting_order": read("/sys/module/page_reporting/parameters/page_reporting_order"),
        "torch": torch.__version__,
        "stager_threads": _default_threads(),
    }


# -- a child: one fresh process ------------------------------------------------------


def child(a: argparse.Namespace) -> None:
    dev = a.device
    if dev == "cuda":
        torch.cuda.init()
    state = {"model": make_state_dict(a, dev)}
    sync(dev)
    opts = StagingOptions(use_shared_memory=a.memory == "shared")
    res: dict[str, Any] = {
        "case": a.child,
        "pipeline": os.environ.get("CKPTIO_STAGING_PIPELINE", "on"),
        "floor_first": a.floor_first,
        "bytes": sum(t.numel() * t.element_size() for t in state["model"].values()),
        "tensors": len(state["model"]),
    }
    root = a.dir  # the parent's folder for this process, removed by the parent
    if a.child == "snapshot":
        snap = StagingOptions(use_shared_memory=opts.use_shared_memory, device_snapshot=True)
        res["saves"], res["exact"] = timed_saves(state, DefaultStager(snap), a.saves, root, False)
    else:
        if a.floor_first:
            res["floor"] = floor(state, opts, dev)
        # The last upload is waited for only where the floor comes after it.
        wait = not a.floor_first
        stager = DefaultStager(opts)
        if a.child in ("new", "old"):
            res["saves"], res["exact"] = timed_saves(state, stager, a.saves, root, wait)
        else:
            res["nocopy_s"] = timed_saves(state, NoCopyStager(), 1, root)[0][0]["staged_s"]
            t0 = time.perf_counter()
            res["prepared_gib"] = stager.prepare(state).result() / GiB
            res["prepare_s"] = time.perf_counter() - t0
            res["saves"], res["exact"] = timed_saves(state, stager, 1, root, wait)
        if wait:
            stager.close()
            res["floor"] = floor(state, opts, dev)
    print("RESULT " + json.dumps(res), flush=True)
    sys.stdout.flush()
    # An upload not waited for ends with the process; the parent removes its files.
    os._exit(0)


def make_state_dict(a: argparse.Namespace, dev: str) -> dict[str, torch.Tensor]:
    size = parse_size(a.size)
    if a.shape == "synthetic":
        return synthetic_state_dict(size, device=dev, dtype=torch.bfloat16)
    n = size // a.tensors // 2
    g = torch.Generator(device=dev).manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randint(
            -(2**15), 2**15, (n,), dtype=torch.int16, device=dev, generator=g
        ).view(torch.bfloat16)
        for i in range(a.tensors)
    }


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def timed_saves(
    state: dict, stager: Any, n: int, root: str, wait_last: bool = True
) -> tuple[list[dict], bool | None]:
    """``n`` consecutive ``dcp.async_save`` calls, each waited for (staging, then
    upload, the last one's upload only with ``wait_last``) before the next; per
    save the seconds from the call to its return and to its staging completion,
    and the stager's ``last_stats``. Whether the first snapshot equals the state
    dict (a sample of its tensors, copied back to the device from the staged
    buffers)."""
    rows, exact = [], None
    for i in range(n):
        d = os.path.join(root, f"save{i}")
        sync_all(state)
        t0 = time.perf_counter()
        r = dcp.async_save(
            state, storage_writer=FileSystemWriter(d), async_stager=stager, no_dist=True
        )
        t_ret = time.perf_counter() - t0
        r.staging_completion.result()
        t_staged = time.perf_counter() - t0
        stats = dict(getattr(stager, "last_stats", {}) or {})
        if i == 0 and isinstance(stager, DefaultStager):
            exact = staged_matches(stager, state)
        row = {"return_s": t_ret, "staged_s": t_staged, "stats": stats}
        rows.append(row)
        if i + 1 < n or wait_last:
            r.upload_completion.result()
            row["upload_s"] = time.perf_counter() - t0
            shutil.rmtree(d, ignore_errors=True)
    return rows, exact


def sync_all(state: dict) -> None:
    if any(t.is_cuda for t in state["model"].values()):
        torch.cuda.synchronize()


def staged_matches(stager: DefaultStager, state: dict) -> bool:
    fut = stager._future
    if fut is None:
        return False
    staged = fut.result()["model"]
    keys = list(state["model"])
    sample = keys[:: max(1, len(keys) // 8)] + keys[-1:]
    for k in sample:
        src = state["model"][k]
        # Bytes, not values: random bits hold NaNs, which never compare equal.
        if not torch.equal(staged[k].to(src.device).view(torch.uint8), src.view(torch.uint8)):
            return False
    return True


class NoCopyStager(AsyncStager):  # type: ignore[misc]
    """A stager that copies nothing: its snapshot is the state dict itself (what
    ``dcp.async_save`` costs without any staging)."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: Any, **kwargs: Any) -> Any:
        f: Future[Any] = Future()
        f.set_result(state_dict)
        return f

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def floor(state: dict, opts: StagingOptions, dev: str) -> dict[str, Any]:
    """The fault-in and pinning of the buffers a first save of ``state`` makes,
    made by the stager's own plan, faulted in on its threads and registered one
    buffer per call (as it registers them), each step timed; then unregistered
    (timed apart) and freed."""
    stager = DefaultStager(opts)
    threads = stager._threads
    t0 = time.perf_counter()
    plan, _ = stager._plan(state)
    plan.materialize()
    alloc_s = time.perf_counter() - t0
    bufs: dict[int, Any] = {}
    for b in plan.memo.values():
        hb = b.slab.buffer if isinstance(b, _HostSlot) else b
        bufs[id(hb)] = hb
    ranges = [(hb.storage.data_ptr(), hb.nbytes) for hb in bufs.values()]
    fault_s = benchlib.madvise_s(ranges, threads, 64 << 20)
    register_s = unregister_s = first_register_s = float("nan")
    if dev == "cuda":
        cu = benchlib.libcuda()
        ctx = ctypes.c_void_p()
        benchlib.cuda_check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError("no current CUDA context on the bench's thread")
        t0 = time.perf_counter()
        for i, (addr, n) in enumerate(ranges):
            benchlib.cuda_check(cu.cuMemHostRegister_v2(addr, n, 1), "cuMemHostRegister")
            if i == 0:
                first_register_s = time.perf_counter() - t0
        register_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for addr, _ in ranges:
            benchlib.cuda_check(cu.cuMemHostUnregister(addr), "cuMemHostUnregister")
        unregister_s = time.perf_counter() - t0
    stager.close()
    del plan, bufs
    return {
        "alloc_s": alloc_s,
        "fault_s": fault_s,
        "register_s": register_s,
        "first_register_s": first_register_s,
        "unregister_s": unregister_s,
        "floor_s": fault_s + register_s if dev == "cuda" else fault_s,
        "buffers": len(ranges),
        "bytes": sum(n for _, n in ranges),
        "threads": threads,
    }


if __name__ == "__main__":
    main()
