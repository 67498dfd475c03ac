"""The engine owns its threads (issue 36): one pool of worker threads per process
serves every transfer (files, the memory path, staging copies, compression), is
bounded, starts no thread per call, and is made again in a forked child. The
Python thread a load reads on while it builds its tensors is kept too (issue 37:
starting one per load waited behind the unmapping of the last load's file).

The Rust side is tested in ``src/workers.rs`` (parallelism, reuse, nested batches,
panics, fork)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import ckptio
import pytest

PACKAGE = pathlib.Path(ckptio.__file__).resolve().parent

SCRIPT = """
import os, sys, threading, time, torch, ckptio
import ckptio.safetensors as cst
from ckptio import _native
from ckptio.io import transfer as _transfer
from ckptio.io.engines import engine as _engine
from ckptio.staging import DefaultStager, StagingOptions

def threads():
    return set(os.listdir("/proc/self/task"))

def pool_threads():
    def name(t):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                return f.read().strip()
        except OSError:
            return ""
    return {t for t in threads() if name(t) == "ckptio-io"}

folder = sys.argv[1]
sd = {f"t{i}": torch.randn(1000 + i) for i in range(40)}
stager = DefaultStager(StagingOptions(False, False, False, False))

def rounds(n, tag):
    for i in range(n):
        p = os.path.join(folder, f"{tag}{i % 3}.pt")
        ckptio.save(sd, p)  # engine write; the replaced file freed off the caller
        assert ckptio.verify(p).ok  # engine checksums (the memory path: cached)
        r = _native.Reader(p)
        _, off, size = next(x for x in r.records() if x[0].endswith("/data/0"))
        buf = torch.empty(size, dtype=torch.uint8)
        _transfer.read(r, _engine(None, None, None), [(off, buf.data_ptr(), size, -1)], [buf])
        assert torch.equal(buf.view(torch.float32), sd["t0"])
        back = ckptio.load(p)  # reads on a kept Python thread beside the build
        assert torch.equal(back["t5"], sd["t5"])
        cst.save_file(sd, p + ".st")
        out = cst.load_file(p + ".st")
        assert all(torch.equal(out[k], v) for k, v in sd.items())
        staged = stager.stage(sd)  # staging copies
        assert torch.equal(staged["t3"], sd["t3"])

rounds(10, "warm")
base, pool = threads(), pool_threads()
# Every thread alive at any moment of 100 rounds, sampled from another thread:
# none is started for a call (a short-lived one shows up between samples).
seen, stop = set(), threading.Event()
def sample():
    while not stop.is_set():
        seen.update(threads())
        time.sleep(0.0005)
sampler = threading.Thread(target=sample)
sampler.start()
rounds(100, "a")
stop.set()
sampler.join()
new = seen - base - {str(sampler.native_id)}
print("threads", len(base), "pool", len(pool), "new", len(new))
assert pool, "no pool threads"
assert pool_threads() == pool, (pool, pool_threads())
assert not new, sorted(new)  # threads started during the rounds

pid = os.fork()
if pid == 0:  # a child of a process whose pool has threads: it makes its own
    try:
        rounds(5, "child")
        code = 0
    except BaseException as e:
        print("child failed:", repr(e), flush=True)
        code = 3
    os._exit(code)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
