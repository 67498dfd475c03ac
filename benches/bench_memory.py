"""Every data path at the memory and PCIe limits when storage is not the wall
(issue 16), on the GPU machine, in one run: medians of ``--rounds`` interleaved
rounds, every ratio against a limit measured in the same run.

    python benches/bench_memory.py [--size 8G] [--rounds 3] [--disk-dir /tmp] [--json OUT]
    python benches/bench_memory.py --device cpu --size 256M --rounds 1   # a smoke test

An 8 GiB bf16 state dict on the GPU (512 tensors):

- limits: the pinned H2D and D2H copy of the same bytes (one 8 GiB copy).
- /dev/shm: ckptio.save against a raw write of the same bytes from pinned memory
  into a fresh tmpfs file by as many threads as cores; ckptio.load to CUDA right
  after the save ("first": freshly written pages) and again ("repeat"), copying
  from a mapping of the page cache (CKPTIO_MEMORY_PATH=map, the default) and with
  pread; KvikIO's POSIX path with as many threads as cores (its own write, then its
  first read); ckptio.safetensors.load_file(device="cuda") right after save_file,
  and safetensors.load_file(device="cuda") of the same file.
- page cache: a checkpoint on the disk read once by another process (``cat``):
  ckptio.load to CUDA (memory path); the same file cold: ckptio.load (disk path,
  O_DIRECT) against the raw O_DIRECT read of the same bytes (8 threads, 64 MiB).
- staging: DefaultStager (THREAD mode, no prepare()), private and shared buffers:
  the first staging of a new stager and the two after it, against the pinned D2H
  copy and the floor: fresh buffers of the same sizes faulted in (huge pages asked
  for) and registered (``stage_pin`` on 16 threads), measured right after.
- pinned lanes: a new engine's first load from /dev/shm with its lanes as
  registered huge-page mappings and as cuMemHostAlloc memory (CKPTIO_PINNED_ALLOC).

Huge pages: every row runs under CKPTIO_HUGE_PAGES as set (default auto), and the
staging and floor rows run once more with it "on" where auto means off (a VM with
free page reporting, see ``ckptio info``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ckptio
import ckptio.dcp
import ckptio.safetensors as cst
import ckptio.serialization as ser
import torch
from ckptio import _native, bench
from ckptio.cli import _size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import kvikio_run  # noqa: E402

GiB = 1 << 30
CORES = os.cpu_count() or 8
times: dict[str, list[float]] = {}
notes: dict[str, str] = {}
DEV = "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def rec(name: str, seconds: float | None, note: str = "") -> None:
    if seconds is not None:
        times.setdefault(name, []).append(seconds)
    if note:
        notes[name] = note


def timed(fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def attempt(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:  # a peer that cannot run here is a row, not a crash
        rec(name, None, f"unavailable: {type(e).__name__}: {e}"[:200])


ENGINES: dict[str, Any] = {}


def memory_path(mode: str) -> None:
    """Every loader takes its engine from ``_engine``: hand them one engine per
    memory-path mode, each kept warm (its pinned lanes made once)."""
    eng = ENGINES.setdefault(mode, _native.Engine(memory_path=mode))
    for mod in (ser, cst, ckptio.dcp):
        mod._engine = lambda *a, **k: eng  # type: ignore[attr-defined]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8G")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list: shm,cache,staging,lanes")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the bench itself")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    # The engines' pinned lanes stay between rounds (a minute apart): every load
    # is timed with its lanes made, as in a process that loads often.
    os.environ.setdefault("CKPTIO_IDLE_RELEASE", "off")
    skip = set(filter(None, a.skip.split(",")))
    size = _size(a.size)
    info = ckptio.info()
    h = info["huge_pages"]
    print(
        f"# {CORES} cores; THP {h['enabled']}, shmem {h['shmem_enabled']}, huge pages "
        f"asked for: {h['advice']}, free page reporting: {h['free_page_reporting']}; "
        f"fault-in private 4K {h['private_4k_gib_s']:.1f} / huge {h['private_huge_gib_s']:.1f} "
        f"(just freed), shared {h['shared_gib_s']:.1f} GiB/s",
        flush=True,
    )
    fault_probe(min(size, 4 * GiB))
    sd = bench.synthetic_state_dict(size, DEV, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"# {nbytes / GiB:.2f} GiB bf16 in {len(sd)} tensors, {a.rounds} rounds", flush=True)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEV == "cuda")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    host.copy_(flat)
    shm = tempfile.mkdtemp(prefix="ckptio-mem-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="ckptio-mem-", dir=a.disk_dir)
    for mode in ("map", "pread"):
        memory_path(mode)  # warm both engines' lanes on a small file
        ckptio.save({"w": torch.ones(256 << 20, dtype=torch.uint8, device=DEV)}, f"{shm}/w.pt")
        ckptio.load(f"{shm}/w.pt", map_location=DEV)
    os.unlink(f"{shm}/w.pt")
    try:
        for r in range(a.rounds):
            print(f"## round {r + 1}", flush=True)
            rec("pinned H2D copy", timed(lambda: flat.copy_(host, non_blocking=True)))
            rec("pinned D2H copy", timed(lambda: host.copy_(flat, non_blocking=True)))
            if "shm" not in skip:
                shm_round(sd, host, shm, r == 0)
            if "cache" not in skip:
                cache_round(sd, disk, nbytes, r == 0)
            if "staging" not in skip:
                staging_round(sd)
            if "lanes" not in skip and r == 0:
                lanes_round(shm)
            report(nbytes, a.json)  # after every round: a run cut short keeps its figures
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def fault_probe(n: int) -> None:
    """Fresh private memory faulted in on as many threads as cores, 4 KiB and huge
    pages, after 3 s idle (on a VM with free page reporting the host takes back
    free 2 MiB blocks by then) and right after the same amount was freed."""
    for kind in ("anon", "anon+thp"):
        time.sleep(3)
        idle = bench.fresh_memory_fault_s([n], threads=CORES, kind=kind)
        again = bench.fresh_memory_fault_s([n], threads=CORES, kind=kind)
        print(
            f"# fault-in {n / GiB:.2f} GiB {kind:<8} on {CORES} threads: after 3 s idle "
            f"{n / GiB / idle:.1f} GiB/s, right after a free {n / GiB / again:.1f} GiB/s",
            flush=True,
        )


def shm_round(sd: dict, host: torch.Tensor, shm: str, check: bool) -> None:
    p = f"{shm}/c.pt"
    for mode in ("map", "pread"):
        memory_path(mode)
        rec(f"ckptio.save -> /dev/shm ({mode} round)", timed(lambda: ckptio.save(sd, p)))
        out: dict[str, Any] = {}
        for which in ("first", "repeat"):
            out.clear()
            t = timed(lambda out=out: out.update(x=ckptio.load(p, map_location=DEV)))
            rep = ckptio.last_report()
            rec(f"ckptio.load /dev/shm {which} ({mode})", t, f"{rep.read_reason} {rep.device_path}")
            if check and not same(out["x"], sd):
                raise SystemExit(f"ckptio.load ({mode}) returned other bytes")
        out.clear()
        os.unlink(p)
    # The raw limit of a fresh tmpfs file: the same bytes from pinned memory.
    raw = f"{shm}/raw.bin"
    rec(
        "raw write, pinned -> fresh tmpfs file",
        bench.raw_write(raw, memoryview(host.numpy()), threads=CORES)[0],
        f"{CORES} threads, 64 MiB",
    )
    os.unlink(raw)

    def kv() -> None:
        w, rd, note = kvikio_run(shm, sum(t.numel() * 2 for t in sd.values()), "ON", CORES)
        rec("KvikIO posix write -> /dev/shm", w, f"{CORES} threads {note}")
        rec("KvikIO posix read /dev/shm first", rd, f"{CORES} threads {note}")

    attempt("KvikIO posix read /dev/shm first", kv)
    memory_path("map")
    sp = f"{shm}/m.safetensors"
    rec("ckptio.safetensors.save_file -> /dev/shm", timed(lambda: cst.save_file(sd, sp)))
    got: dict[str, Any] = {}
    rec(
        "ckptio.safetensors.load_file /dev/shm first",
        timed(lambda: got.update(x=cst.load_file(sp, device=DEV))),
        ckptio.last_report().read_reason or "",
    )
    if check and not same(got["x"], sd):
        raise SystemExit("ckptio.safetensors.load_file returned other bytes")
    got.clear()

    def peer() -> None:
        import safetensors.torch as st

        rec("safetensors.load_file /dev/shm", timed(lambda: got.update(x=st.load_file(sp, DEV))))
        got.clear()

    attempt("safetensors.load_file /dev/shm", peer)
    os.unlink(sp)


def cache_round(sd: dict, disk: str, nbytes: int, check: bool) -> None:
    memory_path("map")
    p = f"{disk}/c.pt"
    ckptio.save(sd, p)
    bench.drop_cache(p)
    subprocess.run(["cat", p], stdout=subprocess.DEVNULL, check=True)  # another process
    out: dict[str, Any] = {}
    t = timed(lambda: out.update(x=ckptio.load(p, map_location=DEV)))
    rep = ckptio.last_report()
    rec("ckptio.load page-cached disk file", t, f"{rep.read_reason} {rep.device_path}")
    if check and not same(out["x"], sd):
        raise SystemExit("ckptio.load of the cached file returned other bytes")
    out.clear()
    bench.drop_cache(p)
    t = timed(lambda: out.update(x=ckptio.load(p, map_location=DEV)))
    rep = ckptio.last_report()
    rec("ckptio.load cold disk file", t, f"{rep.read_reason} {rep.device_path} {rep.gds_mode}")
    out.clear()
    ring = mmap.mmap(-1, 8 * (64 << 20), flags=mmap.MAP_PRIVATE)  # page aligned
    ring.write(b"\0" * len(ring))  # faulted in: the disk alone
    view = memoryview(ring)
    rec(
        "raw O_DIRECT read, cold",
        bench.cold_read(p, view, os.O_DIRECT, 8, 64 << 20, nbytes & ~4095),
    )
    view.release()
    ring.close()
    os.unlink(p)


def staging_round(sd: dict) -> None:
    from ckptio.staging import DefaultStager, StagingOptions

    settings = ["auto"]
    if not ckptio.info()["huge_pages"]["advice"]:
        settings.append("on")
    sizes = [t.untyped_storage().nbytes() for t in sd.values()]
    for hp in settings:
        os.environ["CKPTIO_HUGE_PAGES"] = hp
        for shared in (False, True):
            kind = f"{'shared' if shared else 'private'}, huge pages {hp}"
            stager = DefaultStager(StagingOptions(use_shared_memory=shared))
            try:
                for k in range(3):
                    t = timed(lambda stager=stager: stager.stage(sd).result())
                    rec(f"staging {'first' if k == 0 else 'later'} ({kind})", t)
            finally:
                stager.close()
        # The floor: fresh buffers of the same sizes, faulted in and registered.
        mems = [_native.HostMemory(n) for n in sizes]
        pins = [_native.HostPin(m, m.addr, m.nbytes, pin=True, chunk_size=64 << 20) for m in mems]
        t0 = time.perf_counter()
        pinned = _native.stage_pin(pins, 16)
        t = time.perf_counter() - t0
        huge = sum(m.huge_bytes() or 0 for m in mems)
        rec(
            f"floor: fault-in + register (huge pages {hp})",
            t,
            f"{pinned / GiB:.1f} GiB pinned, {huge / GiB:.1f} GiB in huge pages",
        )
        for p in pins:
            p.close()
        del mems, pins
    os.environ.pop("CKPTIO_HUGE_PAGES", None)


def lanes_round(shm: str) -> None:
    """A new engine's first load (its pinned lanes made) and second, per allocator."""
    p = f"{shm}/l.pt"
    ckptio.save({"w": torch.ones(512 << 20, dtype=torch.uint8, device=DEV)}, p)
    for alloc in ("register", "driver"):
        os.environ["CKPTIO_PINNED_ALLOC"] = alloc
        ENGINES.pop("lanes", None)
        eng = ENGINES.setdefault("lanes", _native.Engine(memory_path="map"))
        for mod in (ser, cst, ckptio.dcp):
            mod._engine = lambda *a, **k: ENGINES["lanes"]  # type: ignore[attr-defined]
        for which in ("first", "second"):
            t = timed(lambda: ckptio.load(p, map_location=DEV))
            pinned = f"pinned {eng.pinned_bytes() >> 20} MiB"
            rec(f"new engine {which} load 512 MiB ({alloc})", t, pinned)
        del eng
        ENGINES.pop("lanes")
    os.environ.pop("CKPTIO_PINNED_ALLOC", None)
    os.unlink(p)


