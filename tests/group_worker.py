"""One rank of the read-once loads' multi-process tests (run by tests/test_group.py).

usage: python group_worker.py DIR CASE [CASE...]  (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment; CKPTIO_DIST_BACKEND=nccl for one GPU per rank,
gloo on the host otherwise). Every case runs in this one process group, in
order (a failed case must leave the group usable for the next); each rank
writes ``DIR/result_RANK.json``: {case: {"ok": bool, ...}}.
"""

import datetime
import errno
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
import warnings

import ckptio
import ckptio.loading.sharing
import ckptio.safetensors as cst
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckptio import _native
from test_dcp import assert_same as same
from torch import nn
from torch.utils._pytree import tree_map_only

warnings.simplefilter("ignore")


def state(seed: int) -> dict:
    """Storages of every size class: split between ranks and batches, in place,
    packed; several dtypes; a view sharing a storage; non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "big": torch.randn(1_500_000, generator=g),  # 6 MB: split
        "mid": torch.randn(300, 1000, generator=g),
        "bf": torch.randn(700, 760, generator=g).bfloat16(),
        "small": [torch.randn(i + 1, generator=g) for i in range(40)],
        "ints": torch.randint(0, 1000, (5000,), generator=g),
        "flags": torch.rand(999, generator=g) > 0.5,
        "empty": torch.zeros(0, 3),  # a storage of no bytes: nothing to read or share
        "step": 7,
    }
    sd["view"] = sd["big"][10:20]
    return sd


def flat(sd: dict) -> dict:
    out = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and k != "view"}
    out.update({f"small.{i}": t for i, t in enumerate(sd["small"])})
    return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(600, 512)
        self.lin = nn.Linear(512, 512)
        self.norm = nn.BatchNorm1d(512)
        self.head = nn.Linear(512, 8, bias=False)


def data_bytes(path: str) -> int:
    return sum(r.nbytes for r in ckptio.records(path) if "/data/" in r.name)


class Ctx:
    def __init__(self, folder: str) -> None:
        self.dir = folder
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.group = dist.group.WORLD
        nccl = os.environ.get("CKPTIO_DIST_BACKEND") == "nccl"
        self.dev = torch.device(f"cuda:{self.rank}") if nccl else torch.device("cpu")

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def shared_file(self, name: str, make) -> str:
        """A file rank 0 writes and every rank then reads."""
        p = self.path(name)
        if self.rank == 0 and not os.path.exists(p):
            make(p)
        dist.barrier()
        return p


def report(total: int) -> dict:
    r = ckptio.last_report()
    return {"bytes_read": r.bytes_read, "bytes_received": r.bytes_received, "total": total}


# --------------------------------------------------------------------------- cases


def case_torch_load(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    alone = ckptio.load(p, map_location=c.dev)
    got = ckptio.load(p, map_location=c.dev, group=c.group)
    out = report(data_bytes(p))
    same(got, alone)
    same(got, state(1))
    assert got["view"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()
    assert got["big"].device == c.dev
    return out


def case_torch_save_file(c: Ctx) -> dict:
    # torch's own file: 64-byte aligned storages.
    p = c.shared_file("plain.pt", lambda p: torch.save(state(2), p))
    got = ckptio.load(p, group=c.group)
    out = report(data_bytes(p))
    same(got, ckptio.load(p))
    same(got, state(2))
    return out


def case_verify(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    got = ckptio.load(p, verify=True, group=c.group)
    out = report(data_bytes(p))
    rep = ckptio.last_report()
    assert rep.verified and not rep.unchecked, rep
    same(got, state(1))
    return out


class Summed:
    """Reads its tensor's values while the pickle is decoded (a user's class)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.total = float(t.sum())

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.seen = float(self.t.sum())


def case_user_class(c: Ctx) -> dict:
    # A pickle that may read values as it decodes: the storages are read (once
    # over the group) before torch.load decodes it over them.
    import zipfile

    obj = {"sd": state(4), "s": Summed(torch.arange(1000.0))}
    p = c.shared_file("user.pt", lambda p: torch.save(obj, p))
    got = ckptio.load(p, map_location=c.dev, weights_only=False, group=c.group)
    with zipfile.ZipFile(p) as z:
        total = sum(i.file_size for i in z.infolist() if "/data/" in i.filename)
    out = report(total)
    assert "before torch.load decoded the pickle" in ckptio.last_report().direct_reason
    same(got["sd"], state(4))
    assert got["s"].seen == obj["s"].total and got["s"].t.device == c.dev
    return out


