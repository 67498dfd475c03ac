"""Where a ckptio.load of a checkpoint in /dev/shm spends its wall time, as a
timeline of stamps (ms from the call): opening, the native pickle, the plan
(allocations), the engine's read on its thread, the tensors built meanwhile,
the report, and the device sync after the call; each load after a load of
another file (whose mapping is then being unmapped), after a load of the same
file, and after the unmappings were waited for (``_native.host_memory``: a
build with the cargo feature ``probes``).

    python probes/probe_load_timeline.py --device cuda --shape llm --size 4G
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benches"))
import benchlib  # noqa: E402
import ckptio  # noqa: E402
import torch  # noqa: E402
from ckptio import _native  # noqa: E402
from ckptio.formats import torchzip  # noqa: E402
from ckptio.io import memory, reports, transfer  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402

stamps: list[tuple[str, float]] = []
t0 = [0.0]


def stamp(what: str) -> None:
    stamps.append((what, (time.perf_counter() - t0[0]) * 1e3))


def wrap(owner: object, name: str) -> None:
    f = getattr(owner, name)

    def timed(*a: object, **k: object) -> object:
        stamp(name + ">")
        try:
            return f(*a, **k)
        finally:
            stamp(name + "<")

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llm", choices=["llm", "even"])
    ap.add_argument("--size", type=parse_size, default=4 << 30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for owner, name in (
        (torchzip, "open_archive"),
        (torchzip, "native_pickle"),
        (memory, "reserve_cuda"),
        (torchzip, "rebuild"),
        (reports, "report"),
        (transfer, "read_batches"),
        (transfer, "read_after"),
        (_native.Reader, "read_segments"),
    ):
        wrap(owner, name)
    dev = a.device
    sd = (
        benchlib.llm_state_dict(a.size, dev)
        if a.shape == "llm"
        else benchlib.even_state_dict(a.size, 512, dev)
    )
    print(f"# {a.shape}: {len(sd)} tensors, {sum(t.nbytes for t in sd.values()) / 2**30:.2f} GiB")
    d = tempfile.mkdtemp(dir="/dev/shm")
    try:
        pt, st = os.path.join(d, "m.pt"), os.path.join(d, "m.safetensors")
        ckptio.save(sd, pt)
        ckptio.safetensors.save_file(sd, st)
        del sd

        def sync() -> None:
            if dev.startswith("cuda"):
                torch.cuda.synchronize()

        def before_other() -> None:
            y = ckptio.safetensors.load_file(st, device=dev)
            sync()
            del y

        def before_flushed() -> None:
            before_other()
            _native.host_memory()  # waits for the unmappings

        cases = [
            ("after another file", before_other),
            ("after the same file", lambda: None),
            ("after another file, unmapped", before_flushed),
        ]
        ckptio.load(pt, map_location=dev)  # warm-up: engine, lanes, allocator
        for r in range(a.rounds):
            for label, before in cases:
                before()
                stamps.clear()
                sync()
                t0[0] = time.perf_counter()
                x = ckptio.load(pt, map_location=dev)
                stamp("returned")
                sync()
                stamp("synced")
                del x
                line = " ".join(f"{w}@{t:.1f}" for w, t in stamps)
                print(f"round {r} {label}: {line}", flush=True)
    finally:
        shutil.rmtree(d)


if __name__ == "__main__":
    main()
