"""Injected I/O errors at every stage, the order of durable operations, SIGKILL and concurrency.

The engine's fault hooks (``_native._set_fault``) only work in a process started with
``CKPTIO_TEST_FAULTS=1``, so these tests run their scenarios in child processes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ckptio
import pytest
import torch
from ckptio import _native
from test_faults import (
    CHILD_PRELUDE,
    TEMP_RE,
    assert_same,
    fork_trial,
    refers_to,
    sample_state,
    temps,
)

MIB = 2**20


def run_faulty(script: str, *args: Any, timeout: float = 300) -> Any:
    """Run CHILD_PRELUDE + script with fault injection enabled; its last stdout line is JSON."""
    env = dict(os.environ, CKPTIO_TEST_FAULTS="1")
    r = subprocess.run(
        [sys.executable, "-c", CHILD_PRELUDE + script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, f"child exited with {r.returncode}:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fault_hooks_refuse_without_the_test_setting():
    if os.environ.get("CKPTIO_TEST_FAULTS") == "1":
        pytest.skip("this process has fault injection enabled")
    with pytest.raises(ValueError, match="CKPTIO_TEST_FAULTS"):
        _native._set_fault("write", errno.EIO)
    with pytest.raises(ValueError, match="CKPTIO_TEST_FAULTS"):
        _native._record_ops()


FAULT_SCRIPT = """
import errno, hashlib, re
from ckptio import _native
folder = sys.argv[1]
cases = json.loads(sys.argv[2])
TEMP = re.compile(r"^\\.ckpt\\.pt\\.ckptio-\\d+-[0-9a-f]{16}\\.tmp$")
target = os.path.join(folder, "ckpt.pt")
old = {"w": torch.arange(300_000, dtype=torch.int32), "s": torch.ones(5)}
new = {"w": torch.arange(300_000, dtype=torch.int32) * 3, "s": torch.zeros(5)}
kw = dict(chunk_size=65536, threads=3)

def digest():
    return hashlib.sha256(open(target, "rb").read()).hexdigest()

def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

out = []
for point, err, nth in cases:
    ckptio.save(old, target)
    before = digest()
    _native._set_fault(point, err, nth)
    if point == "read":
        res = attempt(lambda: ckptio.load(target, **kw))
    else:
        res = attempt(lambda: ckptio.save(new, target, **kw))
    res["unfired"] = _native._clear_faults()
    res["case"] = [point, err, nth]
    res["temps"] = [n for n in os.listdir(folder) if TEMP.match(n)]
    res["old_intact"] = digest() == before and same(ckptio.load(target), old)
    res["is_new"] = same(ckptio.load(target), new)
    res["verify_ok"] = ckptio.verify(target).ok
    out.append(res)