def report(nbytes: int, json_path: str | None) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    gib = nbytes / GiB
    print(f"\n{'what':<52} {'median s':>9} {'GiB/s':>7}  rounds (GiB/s)  note")
    for k, v in times.items():
        n = gib if "512 MiB" not in k else 0.5
        spread = " ".join(f"{n / x:.1f}" for x in v)
        print(f"{k:<52} {med[k]:9.3f} {n / med[k]:7.2f}  {spread:<14} {notes.get(k, '')}")
    for k in notes.keys() - times.keys():
        print(f"{k:<52} {'-':>9} {'-':>7}  {notes[k]}")

    def ratio(ours: str, base: str) -> str:
        if ours not in med or base not in med:
            return "n/a"
        both = min(len(times[ours]), len(times[base]))
        paired = statistics.median(times[base][i] / times[ours][i] for i in range(both))
        return f"{med[base] / med[ours]:.2f}x (paired {paired:.2f}x)"

    h2d, d2h = "pinned H2D copy", "pinned D2H copy"
    lines = [
        (
            "shm first load (map) / pinned H2D, >= 0.85",
            ratio("ckptio.load /dev/shm first (map)", h2d),
        ),
        (
            "shm repeat load (map) / pinned H2D, >= 0.85",
            ratio("ckptio.load /dev/shm repeat (map)", h2d),
        ),
        ("shm first load (pread) / pinned H2D", ratio("ckptio.load /dev/shm first (pread)", h2d)),
        ("shm repeat load (pread) / pinned H2D", ratio("ckptio.load /dev/shm repeat (pread)", h2d)),
        (
            "shm first load (map) / KvikIO posix first, >= 1.8",
            ratio("ckptio.load /dev/shm first (map)", "KvikIO posix read /dev/shm first"),
        ),
        (
            "page-cached disk file load / pinned H2D, >= 0.8",
            ratio("ckptio.load page-cached disk file", h2d),
        ),
        (
            "cold disk file load / raw O_DIRECT read (no regression)",
            ratio("ckptio.load cold disk file", "raw O_DIRECT read, cold"),
        ),
        (
            "safetensors load_file shm / pinned H2D, >= 0.85",
            ratio("ckptio.safetensors.load_file /dev/shm first", h2d),
        ),
        (
            "safetensors load_file shm / safetensors.load_file",
            ratio("ckptio.safetensors.load_file /dev/shm first", "safetensors.load_file /dev/shm"),
        ),
        (
            "save to shm / raw write into a fresh tmpfs file, >= 0.85",
            ratio("ckptio.save -> /dev/shm (map round)", "raw write, pinned -> fresh tmpfs file"),
        ),
    ]
    for hp in ("auto", "on"):
        for kind in ("private", "shared"):
            tag = f"({kind}, huge pages {hp})"
            first, later = f"staging first {tag}", f"staging later {tag}"
            if first not in med:
                continue
            lines += [
                (f"staging first / later {tag}, <= 2.5", f"{med[first] / med[later]:.2f}x"),
                (
                    f"staging first / its floor {tag}, <= 1.2",
                    f"{med[first] / med[f'floor: fault-in + register (huge pages {hp})']:.2f}x"
                    if f"floor: fault-in + register (huge pages {hp})" in med
                    else "n/a",
                ),
                (f"staging later / pinned D2H {tag}, >= 0.9", ratio(later, d2h)),
            ]
    print("\n# targets (ratios of medians, higher is better unless <=)")
    for name, v in lines:
        print(f"  {name:<66} {v}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"times": times, "notes": notes, "medians": med, "targets": dict(lines)},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
