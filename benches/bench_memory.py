"""Every data path at the memory and PCIe limits when storage is not the wall
(issue 16), on the GPU machine, in one run of about 4 minutes at 8 GiB: medians
of ``--rounds`` interleaved rounds, every ratio against a limit measured in the
same run, and beside each target the floor that bounds it.

    python benches/bench_memory.py [--size 8G] [--rounds 2] [--budget 220] [--json OUT]
    python benches/bench_memory.py --device cpu --size 256M --rounds 2   # a smoke test

An 8 GiB bf16 state dict on the GPU (512 tensors). Each round runs staging,
/dev/shm, page cache (and pinned lanes in the first). Rows marked (r1) run in
the first round only (slow peers, diagnostics); the rest in every round. A
later round's section that would overrun ``--budget`` seconds is skipped (what
ran is kept: the JSON is written after every section, and a SIGTERM prints the
table).

- limits: the pinned H2D and D2H copy of the same bytes (registered huge-page
  memory, as the engine's bounce lanes are).
- /dev/shm, in alternating order per round (raw first, then ckptio first):
  * a raw write of the bytes from pinned memory into a fresh tmpfs file by as many
    threads as cores (the save's limit), then on that file the floors of a load:
    (a) the CPU copy floor: the memory path's threads copying the file from a
    mapping into pinned slots of their own, 4 MiB at a time, no GPU
    (``_native.memory_copy_floor``): first read after the write, then repeat
    reads by memcpy ("map"), by non-temporal stores ("map-nt"), by pread, by
    as many threads as cores, and in chunks 4x as large; (b) the zero-copy
    floor: the file mapped and registered with the driver
    (cuMemHostRegister READ_ONLY) in 64 MiB pieces
    on 8 threads, each piece copied to the GPU from its registration, end to
    end and by phase (page tables, registration, copy); (d) the shared-bus
    floor: (a) (repeat, map) timed while pinned H2D copies run throughout, and a
    pinned H2D copy timed while (a) runs in a loop; a load does both jobs at
    once on one host memory, so it takes at least the slower of the two.
  * ckptio.save, then ckptio.load to CUDA right after ("first") and again
    ("repeat"), the repeat also with CKPTIO_MEMORY_PATH=map-nt (the A/B of the
    memory path's copy); each load's engine read is timed alone too
    ("[engine read]"; the rest is unpickling and allocation).
  * (r1) CKPTIO_MEMORY_PATH=pread: save, first and repeat load; KvikIO's POSIX path
    (its own write, then its first read), as many threads as cores.
  * ckptio.safetensors save_file, then load_file(device="cuda") right after;
    (r1) safetensors.load_file(device="cuda") of the same file.
- page cache: a checkpoint on the disk read by another process (``cat``):
  ckptio.load to CUDA (map, map-nt), and the CPU copy floor on the same file;
  (r1) the same file cold: ckptio.load (O_DIRECT) against a raw O_DIRECT read.
- staging, for private buffers with huge pages and with 4 KiB pages
  (CKPTIO_HUGE_PAGES on/off: the H200 decides) and shared ones: a new
  DefaultStager's first staging (THREAD mode, no prepare()) and a later one,
  against the pinned D2H copy and the floor: fresh buffers of the same kind and
  sizes faulted in (MADV_POPULATE_WRITE on the stager's threads) and registered
  (``stage_pin``), floor and stager in alternating order per round, so that
  first / floor compares memory of the same freshness.
- (r1) pinned lanes: a new engine's first load with its lanes as registered
  huge-page mappings and as cuMemHostAlloc memory (CKPTIO_PINNED_ALLOC).

Fresh guest memory: on a freshly started VM the host backs guest memory on its
first touch, and huge pages come from never-touched blocks long after small
pages are recycled (the likely reason: see docs/faststorage.md). Before
anything else the bench faults in 4 GiB with 4 KiB and with huge pages; then
(``--warm``, default on with CUDA) it touches and frees all the memory it can
spare once (at most 25 s), with huge pages, and probes again: rows then measure
ckptio on memory as a host that has been up a while has it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import benchlib
import ckptio
import ckptio.dcp
import ckptio.safetensors as cst
import ckptio.serialization as ser
import torch
from bench_gpu import kvikio_run
from ckptio import _native
from ckptio.io import memory as _hostmem
from ckptio.io.units import parse_size as _size
from ckptio.tools import bench

GiB = 1 << 30
CORES = os.cpu_count() or 8
T0 = time.perf_counter()
DEV = "cuda"
ROUND = 0
# row -> {round: seconds}; notes by row; what the run printed besides rows
times: dict[str, dict[int, float]] = {}
notes: dict[str, str] = {}
probe: dict[str, Any] = {}
sections: dict[str, dict[int, float]] = {}
# Seconds of each section's first round spent on rows of the first round only:
# what a later round of it will not take.
first_only: dict[str, float] = {}
SECTION = ""
READS: benchlib.EngineReads | None = None


@contextlib.contextmanager
def round_one_only() -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        first_only[SECTION] = first_only.get(SECTION, 0.0) + time.perf_counter() - t0


def stamp(what: str) -> None:
    print(f"# [{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def rec(name: str, seconds: float | None, note: str = "") -> None:
    if seconds is not None:
        times.setdefault(name, {})[ROUND] = seconds
    if note:
        notes[name] = note


def settle() -> None:
    """Mappings of earlier reads unmapped (off a caller's path, so they would
    still run under the next row otherwise)."""
    _native.host_memory()


def timed(fn: Callable[[], Any]) -> float:
    settle()
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


def load_row(name: str, fn: Callable[[], Any], check: dict | None = None) -> None:
    """A timed load (its result dropped after), its engine read timed alone as
    ``name [engine read]``, its report in the note."""
    out: dict[str, Any] = {}
    assert READS is not None
    READS.reset()
    t = timed(lambda: out.update(x=fn()))
    io = READS.seconds
    rep = ckptio.last_report()
    rec(name, t, f"{rep.read_source} {rep.read_reason} {rep.device_path}" if rep else "")
    rec(f"{name} [engine read]", io)
    if check is not None and not same(out["x"], check):
        raise SystemExit(f"{name}: other bytes than were saved")


def main() -> None:
    global DEV, ROUND, READS, SECTION
    if not hasattr(_native, "host_memory"):
        sys.exit(
            "bench_memory.py needs the probe hooks: a build with the cargo feature "
            "probes (scripts/dev_build.sh --release, scripts/build_gpu_bundle.sh)"
        )
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8G")
    ap.add_argument("--shape", default="even", choices=["even", "llm"], help="llm: issue 37's")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget", type=float, default=220.0, help="seconds for the whole run")
    ap.add_argument("--disk-dir", default=tempfile.gettempdir())
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list: shm,cache,staging,lanes")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the bench itself")
    ap.add_argument(
        "--warm", default="auto", help="touch spare memory once first: on, off, auto (with CUDA)"
    )
    a = ap.parse_args()
    DEV = a.device
    # The engines' pinned lanes stay between rounds: every load is timed with
    # its lanes made, as in a process that loads often.
    os.environ.setdefault("CKPTIO_IDLE_RELEASE", "off")
    skip = set(filter(None, a.skip.split(",")))
    size = _size(a.size)
    header()
    fault_probe("fresh", min(size, 4 * GiB))
    if a.warm == "on" or (a.warm == "auto" and DEV == "cuda"):
        warm_up()
        fault_probe("after warm-up", min(size, 4 * GiB))
    READS = benchlib.EngineReads()
    sd = benchlib.shaped_state_dict(a.shape, size, DEV)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    host, host_pin = pinned_host(nbytes)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    host.copy_(flat)
    stamp(
        f"{nbytes / GiB:.2f} GiB bf16 in {len(sd)} tensors, {a.rounds} rounds; pinned "
        f"limit buffer: {host_pin.pinned_bytes() / GiB:.1f} GiB registered "
        f"(torch sees it pinned: {host.is_pinned() if DEV == 'cuda' else False})"
    )
    shm = tempfile.mkdtemp(prefix="ckptio-mem-", dir="/dev/shm")
    disk = tempfile.mkdtemp(prefix="ckptio-mem-", dir=a.disk_dir)
    for mode in ("map", "map-nt", "pread"):
        memory_path(mode)  # warm every engine's lanes on a small file
        ckptio.save({"w": torch.ones(256 << 20, dtype=torch.uint8, device=DEV)}, f"{shm}/w.pt")
        ckptio.load(f"{shm}/w.pt", map_location=DEV)
    os.unlink(f"{shm}/w.pt")
    # A run stopped by `timeout` (SIGTERM) still prints what it measured.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    # Staging first: its second round (the other order of floor and stager)
    # matters most when the budget cuts a round short.
    steps: list[tuple[str, Callable[[], None]]] = [
        ("staging", lambda: staging_round(sd)),
        ("shm", lambda: shm_round(sd, host, flat, shm)),
        ("cache", lambda: cache_round(sd, disk, nbytes, a.rounds)),
        ("lanes", lambda: lanes_round(shm)),
    ]
    try:
        for r in range(a.rounds):
            ROUND = r
            stamp(f"round {r + 1}")
            rec("pinned H2D copy", timed(lambda: flat.copy_(host, non_blocking=True)))
            rec("pinned D2H copy", timed(lambda: host.copy_(flat, non_blocking=True)))
            for name, fn in steps:
                if name in skip or (name == "lanes" and r > 0):
                    continue
                took = sections.get(name, {}).get(0, 0.0) - first_only.get(name, 0.0)
                if r > 0 and time.perf_counter() - T0 + took > a.budget:
                    stamp(f"{name} skipped in round {r + 1}: {took:.0f} s would pass the budget")
                    continue
                SECTION = name
                t0 = time.perf_counter()
                fn()
                sections.setdefault(name, {})[r] = time.perf_counter() - t0
                stamp(f"{name} done in {sections[name][r]:.1f} s")
                report(nbytes, a.json, show=False)  # a run cut short keeps its figures
            report(nbytes, a.json, show=True)
    except SystemExit:
        stamp("stopped: what was measured so far")
        report(nbytes, a.json, show=True)
        raise
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        del host_pin


def header() -> None:
    info = ckptio.info()
    h = info["huge_pages"]
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "?",
    )
    eng = _native.Engine()
    probe["host"] = {
        "cores": CORES,
        "cpu": cpu,
        "libc": " ".join(platform.libc_ver()),
        "kernel": platform.release(),
        "thp": h["enabled"],
        "shmem_thp": h["shmem_enabled"],
        "huge_pages_asked": h["advice"],
        "free_page_reporting": h["free_page_reporting"],
        "memory_threads": eng.memory_threads,
        "memory_chunk": eng.memory_chunk_size,
        "staging_threads": _staging_threads(),
    }
    stamp(f"host: {json.dumps(probe['host'])}")


def _staging_threads() -> int:
    from ckptio.staging import _default_threads

    return _default_threads()


def fault_probe(when: str, n: int) -> None:
    """Fresh private memory faulted in on as many threads as cores, 4 KiB pages
    then huge pages: the first touch, and again right after the free."""
    for kind in ("anon", "anon+thp"):
        first = benchlib.fresh_memory_fault_s([n], threads=CORES, kind=kind)
        again = benchlib.fresh_memory_fault_s([n], threads=CORES, kind=kind)
        probe.setdefault("fault_in_gib_s", {})[f"{when} {kind}"] = [
            n / GiB / first,
            n / GiB / again,
        ]
        stamp(
            f"fault-in {n / GiB:.2f} GiB {kind:<8} on {CORES} threads ({when}): "
            f"{n / GiB / first:.1f} GiB/s, again right after the free {n / GiB / again:.1f}"
        )


def warm_up(limit_s: float = 25.0) -> None:
    """Touch (huge pages) and free all the memory this run can spare, once, in
    8 GiB steps for at most ``limit_s`` seconds: a VM backs guest memory on its
    first touch, and huge pages come from blocks nobody touched yet as long as
    there are any."""
    avail = _meminfo("MemAvailable")
    spare = (avail - max(8 * GiB, _meminfo("MemTotal") // 10)) // GiB
    if spare < 1:
        stamp(f"warm-up skipped: {avail / GiB:.0f} GiB available")
        return
    maps: list[mmap.mmap] = []
    t0 = time.perf_counter()
    try:
        while len(maps) < spare and time.perf_counter() - t0 < limit_s:
            step = [
                mmap.mmap(-1, GiB, flags=mmap.MAP_PRIVATE) for _ in range(min(8, spare - len(maps)))
            ]
            for m in step:
                m.madvise(mmap.MADV_HUGEPAGE)
            maps += step
            addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in step]
            benchlib.madvise_s([(x, GiB) for x in addrs], CORES)
        s = time.perf_counter() - t0
    finally:
        for m in maps:
            m.close()
    probe["warm_up"] = {"gib": len(maps), "seconds": s, "spare_gib": spare}
    stamp(
        f"warm-up: {len(maps)} of {spare} spare GiB touched with huge pages in {s:.1f} s "
        f"({len(maps) / s:.1f} GiB/s), freed"
    )


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for ln in f:
            if ln.startswith(key + ":"):
                return int(ln.split()[1]) * 1024
    return 0


def pinned_host(nbytes: int) -> tuple[torch.Tensor, Any]:
    """``nbytes`` of host memory as the bounce lanes have it: huge pages,
    registered with the driver (cudaHostAlloc would take ~5 s for 8 GiB)."""
    st = _hostmem.host_storage(nbytes)
    pin = _native.HostPin(st, st.data_ptr(), nbytes, pin=DEV == "cuda", chunk_size=64 << 20)
    _native.stage_pin([pin], 16)
    t = torch.empty(0, dtype=torch.uint8)
    t.set_(st, 0, (nbytes,), (1,))
    return t, pin


# -- /dev/shm ---------------------------------------------------------------------------


def shm_round(sd: dict, host: torch.Tensor, flat: torch.Tensor, shm: str) -> None:
    first_round = ROUND == 0
    p = f"{shm}/c.pt"

    def raw_and_floors() -> None:
        raw = f"{shm}/raw.bin"
        settle()
        rec(
            "raw write, pinned -> fresh tmpfs file",
            bench.raw_write(raw, memoryview(host.numpy()), threads=CORES)[0],
            f"{CORES} threads, 64 MiB",
        )
        copy_floors(raw, "shm")
        if DEV == "cuda":
            attempt("floor (b) zero-copy shm, end to end", lambda: zero_copy_floor(raw, flat))
            shared_bus_floor(raw, host, flat)
        os.unlink(raw)

    def save_and_loads() -> None:
        memory_path("map")
        rec("ckptio.save -> /dev/shm", timed(lambda: ckptio.save(sd, p)))
        check = sd if first_round else None
        load_row("ckptio.load shm first (map)", lambda: ckptio.load(p, map_location=DEV), check)
        load_row("ckptio.load shm repeat (map)", lambda: ckptio.load(p, map_location=DEV))
        memory_path("map-nt")
        load_row("ckptio.load shm repeat (map-nt)", lambda: ckptio.load(p, map_location=DEV), check)
        memory_path("map")
        os.unlink(p)

    # Alternating order: fresh tmpfs pages cost what the VM makes them cost.
    for part in (raw_and_floors, save_and_loads)[:: 1 if ROUND % 2 == 0 else -1]:
        part()
    if first_round:
        with round_one_only():
            pread_and_kvikio(sd, p, shm)
    sp = f"{shm}/m.safetensors"
    rec("ckptio.safetensors.save_file -> /dev/shm", timed(lambda: cst.save_file(sd, sp)))
    load_row(
        "ckptio.safetensors.load_file shm first",
        lambda: cst.load_file(sp, device=DEV),
        sd if first_round else None,
    )
    if first_round:

        def peer() -> None:
            import safetensors.torch as st

            got: dict[str, Any] = {}
            rec(
                "safetensors.load_file /dev/shm", timed(lambda: got.update(x=st.load_file(sp, DEV)))
            )

        with round_one_only():
            attempt("safetensors.load_file /dev/shm", peer)
    os.unlink(sp)


def pread_and_kvikio(sd: dict, p: str, shm: str) -> None:
    """CKPTIO_MEMORY_PATH=pread (save, first and repeat load), and KvikIO's own
    write and first read of the same bytes."""
    memory_path("pread")
    rec("ckptio.save -> /dev/shm (pread round)", timed(lambda: ckptio.save(sd, p)))
    load_row("ckptio.load shm first (pread)", lambda: ckptio.load(p, map_location=DEV))
    load_row("ckptio.load shm repeat (pread)", lambda: ckptio.load(p, map_location=DEV))
    os.unlink(p)
    memory_path("map")

    def kv() -> None:
        w, rd, note = kvikio_run(shm, sum(t.numel() * 2 for t in sd.values()), "ON", CORES)
        rec("KvikIO posix write -> /dev/shm", w, f"{CORES} threads {note}")
        rec("KvikIO posix read /dev/shm first", rd, f"{CORES} threads {note}")

    attempt("KvikIO posix read /dev/shm first", kv)


def copy_floors(path: str, where: str) -> None:
    """The CPU copy floor on ``path`` (no engine, no GPU): the memory path's
    threads and chunk; first (where the file was never read) through a mapping,
    then repeat reads by each way of copying."""
    eng = ENGINES["map"]
    mt, mc = eng.memory_threads, eng.memory_chunk_size
    runs = [("first" if where == "shm" else "cached", "map", mt)]
    if where == "shm":
        runs += [("repeat", "map", mt), ("repeat", "map-nt", mt), ("repeat", "pread", mt)]
        if CORES != mt:
            runs.append(("repeat", "map", CORES))
    else:
        runs.append(("cached", "map-nt", mt))
    for which, source, threads in runs:
        s, pinned = _native.memory_copy_floor(path, source, threads, mc)
        rec(
            f"floor (a) CPU copy {where} {which} ({source}, {threads} thr)",
            s,
            f"{mc >> 20} MiB chunks into {'pinned' if pinned else 'pageable'} slots",
        )
    if where == "shm":
        s, _ = _native.memory_copy_floor(path, "map", mt, 4 * mc)
        rec(f"floor (a) CPU copy shm repeat (map, {mt} thr, {4 * mc >> 20} MiB)", s)


def shared_bus_floor(path: str, host: torch.Tensor, flat: torch.Tensor) -> None:
    """Floor (d): each half of a copy-based load timed while the other half runs
    flat out on the same host memory. The CPU copy floor (a) of ``path``
    (repeat, map) while pinned H2D copies of the bytes run throughout (three
    are queued first), then one pinned H2D copy while (a) runs in a loop on
    another thread. A load through the memory path does both jobs at once, so
    it takes at least the slower of the two (each measured under the other's
    load); the gaps between the loop's calls only make that floor easier.
    (a) copies into pageable slots here: registering its slots would wait for
    the queued copies, and the memory traffic is the same."""
    eng = ENGINES["map"]
    mt, mc = eng.memory_threads, eng.memory_chunk_size
    settle()
    sync()
    for _ in range(3):
        flat.copy_(host, non_blocking=True)
    cpu, _ = _native.memory_copy_floor(path, "map", mt, mc, pinned=False)
    covered = not torch.cuda.current_stream().query()  # the DMA outlasted the copy
    sync()
    stop = threading.Event()

    def copies() -> None:
        while not stop.is_set():
            _native.memory_copy_floor(path, "map", mt, mc, pinned=False)

    th = threading.Thread(target=copies)
    th.start()
    try:
        time.sleep(0.05)  # past the first call's set-up (its slots faulted in)
        t0 = time.perf_counter()
        flat.copy_(host, non_blocking=True)
        sync()
        dma = time.perf_counter() - t0
    finally:
        stop.set()
        th.join()
    rec(
        "floor (d) CPU copy while H2D copies run",
        cpu,
        f"{mt} thr, the H2D copies {'outlasted' if covered else 'ended before'} it",
    )
    rec("floor (d) H2D copy while CPU copies run", dma, f"{mt} thr copying in a loop")
    rec("floor (d) shared bus: the slower of the two", max(cpu, dma))


READ_ONLY = 8  # CU_MEMHOSTREGISTER_READ_ONLY


def zero_copy_floor(path: str, flat: torch.Tensor, threads: int = 8, piece: int = 64 << 20) -> None:
    """The zero-copy floor: ``path`` mapped read-only (shared), its pages
    registered with the driver (cuMemHostRegister READ_ONLY) in ``piece``-byte
    pieces on ``threads`` threads, each piece copied to the GPU from its
    registration. End to end (each thread: page tables of its piece filled,
    registered, copy queued), then on a second mapping by phase."""
    cu, libc = benchlib.libcuda(), benchlib.libc()
    torch.cuda.synchronize()
    n = os.path.getsize(path)
    dst = flat.data_ptr()
    ck = benchlib.cuda_check

    def on_threads(items: list[int], fn: Callable[[int, Any], None]) -> float:
        return benchlib.on_streams(threads, items, fn)

    offs = list(range(0, n, piece))

    def mapping() -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            p = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if p in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        return int(p)

    def length(o: int) -> int:
        return min(piece, n - o)

    def fill(p: int, o: int) -> None:
        libc.madvise(p + o, length(o), benchlib.MADV_POPULATE_READ)

    registered: set[int] = set()

    def register(p: int, o: int) -> None:
        ck(cu.cuMemHostRegister_v2(p + o, length(o), READ_ONLY), "cuMemHostRegister(READ_ONLY)")
        registered.add(p + o)

    def copy(p: int, o: int, st: Any) -> None:
        ck(cu.cuMemcpyHtoDAsync_v2(dst + o, p + o, length(o), st), "cuMemcpyHtoDAsync")

    def unregister(p: int) -> float:
        t = on_threads(offs, lambda o, st: ck(cu.cuMemHostUnregister(p + o), "unregister"))
        registered.clear()
        return t

    def unmap(p: int) -> None:
        torch.cuda.synchronize()
        for a in registered:  # after an error only
            cu.cuMemHostUnregister(a)
        registered.clear()
        libc.munmap(p, n)

    p = mapping()
    try:
        e2e = on_threads(offs, lambda o, st: (fill(p, o), register(p, o), copy(p, o, st)))
        unreg = unregister(p)
    finally:
        unmap(p)
    p = mapping()
    try:
        tables = on_threads(offs, lambda o, st: fill(p, o))
        reg = on_threads(offs, lambda o, st: register(p, o))
        cp = on_threads(offs, lambda o, st: copy(p, o, st))
        unregister(p)
    finally:
        unmap(p)
    how = f"{threads} threads, {piece >> 20} MiB pieces"
    rec("floor (b) zero-copy shm, end to end", e2e, f"{how}; unregistering after: {unreg:.3f} s")
    rec("floor (b) zero-copy shm: page tables", tables, how)
    rec("floor (b) zero-copy shm: registration", reg, how)
    rec("floor (b) zero-copy shm: copy from registrations", cp, how)


# -- page cache -------------------------------------------------------------------------


def cache_round(sd: dict, disk: str, nbytes: int, rounds: int) -> None:
    p = f"{disk}/c.pt"
    if not os.path.exists(p):
        memory_path("map")
        ckptio.save(sd, p)
    bench.drop_cache(p)
    subprocess.run(["cat", p], stdout=subprocess.DEVNULL, check=True)  # another process
    check = sd if ROUND == 0 else None
    memory_path("map")
    load_row(
        "ckptio.load page-cached disk file (map)", lambda: ckptio.load(p, map_location=DEV), check
    )
    memory_path("map-nt")
    load_row("ckptio.load page-cached disk file (map-nt)", lambda: ckptio.load(p, map_location=DEV))
    memory_path("map")
    copy_floors(p, "disk")
    if ROUND == 0:
        bench.drop_cache(p)
        load_row("ckptio.load cold disk file", lambda: ckptio.load(p, map_location=DEV))
        ring = mmap.mmap(-1, 8 * (64 << 20), flags=mmap.MAP_PRIVATE)  # page aligned
        ring.write(b"\0" * len(ring))  # faulted in: the disk alone
        view = memoryview(ring)
        rec(
            "raw O_DIRECT read, cold",
            bench.cold_read(p, view, os.O_DIRECT, 8, 64 << 20, nbytes & ~4095),
        )
        view.release()
        ring.close()
    if ROUND == rounds - 1:
        os.unlink(p)


# -- staging ----------------------------------------------------------------------------

KINDS = [
    ("private, huge pages", False, "on"),
    ("private, 4 KiB pages", False, "off"),
    ("shared", True, None),
]


def staging_round(sd: dict) -> None:
    """Per kind of buffer, the floor and a new stager's first and a later
    staging; floor first in odd rounds, stager first in even ones (and the
    kinds in the other order), so that each compares like with like."""
    from ckptio.staging import DefaultStager, StagingOptions

    sizes = [t.untyped_storage().nbytes() for t in sd.values()]
    flip = ROUND % 2 == 1
    for label, shared, hp in KINDS[::-1] if flip else KINDS:
        if hp is None:
            os.environ.pop("CKPTIO_HUGE_PAGES", None)
        else:
            os.environ["CKPTIO_HUGE_PAGES"] = hp

        def stager(label: str = label, shared: bool = shared) -> None:
            s = DefaultStager(StagingOptions(use_shared_memory=shared))
            try:
                for which in ("first", "later"):
                    settle()
                    rec(f"staging {which} ({label})", timed(lambda s=s: s.stage(sd).result()))
                    st = s.last_stats
                    notes[f"staging {which} ({label})"] = (
                        f"{st.get('threads')} threads, {st.get('pieces')} pieces, "
                        f"{st.get('unpinned_device_bytes', 0) >> 20} MiB unpinned"
                    )
            finally:
                s.close()

        def floor(label: str = label, shared: bool = shared) -> None:
            staging_floor(sizes, shared, label)

        for step in (stager, floor) if flip else (floor, stager):
            step()
    os.environ.pop("CKPTIO_HUGE_PAGES", None)


def staging_floor(sizes: list[int], shared: bool, label: str) -> None:
    """Fresh buffers as the stager makes them, faulted in on its threads
    (MADV_POPULATE_WRITE, 64 MiB calls), then registered (``stage_pin``)."""
    from ckptio.staging import _PIN_CHUNK, _host_storage

    threads = _staging_threads()
    huge0 = _anon_huge()
    bufs = [_host_storage(n, shared) for n in sizes]
    ranges = [(b.data_ptr(), b.nbytes()) for b in bufs]
    fault = benchlib.madvise_s(ranges, threads, _PIN_CHUNK)
    huge = _anon_huge() - huge0
    pins = [_native.HostPin(b, b.data_ptr(), b.nbytes(), chunk_size=_PIN_CHUNK) for b in bufs]
    t0 = time.perf_counter()
    pinned = _native.stage_pin(pins, threads) if DEV == "cuda" else 0
    reg = time.perf_counter() - t0
    for p in pins:
        p.close()
    del pins, bufs
    rec(f"floor (c) staging ({label}): fault-in", fault, f"{huge / GiB:.1f} GiB in huge pages")
    rec(f"floor (c) staging ({label}): registration", reg, f"{pinned / GiB:.1f} GiB pinned")
    rec(f"floor (c) staging ({label})", fault + reg, f"{threads} threads")


def _anon_huge() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for ln in f:
            if ln.startswith("AnonHugePages:"):
                return int(ln.split()[1]) * 1024
    return 0


# -- pinned lanes -----------------------------------------------------------------------


def lanes_round(shm: str) -> None:
    """A new engine's first load (its pinned lanes made) and second, per allocator."""
    p = f"{shm}/l.pt"
    ckptio.save({"w": torch.ones(512 << 20, dtype=torch.uint8, device=DEV)}, p)
    for alloc in ("register", "driver"):
        os.environ["CKPTIO_PINNED_ALLOC"] = alloc
        eng = _native.Engine(memory_path="map")
        for mod in (ser, cst, ckptio.dcp):
            mod._engine = lambda *a, eng=eng, **k: eng  # type: ignore[attr-defined]
        for which in ("first", "second"):
            t = timed(lambda: ckptio.load(p, map_location=DEV))
            rec(
                f"new engine {which} load 512 MiB ({alloc})",
                t,
                f"pinned {eng.pinned_bytes() >> 20} MiB",
            )
        del eng
    os.environ.pop("CKPTIO_PINNED_ALLOC", None)
    memory_path("map")
    os.unlink(p)


