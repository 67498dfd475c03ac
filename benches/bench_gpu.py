"""GPU checkpoint benchmark, side by side in one run (issue: GPU data path).

For each size (bf16 state dicts on the GPU) and folder it measures: the disk's
raw limits (O_DIRECT write + fsync, cold O_DIRECT and cold buffered reads),
pinned D2H bandwidth, torch.save + fsync, torch.load(map_location="cuda"),
the PyTorch tutorial's torch.cuda.gds recipe, KvikIO (POSIX and cuFile paths,
8 threads, in subprocesses so its environment applies), and ckptio.save/load
through the bounce pipeline and through cuFile. Prints a table per case and
writes all rows as JSON.

The rows the targets compare run ``--rounds`` times, interleaved, and the table
shows medians (the VM's disk drifts by 1.5x within a run), then the ratios: of
the medians, and paired (the median over rounds of each round's own ratio, rows
that ran a minute apart at most: the drift between rounds cancels).

Usage: python benches/bench_gpu.py [--sizes 2G,8G] [--rounds 3] [--dir /tmp]
                                   [--shm-size 8G] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import benchlib
import ckptio
import torch
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench

GiB = 2**30
ROWS: list[dict] = []


def row(case: str, name: str, seconds: float | None, nbytes: int, note: str = "") -> None:
    r = {
        "case": case,
        "name": name,
        "seconds": seconds,
        "nbytes": nbytes,
        "note": note,
        "gib_s": (nbytes / GiB / seconds) if seconds else None,
    }
    ROWS.append(r)
    g = f"{r['gib_s']:7.2f}" if r["gib_s"] else "      -"
    s = f"{seconds:8.3f}" if seconds else "       -"
    print(f"{case:<14} {name:<34} {s} {g}  {note}", flush=True)


def timed(fn, where: str | None = None) -> float:
    """Seconds for ``fn``, GPU work included; first, the disk under ``where`` settles."""
    if where:
        bench.settle_disk(where)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def d2h_pinned(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm up
    t = timed(lambda: dst.copy_(src, non_blocking=True))
    return t


def gds_recipe(sd: dict, path: str) -> tuple[float, float]:
    """The tutorial: skip_data save, FakeTensorMode offsets, GdsFile.save_storage; and back."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.serialization import config

    old = config.save.storage_alignment
    config.save.storage_alignment = 4096
    try:

        def save() -> None:
            with torch.serialization.skip_data():
                torch.save(sd, path)
            with FakeTensorMode():
                fake = torch.load(path)
            f = torch.cuda.gds.GdsFile(path, os.O_RDWR)
            for k, v in sd.items():
                f.save_storage(v.untyped_storage(), fake[k].untyped_storage()._checkpoint_offset)
            del f
            bench.fsync_path(path)

        ws = timed(save, os.path.dirname(path))
        bench.drop_cache(path)

        def load() -> None:
            with FakeTensorMode():
                fake = torch.load(path)
            with torch.serialization.skip_data():
                out = torch.load(path)
            f = torch.cuda.gds.GdsFile(path, os.O_RDONLY)
            for k, v in out.items():
                f.load_storage(v.untyped_storage(), fake[k].untyped_storage()._checkpoint_offset)
            del f

        return ws, timed(load)
    finally:
        config.save.storage_alignment = old


KVIKIO_CHILD = r"""
import json, os, sys, time
import torch, kvikio, kvikio.defaults
sys.path.insert(0, os.environ["CKPTIO_BENCH_DIR"])
from ckptio.tools import bench
path, size = sys.argv[1], int(sys.argv[2])
sd = bench.synthetic_state_dict(size, "cuda", torch.bfloat16)
offs, off = [], 0
for t in sd.values():
    offs.append(off); off += (t.numel() * 2 + 4095) // 4096 * 4096
torch.cuda.synchronize()
bench.settle_disk(os.path.dirname(path))
t0 = time.perf_counter()
f = kvikio.CuFile(path, "w")
futs = [f.pwrite(t.view(torch.int16), file_offset=o) for t, o in zip(sd.values(), offs)]
for x in futs: x.get()
f.close(); bench.fsync_path(path)
ws = time.perf_counter() - t0
bench.drop_cache(path)
out = [torch.empty_like(t) for t in sd.values()]
torch.cuda.synchronize()
t0 = time.perf_counter()
f = kvikio.CuFile(path, "r")
futs = [f.pread(t.view(torch.int16), file_offset=o) for t, o in zip(out, offs)]
for x in futs: x.get()
f.close(); torch.cuda.synchronize()
rs = time.perf_counter() - t0
ok = all(torch.equal(a, b) for a, b in zip(sd.values(), out))
mode = str(kvikio.defaults.get("compat_mode"))
print(json.dumps({"write": ws, "read": rs, "ok": ok, "compat": mode}))
"""