def case_safetensors(c: Ctx) -> dict:
    p = c.shared_file("m.safetensors", lambda p: cst.save_file(flat(state(3)), p))
    got = cst.load_file(p, device=str(c.dev), group=c.group)
    out = report(sum(t.nbytes for t in flat(state(3)).values()))
    same(got, cst.load_file(p, device=str(c.dev)))
    same(got, flat(state(3)))
    return out


def case_sharded(c: Ctx) -> dict:
    folder = c.path("sharded")

    def make(_: str) -> None:
        cst.save_sharded(flat(state(4)), folder, max_shard_size="3MB")

    c.shared_file("sharded", make)
    got = cst.load_sharded(folder, device=str(c.dev), group=c.group)
    out = report(sum(t.nbytes for t in flat(state(4)).values()))
    assert len(os.listdir(folder)) > 2
    same(got, flat(state(4)))
    same(got, cst.load_sharded(folder, device=str(c.dev)))
    return out


def case_load_out(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    want = state(1)
    dest = tree_map_only(torch.Tensor, lambda t: torch.zeros_like(t, device=c.dev), want)
    del dest["view"]
    # A strided destination (read through a buffer, then copied) and one cast.
    dest["mid"] = torch.zeros(1000, 300, device=c.dev).t()
    dest["bf"] = torch.zeros(700, 760, dtype=torch.float32, device=c.dev)
    ptr = dest["big"].data_ptr()
    got = ckptio.load(p, out=dest, cast=True, strict=False, group=c.group)
    total = sum(t.nbytes for k, t in flat(want).items())
    out = report(total)
    assert got["big"].data_ptr() == ptr
    want["bf"] = want["bf"].float()
    del want["view"]
    same({k: v for k, v in got.items() if k != "view"}, want)
    return out


def case_load_state_dict(c: Ctx) -> dict:
    def make(p: str) -> None:
        torch.manual_seed(11)
        m = Net()
        opt = torch.optim.Adam(m.parameters())
        m.head(m.lin(m.embed(torch.randint(0, 600, (8,))))).sum().backward()
        opt.step()
        torch.save({"model": m.state_dict(), "optim": opt.state_dict()}, p)

    p = c.shared_file("net.pt", make)
    torch.manual_seed(100 + c.rank)  # every rank's model starts different
    m = Net().to(c.dev)
    opt = torch.optim.Adam(m.parameters())
    ckptio.load_state_dict(m, p, key="model", group=c.group)
    out = report(sum(t.nbytes for t in torch.load(p)["model"].values()))
    ckptio.load_state_dict(opt, p, key="optim", group=c.group)
    ref = torch.load(p, map_location=c.dev)
    same(m.state_dict(), ref["model"])
    same(opt.state_dict()["state"], ref["optim"]["state"])
    return out


def _safetensors_out(c: Ctx, seed: int, path: str, load) -> dict:
    dest = {k: torch.zeros_like(v, device=c.dev) for k, v in flat(state(seed)).items()}
    got = load(path, out=dest, group=c.group)
    out = report(sum(t.nbytes for t in dest.values()))
    same(got, flat(state(seed)))
    return out


def case_safetensors_out(c: Ctx) -> dict:
    p = c.shared_file("m.safetensors", lambda p: cst.save_file(flat(state(3)), p))
    return _safetensors_out(c, 3, p, cst.load_file)


def case_sharded_out(c: Ctx) -> dict:
    folder = c.path("sharded")
    c.shared_file("sharded", lambda _: cst.save_sharded(flat(state(4)), folder, "3MB"))
    return _safetensors_out(c, 4, folder, cst.load_sharded)


def case_mismatch_size(c: Ctx) -> dict:
    sd = state(1)
    if c.rank == 1:
        sd["extra"] = torch.ones(10)
    p = c.path(f"size_{c.rank}.pt")
    ckptio.save(sd, p)
    dist.barrier()
    ckptio.load(p, group=c.group)
    return {}


def case_mismatch_records(c: Ctx) -> dict:
    a, b = (100, 200) if c.rank != 1 else (200, 100)
    p = os.path.join(c.path(f"records_{c.rank}"), "ck.pt")
    os.makedirs(os.path.dirname(p), exist_ok=True)
    ckptio.save({"a": torch.ones(a), "b": torch.ones(b)}, p)
    dist.barrier()
    ckptio.load(p, group=c.group)
    return {}


def case_mismatch_bytes(c: Ctx) -> dict:
    # One layout, other values (a node's copy of another step): the stored CRC-32s differ.
    p = os.path.join(c.path(f"bytes_{c.rank}"), "ck.pt")
    os.makedirs(os.path.dirname(p), exist_ok=True)
    ckptio.save({"a": torch.full((1000,), float(c.rank)), "step": torch.tensor(c.rank)}, p)
    dist.barrier()
    ckptio.load(p, group=c.group)
    return {}


def case_mismatch_out(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    dest = {"big": torch.zeros(1_500_000), "mid": torch.zeros(300, 1000)}
    if c.rank == 1:
        del dest["mid"]
    ckptio.load(p, out=dest, strict=False, group=c.group)
    return {}


def case_mismatch_verify(c: Ctx) -> dict:
    """Only verify= differs: into cast destinations (pieces never split either way)."""
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    dest = {k: torch.zeros(state(1)[k].shape, dtype=torch.float64) for k in ("big", "mid")}
    ckptio.load(p, out=dest, strict=False, cast=True, verify=c.rank == 0, group=c.group)
    return {}


def case_mismatch_verify_empty(c: Ctx) -> dict:
    """Only verify= differs, a checkpoint with no tensor bytes (no pieces)."""
    p = c.shared_file("empty.pt", lambda p: ckptio.save({"step": 7, "e": torch.zeros(0, 3)}, p))
    ckptio.load(p, verify=c.rank == 0, group=c.group)
    return {}


def case_missing_file(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    ckptio.load(p if c.rank != 1 else c.path("nowhere.pt"), group=c.group)
    return {}


def case_read_error(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    if c.rank == 1:  # two ranks: a later round than the first
        _native._set_fault("read", errno.EIO, 3 if c.world == 2 else 1)
    try:
        ckptio.load(p, group=c.group)
    finally:
        assert not _native._clear_faults(), "the fault did not fire"
    return {}


def case_read_error_inplace(c: Ctx) -> dict:
    p = c.shared_file("ck.pt", lambda p: ckptio.save(state(1), p))
    dest = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in flat(state(1)).items()}
    dest = {k: v for k, v in dest.items() if "." not in k}
    if c.rank == 1:
        _native._set_fault("read", errno.EIO, 2)
    try:
        ckptio.load(p, out=dest, strict=False, group=c.group)
    finally:
        assert not _native._clear_faults(), "the fault did not fire"
    return {}


def case_dcp(c: Ctx) -> dict:
    """DCP: replicated items (plain tensors, bytes) read by one rank and
    broadcast; DTensor shards read by each rank as before."""
    from ckptio.dcp import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh(c.dev.type, (c.world,))
    g = torch.Generator().manual_seed(9)
    w = torch.randn(64, 4096, generator=g)
    rep = {f"rep{i}": torch.randn(100_000 * (i + 1), generator=g) for i in range(4)}
    rep["tiny"] = torch.arange(10, dtype=torch.int16)
    rep["bf"] = torch.randn(300, 300, generator=g).bfloat16()

    def make(dev: torch.device, zero: bool) -> dict:
        f = torch.zeros_like if zero else (lambda t: t)
        return {
            "w": distribute_tensor(f(w).to(dev), mesh, [Shard(0)]),
            **{k: f(v).to(dev) for k, v in rep.items()},
            "step": {"epoch": 0, "names": ["", ""]} if zero else {"epoch": 5, "names": ["a", "b"]},
        }

    folder = c.path("dcp")
    dcp.save(make(c.dev, False), storage_writer=FileSystemWriter(folder))
    rep_bytes = sum(t.nbytes for t in rep.values())
    out = {}
    for share in (True, False):
        dest = make(c.dev, True)
        dest["rep2"] = torch.zeros(300_000, 2, device=c.dev)[:, 1]  # strided
        dest["bf"] = torch.zeros(300, 600, dtype=torch.bfloat16, device=c.dev)[:, ::2]  # strided
        reader = FileSystemReader(folder, share=share)
        dcp.load(dest, storage_reader=reader)
        assert isinstance(dest["w"], DTensor)
        same(dest["w"].full_tensor(), w)
        for k, v in rep.items():
            same(dest[k], v, k)
        assert dest["step"] == {"epoch": 5, "names": ["a", "b"]}, dest["step"]
        read = sum(st.get("bytes", 0) for st in reader.last_stats)
        got = reader.last_share
        out["share" if share else "alone"] = {
            "bytes_read": read,
            "bytes_received": got.get("bytes_received", 0),
            "bytes_sent": got.get("bytes_sent", 0),
        }
    out["rep_bytes"] = rep_bytes
    out["shard_bytes"] = w.nbytes
    return out


def case_dcp_destinations(c: Ctx) -> dict:
    """DCP, shared items into destinations unlike what is stored: another
    dtype on every rank (bf16 into fp32, fp32 into bf16) or on one rank (each
    in turn: its sends and its receipts), conjugate and negative views, a
    strided cast. The sender sent its destination's bytes, as many as the
    stored dtype takes: receivers got garbage, or every rank a ValueError.
    Every rank ends with torch's reader's values, and the items are still
    shared."""
    from ckptio.dcp import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint import FileSystemReader as TorchReader

    g = torch.Generator().manual_seed(21)
    n = 300_000  # fp32 and complex64 items over 1 MiB; bf16 ones too at 2n
    saved = {}
    for i in range(2 * c.world):  # every rank reads some for the others
        saved[f"b{i}"] = torch.randn(2 * n, generator=g).bfloat16()
        saved[f"f{i}"] = torch.randn(n, generator=g)
        saved[f"c{i}"] = torch.randn(n, dtype=torch.complex64, generator=g)
    saved["small"] = torch.randn(100, generator=g).bfloat16()
    folder = c.path("dcp_destinations")
    dcp.save(saved, storage_writer=FileSystemWriter(folder))

    def everywhere(k: str, t: torch.Tensor) -> torch.Tensor:
        cast = {torch.bfloat16: torch.float32, torch.float32: torch.bfloat16}
        return torch.zeros(t.shape, dtype=cast.get(t.dtype, torch.complex128))

    def on_one(k: str, t: torch.Tensor) -> torch.Tensor:
        i = int(k[1:]) if k[1:].isdigit() else 0
        if k[0] == "c":
            return torch.zeros_like(t).conj()
        if k[0] == "f" and i % 2:
            return torch._neg_view(torch.zeros_like(t))
        if k[0] == "f":
            return torch.zeros(2 * t.numel(), dtype=torch.float64)[::2]  # strided, cast
        return torch.zeros(t.shape, dtype=torch.float64)

    cases = [("everywhere", everywhere, None)]
    cases += [(f"on rank {r}", on_one, r) for r in range(c.world)]
    wrong = []  # checked once every load is over: a rank that stops early hangs the rest
    for name, make, only in cases:
        reader = FileSystemReader(folder)
        ours, theirs = (
            {
                k: make(k, t) if only in (None, c.rank) else torch.zeros_like(t)
                for k, t in saved.items()
            }
            for _ in range(2)
        )
        dcp.load(ours, storage_reader=reader)
        dcp.load(theirs, storage_reader=TorchReader(folder))
        for k in saved:
            a, b = ours[k], theirs[k]
            if not (a.dtype == b.dtype and torch.equal(a, b)):
                wrong.append((name, k, a[:3].tolist(), b[:3].tolist()))
        got = reader.last_share
        if not (got["items_sent"] and got["items_received"]):
            wrong.append((name, "not shared", got))
    assert not wrong, wrong[:4]
    return {}


def case_after(c: Ctx) -> dict:
    # The group is still usable after the failures above.
    return case_torch_load(c)


CASES = {n.removeprefix("case_"): f for n, f in globals().items() if n.startswith("case_")}


def describe(e: BaseException) -> dict:
    cause = e.__cause__
    return {
        "ok": False,
        "type": type(e).__name__,
        "mro": [k.__name__ for k in type(e).__mro__],
        "msg": str(e)[:2000],
        "rank": getattr(e, "rank", None),
        "cause": None if cause is None else type(cause).__name__,
        "cause_mro": [] if cause is None else [k.__name__ for k in type(cause).__mro__],
        "tb": traceback.format_exc()[-3000:],
    }


def main() -> None:
    faulthandler.enable(all_threads=True)  # as dist_worker.py
    folder, names = sys.argv[1], sys.argv[2:]
    backend = os.environ.get("CKPTIO_DIST_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A collective that hangs gives up after this (no case should come near it).
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
        timeout=datetime.timedelta(seconds=float(os.environ.get("GROUP_TIMEOUT", "60"))),
    )
    ckptio.loading.sharing.BATCH = 2 << 20  # several rounds per load
    c = Ctx(folder)
    results = {}
    for name in names:
        t0 = time.perf_counter()
        gc.disable()  # a cycle that keeps a session (and its group) alive stays to be seen
        try:
            res = {"ok": True, **CASES[name](c)}
        except BaseException as e:  # noqa: BLE001 - reported (DCP's errors are BaseExceptions)
            res = describe(e)
        res["seconds"] = time.perf_counter() - t0
        session = ckptio.loading.sharing.Session
        res["sessions_left"] = sum(isinstance(o, session) for o in gc.get_objects())
        gc.enable()
        results[name] = res
        dist.barrier()
    with open(os.path.join(folder, f"result_{c.rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: see the end of dist_worker.py


if __name__ == "__main__":
    main()
