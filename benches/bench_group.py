"""Read once, share over torch.distributed (issue 18) and several GPUs (issue 19),
every figure against a baseline measured in the same run.

One process per rank (torch.multiprocessing, spawn), gloo on the host
(``--device cpu``) or NCCL on one GPU per rank (``--device cuda``, with gloo
beside it for DCP's async saves). Parts (``--parts``, default all):

- ``load``: ``ckptio.load`` of one checkpoint (``--size`` of bf16 tensors, the
  same file for every rank) from each of ``--dirs``, cold (page cache dropped
  first, where the folder is on a disk): ``group`` (``group=``: read once,
  shared) against ``alone`` (every rank loading alone at the same moment) and
  ``one`` (rank 0 loading alone, the others idle). Wall time = the slowest
  rank, from a common start. Bytes read from storage per rank (group), and
  the group result compared bit for bit with a load alone.
- ``sharded``: the same for ``ckptio.safetensors.load_sharded`` (shards of
  ``--shard`` bytes).
- ``state_dict``: the same for ``ckptio.load_state_dict`` in place (a module
  whose parameters are the checkpoint's tensors, on each rank's device).
- ``dcp``: ``dcp.async_save`` of a DTensor state dict (``--size`` per rank,
  Shard(0)) on every rank at once, ``--saves`` in a row, with ckptio's stagers
  (host staging; device snapshot on GPUs) and ``ckptio.dcp.FileSystemWriter``
  against torch's ``FileSystemWriter(cache_staged_state_dict=True)``: time until
  async_save returns, staging is done and the upload is done, per rank. Then
  ``dcp.load`` cold with ckptio's reader against torch's, and a resharding load
  on half the ranks (each gets two of the saved shards).
- ``tests``: the NCCL tests (tests/test_dcp.py -k nccl, tests/test_group.py -k
  gpus), GPUs only.

    # issue 18's figure (development machine): 2 gloo ranks, 1 GiB, O_DIRECT, cold
    python benches/bench_group.py --device cpu --ranks 2 --size 1G --dirs /tmp \\
        --parts load --direct on --rounds 3 --json out.json
    # issue 19 (scripts/gpu_check.sh multigpu): 2, 4 or 8 GPUs
    python benches/bench_group.py --device cuda --ranks 8 --size 8G --dirs /tmp,/dev/shm
    # smoke test on CPU
    python benches/bench_group.py --device cpu --ranks 2 --size 64M --dirs /tmp,/dev/shm \\
        --saves 2 --rounds 1

Targets: issue 18 (CPU, 2 ranks, disk): group <= 0.75x alone. Issue 19 (local
disk): group <= 1.2x one, and <= 0.6x alone for 2 ranks (<= 0.35x for 4);
async_save returns in < 5 ms on every rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from typing import Any

import torch

warnings.simplefilter("ignore")
GiB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- one rank


class Rank:
    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = rank
        self.world = args.ranks
        self.args = args
        self.cuda = args.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(rank)
            self.dev = torch.device("cuda", rank)
        else:
            self.dev = torch.device("cpu")
        self.results: dict[str, Any] = {"parts": {}}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def say(self, *a: Any) -> None:
        if self.rank == 0:
            print(*a, flush=True)

    def gather(self, x: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, x)
        return out

    def cold(self, paths: list[str], folder: str) -> None:
        """Drop the pages of ``paths`` (rank 0), where ``folder`` is on a disk."""
        from ckptio.tools.bench import drop_cache

        if self.rank == 0 and not on_tmpfs(folder):
            for p in paths:
                drop_cache(p)
        self.dist.barrier()

    def timed(self, fn: Any, paths: list[str], folder: str, active: bool = True) -> dict[str, Any]:
        """``fn()`` on every rank (``active``) from a common start, cold."""
        import ckptio

        self.cold(paths, folder)
        self.dist.barrier()
        t0 = time.perf_counter()
        out = fn() if active else None
        self.sync()
        own = time.perf_counter() - t0
        rep = ckptio.last_report() if active else None
        mine = {
            "s": own if active else 0.0,
            "bytes_read": rep.bytes_read if rep else 0,
            "bytes_received": rep.bytes_received if rep else 0,
        }
        per = self.gather(mine)
        return {"wall_s": max(p["s"] for p in per), "ranks": per, "out": out}

    # ---- the three loads

    def compare(self, name: str, make: Any, load: Any, paths: list[str], folder: str) -> dict:
        """group / alone / one for ``load(group)`` (``make()`` builds what the
        in-place loads fill; the results are compared bit for bit once)."""
        rounds = []
        exact = None
        for r in range(self.args.rounds):
            row: dict[str, Any] = {}
            order = ["alone", "group", "one"]
            order = order[r % 3 :] + order[: r % 3]
            keep: dict[str, Any] = {}
            for mode in order:
                dest = make()
                grp = self.dist.group.WORLD if mode == "group" else None
                active = mode != "one" or self.rank == 0
                got = self.timed(lambda d=dest, g=grp: load(d, g), paths, folder, active)
                res = got.pop("out")
                if r == 0 and mode in ("alone", "group"):
                    keep[mode] = res
                row[mode] = got
                del res, dest
                if self.cuda:
                    torch.cuda.empty_cache()
            if r == 0:
                ok = same(keep["alone"], keep["group"])
                exact = all(self.gather(ok))
            del keep
            rounds.append(row)
            g, a, o = (row[m]["wall_s"] for m in ("group", "alone", "one"))
            self.say(
                f"  {name:<11} round {r + 1}: group {g:7.3f} s  alone {a:7.3f} s  one {o:7.3f} s"
                f"  group/alone {g / a:5.2f}  group/one {g / o:5.2f}"
            )
        med = {
            m: statistics.median(x[m]["wall_s"] for x in rounds) for m in ("group", "alone", "one")
        }
        paired = [x["group"]["wall_s"] / x["alone"]["wall_s"] for x in rounds]
        read = [p["bytes_read"] for p in rounds[0]["group"]["ranks"]]
        summary = {
            "group_s": med["group"],
            "alone_s": med["alone"],
            "one_s": med["one"],
            "group_vs_alone": med["group"] / med["alone"],
            "group_vs_alone_paired": paired,
            "group_vs_one": med["group"] / med["one"],
            "group_bytes_read_per_rank": read,
            "bit_exact": exact,
        }
        self.say(
            f"  {name:<11} median: group/alone {summary['group_vs_alone']:.2f} (paired "
            f"{', '.join(f'{x:.2f}' for x in paired)}), group/one {summary['group_vs_one']:.2f}; "
            f"read per rank {', '.join(f'{b / GiB:.2f}' for b in read)} GiB; bit-exact {exact}"
        )
        return {"rounds": rounds, "summary": summary}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.nn.Module):
        return same(a.state_dict(), b.state_dict())
    return bool(a == b)


def on_tmpfs(path: str) -> bool:
    try:
        out = subprocess.run(
            ["stat", "-f", "-c", "%T", path], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return False
    return out in ("tmpfs", "ramfs")


class Holder(torch.nn.Module):
    """A module whose parameters are a flat state dict's tensors (names with
    dots become nested modules' names)."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(sd)
        for k, v in sd.items():
            self.register_parameter(
                k.replace(".", "__"), torch.nn.Parameter(v, requires_grad=False)
            )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        renamed = {prefix + k.replace(".", "__"): v for k, v in state_dict.items()}
        super()._load_from_state_dict(renamed, prefix, *args, **kwargs)


