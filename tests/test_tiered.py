"""ckptio.tiered.Checkpointer (issue 38) against a real S3 server: the three
futures, both tiers' layout, loads from either tier, pruning, retries, a drain
killed and resumed by the next process, and bad arguments."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import ckptio
import pytest
import torch
from ckptio.io import remote
from ckptio.tiered import COMMIT, Checkpointer, step_name


def _state(seed: int, n: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": torch.tensor(seed)}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _dcp_from(where, s3, step: int) -> dict[str, torch.Tensor]:
    """The DCP checkpoint at ``where`` (a store URL) loaded into tensors shaped
    as step ``step``'s state."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader

    out = {k: torch.zeros_like(v) for k, v in _state(step).items()}
    dcp.load(out, storage_reader=FileSystemReader(where, storage_options=s3.options), no_dist=True)
    return out


#: A test whose drain fails on purpose (its handle checked): close() warns of it.
_DRAIN_FAILS = pytest.mark.filterwarnings("ignore:ckptio.tiered. steps .* did not reach")


def _ckpt(tmp_path, s3, **kw):
    return Checkpointer(tmp_path / "local", s3.url("run"), storage_options=s3.options, **kw)


def _saved_with_the_store_down(local, url, s3, step: int = 1):
    """A TieredWriter's save of ``step`` into ``local`` while the store cannot be
    reached: durable locally only (its remote future and its rank's upload a
    StoreConnectionError), left for the next writer to drain."""
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    down = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    writer = TieredWriter(local, url, storage_options=down, tries=1)
    dcp.save(_state(step), storage_writer=writer, no_dist=True)
    with pytest.raises(ckptio.StoreConnectionError):
        writer.remote_completion.result(60)
    with pytest.raises(ckptio.StoreConnectionError):
        writer._tier.uploading.result(60)
    return writer


def test_save_gives_three_futures_and_both_tiers(tmp_path, s3):
    with _ckpt(tmp_path, s3) as c:
        h = c.save(10, _state(10))
        h.staged.result(60)
        folder = h.local.result(60)
        assert folder == str(tmp_path / "local" / step_name(10))
        assert sorted(os.listdir(folder)) == [COMMIT, "state.pt"]
        url = h.remote.result(120)
        assert url == s3.url("run", step_name(10))
        assert sorted(u.rsplit("/", 1)[1] for u, _, _, _ in remote.listing(url, s3.options)) == [
            COMMIT,
            "state.pt",
        ]
        assert c.latest() == 10 and c.local_steps() == [10] and c.remote_steps() == [10]
        _same(c.load(), _state(10))
        _same(torch.load(os.path.join(folder, "state.pt"), weights_only=True), _state(10))


def test_the_snapshot_is_taken_before_training_goes_on(tmp_path, s3):
    sd = _state(1)
    want = {k: v.clone() for k, v in sd.items()}
    with _ckpt(tmp_path, s3) as c:
        h = c.save(1, sd)
        h.staged.result(60)
        sd["w"].add_(1)  # training modifies the state once staged
        h.wait(120)
        _same(c.load(1), want)


def test_load_falls_back_to_the_store(tmp_path, s3):
    with _ckpt(tmp_path, s3) as c:
        c.save(5, _state(5)).wait(120)
        os.unlink(os.path.join(c.local, step_name(5), "state.pt"))  # the local copy is gone
        _same(c.load(5), _state(5))
        out = {k: torch.zeros_like(v) for k, v in _state(5).items()}
        c.load(5, out=out)
        _same(out, _state(5))
        with pytest.raises(FileNotFoundError, match="step 6 is complete in neither"):
            c.load(6)


def test_keep_local_and_keep_remote_prune_old_steps(tmp_path, s3):
    with _ckpt(tmp_path, s3, keep_local=1, keep_remote=2) as c:
        for step in (1, 2, 3, 4):
            c.save(step, _state(step))
        c.wait(240)
        assert c.local_steps() == [4]
        assert c.remote_steps() == [3, 4]
        assert not remote.listing(s3.url("run", step_name(1)), s3.options)
        _same(c.load(3), _state(3))


def test_keep_local_prunes_steps_the_store_dropped_first(tmp_path, s3):
    # keep_remote < keep_local: a step the store dropped still leaves the local tier.
    with _ckpt(tmp_path, s3, keep_local=2, keep_remote=1) as c:
        for step in (1, 2, 3, 4):
            c.save(step, _state(step))
            c.wait(240)
        assert c.local_steps() == [3, 4]
        assert c.remote_steps() == [4]


def test_close_with_a_timeout_stops_the_drains_and_the_next_process_drains(tmp_path, s3):
    import time

    # The store is down and the drain would retry for minutes: close(timeout=)
    # returns once the time is up, the local copies whole, for the next process.
    down = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    c = Checkpointer(
        tmp_path / "local", s3.url("run"), storage_options=down, tries=100, backoff=5.0,
    )  # fmt: skip
    h1 = c.save(1, _state(1))
    h2 = c.save(2, _state(2))
    with pytest.raises(ValueError, match="timeout"):
        c.close(timeout=-1)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match=r"steps \[1, 2\] are not in"):
        c.close(timeout=0.5)
    assert time.monotonic() - t0 < 30
    assert h2.local.result(0) == os.path.join(c.local, step_name(2))
    for h in (h1, h2):
        with pytest.raises(ckptio.errors.DrainStoppedError, match="close\\(\\) timed out") as e:
            h.remote.result(0)
        assert e.value.step == h.step and isinstance(e.value, TimeoutError)
    assert Checkpointer.local_steps(c) == [1, 2]
    with _ckpt(tmp_path, s3, keep_local=1) as again:
        assert again.resumed == [1, 2]
        again.wait(240)
        assert again.remote_steps() == [1, 2]
        _same(again.load(2), _state(2))