# -- report -----------------------------------------------------------------------------


def report(nbytes: int, json_path: str | None, show: bool) -> None:
    """The JSON (every time), and with ``show`` the table and the targets."""
    med = {k: statistics.median(v.values()) for k, v in times.items()}
    gib = nbytes / GiB
    if show:
        print(f"\n{'what':<62} {'median s':>9} {'GiB/s':>7}  rounds (GiB/s)  note")
        for k, v in times.items():
            n = gib if "512 MiB" not in k else 0.5
            spread = " ".join(f"{n / x:.1f}" for x in v.values())
            print(f"{k:<62} {med[k]:9.3f} {n / med[k]:7.2f}  {spread:<14} {notes.get(k, '')}")
        for k in notes.keys() - times.keys():
            print(f"{k:<62} {'-':>9} {'-':>7}  {notes[k]}")

    def speed(ours: str, base: str) -> str:
        """How fast ``ours`` ran against ``base`` (base seconds / ours): ratio of
        medians, and the median of the per-round ratios."""
        if ours not in med or base not in med:
            return "n/a"
        both = sorted(times[ours].keys() & times[base].keys())
        paired = statistics.median(times[base][i] / times[ours][i] for i in both) if both else 0
        return f"{med[base] / med[ours]:.2f}x (paired {paired:.2f}x)"

    def slower(ours: str, base: str) -> str:
        """``ours`` seconds / ``base`` seconds, medians and paired by round."""
        if ours not in med or base not in med:
            return "n/a"
        both = sorted(times[ours].keys() & times[base].keys())
        paired = statistics.median(times[ours][i] / times[base][i] for i in both) if both else 0
        return f"{med[ours] / med[base]:.2f}x (paired {paired:.2f}x)"

    h2d, d2h = "pinned H2D copy", "pinned D2H copy"
    eng = ENGINES.get("map")
    mt, mc = (eng.memory_threads, eng.memory_chunk_size) if eng else (0, 0)
    fa = f"floor (a) CPU copy shm first (map, {mt} thr)"
    fr = f"floor (a) CPU copy shm repeat (map, {mt} thr)"
    fc = f"floor (a) CPU copy disk cached (map, {mt} thr)"
    zc = "floor (b) zero-copy shm, end to end"
    bus = "floor (d) shared bus: the slower of the two"
    first, repeat = "ckptio.load shm first (map)", "ckptio.load shm repeat (map)"
    cached = "ckptio.load page-cached disk file (map)"
    stl = "ckptio.safetensors.load_file shm first"

    def load_line(ours: str, floor: str) -> str:
        return (
            f"{speed(ours, h2d)}; {speed(ours, floor)} of its CPU copy floor, "
            f"which runs at {speed(floor, h2d)} of pinned H2D; engine read alone "
            f"{speed(ours + ' [engine read]', h2d)}"
        )

    lines = [
        ("shm first load (map) / pinned H2D, >= 0.85", load_line(first, fa)),
        ("shm repeat load (map) / pinned H2D, >= 0.85", load_line(repeat, fr)),
        ("  bound: zero-copy floor (b) / pinned H2D", speed(zc, h2d)),
        ("  bound: zero-copy floor (b) / CPU copy floor (a) repeat", speed(zc, fr)),
        ("  bound: shared-bus floor (d) / pinned H2D", speed(bus, h2d)),
        ("  shm repeat load / shared-bus floor (d)", speed(repeat, bus)),
        ("  shm first load / shared-bus floor (d)", speed(first, bus)),
        ("  safetensors load_file shm / shared-bus floor (d)", speed(stl, bus)),
        (
            "  A/B: shm repeat load map-nt / map (> 1: map-nt wins)",
            speed("ckptio.load shm repeat (map-nt)", repeat),
        ),
        ("  A/B: CPU floor repeat map-nt / map", speed(fr.replace("(map,", "(map-nt,"), fr)),
        ("  A/B: CPU floor repeat pread / map", speed(fr.replace("(map,", "(pread,"), fr)),
        (
            "  A/B: CPU floor repeat, 4x the memory chunk / the memory chunk",
            speed(f"floor (a) CPU copy shm repeat (map, {mt} thr, {4 * mc >> 20} MiB)", fr),
        ),
        (
            "  A/B: CPU floor repeat on cores threads / memory threads",
            speed(f"floor (a) CPU copy shm repeat (map, {CORES} thr)", fr),
        ),
        ("  CPU floor first / repeat (the kernel's cost of fresh pages)", speed(fa, fr)),
        ("shm first load (pread) / pinned H2D", speed("ckptio.load shm first (pread)", h2d)),
        ("shm repeat load (pread) / pinned H2D", speed("ckptio.load shm repeat (pread)", h2d)),
        (
            "shm first load (map) / KvikIO posix first, >= 1.8",
            speed(first, "KvikIO posix read /dev/shm first"),
        ),
        ("page-cached disk file load / pinned H2D, >= 0.8", load_line(cached, fc)),
        (
            "  A/B: page-cached load map-nt / map",
            speed("ckptio.load page-cached disk file (map-nt)", cached),
        ),
        (
            "cold disk file load / raw O_DIRECT read (no regression)",
            speed("ckptio.load cold disk file", "raw O_DIRECT read, cold"),
        ),
        ("safetensors load_file shm / pinned H2D, >= 0.85", load_line(stl, fa)),
        (
            "safetensors load_file shm / safetensors.load_file",
            speed(stl, "safetensors.load_file /dev/shm"),
        ),
        (
            "save to shm / raw write into a fresh tmpfs file, >= 0.85",
            speed("ckptio.save -> /dev/shm", "raw write, pinned -> fresh tmpfs file"),
        ),
    ]
    for label, _, _ in KINDS:
        tag = f"({label})"
        f, later, floor = f"staging first {tag}", f"staging later {tag}", f"floor (c) staging {tag}"
        if f not in med:
            continue
        lines += [
            (f"staging first / later {tag}, <= 2.5", slower(f, later)),
            (f"  bound: its floor / later {tag}", slower(floor, later)),
            (f"staging first / its floor {tag}, <= 1.2", slower(f, floor)),
            (
                f"  first / (floor + later) {tag} (< 1: the copy overlaps)",
                _overlap(f, floor, later),
            ),
            (f"staging later / pinned D2H {tag}, >= 0.9", speed(later, d2h)),
        ]
    lines.append(
        (
            "  A/B: staging first, huge pages / 4 KiB pages (< 1: huge pages win)",
            slower("staging first (private, huge pages)", "staging first (private, 4 KiB pages)"),
        )
    )
    if show:
        print("\n# targets (ratios of medians, paired = median of per-round ratios)")
        for name, v in lines:
            print(f"  {name:<72} {v}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(
                {
                    "times": times,
                    "notes": notes,
                    "medians": med,
                    "targets": dict(lines),
                    "probe": probe,
                    "sections": sections,
                },
                fh,
                indent=2,
            )


def _overlap(first: str, floor: str, later: str) -> str:
    both = sorted(
        times.get(first, {}).keys() & times.get(floor, {}).keys() & times.get(later, {}).keys()
    )
    if not both:
        return "n/a"
    r = [times[first][i] / (times[floor][i] + times[later][i]) for i in both]
    return f"{statistics.median(r):.2f}x"


if __name__ == "__main__":
    main()