def part_loads(c: Rank, d: str, size: int) -> dict[str, Any]:
    import ckptio
    import ckptio.safetensors as cst
    from ckptio.tools.bench import synthetic_state_dict

    folder = os.path.join(d, "ckptio_bench_group")
    ckpt = os.path.join(folder, "ckpt.pt")
    sharded = os.path.join(folder, "sharded")
    parts = c.args.parts
    direct = c.args.direct if not on_tmpfs(d) else None
    if c.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        sd = synthetic_state_dict(size, dtype=torch.bfloat16)
        ckptio.save(sd, ckpt)
        if "sharded" in parts:
            cst.save_sharded(sd, sharded, max_shard_size=c.args.shard)
        del sd
    c.dist.barrier()
    n = os.path.getsize(ckpt)
    c.say(f"== {d}: {n / GiB:.2f} GiB checkpoint, {c.world} ranks on {c.args.device}")
    out: dict[str, Any] = {"dir": d, "nbytes": n, "tmpfs": on_tmpfs(d)}
    dev = c.dev
    if "load" in parts:
        out["load"] = c.compare(
            "load",
            lambda: None,
            lambda _, g: ckptio.load(ckpt, map_location=dev, direct=direct, group=g),
            [ckpt],
            d,
        )
    if "sharded" in parts:
        shards = [os.path.join(sharded, f) for f in sorted(os.listdir(sharded))]
        out["sharded"] = c.compare(
            "sharded",
            lambda: None,
            lambda _, g: cst.load_sharded(sharded, device=str(dev), direct=direct, group=g),
            shards,
            d,
        )
    if "state_dict" in parts:
        shapes = {k: (v.shape, v.dtype) for k, v in torch.load(ckpt, mmap=True).items()}

        def make() -> Holder:
            return Holder({k: torch.empty(s, dtype=t, device=dev) for k, (s, t) in shapes.items()})

        def fill(m: Holder, g: Any) -> Holder:
            ckptio.load_state_dict(m, ckpt, direct=direct, group=g)
            return m

        out["state_dict"] = c.compare("state_dict", make, fill, [ckpt], d)
    if c.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- DCP