def kvikio_run(folder: str, size: int, mode: str, threads: int = 8) -> tuple[float, float, str]:
    env = dict(
        os.environ,
        KVIKIO_COMPAT_MODE=mode,
        KVIKIO_NTHREADS=str(threads),
        CKPTIO_BENCH_DIR=os.path.dirname(os.path.dirname(ckptio.__file__)),
    )
    path = os.path.join(folder, f"kvikio_{mode}.bin")
    p = subprocess.run(
        [sys.executable, "-c", KVIKIO_CHILD, path, str(size)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    try:
        os.unlink(path)
    except OSError:
        pass
    if p.returncode != 0:
        raise RuntimeError(p.stderr.strip().splitlines()[-1] if p.stderr else "failed")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r["write"], r["read"], f"compat={r['compat']} ok={r['ok']}"


def case(label: str, folder: str, size: int, full: bool, rounds: int, tmpfs: bool = False) -> None:
    """One size in one folder. The disk's speed drifts during a run, so the rows
    that the targets compare (raw limits, KvikIO, ckptio) are measured ``rounds``
    times, interleaved, and reported as medians; torch.save, torch.load and the
    torch.cuda.gds recipe (far from the targets, slow) run in the first round.
    On tmpfs, where a "cold" read is the first read of freshly written pages
    (slower, for any reader), ckptio.load is timed a second time as well."""
    import shutil

    tmp = tempfile.mkdtemp(prefix="ckptio-gpu-", dir=folder)
    sd = bench.synthetic_state_dict(size, "cuda", torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"\n## {label}: {nbytes / GiB:.2f} GiB bf16, {len(sd)} tensors, {tmp}", flush=True)
    times: dict[str, dict[int, float]] = {}  # row -> {round: seconds}
    notes: dict[str, str] = {}
    r = 0  # the round, for rec

    def rec(name: str, seconds: float | None, note: str = "") -> None:
        times.setdefault(name, {})
        if seconds is not None:
            times[name][r] = seconds
        if note:
            notes[name] = note

    def attempt(name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # a peer that cannot run here is a row, not a crash
            rec(name, None, f"unavailable: {type(e).__name__}: {e}"[:160])

    def raw_rows() -> None:
        raw_ = bench.raw_limits(tmp, nbytes)
        tag = " (O_DIRECT)" if raw_.direct else ""
        rec("raw write + fsync" + tag, raw_.write)
        rec("raw read, cold" + tag, raw_.read)
        raw = os.path.join(tmp, "rawb.bin")
        with open(raw, "wb") as f:
            chunk = os.urandom(1 << 20) * 64
            for _ in range(0, nbytes, len(chunk)):
                f.write(chunk)
        rec("raw read, cold (buffered)", benchlib.buffered_cold_read(raw, nbytes))
        os.unlink(raw)

    def torch_rows() -> None:
        p = os.path.join(tmp, "torch.pt")
        rec("torch.save + fsync", timed(lambda: (torch.save(sd, p), bench.fsync_path(p)), tmp))
        bench.drop_cache(p)
        rec(
            "torch.load -> cuda, cold",
            timed(lambda: torch.load(p, map_location="cuda", weights_only=True)),
        )
        os.unlink(p)

    def gds_rows() -> None:
        p = os.path.join(tmp, "gds.pt")
        w, r = gds_recipe(sd, p)
        rec("torch.cuda.gds recipe save", w)
        rec("torch.cuda.gds recipe load", r)
        os.unlink(p)

    def kv(mode: str) -> None:
        w, r, note = kvikio_run(tmp, size, mode)
        name = "KvikIO posix" if mode == "ON" else "KvikIO cuFile"
        rec(f"{name} write + fsync", w, note)
        rec(f"{name} read, cold", r, note)

    def ck(backend: str, warm_up: bool) -> None:
        # Warm the engine (pinned pool) on another file once, then time a save
        # to a fresh path, as every other row does.
        if warm_up:
            warm = os.path.join(tmp, f"warm_{backend}.pt")
            ckptio.save(sd, warm, backend=backend)
            os.unlink(warm)
        p = os.path.join(tmp, f"ckptio_{backend}.pt")
        t = timed(lambda: ckptio.save(sd, p, backend=backend), tmp)
        rep = ckptio.last_report()
        rec(
            f"ckptio.save ({backend})",
            t,
            f"ran={rep.device_path} gds_mode={rep.gds_mode} direct={rep.direct}",
        )
        bench.drop_cache(p)
        out = {}
        t = timed(lambda: out.update(x=ckptio.load(p, map_location="cuda", backend=backend)))
        rep = ckptio.last_report()
        ok = all(torch.equal(out["x"][k], v) for k, v in sd.items())
        rec(f"ckptio.load ({backend}), cold", t, f"ran={rep.device_path} ok={ok}")
        if tmpfs:
            out.clear()
            t = timed(lambda: out.update(x=ckptio.load(p, map_location="cuda", backend=backend)))
            rec(f"ckptio.load ({backend}), pages read before", t)
        eng = ckptio.io.engines.engine(None, None, None)
        notes["ckptio pinned pool"] = f"{eng.pinned_bytes() / 2**20:.0f} MiB"
        out.clear()
        os.unlink(p)

    rec("D2H pinned copy", d2h_pinned(nbytes))
    for r in range(rounds):
        attempt("raw", raw_rows)
        if full and r == 0:
            attempt("torch.save/load", torch_rows)
            attempt("torch.cuda.gds recipe", gds_rows)
        for mode in ("ON", "AUTO") if full else ("ON",):
            attempt(f"KvikIO {mode}", lambda mode=mode: kv(mode))
        for backend in ("posix", "cufile") if full else ("posix",):
            attempt(f"ckptio {backend}", lambda backend=backend, r=r: ck(backend, r == 0))
    for name, by_round in times.items():
        ts = list(by_round.values())
        if ts:
            spread = f"n={len(ts)} {nbytes / GiB / max(ts):.2f}-{nbytes / GiB / min(ts):.2f} GiB/s"
            note = f"{spread} {notes.get(name, '')}".strip()
            row(label, name, statistics.median(ts), nbytes, note)
        else:
            row(label, name, None, nbytes, notes.get(name, ""))
    if "ckptio pinned pool" in notes:
        row(label, "ckptio pinned pool", None, nbytes, notes["ckptio pinned pool"])
    ratios(label, times)
    sd.clear()
    torch.cuda.empty_cache()
    shutil.rmtree(tmp, ignore_errors=True)


def ratios(label: str, times: dict[str, dict[int, float]]) -> None:
    """The targets, higher is better for ckptio: the ratio of the medians, then
    (in brackets) the median of the rounds' own ratios."""
    found = {k: v for k, v in times.items() if v}

    def get(prefix: str) -> dict[int, float] | None:
        return next((v for k, v in found.items() if k.startswith(prefix)), None)

    def rel(base: dict[int, float], ours: dict[int, float]) -> str:
        m = statistics.median(base.values()) / statistics.median(ours.values())
        both = sorted(base.keys() & ours.keys())
        if not both:
            return f"{m:.2f}x"
        return f"{m:.2f}x ({statistics.median(base[i] / ours[i] for i in both):.2f}x)"

    raw_w = get("raw write")
    reads = [x for x in (get("raw read, cold (O"), get("raw read, cold (b")) if x]
    # The better of O_DIRECT and buffered, round by round.
    raw_r = {i: min(x[i] for x in reads if i in x) for i in set().union(*reads)}
    peers_w = {k: v for k, v in found.items() if k.startswith("KvikIO") and "write" in k}
    peers_r = {
        k: v
        for k, v in found.items()
        if ("KvikIO" in k and "read" in k) or k.startswith("torch.load")
    }
    pinned = get("D2H pinned copy")
    for b in ("posix", "cufile"):
        sv, ld = found.get(f"ckptio.save ({b})"), found.get(f"ckptio.load ({b}), cold")
        parts = []
        if sv and raw_w:
            parts.append(f"save {rel(raw_w, sv)} raw write")
            parts += [f"{rel(v, sv)} {k.split(' write')[0]}" for k, v in peers_w.items()]
        if ld and raw_r:
            parts.append(f"load {rel(raw_r, ld)} best raw read")
            parts += [
                f"{rel(v, ld)} {k.split(',')[0].split(' read')[0]}" for k, v in peers_r.items()
            ]
        again = found.get(f"ckptio.load ({b}), pages read before")
        if ld and again and pinned:  # tmpfs: the pipeline's own limit is the target
            p = statistics.median(pinned.values())
            parts.append(f"load {p / statistics.median(ld.values()):.2f}x pinned D2H")
            again_x = p / statistics.median(again.values())
            parts.append(f"pages read before {again_x:.2f}x pinned D2H")
        if parts:
            print(f"{label:<14} ratio ckptio {b:<7} " + " | ".join(parts), flush=True)
    medians = {k: statistics.median(v.values()) for k, v in found.items()}
    ROWS.append({"case": label, "name": "medians", "medians": medians, "rounds": times})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2G,8G")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--shm-size", default="8G")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved repeats of the compared rows"
    )
    ap.add_argument("--shm-rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"{'case':<14} {'what':<34} {'seconds':>8} {'GiB/s':>7}  note", flush=True)
    for s in filter(None, a.sizes.split(",")):  # --sizes "" runs the shm case only
        try:
            case(f"disk {s}", a.dir, _size(s), True, a.rounds)
        except Exception:
            traceback.print_exc()
    if a.shm_size and os.path.isdir("/dev/shm"):
        try:
            case(f"shm {a.shm_size}", "/dev/shm", _size(a.shm_size), False, a.shm_rounds, True)
        except Exception:
            traceback.print_exc()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=2)


if __name__ == "__main__":
    main()