def test_a_store_that_is_down_keeps_the_local_copy_and_the_next_process_drains(tmp_path, s3):
    down = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    c = Checkpointer(
        tmp_path / "local", s3.url("run"), storage_options=down, keep_local=1, tries=2,
        backoff=0.01,
    )  # fmt: skip
    h1 = c.save(1, _state(1))
    h2 = c.save(2, _state(2))
    h2.local.result(60)
    with pytest.raises(ckptio.StoreConnectionError):
        h1.remote.result(60)
    with pytest.raises(ckptio.StoreConnectionError):
        c.wait(60)
    c.close()
    assert Checkpointer.local_steps(c) == [1, 2]  # nothing pruned: not in the store
    with _ckpt(tmp_path, s3, keep_local=1) as again:
        assert again.resumed == [1, 2]
        again.wait(240)
        assert again.remote_steps() == [1, 2] and again.local_steps() == [2]
        _same(again.load(1), _state(1))
    with _ckpt(tmp_path, s3) as third:  # nothing left to drain
        assert third.resumed == []


def test_a_drain_that_failed_for_good_is_a_warning_at_close(tmp_path, s3):
    """A trainer that only closes (or leaves the with block) never asked a
    handle: a drain that failed for good was silent. Now close() warns, naming
    the step and its error (it does not raise: the run's exit stays), and
    wait() raises it, also after close()."""
    down = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    local, url = tmp_path / "local", s3.url("run")
    with pytest.warns(UserWarning, match=r"steps \[1\] did not reach .*StoreConnectionError") as w:
        with Checkpointer(local, url, storage_options=down, tries=1) as c:
            h = c.save(1, _state(1))
    assert url in str(w[0].message) and str(local) in str(w[0].message)
    assert w[0].filename == __file__  # pointed at the with statement
    with pytest.raises(ckptio.StoreConnectionError):
        h.remote.result(0)
    with pytest.raises(ckptio.StoreConnectionError):
        c.wait(0)
    # Raised by wait() already: not said again.
    c = Checkpointer(tmp_path / "other", url, storage_options=down, tries=1)
    c.save(1, _state(1))
    with pytest.raises(ckptio.StoreConnectionError):
        c.wait(60)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.close()


def test_a_dead_local_save_is_removed(tmp_path, s3):
    dead = tmp_path / "local" / step_name(7)
    dead.mkdir(parents=True)
    (dead / "state.pt").write_bytes(b"torn")
    with _ckpt(tmp_path, s3) as c:
        assert not dead.exists() and c.latest() is None
        with pytest.raises(FileNotFoundError, match="no complete step"):
            c.load()


@_DRAIN_FAILS
def test_a_step_committed_with_other_contents_is_a_conflict(tmp_path, s3):
    url = s3.url("run", step_name(3), COMMIT)
    remote.put_bytes(url, b'{"someone":"else"}', s3.options)
    with _ckpt(tmp_path, s3) as c:
        h = c.save(3, _state(3))
        with pytest.raises(ckptio.CommitConflictError):
            h.wait(120)


def test_safetensors_and_dcp_formats(tmp_path, s3):
    with _ckpt(tmp_path, s3, format="safetensors") as c:
        c.save(1, _state(1)).wait(120)
        _same(c.load(1), _state(1))
        os.unlink(os.path.join(c.local, step_name(1), "model.safetensors"))
        _same(c.load(1), _state(1))
    tmp2 = tmp_path / "dcp"
    tmp2.mkdir()
    with Checkpointer(tmp2 / "local", s3.url("dcp"), storage_options=s3.options, format="dcp") as c:
        c.save(2, _state(2)).wait(120)
        out = {k: torch.zeros_like(v) for k, v in _state(2).items()}
        c.load(2, out=out)
        _same(out, _state(2))
        for name in os.listdir(os.path.join(c.local, step_name(2))):
            os.unlink(os.path.join(c.local, step_name(2), name))
        out = {k: torch.zeros_like(v) for k, v in _state(2).items()}
        c.load(2, out=out)  # from the store
        _same(out, _state(2))
        with pytest.raises(ValueError, match="loads in place"):
            c.load(2)


def test_bad_arguments(tmp_path, s3):
    with pytest.raises(ValueError, match="remote must be an object URL"):
        Checkpointer(tmp_path / "a", str(tmp_path / "b"))
    with pytest.raises(ValueError, match="local must be a local folder"):
        Checkpointer(s3.url("x"), s3.url("y"))
    with pytest.raises(ValueError, match="format"):
        _ckpt(tmp_path, s3, format="pickle")
    with pytest.raises(ValueError, match="keep_local"):
        _ckpt(tmp_path, s3, keep_local=0)
    with pytest.raises(ValueError, match="keep_remote"):
        _ckpt(tmp_path, s3, keep_remote=0)
    c = _ckpt(tmp_path, s3)
    with pytest.raises(ValueError, match="step must be an int"):
        c.save(-1, _state(0))
    c.save(4, _state(4)).wait(120)
    with pytest.raises(ValueError, match="not after the last saved step"):
        c.save(4, _state(4))
    c.close()
    with pytest.raises(RuntimeError, match="after close"):
        c.save(5, _state(5))


CHILD = textwrap.dedent(
    """
    import sys, torch
    from ckptio.tiered import Checkpointer
    local, url, endpoint, key, secret = sys.argv[1:6]
    opts = dict(endpoint=endpoint, access_key_id=key, secret_access_key=secret,
                region="us-east-1", part_size="16M", concurrency="1")
    c = Checkpointer(local, url, storage_options=opts)
    h = c.save(1, {"big": torch.arange(48 << 20, dtype=torch.int32)})
    h.local.result()
    print("LOCAL", flush=True)
    h.wait()
    print("REMOTE", flush=True)
    """
)


def test_a_drain_killed_midway_is_resumed(tmp_path, s3):
    import s3server

    args = [str(tmp_path / "local"), s3.url("run"), s3.endpoint, s3server.KEY_ID, s3server.SECRET]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )  # fmt: skip
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "LOCAL"
    child.send_signal(signal.SIGKILL)  # 192 MiB in 12 parts, one at a time: mid-drain
    child.wait()
    with _ckpt(tmp_path, s3) as c:
        assert c.resumed == [1]
        c.wait(300)
        os.unlink(os.path.join(c.local, step_name(1), "state.pt"))
        got = c.load(1)
        assert torch.equal(got["big"], torch.arange(48 << 20, dtype=torch.int32))