def part_dcp(c: Rank, d: str, size: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from bench_dcp import timed_async_save
    from ckptio.dcp import FileSystemReader, FileSystemWriter
    from ckptio.staging import DefaultStager, StagingOptions
    from ckptio.tools.bench import drop_cache
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist = c.dist
    folder = os.path.join(d, "ckptio_bench_group_dcp")
    mesh = init_device_mesh(c.dev.type, (c.world,))
    rows_per = 2048
    cols = 4096
    layers = max(1, size // (rows_per * cols * 2))

    def local(layer: int, src: int, dev: torch.device) -> torch.Tensor:
        g = torch.Generator(device=dev).manual_seed(1000 * layer + src)
        return torch.randn(rows_per, cols, generator=g, device=dev).bfloat16()

    sd = {
        f"layer{i}": DTensor.from_local(local(i, c.rank, c.dev), mesh, [Shard(0)])
        for i in range(layers)
    }
    sd["step"] = torch.tensor(7, device=c.dev)  # replicated: read once, shared
    per_rank = layers * rows_per * cols * 2
    c.say(f"== dcp in {d}: {per_rank / GiB:.2f} GiB per rank, {layers} tensors, {c.world} ranks")
    out: dict[str, Any] = {"dir": d, "per_rank_bytes": per_rank, "configs": {}}
    configs: dict[str, Any] = {
        "torch FSW(cache_staged=True)": None,
        "ckptio host": StagingOptions(use_shared_memory=False),
    }
    if c.cuda:
        configs["ckptio snapshot"] = StagingOptions(use_shared_memory=False, device_snapshot=True)
    for name, opts in configs.items():
        rows = []
        try:
            stager = DefaultStager(opts) if opts is not None else None
            torch_writer = dcp.FileSystemWriter(folder, cache_staged_state_dict=True)
            for i in range(c.args.saves):
                if c.rank == 0:
                    shutil.rmtree(folder, ignore_errors=True)
                    os.makedirs(folder)
                dist.barrier()
                writer = torch_writer if stager is None else FileSystemWriter(folder)
                per = c.gather(timed_async_save(sd, writer, stager))
                rows.append(per)
                ret, stg, up = (
                    max(p[k] for p in per) for k in ("return_s", "staged_s", "upload_s")
                )
                c.say(
                    f"  {name:<28} save {i + 1}: return max {ret * 1e3:8.2f} ms"
                    f"  staged max {stg:6.3f} s  upload max {up:6.3f} s"
                )
            if stager is not None:
                stager.close()
            later = rows[1:] or rows
            out["configs"][name] = {
                "saves": rows,
                "max_return_ms": max(p["return_s"] for s in rows for p in s) * 1e3,
                "max_return_later_ms": max(p["return_s"] for s in later for p in s) * 1e3,
                "median_staged_s": statistics.median(max(p["staged_s"] for p in s) for s in later),
                "median_upload_s": statistics.median(max(p["upload_s"] for p in s) for s in later),
            }
        except Exception as e:  # noqa: BLE001 - e.g. pinned memory without a GPU
            c.say(f"  {name}: skipped ({type(e).__name__}: {str(e)[:160]})")
            out["configs"][name] = {"skipped": f"{type(e).__name__}: {e}"}
    # dcp.load, cold, with each reader (the last save's checkpoint).
    files = [os.path.join(folder, f) for f in os.listdir(folder)] if os.path.isdir(folder) else []
    for name, reader in (("torch", dcp.FileSystemReader), ("ckptio", FileSystemReader)):
        dest = {
            k: DTensor.from_local(torch.empty_like(v.to_local()), mesh, [Shard(0)])
            for k, v in sd.items()
            if k != "step"
        }
        dest["step"] = torch.zeros((), dtype=torch.int64, device=c.dev)
        got = c.timed(lambda x=dest, r=reader: dcp.load(x, storage_reader=r(folder)), files, d)
        exact = all(
            c.gather(
                all(torch.equal(dest[k].to_local(), sd[k].to_local()) for k in dest if k != "step")
            )
        )
        out[f"load_{name}_s"] = got["wall_s"]
        out[f"load_{name}_exact"] = exact
        rate = c.world * per_rank / GiB / got["wall_s"]
        c.say(
            f"  dcp.load {name:<7} {got['wall_s']:7.3f} s ({rate:6.2f} GiB/s over all ranks), "
            f"bit-exact {exact}"
        )
        del dest
    out["load_ours_vs_torch"] = out["load_torch_s"] / out["load_ckptio_s"]
    # A resharding load on half the ranks: each gets two saved shards.
    half = max(1, c.world // 2)
    sub = dist.new_group(list(range(half)))
    if c.rank < half:
        sub_mesh = DeviceMesh.from_group(sub, c.dev.type)
        per = c.world // half
        dest = {
            k: DTensor.from_local(
                torch.empty(rows_per * per, cols, dtype=torch.bfloat16, device=c.dev),
                sub_mesh,
                [Shard(0)],
            )
            for k in sd
            if k != "step"
        }
        dest["step"] = torch.zeros((), dtype=torch.int64, device=c.dev)
        if c.rank == 0 and not on_tmpfs(d):
            for f in files:
                drop_cache(f)
        dist.barrier(group=sub)
        c.sync()
        t0 = time.perf_counter()
        dcp.load(
            dest, storage_reader=FileSystemReader(folder, process_group=sub), process_group=sub
        )
        c.sync()
        took = time.perf_counter() - t0
        ok = (
            all(
                torch.equal(
                    dest[f"layer{i}"].to_local(),
                    torch.cat([local(i, c.rank * per + j, c.dev) for j in range(per)]),
                )
                for i in range(layers)
            )
            and int(dest["step"]) == 7
        )
        del dest
    else:
        took, ok = 0.0, True
    per_r = c.gather((took, ok))
    out["reshard_half_s"] = max(t for t, _ in per_r)
    out["reshard_half_exact"] = all(o for _, o in per_r)
    c.say(
        f"  resharding load on {half} of {c.world} ranks: {out['reshard_half_s']:.3f} s, "
        f"bit-exact {out['reshard_half_exact']}"
    )
    dist.barrier()
    if c.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return out


# --------------------------------------------------------------------------- driver


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    c = Rank(rank, args)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if c.cuda else "gloo",
        rank=rank,
        world_size=args.ranks,
        timeout=datetime.timedelta(seconds=600),
    )
    import ckptio

    size = _size(args.size)
    c.results.update(
        device=args.device,
        ranks=args.ranks,
        size=size,
        torch=torch.__version__,
        ckptio=ckptio.__version__,
        group_batch=ckptio.loading.sharing.BATCH,
    )
    if c.cuda and rank == 0:
        c.results["gpu"] = torch.cuda.get_device_name(0)
    for d in args.dirs.split(","):
        try:
            if {"load", "sharded", "state_dict"} & set(args.parts):
                c.results["parts"].setdefault("loads", []).append(part_loads(c, d, size))
            if "dcp" in args.parts:
                c.results["parts"].setdefault("dcp", []).append(part_dcp(c, d, size))
        except Exception:  # noqa: BLE001 - reported, the next folder still runs
            c.say(traceback.format_exc())
            c.results.setdefault("errors", []).append(traceback.format_exc())
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(c.results, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


def _size(s: str) -> int:
    from ckptio.io.units import parse_size as size

    return size(s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--ranks", type=int, default=0, help="default: every GPU (cuda) or 2 (cpu)")
    ap.add_argument("--size", default="8G", help="checkpoint (loads) / per rank (dcp)")
    ap.add_argument("--shard", default="1GB", help="load_sharded's shard size")
    ap.add_argument("--dirs", default="/tmp")
    ap.add_argument("--parts", default="load,sharded,state_dict,dcp,tests")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--direct", default=None, help="the loads' direct= on disks (auto|on|off)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not args.ranks:
        args.ranks = torch.cuda.device_count() if args.device == "cuda" else 2
    args.parts = args.parts.split(",")
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args, _free_port()), nprocs=args.ranks, join=True)
    if "tests" in args.parts and args.device == "cuda":
        tests = os.path.join(HERE, "..", "tests")
        cmd = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
            os.path.join(tests, "test_dcp.py"), os.path.join(tests, "test_group.py"),
            "-k", "nccl or gpus",
        ]  # fmt: skip
        print("== NCCL tests:", " ".join(cmd[3:]), flush=True)
        rc = subprocess.run(cmd, check=False).returncode
        if args.json:
            with open(args.json) as f:
                res = json.load(f)
            res["nccl_tests_rc"] = rc
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