print(json.dumps(out))
"""

CASES = [
    ("create", errno.EIO, 1),
    ("create", errno.EACCES, 1),
    ("create", errno.EDQUOT, 1),
    ("fallocate", errno.ENOSPC, 1),
    ("fallocate", errno.EDQUOT, 1),
    ("write", errno.EIO, 1),
    ("write", errno.ENOSPC, 2),
    ("write", errno.EDQUOT, 7),
    ("write", errno.EIO, 18),
    ("crc", errno.EIO, 1),
    ("fsync", errno.EIO, 1),
    ("fsync", errno.ENOSPC, 1),
    ("rename", errno.EIO, 1),
    ("rename", errno.EXDEV, 1),
    ("fsync_dir", errno.EIO, 1),
    ("read", errno.EIO, 1),
    ("read", errno.EIO, 4),
]
SUBCLASS = {errno.EACCES: PermissionError}


def test_injected_errors_at_every_stage_lose_nothing(tmp_path):
    """An I/O error at each stage of a save (temp creation, fallocate, chunk 1/2/7/18 of the data,
    the CRC patch, fsync, rename) raises the matching OSError subclass naming the file, leaves
    the previous checkpoint bit-exact and no temp file. After the rename (a failed folder fsync)
    the file is the new checkpoint, whole. A read error fails the load the same way."""
    res = run_faulty(FAULT_SCRIPT, tmp_path, json.dumps(CASES))
    assert len(res) == len(CASES)
    for r in res:
        point, err, _ = r["case"]
        cls = SUBCLASS.get(err, OSError)
        assert r["type"] == cls.__name__ and r["errno"] == err, r
        assert r["unfired"] == [], r
        target = tmp_path / "ckpt.pt"
        assert refers_to(r["filename"], r["message"], target), r
        assert r["temps"] == [], r
        assert r["verify_ok"], r
        if point == "fsync_dir":
            assert r["is_new"], r  # renamed: the new file is there, complete
        else:
            assert r["old_intact"], r


ORDER_SCRIPT = """
from ckptio import _native
target = sys.argv[1]
ckptio.save({"x": torch.ones(10)}, target)
_native._record_ops()
ckptio.save({"w": torch.arange(200_000), "v": torch.ones(3)}, target, chunk_size=65536)
log = _native._op_log()
_native._clear_faults()
print(json.dumps(log))
"""


def test_durable_operations_happen_in_order(tmp_path):
    """The recording hook sees: temp created, space reserved, every data chunk written, the
    CRC-32 fields written, fsync of the temp file, rename over the target, fsync of the folder
    -- nothing after the rename but the folder fsync, nothing durable out of order."""
    log = run_faulty(ORDER_SCRIPT, tmp_path / "ckpt.pt")
    ops = [line.split(" ", 1)[0] for line in log]
    files = [line.split(" ", 1)[1] for line in log]
    assert ops[:2] == ["create", "fallocate"], log
    writes = ops[2 : ops.index("crc")]
    assert writes and set(writes) == {"write"} and len(writes) >= 200_000 * 8 // 65536, log
    assert ops[ops.index("crc") :] == ["crc", "fsync", "rename", "fsync_dir"], log
    assert all(TEMP_RE.match(f) for f in files[: ops.index("rename")]), log
    assert files[ops.index("rename") :] == ["ckpt.pt", "ckpt.pt"], log


# --------------------------------------------------------------------------- SIGKILL

FORK_SERVER = """
target, n = sys.argv[1], int(sys.argv[2])
w = torch.arange(n, dtype=torch.int32)
ckptio.save({"gen": torch.tensor(0), "w": w}, target)
print("ready", flush=True)
gen = 0
for line in sys.stdin:
    cmd, delay = line.split()
    if cmd != "go":
        break
    gen += 1
    work = lambda: ckptio.save({"gen": torch.tensor(gen), "w": w}, target)
    r = fork_kill(None if delay == "none" else float(delay), work)
    print(json.dumps(r), flush=True)
