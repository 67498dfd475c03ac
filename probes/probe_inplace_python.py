"""The Python side of an in-place load, per load: ckptio.load_state_dict of a
model of many small tensors (86 layers of 6 tensors of 1 KiB in 690 modules,
the module tree of bench_inplace.py) from /dev/shm to the host, where the
engine's read is a small part. With --against REF, the same loads by the
ckptio Python package at git REF (imported as ckptio_ref, sharing this tree's
native module) alternate with this tree's in one process: the dev VMs' speed
drifts by 2x between processes, a ratio in one process does not.

usage: PYTHONPATH=python python probes/probe_inplace_python.py [--against REF]
       [--rounds 40] [--phases] [--device cuda]

--phases also times the native reads (read_segments) and prints what is left
("rest": the load's own steps outside the phases, its report, the walk's
setup). --device cuda puts the model on the GPU (the same Python steps, with
CUDA destinations: streams, device codes).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import ckptio
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benches"))
import benchlib  # noqa: E402
from bench_inplace import module_of  # noqa: E402


def ref_package(ref: str, into: str) -> None:
    """python/ckptio at ``ref`` as package ckptio_ref under ``into``."""
    root = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"],
        cwd=HERE,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tar = subprocess.run(
        ["git", "archive", ref, "python/ckptio"], cwd=root, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=tar, check=True)
    pkg = os.path.join(into, "ckptio_ref")
    os.rename(os.path.join(into, "python", "ckptio"), pkg)
    native = os.path.dirname(ckptio._native.__file__)
    for name in os.listdir(native):
        if name.startswith("_native") and name.endswith(".so"):
            shutil.copy(os.path.join(native, name), pkg)
    for dirpath, _, names in os.walk(pkg):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                text = re.sub(r"\bfrom ckptio\b", "from ckptio_ref", text)
                text = re.sub(r"\bimport ckptio\b", "import ckptio_ref as ckptio", text)
                text = text.replace('"ckptio.', '"ckptio_ref.')
                with open(path, "w") as f:
                    f.write(text)


class Phases:
    """Seconds in each step of an in-place load (benchlib.LoadPhases) and in the
    native reads within execute (benchlib.EngineReads), for package ``mod``."""

    def __init__(self, mod) -> None:
        self.steps, self.reads = benchlib.LoadPhases(mod), benchlib.EngineReads(mod)

    def clear(self) -> None:
        self.steps.reset()
        self.reads.reset()

    def items(self):
        return [*self.steps.seconds.items(), ("(read_segments)", self.reads.seconds)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", default=None, help="a git ref to compare with")
    p.add_argument("--rounds", type=int, default=40, help="rounds of 5 loads each")
    p.add_argument("--phases", action="store_true", help="time open/walk/plan/execute")
    p.add_argument("--device", default="cpu", help="where the model lives (cpu, cuda)")
    args = p.parse_args()
    shapes = {
        f"layers.{layer}.{name}": [256]
        for layer in range(86)
        for name in (
            "attn.qkv.weight",
            "attn.out.weight",
            "mlp.up.weight",
            "mlp.down.weight",
            "norm.weight",
            "norm.bias",
        )
    }
    model = module_of(shapes, torch.float32, args.device)
    tmp = tempfile.mkdtemp(prefix="ckptio-probe-")
    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tmp, "probe-inplace-python.pt")
    try:
        ckptio.save(model.state_dict(), path)
        mods = {"this tree": ckptio}
        if args.against:
            ref_package(args.against, tmp)
            sys.path.insert(0, tmp)
            import ckptio_ref

            mods[f"at {args.against}"] = ckptio_ref
        acc = {k: Phases(m) for k, m in mods.items()} if args.phases else {}
        for m in mods.values():
            for _ in range(10):
                m.load_state_dict(model, path)
        for a in acc.values():
            a.clear()
        times: dict[str, list[float]] = {k: [] for k in mods}
        for _ in range(args.rounds):
            for k, m in mods.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    m.load_state_dict(model, path)
                if args.device != "cpu":
                    torch.cuda.synchronize()
                times[k].append((time.perf_counter() - t0) / 5)
        print(
            f"# in-place loads of {len(shapes)} tensors in {len(list(model.modules()))} "
            f"modules on {args.device}"
        )
        for k, v in times.items():
            v.sort()
            line = f"{k:>16}: median {statistics.median(v) * 1e3:.2f} ms, best {v[0] * 1e3:.2f} ms"
            if k in acc:
                n = 5 * args.rounds
                line += "; " + ", ".join(f"{s} {t / n * 1e3:.2f}" for s, t in acc[k].items())
                whole = sum(v) / len(v) * 1e3
                inside = sum(t for s, t in acc[k].items() if s != "(read_segments)") / n * 1e3
                line += f", rest {whole - inside:.2f} (mean {whole:.2f})"
            print(line)
        if args.against:
            a, b = (statistics.median(v) for v in times.values())
            print(f"this tree / {args.against}: {a / b:.3f} (ratio of medians)")
    finally:
        if os.path.exists(path):
            os.remove(path)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
