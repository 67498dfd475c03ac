"""Saves to an object store killed at stratified moments (issue 38): a 256 MiB
save over an existing checkpoint (one torch.save object, sharded safetensors, a
2-rank DCP save over gloo) is SIGKILLed at 8 moments spread over its duration;
the checkpoint then loads bit-exact with verify=True, as the old state or (a
kill after the commit) the new one, every object its index or .metadata names is
there, and ``ckptio clean`` aborts what the dead saves left pending."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import ckptio
import pytest
import torch
from ckptio.io import remote

# Its saves write GiBs, which SeaweedFS keeps until its server stops.
pytestmark = pytest.mark.own_s3_server

MOMENTS = 8
MIB = 1 << 20

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    fmt, url, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    n = int(os.environ.get("CKPTIO_KILL_MIB", "256")) << 18  # int32 elements

    def state(seed):
        base = torch.arange(n // 8, dtype=torch.int32)
        return {f"t{i}": base * (seed + 1) + i for i in range(8)}

    if fmt == "torch":
        import ckptio
        ckptio.save(state(seed), url + "/state.pt")
    elif fmt == "safetensors":
        import ckptio.safetensors as st
        st.save_sharded(state(seed), url + "/sharded", max_shard_size="80MB")
    else:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from ckptio.dcp import FileSystemWriter
        dist.init_process_group("gloo")
        r, w = dist.get_rank(), dist.get_world_size()
        mine = {k: v for i, (k, v) in enumerate(state(seed).items()) if i % w == r}
        dcp.save(mine, storage_writer=FileSystemWriter(url + "/dcp"))
        dist.destroy_process_group()
    print("DONE", flush=True)
    """
)


def _state(seed, mib):
    n = mib << 18
    base = torch.arange(n // 8, dtype=torch.int32)
    return {f"t{i}": base * (seed + 1) + i for i in range(8)}


def _spawn(fmt, url, seed, s3, mib):
    env = dict(os.environ, **s3.env, CKPTIO_KILL_MIB=str(mib), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    argv = [sys.executable, "-c", CHILD, fmt, url, str(seed)]
    if fmt != "dcp":
        return [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        e = dict(env, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        e["MASTER_PORT"] = str(port)
        procs.append(subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, text=True))
    return procs


def _wait(procs, timeout=300):
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0 and "DONE" in out


def _load(fmt, url, s3, mib):
    opts = s3.options
    if fmt == "torch":
        return ckptio.load(url + "/state.pt", storage_options=opts, verify=True)
    if fmt == "safetensors":
        data, _ = remote.get_bytes(url + "/sharded/model.safetensors.index.json", opts)
        import json

        named = set(json.loads(data)["weight_map"].values())
        there = {u.rsplit("/", 1)[1] for u, _, _, _ in remote.listing(url + "/sharded", opts)}
        assert named <= there, f"the index names missing objects: {named - there}"
        assert ckptio.verify(url + "/sharded", storage_options=opts).ok
        return ckptio.safetensors.load_sharded(url + "/sharded", storage_options=opts)
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader

    out = {k: torch.zeros_like(v) for k, v in _state(0, mib).items()}
    reader = FileSystemReader(url + "/dcp", storage_options=opts, verify=True)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_a_killed_save_leaves_a_whole_checkpoint(s3, fmt):
    mib = 256
    url = s3.url(fmt)
    t0 = time.monotonic()
    _wait(_spawn(fmt, url, 1, s3, mib))  # the checkpoint the kills fall on
    full = time.monotonic() - t0  # one whole save's duration, start-up included
    old, new = _state(1, mib), _state(2, mib)
    outcomes = []
    for i in range(MOMENTS):
        procs = _spawn(fmt, url, 2 if i % 2 else 1, s3, mib)
        time.sleep(full * (i + 0.5) / MOMENTS)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
        got = _load(fmt, url, s3, mib)
        if all(torch.equal(got[k], old[k]) for k in old):
            outcomes.append("old")
        else:
            assert all(torch.equal(got[k], new[k]) for k in new), f"kill {i}: neither state"
            outcomes.append("new")
            old, new = new, old  # the next saves write the other state over this one
    print(fmt, f"{full:.1f} s a save;", outcomes)
    _wait(_spawn(fmt, url, 5, s3, mib))  # a save after the kills completes
    got = _load(fmt, url, s3, mib)
    assert all(torch.equal(got[k], _state(5, mib)[k]) for k in got)
    boto3 = pytest.importorskip("boto3")
    env = s3.env
    client = boto3.client(
        "s3", endpoint_url=s3.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
    )  # fmt: skip
    from ckptio.tools.clean import abort_uploads

    abort_uploads(url, 0, s3.options)
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
