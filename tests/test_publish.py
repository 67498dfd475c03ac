"""Checkpoints of several files (DCP folders, sharded safetensors) commit as one.

A save over an existing checkpoint folder is published by one atomic step after every file
is durable: a save that is killed (SIGKILL at random moments) or fails (a full disk at any of
its files) leaves the previous checkpoint loadable and bit-exact, by ckptio's readers and by
torch's / the safetensors package's; the next save removes the leftovers.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ckptio.safetensors as cst
import pytest
import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter
from ckptio.formats.dcp import DATA_FILE
from test_faults import CHILD_PRELUDE, IS_ROOT, TEMP_RE, fork_trial, temps

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
MIB = 2**20
N_TENSORS = 8


def state(gen: int, numel: int = MIB) -> dict[str, torch.Tensor]:
    """Generation ``gen``'s checkpoint: 8 tensors of 4 MiB (float32), all different per gen."""
    g = torch.Generator().manual_seed(gen)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(N_TENSORS)}


def digest(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def dcp_save(folder: Path, sd: dict, files: int) -> None:
    dcp.save(sd, storage_writer=FileSystemWriter(folder, thread_count=files), no_dist=True)


def dcp_loads(folder: Path, numel: int = MIB) -> str:
    """The digest of what ckptio's reader and torch's reader load from ``folder`` (the same)."""
    got = []
    for reader in (FileSystemReader(folder, verify=True), dcp.FileSystemReader(folder)):
        out = {f"w{i}": torch.zeros(numel) for i in range(N_TENSORS)}
        dcp.load(out, storage_reader=reader, no_dist=True)
        got.append(digest(out))
    assert got[0] == got[1], "ckptio's and torch's readers disagree"
    return got[0]


def sharded_loads(folder: Path) -> str:
    """The digest of what load_sharded and a transformers-style reader (the index's
    weight_map, each shard read by the safetensors package) load (the same)."""
    ours = cst.load_sharded(folder)
    index = folder / cst.INDEX_NAME
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        theirs: dict[str, torch.Tensor] = {}
        for shard in sorted(set(wm.values())):
            part = st.load_file(folder / shard)
            assert {k for k, v in wm.items() if v == shard} == set(part), shard
            theirs.update(part)
    else:
        theirs = st.load_file(folder / "model.safetensors")
    assert digest(ours) == digest(theirs), "load_sharded and the safetensors package disagree"
    return digest(ours)


def checkpoint_files(kind: str, folder: Path) -> set[str]:
    """The files the folder's current checkpoint names (plus its metadata/index)."""
    if kind == "dcp":
        md = FileSystemReader(folder).read_metadata()
        return {".metadata"} | {i.relative_path for i in md.storage_data.values()}
    index = folder / cst.INDEX_NAME
    if not index.exists():
        return {"model.safetensors"}
    return {cst.INDEX_NAME} | set(json.loads(index.read_text())["weight_map"].values())


# --------------------------------------------------------------------------- SIGKILL

SERVER = """
import warnings
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
import ckptio.safetensors as cst
from ckptio.dcp import FileSystemWriter
kind, folder, variant = sys.argv[1], sys.argv[2], sys.argv[3]
def state(gen):
    g = torch.Generator().manual_seed(gen)
    return {f"w{i}": torch.randn(1 << 18, generator=g) for i in range(8)}
def save(gen, variant):
    if kind == "dcp":
        w = FileSystemWriter(folder, thread_count=int(variant))
        dcp.save(state(gen), storage_writer=w, no_dist=True)
    else:
        cst.save_sharded(state(gen), folder, max_shard_size=int(variant))
save(0, variant)
print("ready", flush=True)
for line in sys.stdin:
    cmd, delay, gen, variant = line.split()
    if cmd != "go":
        break
    r = fork_kill(None if delay == "none" else float(delay), lambda: save(int(gen), variant))
    print(json.dumps(r), flush=True)
"""

# (kind, variants cycled through the saves): DCP with 2 data files every time; DCP
# alternating 4 and 2 files (new names and counts); shards of 2 tensors (4 shards) every
# time; alternating 4 and 3 shards.
KILL_NUMEL = 1 << 18
SCENARIOS = {
    "dcp_2_files": ("dcp", [2]),
    "dcp_4_then_2_files": ("dcp", [4, 2]),
    "sharded_same_count": ("sharded", [9 * KILL_NUMEL]),
    "sharded_new_count": ("sharded", [9 * KILL_NUMEL, 13 * KILL_NUMEL]),
}
KILLS = 8  # per scenario: 32 SIGKILLs mid-save in all


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sigkill_at_random_moments_leaves_old_or_new_never_a_mix(tmp_path, scenario):
    """Saves over a checkpoint folder SIGKILLed at moments spread over a whole save: after
    each kill the folder loads, by ckptio's and by the other readers, as exactly the previous
    checkpoint or (killed after the commit) the new one; temp files left belong to killed
    saves; a save that ends leaves only its own files. 4 scenarios x 8 SIGKILLs mid-save."""
    kind, variants = SCENARIOS[scenario]
    folder = tmp_path / "ck"

    def loads(folder: Path) -> str:
        return dcp_loads(folder, KILL_NUMEL) if kind == "dcp" else sharded_loads(folder)

    server = subprocess.Popen(
        [sys.executable, "-c", CHILD_PRELUDE + SERVER, kind, str(folder), str(variants[0])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rng = random.Random(scenario)
    log, killed, hits = [], set(), 0
    try:
        assert server.stdout.readline().strip() == "ready"
        hashes = {0: digest(state(0, KILL_NUMEL))}

        def trial(gen: int, delay: float | None) -> dict:
            variant = variants[gen % len(variants)]
            hashes[gen] = digest(state(gen, KILL_NUMEL))
            return fork_trial(
                server, f"{'none' if delay is None else delay} {gen} {variant}", killed
            )

        durations = []
        for gen in (1, 2):  # whole saves: the time scale (one of each variant)
            full = trial(gen, None)
            assert full["status"] == 0, full
            assert loads(folder) == hashes[gen]
            durations.append(full["seconds"])
        current, n = 2, 0
        # Until KILLS saves were SIGKILLed mid-save (at most 3 x KILLS trials): the moments
        # are strata over a save, in turn; the scale follows the saves that ended (the
        # median of the last ones: the shared machine's speed drifts).
        while hits < KILLS and n < 3 * KILLS:
            gen = 3 + n  # a generation never saved before: new content
            delay = statistics.median(durations[-3:]) * (n % KILLS + rng.random()) / KILLS
            n += 1
            r = trial(gen, delay)
            got = loads(folder)
            assert got in (hashes[current], hashes[gen]), (
                f"after a kill at {delay:.3f}s the folder is neither gen {current} nor {gen}: "
                f"{sorted(os.listdir(folder))} {log}"
            )
            if got == hashes[gen]:
                current = gen
            left = temps(folder)
            assert all(int(TEMP_RE.match(t)["pid"]) in killed for t in left), (left, log)
            if not r["killed"]:
                durations.append(r["seconds"])
                assert r["status"] == 0 and current == gen, (r, log)
                assert set(os.listdir(folder)) == checkpoint_files(kind, folder), log
            hits += r["killed"]
            log.append(f"gen {gen} kill at {delay:.3f}s: killed={r['killed']} -> gen {current}")
        # The next save removes every leftover.
        final = trial(3 + n, None)
        assert final["status"] == 0
        assert set(os.listdir(folder)) == checkpoint_files(kind, folder), os.listdir(folder)
    finally:
        server.stdin.close()
        server.wait(timeout=120)
    print(f"\n{scenario}: {hits} of {n} saves SIGKILLed mid-save; " + "; ".join(log))
    assert hits >= KILLS, log


# --------------------------------------------------------------------------- disk full


def _mount_tmpfs(mnt: Path, size: str) -> None:
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.strip()}")


def _umount(mnt: Path) -> None:
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _new_file_sizes(kind: str, scratch: Path, sd: dict) -> list[int]:
    """The sizes of the data files a save of ``sd`` writes, in the order it writes them."""
    if kind == "dcp":
        dcp_save(scratch, sd, 4)
        md = FileSystemReader(scratch).read_metadata()
        names = sorted({i.relative_path for i in md.storage_data.values()}, key=_file_number)
    else:
        cst.save_sharded(sd, scratch, max_shard_size=9 * MIB)
        names = sorted(n for n in os.listdir(scratch) if n.endswith(".safetensors"))
    return [os.path.getsize(scratch / n) for n in names]


def _file_number(name: str) -> int:
    return int(name.rsplit("_", 1)[1].split(".")[0])


def _fill_to(mnt: Path, free: int) -> None:
    """Leave about ``free`` bytes free on the filesystem at ``mnt``."""
    s = os.statvfs(mnt)
    have = s.f_bavail * s.f_frsize
    assert have > free, (have, free)
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, (have - free) // 4096 * 4096)
    finally:
        os.close(fd)


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("kind", ["dcp", "sharded"])
def test_disk_full_at_every_file_keeps_the_previous_checkpoint(tmp_path, kind):
    """A tmpfs that fills up while the k-th data file of a save is written (k = each of the
    4 files): the save raises ENOSPC naming a file of the folder, the previous checkpoint
    still loads bit-exact (every reader), no temp file is left; once there is room the next
    save succeeds and leaves only its own files."""
    old, new = state(0), state(1)
    sizes = _new_file_sizes(kind, tmp_path / "scratch", new)
    assert len(sizes) == 4, sizes
    loads = dcp_loads if kind == "dcp" else sharded_loads
    for k in range(len(sizes)):
        mnt = tmp_path / f"mnt{k}"
        _mount_tmpfs(mnt, "96m")
        try:
            folder = mnt / "ck"
            if kind == "dcp":
                dcp_save(folder, old, 4)
            else:
                cst.save_sharded(old, folder, max_shard_size=9 * MIB)
            before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
            _fill_to(mnt, sum(sizes[:k]) + sizes[k] // 2)
            with pytest.raises(BaseException) as ei:
                if kind == "dcp":
                    dcp_save(folder, new, 4)
                else:
                    cst.save_sharded(new, folder, max_shard_size=9 * MIB)
            e = ei.value
            if kind == "dcp":  # DCP wraps it; the OSError is the rank's failure
                assert isinstance(e, dcp.api.CheckpointException), repr(e)
                e = e.failures[0][0]
            assert isinstance(e, OSError) and e.errno == errno.ENOSPC, repr(e)
            assert os.path.dirname(os.fsdecode(e.filename)) == str(folder), e.filename
            assert loads(folder) == digest(old), f"disk full at file {k}: old checkpoint lost"
            for n, data in before.items():
                assert (folder / n).read_bytes() == data, f"{n} changed"
            assert temps(folder) == []
            os.remove(mnt / "filler")
            if kind == "dcp":
                dcp_save(folder, state(2), 4)
            else:
                cst.save_sharded(state(2), folder, max_shard_size=9 * MIB)
            assert loads(folder) == digest(state(2))
            assert set(os.listdir(folder)) == checkpoint_files(kind, folder)
        finally:
            _umount(mnt)


FAULT_SCRIPT = """
import errno, warnings
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
import ckptio.safetensors as cst
from ckptio import _native
from ckptio.dcp import FileSystemWriter
kind, base = sys.argv[1], sys.argv[2]
def state(gen):
    g = torch.Generator().manual_seed(gen)
    return {f"w{i}": torch.randn(1 << 16, generator=g) for i in range(8)}
def save(folder, gen):
    if kind == "dcp":
        dcp.save(state(gen), storage_writer=FileSystemWriter(folder, thread_count=4), no_dist=True)
    else:
        cst.save_sharded(state(gen), folder, max_shard_size=600_000)
out = []
for point in ("fallocate", "write", "rename"):
    for nth in range(1, 6):  # the 4 data files, then .metadata / the index
        folder = os.path.join(base, f"{point}{nth}")
        save(folder, 0)
        _native._set_fault(point, errno.ENOSPC, nth)
        res = attempt(lambda: save(folder, 1))
        res["unfired"] = _native._clear_faults()
        res["case"] = [point, nth, folder]
        out.append(res)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dcp", "sharded"])
def test_injected_enospc_at_every_file_keeps_the_previous_checkpoint(tmp_path, kind):
    """ENOSPC injected at one stage (space reservation, a data write, the rename)
    of each file of a 4-file save in turn, and of the metadata / index written last: the
    save fails and the previous checkpoint loads bit-exact by every reader."""
    from test_fault_injection import run_faulty

    g = torch.Generator().manual_seed(0)
    want = digest({f"w{i}": torch.randn(1 << 16, generator=g) for i in range(8)})
    results = run_faulty(FAULT_SCRIPT, kind, tmp_path)
    fired = 0
    for r in results:
        point, nth, folder = r["case"]
        if r["unfired"]:  # fewer hits of this point than nth (no fallocate for the index)
            continue
        fired += 1
        assert r["type"] is not None and "28" in r["message"] + str(r["errno"]), r
        got = dcp_loads(Path(folder), 1 << 16) if kind == "dcp" else sharded_loads(Path(folder))
        assert got == want, r
        assert temps(Path(folder)) == [], r
    assert fired >= 12, results


# --------------------------------------------------------------------------- layouts


def test_dcp_save_over_a_folder_of_torchs_writer_and_back(tmp_path):
    """ckptio's writer saves over a folder torch's writer made (its __0_n.distcp files go
    once ckptio's .metadata is in place), and torch's writer over ckptio's; every reader
    reads every result."""
    folder = tmp_path / "ck"
    dcp.save(state(0, 4096), storage_writer=dcp.FileSystemWriter(folder, thread_count=2))
    assert sorted(n for n in os.listdir(folder) if DATA_FILE.fullmatch(n)) == [
        "__0_0.distcp",
        "__0_1.distcp",
    ]
    dcp_save(folder, state(1, 4096), 2)
    names = sorted(os.listdir(folder))
    assert "__0_0.distcp" not in names and len(names) == 3, names
    assert dcp_loads(folder, 4096) == digest(state(1, 4096))
    dcp.save(state(2, 4096), storage_writer=dcp.FileSystemWriter(folder, thread_count=2))
    assert dcp_loads(folder, 4096) == digest(state(2, 4096))
    dcp_save(folder, state(3, 4096), 3)
    assert set(os.listdir(folder)) == checkpoint_files("dcp", folder)
    assert dcp_loads(folder, 4096) == digest(state(3, 4096))


def test_dcp_cleanup_leaves_other_files_alone(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    keep = ["notes.txt", "__0_0.distcp.bak", "model.safetensors", "__x_0.distcp", "__0.metadata"]
    for n in keep:
        (folder / n).write_text("mine")
    dcp_save(folder, state(0, 1000), 2)
    dcp_save(folder, state(1, 1000), 2)
    for n in keep:
        assert (folder / n).read_text() == "mine", n
    assert dcp_loads(folder, 1000) == digest(state(1, 1000))


def test_sharded_layout_changes_and_hub_names(tmp_path):
    """Shards take the hub's names when the current checkpoint does not use them, else a
    token of their own; single file <-> shards both ways; the transformers-style reader and
    load_sharded agree after each save; nothing of another generation stays."""
    folder = tmp_path / "ck"
    sd = state(0, 4096)
    cst.save_sharded(sd, folder, max_shard_size=40_000)
    first = sorted(os.listdir(folder))
    assert first[0] == "model-00001-of-00004.safetensors", first
    cst.save_sharded(state(1, 4096), folder, max_shard_size=40_000)
    second = sorted(os.listdir(folder))
    assert not set(first) & set(second) - {cst.INDEX_NAME}, (first, second)
    assert sharded_loads(folder) == digest(state(1, 4096))
    cst.save_sharded(state(2, 4096), folder, max_shard_size=40_000)
    assert sorted(os.listdir(folder)) == first  # the hub's names are free again
    cst.save_sharded(state(3, 4096), folder, max_shard_size=10**9)
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    assert sharded_loads(folder) == digest(state(3, 4096))
    cst.save_sharded(state(4, 4096), folder, max_shard_size=40_000)
    assert set(os.listdir(folder)) == checkpoint_files("sharded", folder)
    assert sharded_loads(folder) == digest(state(4, 4096))
    (folder / "README.md").write_text("mine")
    (folder / "model.safetensors.bak").write_text("mine")
    cst.save_sharded(state(5, 4096), folder, max_shard_size=40_000)
    assert (folder / "README.md").exists() and (folder / "model.safetensors.bak").exists()


def test_sharded_save_with_an_unreadable_index_takes_fresh_names(tmp_path):
    folder = tmp_path / "ck"
    cst.save_sharded(state(0, 4096), folder, max_shard_size=40_000)
    (folder / cst.INDEX_NAME).write_text("{")
    cst.save_sharded(state(1, 4096), folder, max_shard_size=40_000)
    assert sharded_loads(folder) == digest(state(1, 4096))
    assert set(os.listdir(folder)) == checkpoint_files("sharded", folder)


def hub_cache_layout(tmp_path: Path) -> Path:
    """A Hugging Face cache snapshot: shards are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--m"
    src = tmp_path / "src"
    cst.save_sharded(state(0, 4096), src, max_shard_size=40_000)
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for n in os.listdir(src):
        blob = hashlib.sha256(n.encode()).hexdigest()
        shutil.copy(src / n, repo / "blobs" / blob)
        (snap / n).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snap


def test_hub_cache_snapshots_still_load(tmp_path):
    snap = hub_cache_layout(tmp_path)
    assert digest(cst.load_sharded(snap)) == digest(state(0, 4096))


# --------------------------------------------------------------------------- several ranks


def _run_dying_ranks(tmp_path: Path, scenario: str) -> list[int]:
    from test_dcp import _free_port

    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(os.path.dirname(__file__), "dist_worker.py"),
                    scenario,
                    str(tmp_path),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    codes = []
    deadline = time.monotonic() + 240
    for p in procs:
        try:
            p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()  # a rank blocked on its dead peer
            p.communicate()
        codes.append(p.returncode)
    return codes


def _dist_state(step: int) -> dict:
    g = torch.Generator().manual_seed(1234 + step)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(64, generator=g).bfloat16()}


def _dist_loads(folder: Path) -> list[dict]:
    out = []
    for reader in (FileSystemReader(folder, verify=True), dcp.FileSystemReader(folder)):
        sd = {"w": torch.zeros(64, 48), "b": torch.zeros(64).bfloat16(), "step": None}
        dcp.load(sd, storage_reader=reader, no_dist=True)
        out.append(sd)
    return out


@pytest.mark.slow
def test_a_rank_that_dies_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """Two ranks over gloo save step 0, then step 1 during which one rank is SIGKILLed: rank 1
    after its first data file is durable, then (another round) the coordinator, rank 0, right
    before it writes .metadata, every rank's files being durable. Each time the folder still
    loads step 0 exactly (.metadata is the single commit point); a later two-rank save
    removes the leftovers."""
    folder = tmp_path / "die"
    for who, dead in (("rank1_in_write", 1), ("rank0_before_commit", 0)):
        codes = _run_dying_ranks(tmp_path, f"die_{who}")
        assert codes[dead] == -signal.SIGKILL, (who, codes)
        for sd in _dist_loads(folder):
            want = _dist_state(0)
            assert torch.equal(sd["w"], want["w"]) and torch.equal(sd["b"], want["b"]), who
            assert sd["step"] == 0
        leftovers = set(os.listdir(folder)) - checkpoint_files("dcp", folder)
        assert leftovers, f"{who}: the killed save left nothing: it did not get far enough"
    codes = _run_dying_ranks(tmp_path, "die_none")
    assert codes == [0, 0], codes
    for sd in _dist_loads(folder):
        want = _dist_state(2)
        assert torch.equal(sd["w"], want["w"]) and sd["step"] == 2
    assert set(os.listdir(folder)) == checkpoint_files("dcp", folder)