rounds(3, "parent")
stager.close()
print("ok")
"""


def test_no_thread_per_call_and_a_forked_child_has_its_own_pool(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


def test_a_read_beside_the_build_raises_its_error_and_the_worker_stays(tmp_path):
    from ckptio.io import transfer

    def boom():
        raise OSError(5, "read failed")

    for _ in range(3):  # the same kept thread serves every job, errors or not
        job = transfer.submit(boom)
        try:
            job.result()
        except OSError as e:
            assert e.errno == 5
        else:
            raise AssertionError("no error")
    assert transfer.submit(lambda: 7).result() == 7


def test_an_idle_kept_thread_holds_nothing_of_a_failed_read():
    """A failed job's error holds its frames (the destinations, the file): the idle
    thread that ran it must not keep them alive (found in review)."""
    import gc
    import time
    import weakref

    from ckptio.io import transfer

    class Owner:
        pass

    def failed() -> weakref.ref:
        owner = Owner()

        def fn(owner=owner):
            raise OSError(5, "read failed")

        try:
            transfer.submit(fn).result()
        except OSError:
            pass
        return weakref.ref(owner)

    ref = failed()
    for _ in range(50):  # the thread lets go right after signalling
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.01)
    assert ref() is None


def test_batches_added_while_a_read_waits_join_it():
    """transfer.Pipeline(join=True): the first batch is read at once; the
    batches added while it runs join one read, which starts when it is done;
    each batch's stats are its own share (bytes, CRC-32s); a failed read fails
    the one behind it, which is not made."""
    import threading

    from ckptio.io import transfer

    first_runs, reads = threading.Event(), []

    def read(source, segments, owners, streams):
        reads.append([s[0] for s in segments])
        if len(reads) == 1:
            assert first_runs.wait(10)
        if any(s[0] < 0 for s in segments):
            raise OSError("a GET failed")
        return {"bytes": sum(s[2] for s in segments), "crc32": [s[0] * 10 for s in segments]}

    def seg(offset: int, n: int) -> tuple[int, int, int, int]:
        return (offset, 0, n, -1)

    p = transfer.Pipeline(read, join=True)
    assert p.add([], []) is None
    assert p.add([seg(1, 5)], [None]) == 0
    assert p.add([seg(2, 7), seg(3, 1)], [None]) == 1
    assert p.add([seg(4, 100)], [None]) == 2
    first_runs.set()
    p.wait()
    assert reads == [[1], [2, 3, 4]]
    assert p.result(0) == {"bytes": 5, "crc32": [10]}
    assert p.result(1) == {"bytes": 8, "crc32": [20, 30]}
    assert p.result(2) == {"bytes": 100, "crc32": [40]}
    assert sum(p.result(i)["bytes"] for i in range(3)) == 113
    # Without join: a read per batch.
    reads.clear()
    p = transfer.Pipeline(read)
    for k in (1, 2, 3):
        p.add([seg(k, 1)], [None])
    p.wait()
    assert reads == [[1], [2], [3]]
    # A read that fails: the one behind it is not made, and fails with its error.
    reads.clear()
    p = transfer.Pipeline(read, join=True)
    p.add([seg(-1, 1)], [None])
    p.add([seg(5, 1)], [None])
    with pytest.raises(OSError, match="a GET failed"):
        p.wait()
    assert reads == [[-1]]
    with pytest.raises(OSError, match="a GET failed"):
        p.result(1)


def test_batched_reads_wait_for_every_batch_and_raise_the_reads_error_first(tmp_path, monkeypatch):
    """transfer.read_batches: one read at a time, in order, each queued behind
    the one before without the caller waiting for it (the next batch is made
    while a read runs); a batch that fails to be made, or ``meanwhile``
    failing, returns only once every batch handed to the engine is read (their
    destinations are the engine's until then); a read's error comes first, the
    other chained to it."""
    import threading

    import torch
    from ckptio import _native
    from ckptio.io import transfer
    from ckptio.io.engines import IoOptions

    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    reader = _native.DeviceFile(str(p), False, None, None)
    eng = IoOptions().engine()
    dests = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(4)]
    order: list[int] = []  # reads in the order they ran
    running: list[int] = []
    made_third = threading.Event()
    real = transfer.read_after
    calls = iter(range(1000))

    def call(*a, **k):
        assert not running, "two reads at once"
        n = next(calls)
        running.append(n)
        try:
            if n == 0:  # the caller makes batches 1 and 2 while this read runs
                assert made_third.wait(10), "the caller waited for the read"
            return real(*a, **k)
        finally:
            order.append(running.pop())

    def batches(fail_at: int | None, past_end: int | None = None):
        for i, d in enumerate(dests):
            if i == fail_at:
                raise ValueError("making batch failed")
            if i == 2:
                made_third.set()
            off = (1 << 20) if i == past_end else i << 16
            yield [(off, d.data_ptr(), d.numel(), -1)], [d]

    monkeypatch.setattr(transfer, "read_after", call)
    stats, got = transfer.read_batches(reader, eng, batches(None), lambda: 7)
    assert got == 7 and stats["bytes"] == 4 << 16 and order == [0, 1, 2, 3]
    assert all(torch.equal(d, torch.arange(256, dtype=torch.uint8).repeat(256)) for d in dests)
    order.clear()
    made_third.clear()
    calls = iter(range(1000))
    with pytest.raises(ValueError, match="making batch failed"):
        transfer.read_batches(reader, eng, batches(3), lambda: 7)
    # The three batches made were read before the error came out.
    assert order == [0, 1, 2]
    order.clear()
    calls = iter(range(1000))
    with pytest.raises(ckptio.FormatError) as ei:  # a read past the end of the file
        transfer.read_batches(reader, eng, batches(None, past_end=3), lambda: 1 / 0)
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    # A read that fails: the reads queued behind it are not made, and fail with its error.
    for d in dests:
        d.zero_()
    order.clear()
    calls = iter(range(1000))
    with pytest.raises(ckptio.FormatError):
        transfer.read_batches(reader, eng, batches(None, past_end=1), lambda: 7)
    assert order == [0, 1] and not dests[2].any() and not dests[3].any()
    # join=True: the batches made while a read runs are read together, in
    # one call, once it is done.
    for d in dests:
        d.zero_()
    sizes: list[int] = []
    all_made = threading.Event()  # meanwhile() runs once every batch is handed over

    def joined(*a, **k):
        sizes.append(len(a[2]))
        if len(sizes) == 1:
            assert all_made.wait(10), "the caller waited for the read"
        return real(*a, **k)

    monkeypatch.setattr(transfer, "read_after", joined)
    stats, got = transfer.read_batches(
        reader, eng, batches(None), lambda: all_made.set() or 7, join=True
    )
    assert got == 7 and stats["bytes"] == 4 << 16
    assert sizes == [1, 3]  # batch 0 alone; 1-3, made during its read, in one call
    assert all(torch.equal(d, torch.arange(256, dtype=torch.uint8).repeat(256)) for d in dests)