"""


def sample_digest(path: Path) -> str:
    """A cheap digest: 64 KiB at 64 places and the size (the file is never changed in place)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        for i in range(64):
            f.seek(size * i // 64)
            h.update(f.read(65536))
    return f"{size}:{h.hexdigest()}"


@pytest.mark.slow
def test_sigkill_at_random_moments_of_a_2gib_save(tmp_path):
    """40 saves of a 2 GiB checkpoint SIGKILLed at moments spread uniformly over a whole save
    (fork of a warm process, so a trial costs a save, not an interpreter start): after each kill
    the file at the path is a complete checkpoint -- the previous one, unchanged, or (killed after
    the rename) the new one, whole; every leftover temp file matches the temp name pattern and
    belongs to a killed process; the next save removes it."""
    gib = int(os.environ.get("CKPTIO_KILL_TEST_GIB", "2"))
    n = gib * 2**30 // 4
    target = tmp_path / "ckpt.pt"
    server = subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + FORK_SERVER, str(target), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rng = random.Random(5)
    log, killed, renamed, left, done = [], set(), 0, 0, 0
    t_start = time.perf_counter()
    try:
        assert server.stdout.readline().strip() == "ready"

        def trial(delay: float | None) -> dict:
            return fork_trial(server, "none" if delay is None else str(delay), killed)

        full = trial(None)  # one whole save: the first time scale of the kills
        assert full["status"] == 0, full
        durations = [full["seconds"]]
        prev = sample_digest(target)
        trials = 40
        strata = list(range(trials))
        rng.shuffle(strata)
        for k in strata:
            # Strata over the whole save and a little past it, in random order; the time scale
            # follows the saves that ran to the end (the shared disk's speed drifts).
            save_s = statistics.median(durations[-5:])
            delay = save_s * (k + rng.random()) / trials * 1.2
            r = trial(delay)
            if not r["killed"]:
                durations.append(r["seconds"])
            now = sample_digest(target)
            mine = [t for t in temps(tmp_path) if int(TEMP_RE.match(t)["pid"]) == r["pid"]]
            assert all(int(TEMP_RE.match(t)["pid"]) in killed for t in temps(tmp_path)), log
            assert len(temps(tmp_path)) <= 1, f"older temps were not cleaned up: {log}"
            left += bool(mine)
            if now != prev:
                # Killed after the rename: the new file must be whole (checked by its CRC-32s).
                assert ckptio.verify(target).ok, log
                renamed += 1
                prev = now
            done += not r["killed"]
            log.append(f"kill at {delay:.2f}s status={r['status']} temp={'left' if mine else '-'}")
    finally:
        server.stdin.close()
        server.wait(timeout=120)
    elapsed = time.perf_counter() - t_start
    rep = ckptio.verify(target)
    assert rep.ok and not rep.unchecked, rep
    got = ckptio.load(target)
    assert torch.equal(got["w"], torch.arange(n, dtype=torch.int32))
    del got
    ckptio.save(sample_state(1), target)  # the next save of the path removes the leftovers
    assert temps(tmp_path) == []
    print(
        f"\n{trials} trials over a {gib} GiB save of {save_s:.2f} s: {trials - done} SIGKILLs "
        f"mid-save ({left} left a temp file, the old file intact), {done} saves ended first "
        f"(new file whole); {elapsed:.1f} s in all"
    )
    assert trials - done >= trials // 2 and left >= trials // 2, log  # most kills hit a save


# --------------------------------------------------------------------------- concurrency

RACE_SCRIPT = """
import os, time
target, value, rounds, sync = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
obj = {"who": torch.tensor(value), "w": torch.full((4 * 2**20,), value, dtype=torch.int32)}
open(f"{sync}/ready-{value}", "w").close()
while not os.path.exists(f"{sync}/go"):
    time.sleep(0.001)
for _ in range(rounds):
    ckptio.save(obj, target)
print(json.dumps({"ok": True}))
"""

LOAD_SCRIPT = """
import os, time
target, sync = sys.argv[1], sys.argv[2]
seen, torn = {}, []
open(f"{sync}/ready-reader", "w").close()
while not os.path.exists(f"{sync}/go"):
    time.sleep(0.001)
# Loads go on until the writers are done, and at least a few more after.
while not os.path.exists(f"{sync}/stop") or sum(seen.values()) < 6:
    try:
        d = ckptio.load(target)
    except FileNotFoundError:
        continue
    who = int(d["who"])
    if not bool((d["w"] == who).all()):
        torn.append(who)
    seen[who] = seen.get(who, 0) + 1
print(json.dumps({"seen": seen, "torn": torn}))
"""


@pytest.mark.slow
def test_two_writers_and_a_reader_on_one_path(tmp_path):
    """Two processes save different 16 MiB checkpoints to one path at the same moments, 15 times
    each, while a third loads it in a loop: every load and the final file are one writer's
    checkpoint, whole; no temp file is left."""
    target = tmp_path / "ckpt.pt"
    ckptio.save({"who": torch.tensor(0), "w": torch.zeros(4 * 2**20, dtype=torch.int32)}, target)
    # The three children start together once all have imported torch (a fixed
    # start time failed on a loaded machine, where imports took longer).
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + RACE_SCRIPT]
            + [str(target), str(v), "15", str(sync)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for v in (1, 2)
    ]
    reader = subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + LOAD_SCRIPT, str(target), str(sync)],
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while len(list(sync.glob("ready-*"))) < 3 and time.time() < deadline:
        time.sleep(0.01)
    (sync / "go").touch()
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    (sync / "stop").touch()
    assert all(o["ok"] for o in outs)
    r = json.loads(reader.communicate(timeout=120)[0].strip().splitlines()[-1])
    assert r["torn"] == [], r
    assert sum(r["seen"].values()) > 5, r
    final = ckptio.load(target)
    who = int(final["who"])
    assert who in (1, 2)
    assert_same(
        final, {"who": torch.tensor(who), "w": torch.full((4 * 2**20,), who, dtype=torch.int32)}
    )
    assert ckptio.verify(target).ok
    assert temps(tmp_path) == []
    print(f"\nreader saw {r['seen']}")


def test_temp_name_pattern_is_documented():
    """Leftover temp files are recognisable: .<name>.ckptio-<pid>-<16 hex>.tmp."""
    assert TEMP_RE.match(".ckpt.pt.ckptio-123-0123456789abcdef.tmp")
    assert re.search(
        r"ckptio-<pid>-<nonce>\.tmp|ckptio-PID-NONCE\.tmp",
        Path(__file__).parents[1].joinpath("README.md").read_text(),
    )