# --------------------------------------------------------------------------- DCP writer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_the_tiered_dcp_writer_commits_locally_then_in_the_store(tmp_path, s3):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-tiered")
    writer = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    names = []
    for step in (1, 2, 3):
        dcp.save(_state(step), storage_writer=writer, no_dist=True)
        out = {k: torch.zeros_like(v) for k, v in _state(step).items()}
        dcp.load(out, storage_reader=FileSystemReader(tmp_path / "local"), no_dist=True)
        _same(out, _state(step))  # locally durable when save returns
        assert writer.remote_completion.result(120) == url
        names.append({u.rsplit("/", 1)[1] for u, _, _, _ in remote.listing(url, s3.options)})
        out = {k: torch.zeros_like(v) for k, v in _state(step).items()}
        reader = FileSystemReader(url, storage_options=s3.options)
        dcp.load(out, storage_reader=reader, no_dist=True)
        _same(out, _state(step))
    # One data file per save: the newest two generations stay, no rank marks.
    assert len(names[0]) == 2 and len(names[1]) == 3 and len(names[2]) == 3
    assert not any(n.startswith(".ckptio") for n in names[2])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_tiered_dcp_drain_left_unfinished_is_resumed_by_the_next_writer(tmp_path, s3):
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-resume")
    down = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    first = TieredWriter(tmp_path / "local", url, storage_options=down, tries=1)
    assert first.resumed is None  # nothing committed locally yet
    dcp.save(_state(1), storage_writer=first, no_dist=True)  # durable locally
    with pytest.raises(ckptio.StoreConnectionError):
        first.remote_completion.result(60)
    assert remote.listing(url, s3.options) == []
    again = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    assert again.resumed is not None and again.resumed.result(120) == url
    _same(_dcp_from(url, s3, 1), _state(1))
    third = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    assert third.resumed is not None and third.resumed.result(60) == url  # nothing to do
    dcp.save(_state(2), storage_writer=third, no_dist=True)  # the next save goes on as usual
    assert third.remote_completion.result(120) == url
    _same(_dcp_from(url, s3, 2), _state(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_commit_spares_the_next_save_and_commits_land_in_save_order(tmp_path, s3, monkeypatch):
    """The next save's objects may reach the store while the last one commits:
    that commit's sweep leaves them, and the commits land in save order."""
    import threading
    import time

    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    gate, seen = threading.Event(), []
    wait_marks = TieredWriter._await_marks

    def held(self, token, *rest):  # the first save's commit waits for the gate
        seen.append(token)
        if len(seen) == 1:
            assert gate.wait(60)
        return wait_marks(self, token, *rest)

    monkeypatch.setattr(TieredWriter, "_await_marks", held)
    url = s3.url("dcp-order")
    writer = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    first = writer.remote_completion
    dcp.save(_state(2), storage_writer=writer, no_dist=True)
    second = writer.remote_completion

    def data_objects() -> int:
        return sum(u.endswith(".distcp") for u, _, _, _ in remote.listing(url, s3.options))

    deadline = time.monotonic() + 60
    while data_objects() < 2:  # the second save's file is up before the first commits
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not second.done()  # behind the first commit
    remote.put_bytes(f"{url}/.ckptio-ranks/deadbeef/0", b"", s3.options)  # a dead save's
    gate.set()
    assert first.result(60) == url and second.result(60) == url
    left = [u for u, _, _, _ in remote.listing(url, s3.options)]
    assert data_objects() == 2 and not [u for u in left if ".ckptio-ranks" in u], left
    _same(_dcp_from(url, s3, 2), _state(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_commit_whose_files_never_come_gives_way_to_the_next(tmp_path, s3, monkeypatch):
    """A save whose upload failed (its mark never comes) does not hold the
    next save's commit for ``mark_timeout``: it fails, typed, the next lands."""
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    upload, calls = remote.upload, []

    def broken_once(*args, **kw):
        calls.append(args)
        if len(calls) == 1:
            raise ValueError("injected: not a transient error")
        return upload(*args, **kw)

    monkeypatch.setattr(remote, "upload", broken_once)
    url = s3.url("dcp-give-way")
    writer = TieredWriter(tmp_path / "local", url, storage_options=s3.options, mark_timeout=600)
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    first = writer.remote_completion
    # Its own rank's upload failed: the commit fails at once with that error
    # (it waited mark_timeout for a mark that never comes).
    with pytest.raises(ValueError, match="injected"):
        first.result(10)
    dcp.save(_state(2), storage_writer=writer, no_dist=True)
    assert writer.remote_completion.result(60) == url
    _same(_dcp_from(url, s3, 2), _state(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_stale_folder_does_not_roll_the_store_back(tmp_path, s3):
    """A local commit never drained, resumed after another folder committed a
    newer checkpoint to the same store: a typed conflict, the store untouched."""
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-stale")
    _saved_with_the_store_down(tmp_path / "a", url, s3)  # durable in a only
    newer = TieredWriter(tmp_path / "b", url, storage_options=s3.options)
    dcp.save(_state(2), storage_writer=newer, no_dist=True)
    assert newer.remote_completion.result(60) == url
    again = TieredWriter(tmp_path / "a", url, storage_options=s3.options)
    assert again.resumed is not None
    with pytest.raises(ckptio.CommitConflictError, match="did not make"):
        again.resumed.result(60)
    _same(_dcp_from(url, s3, 2), _state(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_what_a_running_process_left_is_its_own_to_drain(tmp_path, s3):
    """DCP's process mode: the trainer makes writers while the checkpoint process
    (alive) saves and drains. A new writer resumes nothing that a process still
    running wrote (its drain record, its local commit); once it has ended, the
    next writer resumes it."""
    from ckptio.io import liveness
    from ckptio.tiered import COMMITTER, DRAIN_RECORD, TieredWriter

    if liveness.tag() is None:
        pytest.skip("no process tags here (/proc without boot_id or pid namespaces)")
    url, local = s3.url("dcp-live"), tmp_path / "local"
    _saved_with_the_store_down(local, url, s3)  # its records then say nobody drains them
    for name in (f"{DRAIN_RECORD}0.json", COMMITTER):
        assert json.loads((local / name).read_text())["owner"] is None
    code = "from ckptio.io import liveness; print(liveness.tag(), flush=True); input()"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    other = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    try:
        assert other.stdout is not None
        owner = other.stdout.readline().strip()
        for name in (f"{DRAIN_RECORD}0.json", COMMITTER):  # as that process wrote them
            rec = json.loads((local / name).read_text())
            (local / name).write_text(json.dumps(dict(rec, owner=owner)))
        again = TieredWriter(local, url, storage_options=s3.options)
        assert again._resumed_as == (0, True)  # it looked ...
        assert again.resumed is None  # ... and left all to the running process
        assert remote.listing(url, s3.options) == []
    finally:
        other.kill()
        other.wait()
    third = TieredWriter(local, url, storage_options=s3.options)
    assert third.resumed is not None and third.resumed.result(60) == url
    _same(_dcp_from(url, s3, 1), _state(1))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_resume_keeps_a_record_written_for_a_newer_save_meanwhile(tmp_path, s3, monkeypatch):
    """A resume drains a dead process's record; a live process of the folder
    (DCP's checkpoint process) writes its next save's record meanwhile: the
    resume removes its own record only, never that one."""
    from ckptio.tiered import DRAIN_RECORD, TieredWriter

    url, local = s3.url("dcp-keep-record"), tmp_path / "local"
    _saved_with_the_store_down(local, url, s3)
    record = local / f"{DRAIN_RECORD}0.json"
    newer = {"token": "abcdef12", "names": ["__0_abcdef12_0.distcp"], "owner": None}
    upload = TieredWriter._upload_missing

    def then_newer(self, names):
        monkeypatch.setattr(TieredWriter, "_upload_missing", upload)  # once
        got = upload(self, names)
        record.write_text(json.dumps(newer))  # the live process's next save
        return got

    monkeypatch.setattr(TieredWriter, "_upload_missing", then_newer)
    again = TieredWriter(local, url, storage_options=s3.options)
    assert again.resumed is not None and again.resumed.result(60) == url
    assert json.loads(record.read_text()) == newer


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_save_over_another_group_resumes_as_its_rank_there(tmp_path, s3, monkeypatch):
    """Made where the default group says rank 1, saving with ``no_dist=True``
    (or a ``process_group=`` where it is rank 0): the resume as rank 1 found
    nothing of its own, the save's set-up resumes as DCP's rank 0, coordinator."""
    import torch.distributed.checkpoint as dcp
    from ckptio import tiered
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-subgroup")
    _saved_with_the_store_down(tmp_path / "local", url, s3)  # rank 0's record, locally only
    monkeypatch.setattr(tiered, "_rank", lambda: 1)
    again = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    assert again.resumed is None  # rank 1 left nothing; not the coordinator
    dcp.save(_state(2), storage_writer=again, no_dist=True)
    assert again.resumed is not None and again.resumed.result(60) == url
    assert again.remote_completion.result(60) == url
    _same(_dcp_from(url, s3, 2), _state(2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_writer_made_before_its_group_resumes_at_its_first_save(tmp_path, s3, monkeypatch):
    """Where the launcher says there are several ranks and the group is not up
    yet, the rank (and so which record to resume) is known at the first save."""
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-later")
    _saved_with_the_store_down(tmp_path / "local", url, s3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    again = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    assert again.resumed is None  # not before its rank is known
    dcp.save(_state(2), storage_writer=again, no_dist=True)  # set-up: rank 0, coordinator
    assert again.resumed is not None and again.resumed.result(60) == url
    assert again.remote_completion.result(60) == url
    _same(_dcp_from(url, s3, 2), _state(2))


def test_a_record_whose_files_are_gone_is_dropped_unmarked(tmp_path, s3):
    """A rank's record of a save that died before its local commit (its files
    swept since): nothing uploaded, no mark, the record removed."""
    from ckptio.tiered import DRAIN_RECORD, TieredWriter

    url = s3.url("dcp-gone")
    local = tmp_path / "local"
    local.mkdir()
    record = local / f"{DRAIN_RECORD}0.json"
    record.write_text('{"token": "deadbeef", "names": ["__0_deadbeef_0.distcp"]}')
    w = TieredWriter(local, url, storage_options=s3.options)
    assert w.resumed is not None and w.resumed.result(60) == url
    assert not record.exists() and remote.listing(url, s3.options) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_old_files_go_but_never_those_the_local_commit_names(tmp_path, s3, monkeypatch):
    """Saves whose local commit failed after their upload: the files of the
    checkpoint the folder still holds stay, and it loads from the folder."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-keep")
    writer = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    assert writer.remote_completion.result(60) == url

    def failing_finish(self, metadata, results):
        raise OSError("injected: the local commit fails")

    monkeypatch.setattr(TieredWriter, "finish", failing_finish)
    failed = []
    for step in (2, 3):
        with pytest.raises(BaseException, match="injected"):  # DCP's, around ours
            dcp.save(_state(step), storage_writer=writer, no_dist=True)
        failed.append(writer.remote_completion)
        writer._tier.uploading.result(60)  # its upload went on, as a save's does
    # The next save's plan settles the failed one's future (nothing was drained).
    with pytest.raises(ckptio.CkptioError, match="failed before its local commit"):
        failed[0].result(1)
    out = {k: torch.zeros_like(v) for k, v in _state(1).items()}
    dcp.load(out, storage_reader=FileSystemReader(tmp_path / "local"), no_dist=True)
    _same(out, _state(1))


def test_a_pickled_writer_shares_what_its_tiers_hold_in_the_process(tmp_path):
    """DCP's process mode unpickles the writer for each save: the generations in
    flight and the commit order stay with the tiers, not the copy."""
    import pickle

    from ckptio.tiered import TieredWriter

    w = TieredWriter(tmp_path / "local", "s3://bucket/run")
    copy = pickle.loads(pickle.dumps(w))
    assert copy._tier is w._tier and copy.resumed is None and copy.remote == w.remote
    other = TieredWriter(tmp_path / "other", "s3://bucket/run")
    assert other._tier is not w._tier


def test_the_tiered_dcp_writer_refuses_bad_tiers(tmp_path, s3):
    from ckptio.tiered import TieredWriter

    with pytest.raises(ValueError, match="remote must be an object URL"):
        TieredWriter(tmp_path, str(tmp_path / "x"))
    with pytest.raises(ValueError, match="local must be a local folder"):
        TieredWriter(s3.url("a"), s3.url("b"))


@pytest.mark.slow
def test_the_tiered_dcp_writer_over_two_ranks(tmp_path, s3):
    from test_dcp import _run_ranks

    _run_ranks(2, "tiered", s3.url("ranks"), CKPTIO_TIER_LOCAL=str(tmp_path), **s3.env)


@pytest.mark.slow
def test_a_tiered_dcp_drain_of_two_hosts_is_resumed_by_each(tmp_path, s3):
    """Each rank with a local folder of its own, as on separate hosts: a drain
    that never reached the store is resumed by the next writers, each rank
    uploading its own files, the coordinator committing once all are there."""
    from test_dcp import _run_ranks

    _run_ranks(2, "tiered_hosts", s3.url("hosts"), CKPTIO_TIER_LOCAL=str(tmp_path), **s3.env)


# --------------------------------------------------------------------------- review of 2026-12-06


@_DRAIN_FAILS
def test_a_step_saved_again_is_a_conflict_not_the_old_bytes(tmp_path, s3):
    """The store's step 2 is another save's: a new save of step 2 (same files,
    same sizes) fails with a conflict instead of being taken as durable."""
    with _ckpt(tmp_path, s3) as c:
        c.save(2, _state(0)).wait(60)
    shutil.rmtree(tmp_path / "local" / step_name(2))  # the local copy gone (another node)
    with _ckpt(tmp_path, s3) as c:
        with pytest.raises(ckptio.CommitConflictError, match="another save committed"):
            c.save(2, _state(1)).wait(60)
    _same(ckptio.load(s3.url("run", step_name(2), "state.pt"), storage_options=s3.options),
          _state(0))  # fmt: skip


def test_a_dead_drains_stray_object_is_sent_again(tmp_path, s3):
    """A drain that died after its upload, before its commit record, left an
    object of the same size: the next save of the step uploads its own."""
    with _ckpt(tmp_path, s3) as c:
        c.save(2, _state(0)).wait(60)
    remote.delete(s3.url("run", step_name(2), COMMIT), s3.options)
    shutil.rmtree(tmp_path / "local")
    with _ckpt(tmp_path, s3) as c:
        c.save(2, _state(1)).wait(60)
    got = ckptio.load(s3.url("run", step_name(2), "state.pt"), storage_options=s3.options)
    _same(got, _state(1))


def test_a_resumed_drain_skips_only_what_it_uploaded(tmp_path, s3, monkeypatch):
    with _ckpt(tmp_path, s3) as c:
        c.save(1, _state(1)).wait(60)
    remote.delete(s3.url("run", step_name(1), COMMIT), s3.options)  # died before its commit
    sent = []
    real = remote.upload
    monkeypatch.setattr(remote, "upload", lambda *a, **k: sent.append(a[1]) or real(*a, **k))
    with _ckpt(tmp_path, s3) as c:
        assert c.resumed == [1]
        c.wait(60)
        assert c.remote_steps() == [1] and sent == []


def test_a_live_writers_step_folder_is_left_to_it(tmp_path, s3):
    from ckptio.io import liveness
    from ckptio.tiered import WRITER

    folder = tmp_path / "local" / step_name(1)
    folder.mkdir(parents=True)
    (folder / WRITER).write_text(json.dumps({"owner": liveness.tag()}))  # this live process
    (folder / "state.pt").write_bytes(b"half")
    dead = tmp_path / "local" / step_name(2)
    dead.mkdir()
    with _ckpt(tmp_path, s3):
        pass
    assert folder.is_dir() and not dead.exists()


def test_a_process_that_exits_without_close_still_drains(tmp_path, s3):
    import s3server

    child = textwrap.dedent("""
        import sys, torch
        from ckptio.tiered import Checkpointer
        local, url, endpoint, key, secret = sys.argv[1:6]
        opts = dict(endpoint=endpoint, access_key_id=key, secret_access_key=secret,
                    region="us-east-1")
        c = Checkpointer(local, url, storage_options=opts)
        c.save(1, {"w": torch.zeros(4 << 20)})
    """)
    args = [str(tmp_path / "local"), s3.url("run"), s3.endpoint, s3server.KEY_ID, s3server.SECRET]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", child, *args], env=env, timeout=120)
    assert r.returncode == 0
    with Checkpointer(tmp_path / "other", s3.url("run"), storage_options=s3.options) as c:
        assert c.remote_steps() == [1]


def test_a_local_folder_is_drained_only_into_its_own_remote(tmp_path, s3):
    with Checkpointer(tmp_path / "shm", s3.url("x"), storage_options=s3.options) as c:
        h = c.save(1, _state(1))
        h.local.result(60)
    remote.delete(s3.url("x", step_name(1), COMMIT), s3.options)  # x's drain not done
    with pytest.warns(UserWarning, match="not drained, loaded or pruned here"):
        c = Checkpointer(tmp_path / "shm", s3.url("y"), storage_options=s3.options)
    with c:
        assert c.resumed == [] and c.latest() is None  # x's, not y's
        assert c.remote_steps() == [] and c.local_steps() == []
    assert (tmp_path / "shm" / step_name(1) / COMMIT).is_file()  # left for x


@pytest.mark.filterwarnings("ignore:ckptio.tiered. .* not drained, loaded or pruned here")
def test_a_local_step_of_another_remote_is_not_this_checkpointers(tmp_path, s3):
    """Two runs sharing a node-local folder, each with its own remote: run B
    read run A's local step 100 as its own (latest, load, a save of 100
    refused as saved already). Now only B's store answers for it, a save of
    100 is refused naming both remotes (A's copy is the only one until A
    drains it), and B's pruning leaves A's steps alone."""
    shared, a_url, b_url = tmp_path / "shm", s3.url("a"), s3.url("b")
    with Checkpointer(shared, a_url, storage_options=s3.options) as a:
        a.save(100, _state(1)).local.result(60)
        a.save(200, _state(2)).local.result(60)
    with Checkpointer(tmp_path / "elsewhere", b_url, storage_options=s3.options) as b:
        b.save(100, _state(3)).wait(60)  # B's step 100, saved on another node
    a_copy = (tmp_path / "shm" / step_name(100) / "state.pt").read_bytes()
    with Checkpointer(shared, b_url, storage_options=s3.options, keep_local=1) as b:
        assert b.local_steps() == [] and b.latest() == 100
        _same(b.load(100), _state(3))
        _same(b.load(), _state(3))
        with pytest.raises(FileExistsError, match="another run") as e:
            b.save(100, _state(4))
        assert a_url in str(e.value) and b_url in str(e.value)
        assert e.value.filename == str(shared / step_name(100))
        for step in (300, 400, 500):  # keep_local=1 prunes B's own steps only
            b.save(step, _state(step)).wait(60)
        assert b.local_steps() == [500]
    with Checkpointer(shared, s3.url("c"), storage_options=s3.options) as c:
        assert c.latest() is None  # an empty remote: no step, A's are not C's
        with pytest.raises(FileNotFoundError):
            c.load()
    assert (tmp_path / "shm" / step_name(100) / "state.pt").read_bytes() == a_copy
    with Checkpointer(shared, a_url, storage_options=s3.options) as a:
        assert a.local_steps() == [100, 200]
        _same(a.load(100), _state(1))


def test_load_reads_the_store_when_the_local_copy_goes_under_it(tmp_path, s3, monkeypatch):
    import ckptio.tiered as tiered

    with _ckpt(tmp_path, s3, keep_local=1) as c:
        c.save(1, _state(1)).wait(60)
        real = tiered._load

        def pruned_meanwhile(path, *a, **k):
            if not remote.is_url(path):
                shutil.rmtree(tmp_path / "local" / step_name(1))
            return real(path, *a, **k)

        monkeypatch.setattr(tiered, "_load", pruned_meanwhile)
        _same(c.load(1), _state(1))


def test_keep_remote_covers_steps_an_earlier_process_left(tmp_path, s3):
    with _ckpt(tmp_path, s3) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step)).wait(60)
    with Checkpointer(tmp_path / "new", s3.url("run"), storage_options=s3.options,
                      keep_remote=2) as c:  # fmt: skip
        c.save(4, _state(4)).wait(60)
        assert c.remote_steps() == [3, 4]


@_DRAIN_FAILS
def test_a_step_whose_local_write_failed_may_be_saved_again(tmp_path, s3, monkeypatch):
    import ckptio.tiered as tiered

    real = tiered._save

    def full(*a, **k):
        raise OSError(28, "No space left on device (injected)")

    with _ckpt(tmp_path, s3) as c:
        monkeypatch.setattr(tiered, "_save", full)
        with pytest.raises(OSError, match="injected"):
            c.save(1, _state(1)).local.result(60)
        assert not (tmp_path / "local" / step_name(1)).exists()
        monkeypatch.setattr(tiered, "_save", real)
        c.save(1, _state(1)).wait(60)
        assert c.remote_steps() == [1]


@pytest.mark.filterwarnings("ignore:ckptio.tiered. pruning old steps failed")
def test_a_removal_killed_midway_is_finished_by_the_next_process(tmp_path, s3, monkeypatch):
    """keep_remote removes step 1 from the store; the process dies right after
    it deleted the step's commit record (before the step's objects): those
    stayed in the store, named by no listing, and no later Checkpointer removed
    them. Now the step's removal mark names them and the next Checkpointer on
    the same folders finishes the removal."""
    real = remote.delete

    def dies_after_the_commit_record(url, *a, **k):
        real(url, *a, **k)
        if url.endswith("/" + COMMIT):
            raise OSError("killed (injected)")

    with _ckpt(tmp_path, s3, keep_local=1, keep_remote=2) as c:
        c.save(1, _state(1)).wait(60)
        c.save(2, _state(2)).wait(60)
        monkeypatch.setattr(remote, "delete", dies_after_the_commit_record)
        c.save(3, _state(3)).wait(60)  # its prune of step 1 dies midway
    monkeypatch.setattr(remote, "delete", real)
    step1 = s3.url("run", step_name(1))
    left = {u.rsplit("/", 1)[1] for u, _, _, _ in remote.listing(step1, s3.options)}
    assert "state.pt" in left and COMMIT not in left
    with _ckpt(tmp_path, s3, keep_local=1, keep_remote=2) as c:
        assert c.resumed == []
        assert remote.listing(step1, s3.options) == []  # no orphan left
        assert c.remote_steps() == [2, 3] and c.latest() == 3
        _same(c.load(2), _state(2))


def test_a_step_marked_for_removal_is_not_complete(tmp_path, s3):
    """A process died right after it marked step 3 for removal (its commit
    record still there): no listing, latest() or load() takes step 3; a new
    save of step 3 finishes the removal and saves anew; a Checkpointer that
    lists the store finishes a removal a dead process left."""
    from ckptio.tiered import REMOVING

    with _ckpt(tmp_path, s3) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step)).wait(60)
    remote.put_bytes(s3.url("run", step_name(3), REMOVING), b"{}", s3.options)
    remote.put_bytes(s3.url("run", step_name(1), REMOVING), b"{}", s3.options)
    with Checkpointer(tmp_path / "other", s3.url("run"), storage_options=s3.options) as c:
        assert c.remote_steps() == [2] and c.latest() == 2
        _same(c.load(), _state(2))
        with pytest.raises(FileNotFoundError, match="step 3 is complete in neither"):
            c.load(3)
        c.save(3, _state(4)).wait(60)  # step 3's removal finished, then saved anew
        assert c.remote_steps() == [2, 3]
        assert remote.listing(s3.url("run", step_name(1)), s3.options) == []
    shutil.rmtree(tmp_path / "other")
    with Checkpointer(tmp_path / "other", s3.url("run"), storage_options=s3.options) as c:
        _same(c.load(3), _state(4))


# ------------------------------------------------------------------- review of 2026-12-06, later


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tiered_writer_refuses_what_it_cannot_drain(tmp_path, s3):
    """use_collectives=False committed a stale .metadata to the store (each rank
    commits its own __<rank>.metadata) and reported success; a checkpoint_id
    elsewhere moved the local folder only, or lost the store's settings."""
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import TieredWriter

    url = s3.url("dcp-refused")
    writer = TieredWriter(tmp_path / "local", url, storage_options=s3.options)
    with pytest.raises(ValueError, match="use_collectives=False"):
        dcp.save(_state(1), storage_writer=writer, no_dist=True, use_collectives=False)
    for elsewhere in (tmp_path / "other", url + "/other"):
        with pytest.raises(ValueError, match="checkpoint_id"):
            dcp.save(_state(1), storage_writer=writer, checkpoint_id=elsewhere, no_dist=True)
    assert list(remote.listing(url, s3.options)) == []
    # The writer's own folder as checkpoint_id is fine; the first save completes
    # the future the writer was made with (nothing completed it before).
    early = writer.remote_completion
    dcp.save(_state(2), storage_writer=writer, checkpoint_id=tmp_path / "local", no_dist=True)
    assert writer.remote_completion is early and early.result(60) == url
    _same(_dcp_from(url, s3, 2), _state(2))


def test_a_process_that_ends_after_a_save_puts_it_in_the_store(tmp_path, s3):
    """The drain ran on daemon threads: a script whose last line is dcp.save ended
    with SIGABRT mid-upload and the store lacked its .metadata."""
    url = s3.url("dcp-exit")
    script = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp
        from ckptio.tiered import TieredWriter
        w = TieredWriter({str(tmp_path / "local")!r}, {url!r}, storage_options={s3.options!r})
        dcp.save({{"w": torch.full((1 << 20,), 3.0)}}, storage_writer=w, no_dist=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = {"w": torch.zeros(1 << 20)}
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader

    dcp.load(out, storage_reader=FileSystemReader(url, storage_options=s3.options), no_dist=True)
    assert torch.equal(out["w"], torch.full((1 << 20,), 3.0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_a_commit_the_folder_made_but_did_not_record_is_its_own(tmp_path, s3):
    """Killed after its remote commit, before its local record of it: the next
    writer found the store at the folder's own commit, kept the old record, and
    every later resume called the folder's next commit a conflict."""
    import torch.distributed.checkpoint as dcp
    from ckptio.tiered import REMOTE_RECORD, TieredWriter

    url, local = s3.url("dcp-unrecorded"), tmp_path / "local"
    writer = TieredWriter(local, url, storage_options=s3.options)
    dcp.save(_state(1), storage_writer=writer, no_dist=True)
    writer.remote_completion.result(60)
    (local / REMOTE_RECORD).write_text('{"e_tag": "the commit before"}')  # (the kill)
    again = TieredWriter(local, url, storage_options=s3.options)
    assert again.resumed is not None and again.resumed.result(60) == url
    _saved_with_the_store_down(local, url, s3, step=2)
    third = TieredWriter(local, url, storage_options=s3.options)
    assert third.resumed.result(60) == url
    _same(_dcp_from(url, s3, 2), _state(2))


# --------------------------------------------------------------------------- review of 2026-12-07


def test_retry_and_retention_settings_are_checked(tmp_path, s3):
    """TieredWriter took tries=0 (nothing uploaded, a TypeError later), and
    Checkpointer tries=1.5, backoff="1", max_backoff=None, keep_local=True."""
    from ckptio.tiered import TieredWriter

    for kw, error in [
        (dict(tries=1.5), TypeError), (dict(tries=True), TypeError), (dict(tries=0), ValueError),
        (dict(backoff="1"), TypeError), (dict(backoff=-1.0), ValueError),
        (dict(max_backoff=None), TypeError), (dict(max_backoff=float("inf")), ValueError),
        (dict(keep_local=True), TypeError), (dict(keep_remote=2.0), TypeError),
    ]:  # fmt: skip
        with pytest.raises(error, match=next(iter(kw))):
            _ckpt(tmp_path, s3, **kw)
    for kw, error in [
        (dict(tries=0), ValueError), (dict(tries="3"), TypeError),
        (dict(backoff=float("nan")), ValueError), (dict(mark_timeout=None), TypeError),
    ]:  # fmt: skip
        with pytest.raises(error, match=next(iter(kw))):
            TieredWriter(tmp_path / "dcp", s3.url("dcp"), storage_options=s3.options, **kw)
    writer = TieredWriter(tmp_path / "dcp", s3.url("dcp"), storage_options=s3.options, tries=1)
    writer._tries = 0  # (as a writer unpickled from an older version might hold)
    assert writer._retried(lambda: "done") == "done"  # never None for an op not run


def test_load_checks_its_step_as_save_does(tmp_path, s3):
    """load("1") and load(1.0) failed on a format code, load(True) loaded step 1
    and load(-1) looked for step--000000001."""
    with _ckpt(tmp_path, s3) as c:
        c.save(1, _state(1)).wait(60)
        for bad in ("1", 1.0, True, -1):
            with pytest.raises(ValueError, match="step must be an int >= 0"):
                c.load(bad)
        _same(c.load(1), _state(1))


def test_wait_has_one_deadline_for_all_the_drains(tmp_path, s3, monkeypatch):
    """wait(timeout=) gave each pending drain the whole timeout: with drains of
    1 s each, wait(timeout=1.5) took 4 s and raised nothing."""
    import time

    real = remote.upload

    def slow(*a, **k):
        time.sleep(1.0)
        return real(*a, **k)

    monkeypatch.setattr(remote, "upload", slow)
    with _ckpt(tmp_path, s3) as c:
        for step in range(4):
            c.save(step, _state(step))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="of 4 drains"):
            c.wait(timeout=2.5)  # each drain within 2.5 s of the one before: 4 s in all
        assert time.monotonic() - t0 < 3.5
        c.wait(60)
        assert c.remote_steps() == [0, 1, 2, 3]


def test_a_dcp_load_reads_the_store_when_the_local_copy_goes_under_it(tmp_path, s3, monkeypatch):
    """DCP wraps a file removed mid-load in a CheckpointException, not an
    OSError: load() failed though the step is complete in the store."""
    import ckptio.tiered as tiered
    import torch.distributed.checkpoint as dcp

    with _ckpt(tmp_path, s3, format="dcp") as c:
        c.save(1, _state(1)).wait(60)
        real = tiered.FileSystemReader

        class PrunedMeanwhile(real):
            def read_data(self, plan, planner):
                # (the drain thread's prune; a no-op for the store's reader after it)
                shutil.rmtree(tmp_path / "local" / step_name(1), ignore_errors=True)
                return super().read_data(plan, planner)

        monkeypatch.setattr(tiered, "FileSystemReader", PrunedMeanwhile)
        out = {k: torch.zeros_like(v) for k, v in _state(1).items()}
        c.load(1, out=out)
        _same(out, _state(1))
        # Where the local copy is still there, its failure is the load's.
        monkeypatch.setattr(tiered, "FileSystemReader", real)
        c.save(2, _state(2)).wait(60)
        with pytest.raises(dcp.CheckpointException, match="Size mismatch"):
            c.load(2, out={"w": torch.zeros(3)})


def test_a_forked_child_is_told_to_make_its_own(tmp_path, s3):
    """In a child forked after a save, save() returned and its futures never
    completed (the drain threads are the parent's); close() would hang."""
    with _ckpt(tmp_path, s3) as c:
        c.save(1, _state(1)).wait(60)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report each call's error, then leave at once
            got = []
            calls = (lambda: c.save(2, _state(2)), lambda: c.load(1), lambda: c.wait(5), c.close)
            for call in calls:
                try:
                    call()
                    got.append("returned")
                except BaseException as e:  # noqa: BLE001 - reported to the parent
                    got.append(f"{type(e).__name__}: {e}")
            os.write(write, json.dumps(got).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as fh:
            got = json.loads(fh.read())
        os.waitpid(pid, 0)
        assert len(got) == 4
        for line in got:
            assert line.startswith("RuntimeError") and "forked" in line, got
        c.save(2, _state(2)).wait(60)  # the parent's goes on
        assert c.remote_steps() == [1, 2]


@_DRAIN_FAILS
def test_a_step_whose_drain_met_another_save_stays_local(tmp_path, s3):
    """A step whose drain failed with a CommitConflictError (the store holds
    another save of its number) was pruned locally at the next drain, as the
    listing put it in the store: the only copy of what was saved went, and
    load() returned the other save's data."""
    with _ckpt(tmp_path, s3, keep_local=1) as c:
        for step in (1, 2, 3):
            c.save(step, _state(step)).wait(60)
    with _ckpt(tmp_path, s3, keep_local=1) as c:
        with pytest.raises(ckptio.CommitConflictError):
            c.save(2, _state(22)).wait(60)  # a new run in the same prefix
        c.save(4, _state(4)).wait(60)  # its prune
        assert c.local_steps() == [2, 4]
        _same(c.load(2), _state(22))
    with _ckpt(tmp_path, s3, keep_local=1) as c:  # nor by the next process
        assert c.resumed == []
        c.save(5, _state(5)).wait(60)
        assert c.local_steps() == [2, 5]
        _same(c.load(2), _state(22))


@_DRAIN_FAILS
def test_retention_after_a_restart_from_an_older_step_keeps_the_new_saves(tmp_path, s3):
    """keep_remote ranked the store's steps by number: a run restarted from step
    100 after 200 was saved had each new save (150, 160) removed from the store
    right after its drain, its remote future done, then its local copy pruned:
    the save was lost. In save order, the new saves are the newest."""
    with _ckpt(tmp_path, s3, keep_local=1, keep_remote=1) as c:
        for step in (100, 200):
            c.save(step, _state(step)).wait(60)
    with _ckpt(tmp_path, s3, keep_local=1, keep_remote=1) as c:
        for step in (150, 160):
            c.save(step, _state(step)).wait(60)
            assert c.local_steps() == [step] and c.remote_steps() == [step]
            _same(c.load(step), _state(step))
    # Restarted from 150 again, saved 155 while the store was down: the next
    # process's resumed drain of 155 is newer in save order than the store's 160.
    down = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    with pytest.warns(UserWarning, match="not listed"):
        c = Checkpointer(tmp_path / "local", s3.url("run"), storage_options=down, tries=1)
    with c:
        with pytest.raises(ckptio.StoreConnectionError):
            c.save(155, _state(155)).wait(60)
    with _ckpt(tmp_path, s3, keep_local=1, keep_remote=1) as c:
        assert c.resumed == [155]
        c.wait(60)
        assert c.local_steps() == [155] and c.remote_steps() == [155]
    with _ckpt(tmp_path, s3, keep_local=2, keep_remote=2) as c:
        c.save(170, _state(170)).wait(60)
        c.save(180, _state(180)).wait(60)  # in save order as in step order
        assert c.local_steps() == [170, 180] and c.remote_steps() == [170, 180]


def test_steps_keep_remote_dropped_are_not_drained_again(tmp_path, s3, monkeypatch):
    """keep_local > keep_remote: the steps the store dropped stay local, and every
    new Checkpointer on the same folders uploaded them again in full (taken for
    undrained), then removed them from the store again."""
    from ckptio.tiered import DROPPED

    with _ckpt(tmp_path, s3, keep_local=3, keep_remote=1) as c:
        for step in (8, 9, 10):
            c.save(step, _state(step)).wait(60)
        assert c.local_steps() == [8, 9, 10] and c.remote_steps() == [10]
    assert sorted(p.parent.name for p in (tmp_path / "local").glob(f"*/{DROPPED}")) == [
        step_name(8), step_name(9),
    ]  # fmt: skip
    sent = []
    real = remote.upload
    monkeypatch.setattr(remote, "upload", lambda *a, **k: sent.append(a[1]) or real(*a, **k))
    with _ckpt(tmp_path, s3, keep_local=3, keep_remote=1) as c:
        assert c.resumed == []
        c.save(11, _state(11)).wait(60)
        assert [u.rsplit("/", 2)[1] for u in sent] == [step_name(11)]
        assert c.local_steps() == [9, 10, 11] and c.remote_steps() == [11]
        _same(c.load(9), _state(9))
