"""Object storage (issue 38) against a real S3 server (SeaweedFS on the
loopback, tests/s3server.py): every single-object call on s3:// URLs, the
configuration (storage_options, the AWS variables), the commit semantics
(the old object whole until a save completes), and typed errors naming the URL."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import ckptio
import pytest
import torch
from ckptio.io import remote, transfer
from torch.distributed.checkpoint.api import CheckpointException


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """``CKPTIO_SCRATCH`` an empty folder: a test then checks that no copy went there."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setenv("CKPTIO_SCRATCH", str(folder))
    return folder


def _state(seed: int = 0, big: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {
        "w": torch.randn(256, 64, generator=g),
        "b": torch.arange(10, dtype=torch.int64),
        "h": torch.randn(33, generator=g).to(torch.bfloat16),
    }
    if big:
        sd["big"] = torch.randint(0, 255, (big,), dtype=torch.uint8, generator=g)
    return sd


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_save_and_load_round_trip_with_storage_options(s3, tmp_path):
    sd = _state(big=40 << 20)  # 40 MiB: three parts of 16 MiB
    url = s3.url("model.pt")
    ckptio.save(sd, url, storage_options=s3.options)
    assert ckptio.last_report().device_path is None  # host memory only: no host buffers
    assert remote.head(url, s3.options)["size"] > 40 << 20
    _same(ckptio.load(url, storage_options=s3.options), sd)
    assert ckptio.last_report().device_path is None
    _same(ckptio.load(url, storage_options=s3.options, verify=True), sd)
    # The object is a plain torch.save file.
    local = tmp_path / "copy.pt"
    info = remote.download(url, local, s3.options)
    assert info["parts"] == 3 and info["size"] == os.path.getsize(local)
    _same(torch.load(local, weights_only=True), sd)


def test_the_standard_variables_configure_the_store(s3, monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    url = s3.url("env.pt")
    ckptio.save(_state(1), url)
    _same(ckptio.load(url), _state(1))


def test_keys_in_storage_options_replace_the_environments_session_token(s3, monkeypatch):
    """A session token in the environment belongs to the environment's keys:
    with keys of their own, storage_options send no token (else the store
    refuses the mix: access denied)."""
    url = s3.url("token.pt")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-token-of-another-identity")
    ckptio.save(_state(1), url, storage_options=s3.options)
    _same(ckptio.load(url, storage_options=s3.options), _state(1))
    # Without keys in the options the environment's credentials are taken
    # whole, its token too (which this server refuses).
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ckptio.StorePermissionError):
        ckptio.load(url, storage_options={"max_retries": "0"})
    monkeypatch.delenv("AWS_SESSION_TOKEN")
    _same(ckptio.load(url, storage_options={"max_retries": "0"}), _state(1))


def test_a_none_storage_option_is_unset(s3):
    from ckptio import _native

    url = s3.url("none.pt")
    opts = dict(s3.options, session_token=None, concurrency=None, part_size=None)
    ckptio.save(_state(2), url, storage_options=opts)
    _same(ckptio.load(url, storage_options=opts), _state(2))
    # The core's own reading of the options: None is not the string "None".
    assert _native.store_head(url, opts)["size"] == remote.head(url, s3.options)["size"]


def test_load_in_place_and_map_location(s3):
    url = s3.url("inplace.pt")
    sd = _state(2)
    ckptio.save(sd, url, storage_options=s3.options)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    ckptio.load(url, out=out, storage_options=s3.options)
    _same(out, sd)
    meta = ckptio.load(url, map_location="meta", storage_options=s3.options)
    assert meta["w"].device.type == "meta"


def test_safetensors_round_trip(s3):
    url = s3.url("model.safetensors")
    sd = _state(3, big=1 << 20)
    ckptio.safetensors.save_file(sd, url, {"step": "7"}, storage_options=s3.options)
    _same(ckptio.safetensors.load_file(url, storage_options=s3.options), sd)
    # ckptio.load hands a .safetensors key to safetensors, as torch.load does.
    _same(ckptio.load(url, storage_options=s3.options), sd)
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    ckptio.safetensors.load_file(url, out=out, storage_options=s3.options)
    _same(out, sd)
    for dev in ["cpu:0", torch.device("cpu")]:  # the host, spelled otherwise
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        ckptio.safetensors.load_file(url, dev, out=out, storage_options=s3.options)
        _same(out, sd)
    # metadata() reads a header as safetensors does, though torch cannot hold its tensors.
    header = json.dumps({"__metadata__": {"k": "v"}, "a": {"dtype": "F6_E2M3", "shape": [4],
                         "data_offsets": [0, 3]}}).encode()  # fmt: skip
    remote.put_bytes(url, len(header).to_bytes(8, "little") + header + bytes(3), s3.options)
    assert ckptio.safetensors.metadata(url, storage_options=s3.options) == {"k": "v"}


def test_a_failed_save_leaves_the_old_object_whole(s3):
    url = s3.url("keep.pt")
    ckptio.save(_state(4), url, storage_options=s3.options)
    before = remote.head(url, s3.options)
    with pytest.raises((AttributeError, pickle.PicklingError)):
        ckptio.save({"f": lambda: 0}, url, storage_options=s3.options)
    assert remote.head(url, s3.options) == before
    _same(ckptio.load(url, storage_options=s3.options), _state(4))
    ckptio.save(_state(5), url, storage_options=s3.options)  # a completed save replaces it
    _same(ckptio.load(url, storage_options=s3.options), _state(5))


def test_no_scratch_copy_is_left_behind(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_SCRATCH", str(tmp_path))
    url = s3.url("scratch.pt")
    ckptio.save(_state(), url, storage_options=s3.options)
    ckptio.load(url, storage_options=s3.options)
    with pytest.raises(ckptio.StoreNotFoundError):
        ckptio.load(s3.url("missing.pt"), storage_options=s3.options)
    assert os.listdir(tmp_path) == []


def test_a_killed_processs_scratch_copy_goes_at_the_next_staging(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_SCRATCH", str(tmp_path))
    code = (
        "import os, signal; from ckptio.io import remote; d = remote.scratch_folder(); "
        "open(os.path.join(d, 'x.pt'), 'wb').write(bytes(4096)); print(d, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert child.returncode == -signal.SIGKILL
    dead = child.stdout.strip()
    assert os.path.isfile(os.path.join(dead, "x.pt"))
    boot, ns, pid, start = (
        os.path.basename(dead)[len("ckptio-stage-") :].rsplit("-", 1)[0].split(".")
    )
    other_boot = "0" * 8 if boot != "0" * 8 else "1" * 8
    kept = [
        tmp_path / f"ckptio-stage-{boot}.{int(ns) + 1}.{pid}.{start}-x",  # another namespace's
        tmp_path / f"ckptio-stage-{other_boot}.{ns}.{pid}.{start}-x",  # another host's
        tmp_path / f"ckptio-stage-{boot}.{ns}.{pid}-x",  # not a whole tag
        tmp_path / "ckptio-stage-nothing",  # not a name of ours
    ]
    for k in kept:
        k.mkdir()
    fifo = tmp_path / f"ckptio-dcp-{boot}.{ns}.{pid}.{start}-fifo"  # not a folder: never opened
    os.mkfifo(fifo)
    link = tmp_path / f"ckptio-dcp-{boot}.{ns}.{pid}.{start}-link"
    os.symlink(kept[0], link)
    kept += [fifo, link]
    mine = remote.scratch_folder()
    assert not os.path.exists(dead)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(mine), *(k.name for k in kept)])
    again = remote.scratch_name("ckptio-dcp-")  # this process's own stays
    assert os.path.isdir(mine) and os.path.dirname(again) == str(tmp_path)


def test_a_missing_key_is_file_not_found_naming_the_url(s3):
    url = s3.url("nothing-here.pt")
    with pytest.raises(FileNotFoundError) as e:
        ckptio.load(url, storage_options=s3.options)
    assert isinstance(e.value, ckptio.StoreNotFoundError)
    assert isinstance(e.value, ckptio.CkptioError)
    assert e.value.filename == url and "no such key" in str(e.value)


def test_a_missing_bucket_says_so(s3):
    url = "s3://no-such-bucket-ckptio/x.pt"
    with pytest.raises(ckptio.StoreNotFoundError, match="no such bucket"):
        ckptio.load(url, storage_options=s3.options)


def test_a_wrong_secret_is_a_permission_error(s3):
    opts = dict(s3.options, secret_access_key="wrong")
    with pytest.raises(PermissionError) as e:
        ckptio.save(_state(), s3.url("denied.pt"), storage_options=opts)
    assert isinstance(e.value, ckptio.StorePermissionError)


def test_no_credentials_is_a_credentials_error_naming_the_url(s3, monkeypatch):
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.aws either
    opts = {k: v for k, v in s3.options.items() if k not in ("access_key_id", "secret_access_key")}
    # No keys: the client asks the instance metadata service, here a closed port.
    opts["metadata_endpoint"] = "http://127.0.0.1:9"
    url = s3.url("nocreds.pt")
    for call in (
        lambda: ckptio.load(url, storage_options=opts),
        lambda: ckptio.save(_state(), url, storage_options=opts),
    ):
        with pytest.raises(PermissionError, match="no credentials.*metadata service") as e:
            call()
        assert isinstance(e.value, ckptio.StoreCredentialsError)
        assert e.value.filename == url


def test_an_unreachable_store_is_a_connection_error(s3):
    opts = dict(s3.options, endpoint="http://127.0.0.1:9", max_retries="0")
    with pytest.raises(ConnectionError) as e:
        ckptio.load(s3.url("x.pt"), storage_options=opts)
    assert isinstance(e.value, ckptio.StoreConnectionError)


def test_bad_options_are_value_errors(s3, tmp_path):
    with pytest.raises(ValueError, match="unknown storage option"):
        ckptio.load(s3.url("x.pt"), storage_options=dict(s3.options, colour="blue"))
    with pytest.raises(ValueError, match="storage_options applies to object-store URLs"):
        ckptio.save(_state(), tmp_path / "local.pt", storage_options=s3.options)
    with pytest.raises(ValueError, match="concurrency"):
        ckptio.load(s3.url("x.pt"), storage_options=dict(s3.options, concurrency=0))
    with pytest.raises(TypeError, match="storage_options must be a mapping"):
        ckptio.load(s3.url("x.pt"), storage_options=[("a", "b")])
    with pytest.raises(ValueError, match="not an object-store URL|not an s3"):
        remote.head("s3:/broken", s3.options)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e300", -1.0, float("nan")])
def test_a_bad_retry_timeout_is_a_value_error_naming_the_url_and_option(s3, value):
    url = s3.url("rt.pt")
    with pytest.raises(ValueError, match="retry_timeout") as e:
        ckptio.save(_state(), url, storage_options=dict(s3.options, retry_timeout=value))
    assert url in str(e.value)


def test_a_whole_concurrency_of_any_integral_type_is_taken():
    import numpy as np

    for given in (8, "8", np.int64(8), np.uint16(8)):
        assert remote.client_options({"concurrency": given}, "s3://b/k")[1] == 8


@pytest.mark.parametrize(
    "option, value",
    [("concurrency", "abc"), ("concurrency", 1.5), ("concurrency", True), ("concurrency", "0"),
     ("part_size", "100G"), ("part_size", 0), ("part_size", "lots")],
)  # fmt: skip
def test_a_bad_concurrency_or_part_size_is_a_value_error_naming_the_url_and_option(
    s3, tmp_path, option, value
):
    """concurrency="abc" was int()'s bare ValueError, and a part_size over
    5 GiB (no multipart upload takes such parts) the core's message of a grid:
    neither named the URL. Now loads and saves alike refuse them up front."""
    url = s3.url("opt.pt")
    opts = dict(s3.options, **{option: value})
    for call in (
        lambda: ckptio.save(_state(), url, storage_options=opts),
        lambda: ckptio.load(url, storage_options=opts),
        lambda: ckptio.safetensors.save_file(_state(), url + ".st", storage_options=opts),
    ):
        with pytest.raises(ValueError, match=option) as e:
            call()
        assert url in str(e.value)
    from ckptio.tiered import Checkpointer

    with pytest.raises(ValueError, match=option) as e:  # made, not at its first drain
        Checkpointer(tmp_path / "local", s3.url("run"), storage_options=opts)
    assert s3.url("run") in str(e.value)


@pytest.mark.parametrize("age", ["-5", "nan", "inf", "1e400"])
def test_clean_refuses_an_age_that_is_negative_or_not_finite(s3, age):
    """clean --older-than -5 aborted the uploads of saves running now (begun in
    the last five seconds: all of them); nan was a ValueError of datetime's.
    Now one line naming the URL, exit 1, nothing aborted."""
    client = _boto3_client(s3)
    bucket, _, key = s3.url("live.pt").split("://", 1)[1].partition("/")
    up = client.create_multipart_upload(Bucket=bucket, Key=key)
    try:
        r = _cli(s3, "clean", s3.url(""), "--older-than", age)
        assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
        assert len(r.stderr.splitlines()) == 1 and "older_than" in r.stderr, r.stderr
        assert s3.url("").rstrip("/") in r.stderr
        ups = client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
        assert [u["UploadId"] for u in ups] == [up["UploadId"]]
    finally:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=up["UploadId"])
    from ckptio.tools.clean import abort_uploads

    with pytest.raises(ValueError, match="older_than"):
        abort_uploads(s3.url(""), float(age), s3.options)


def test_conditional_puts_are_typed_conflicts(s3):
    url = s3.url("commit.json")
    v1 = remote.put_bytes(url, b"one", s3.options, create=True)
    with pytest.raises(ckptio.CommitConflictError) as e:
        remote.put_bytes(url, b"two", s3.options, create=True)
    assert isinstance(e.value, FileExistsError) and e.value.filename == url
    v2 = remote.put_bytes(url, b"two", s3.options, if_match=v1["e_tag"])
    with pytest.raises(ckptio.CommitConflictError):
        remote.put_bytes(url, b"three", s3.options, if_match=v1["e_tag"])
    data, v = remote.get_bytes(url, s3.options)
    assert data == b"two" and v["e_tag"] == v2["e_tag"]


def test_listing_and_delete(s3):
    for name in ("a/1", "a/2", "b/1"):
        remote.put_bytes(s3.url("tree", name), name.encode(), s3.options)
    listed = sorted(u for u, _, _, _ in remote.listing(s3.url("tree", "a"), s3.options))
    assert listed == [s3.url("tree", "a/1"), s3.url("tree", "a/2")]
    remote.delete(s3.url("tree", "a/1"), s3.options)
    remote.delete(s3.url("tree", "a/1"), s3.options)  # gone already: not an error
    assert [u for u, _, _, _ in remote.listing(s3.url("tree"), s3.options)] == [
        s3.url("tree", "a/2"),
        s3.url("tree", "b/1"),
    ]


def _child_load(url, options, q):
    try:
        sd = ckptio.load(url, storage_options=options)
        q.put(float(sd["w"].sum()))
    except BaseException as e:  # pragma: no cover - reported to the parent
        q.put(repr(e))


def test_a_forked_child_makes_its_own_client(s3):
    url = s3.url("fork.pt")
    sd = _state(6)
    ckptio.save(sd, url, storage_options=s3.options)  # the parent's client exists now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_load, args=(url, s3.options, q))
    p.start()
    got = q.get(timeout=60)
    p.join(30)
    assert got == float(sd["w"].sum())
    _same(ckptio.load(url, storage_options=s3.options), sd)  # and the parent's still works


# --------------------------------------------------------------------------- sharded safetensors


def _index_names(s3, url):
    data, _ = remote.get_bytes(url + "/model.safetensors.index.json", s3.options)
    return set(json.loads(data)["weight_map"].values())


def _shard_names(s3, url):
    return sorted(u[len(url) + 1 :] for u, _, _, _ in remote.listing(url, s3.options))


def test_sharded_safetensors_commit_by_their_index(s3):
    url = s3.url("sharded")
    sd1 = {f"t{i}": torch.full((1024,), float(i)) for i in range(6)}  # 4 KiB each
    st = ckptio.safetensors
    st.save_sharded(sd1, url, max_shard_size="10KB", storage_options=s3.options)
    gen1 = _shard_names(s3, url)
    assert "model.safetensors.index.json" in gen1 and len(gen1) == 4
    _same(st.load_sharded(url, storage_options=s3.options), sd1)
    _same(st.load_sharded(url + "/model.safetensors.index.json", storage_options=s3.options), sd1)
    # The next generation: new names; the previous one kept for readers of its index.
    sd2 = {k: v + 100 for k, v in sd1.items()}
    st.save_sharded(sd2, url, max_shard_size="10KB", storage_options=s3.options)
    gen2 = _shard_names(s3, url)
    assert set(gen1) - {"model.safetensors.index.json"} <= set(gen2) and len(gen2) == 7
    _same(st.load_sharded(url, storage_options=s3.options), sd2)
    # A third: what neither the new index nor the previous one names goes, once
    # it began before the commit by the store's clock (whole seconds).
    prev = set(_index_names(s3, url))
    time.sleep(remote.CLOCK_SLACK + 1)
    st.save_sharded(sd1, url, max_shard_size="10KB", storage_options=s3.options)
    gen3 = set(_shard_names(s3, url))
    assert gen3 == prev | set(_index_names(s3, url)) | {"model.safetensors.index.json"}
    _same(st.load_sharded(url, storage_options=s3.options), sd1)
    out = {k: torch.empty_like(v) for k, v in sd1.items()}
    st.load_sharded(url, out=out, storage_options=s3.options)
    _same(out, sd1)


def test_load_sharded_reads_the_shards_straight_and_checks_the_index(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_SCRATCH", str(tmp_path))
    url = s3.url("straight-sharded")
    st = ckptio.safetensors
    g = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(1000 + i, generator=g) for i in range(9)}
    sd["bf"] = torch.randn(33, generator=g).bfloat16()
    sd["empty"] = torch.zeros(0)
    st.save_sharded(sd, url, max_shard_size="12KB", storage_options=s3.options)
    back = st.load_sharded(url, storage_options=s3.options)
    _same(back, sd)
    assert ckptio.last_report().backend == "store"
    assert os.listdir(tmp_path) == []  # no scratch copy
    index_url = url + "/model.safetensors.index.json"
    index = json.loads(remote.get_bytes(index_url, s3.options)[0])
    # An index that is no JSON, one whose weight_map points outside its folder,
    # one that puts a tensor in the wrong shard, one that names a missing shard.
    wrong = dict(index["weight_map"])
    moved = next(iter(wrong))
    wrong[moved] = next(v for v in wrong.values() if v != wrong[moved])
    for bad, error, match in [
        (b"{not json", ckptio.safetensors.SafetensorError, "index.json: not a safetensors index"),
        (json.dumps({"weight_map": {"t0": "../x.safetensors"}}).encode(),
         ckptio.safetensors.SafetensorError, "not a file name"),
        (json.dumps({"weight_map": {"t0": "."}}).encode(),
         ckptio.safetensors.SafetensorError, "tensor 't0' in '.', not a file name"),
        (json.dumps({"weight_map": wrong}).encode(),
         ckptio.safetensors.SafetensorError, f"tensor '{moved}'"),
        (json.dumps({"weight_map": {"t0": "gone.safetensors"}}).encode(),
         FileNotFoundError, "gone.safetensors"),
    ]:  # fmt: skip
        remote.put_bytes(index_url, bad, s3.options)
        with pytest.raises(error, match=match):
            st.load_sharded(url, storage_options=s3.options)
    assert os.listdir(tmp_path) == []


def test_sharded_safetensors_single_file_and_back(s3):
    url = s3.url("single")
    st = ckptio.safetensors
    sd = {f"t{i}": torch.full((1024,), float(i)) for i in range(3)}
    st.save_sharded(sd, url, storage_options=s3.options)  # one shard: model.safetensors
    assert _shard_names(s3, url) == ["model.safetensors"]
    _same(st.load_sharded(url, storage_options=s3.options), sd)
    st.save_sharded(sd, url, max_shard_size="4KB", storage_options=s3.options)
    _same(st.load_sharded(url, storage_options=s3.options), sd)
    st.save_sharded(sd, url, storage_options=s3.options)  # back to one file: the index goes
    assert "model.safetensors.index.json" not in _shard_names(s3, url)
    _same(st.load_sharded(url, storage_options=s3.options), sd)


def test_a_stored_folder_is_read_through_the_rule_of_a_local_one(s3):
    """As on a disk (formats.safetensors.read_through): a folder with neither
    model.safetensors.index.json nor model.safetensors is read through its one
    other index, a save's model.safetensors before that index, and the shards
    that index names stay through later saves and their sweeps."""
    url, o = s3.url("foreign"), s3.options
    st = ckptio.safetensors
    theirs = {"a": torch.full((4,), 7.0)}
    shard, index = "model-00001-of-00001.safetensors", "consolidated.safetensors.index.json"
    remote.put_bytes(f"{url}/{shard}", st.save(theirs), o)
    remote.put_bytes(f"{url}/{index}", json.dumps({"weight_map": {"a": shard}}).encode(), o)
    _same(st.load_sharded(url, storage_options=o), theirs)
    out = {"a": torch.zeros(4)}
    st.load_sharded(url, out=out, storage_options=o)
    _same(out, theirs)
    time.sleep(remote.CLOCK_SLACK + 1)  # the sweeps below may remove what is this old
    for sd, size in [({"a": torch.ones(4)}, "5GB"), ({"a": torch.ones(4), "b": torch.ones(4)}, 16)]:
        st.save_sharded(sd, url, max_shard_size=size, storage_options=o)
        _same(st.load_sharded(url, storage_options=o), sd)
        _same(st.load_sharded(f"{url}/{index}", storage_options=o), theirs)
    with pytest.raises(FileNotFoundError):
        st.load_sharded(f"{url}/gone.safetensors.index.json", storage_options=o)


def test_a_racing_sharded_save_is_a_conflict(s3, monkeypatch):
    url = s3.url("race")
    st = ckptio.safetensors
    sd = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    st.save_sharded(sd, url, max_shard_size="10KB", storage_options=s3.options)
    real = remote.upload

    def upload_then_race(path, obj, options=None):
        info = real(path, obj, options)
        if not getattr(upload_then_race, "raced", False):
            upload_then_race.raced = True
            # Another writer commits its index while this save uploads its shards.
            remote.put_bytes(url + "/model.safetensors.index.json", b'{"weight_map":{}}', options)
        return info

    monkeypatch.setattr(remote, "upload", upload_then_race)
    before = set(_shard_names(s3, url))
    with pytest.raises(ckptio.CommitConflictError):
        st.save_sharded(
            {k: v * 2 for k, v in sd.items()}, url, max_shard_size="8KB",
            storage_options=s3.options,
        )  # fmt: skip
    assert set(_shard_names(s3, url)) == before  # the loser's shards removed


def _four(v: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((1024,), float(v)) for i in range(4)}  # 4 KiB each


def test_racing_sharded_saves_never_write_each_others_shards(s3, monkeypatch):
    """Two saves that read the same index (here none) upload under names of
    their own: the loser's conflict removes only its own shards, and a loser
    whose commit is lost (not a conflict) leaves the winner's bytes alone."""
    url, o = s3.url("race-names"), s3.options
    st = ckptio.safetensors

    def save_b(p):  # B has read "no index"; A saves and commits meanwhile
        st.save_sharded(_four(1), url, max_shard_size="10KB", storage_options=o)
        st.save_sharded(_four(2), p, max_shard_size="10KB")

    with pytest.raises(ckptio.CommitConflictError):
        st._save_sharded_remote(url, o, save_b)
    _same(st.load_sharded(url, storage_options=o), _four(1))
    assert set(_shard_names(s3, url)) == _index_names(s3, url) | {"model.safetensors.index.json"}

    def lost(*a, **k):
        raise ckptio.StoreError(5, "connection lost (injected)")

    def save_c(p):  # the same race, C's commit lost instead of refused
        st.save_sharded(_four(3), url, max_shard_size="10KB", storage_options=o)
        st.save_sharded(_four(4), p, max_shard_size="10KB")
        monkeypatch.setattr(remote, "put_bytes", lost)

    with pytest.raises(ckptio.StoreError, match="injected"):
        st._save_sharded_remote(url, o, save_c)
    monkeypatch.undo()
    _same(st.load_sharded(url, storage_options=o), _four(3))


def test_a_sharded_save_keeps_what_a_later_save_uploaded(s3, monkeypatch):
    """A's sweep after its commit leaves the shards of B, a save that began
    after A's commit (it read A's index, so it may still commit over it)."""
    url, o = s3.url("race-sweep"), s3.options
    st = ckptio.safetensors
    for v in (0, 1):
        st.save_sharded(_four(v), url, max_shard_size="10KB", storage_options=o)
    real_listing, real_put = remote.listing, remote.put_bytes
    held: dict = {}

    class Paused(Exception):
        pass

    def put_b(u, data, options=None, **kw):  # B: shards uploaded, commit not yet
        held.update(u=u, data=data, kw=kw)
        raise Paused

    def listing_a(u, options=None):  # A has committed and lists to sweep
        monkeypatch.setattr(remote, "listing", real_listing)
        monkeypatch.setattr(remote, "put_bytes", put_b)
        with pytest.raises(Paused):
            st.save_sharded(_four(3), url, max_shard_size="10KB", storage_options=o)
        monkeypatch.setattr(remote, "put_bytes", real_put)
        return real_listing(u, options)

    monkeypatch.setattr(remote, "listing", listing_a)
    st.save_sharded(_four(2), url, max_shard_size="10KB", storage_options=o)  # A
    monkeypatch.undo()
    b_shards = set(json.loads(held["data"])["weight_map"].values())
    assert b_shards <= set(_shard_names(s3, url))
    real_put(held["u"], held["data"], o, **held["kw"])  # B commits over A's index
    _same(st.load_sharded(url, storage_options=o), _four(3))


# --------------------------------------------------------------------------- DCP


def _dcp_state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.arange(100) + seed, "n": seed}


def _dcp_save(url, sd, s3, **kw):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter

    w = FileSystemWriter(url, storage_options=s3.options, **kw)
    dcp.save(sd, storage_writer=w, no_dist=True)


def _dcp_load(url, s3, seed):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader

    out = {"a": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.int64), "n": -1}
    dcp.load(out, storage_reader=FileSystemReader(url, storage_options=s3.options), no_dist=True)
    want = _dcp_state(seed)
    assert torch.equal(out["a"], want["a"]) and torch.equal(out["b"], want["b"])
    assert out["n"] == seed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_commits_by_its_metadata(s3):
    url = s3.url("dcp")
    _dcp_save(url, _dcp_state(1), s3)
    names1 = set(_shard_names(s3, url))
    assert ".metadata" in names1 and len(names1) == 2
    _dcp_load(url, s3, 1)
    _dcp_save(url, _dcp_state(2), s3)
    names2 = set(_shard_names(s3, url))
    assert names1 < names2 and len(names2) == 3  # the previous generation kept
    _dcp_load(url, s3, 2)
    time.sleep(remote.CLOCK_SLACK + 1)  # the sweep removes what began before the commit
    _dcp_save(url, _dcp_state(3), s3)
    names3 = set(_shard_names(s3, url))
    assert not (names1 - {".metadata"}) & names3 and len(names3) == 3
    _dcp_load(url, s3, 3)


def test_a_dcp_commit_keeps_what_a_later_save_uploaded(s3, monkeypatch):
    """The sweep after a DCP commit removes a dead save's data object that began
    before it, and keeps one that began after it (a save that read this
    ``.metadata`` and may still commit over it)."""
    url = s3.url("dcp-sweep")
    _dcp_save(url, _dcp_state(1), s3)
    stray = url + "/__0_deadbeef_0.distcp"
    remote.put_bytes(stray, b"a dead save's data", s3.options)
    time.sleep(remote.CLOCK_SLACK + 1)
    real = remote.listing
    later = url + "/__0_0badf00d_0.distcp"

    def listing(u, options=None):  # the commit is in: a later save uploads meanwhile
        remote.put_bytes(later, b"a later save's data", options)
        monkeypatch.setattr(remote, "listing", real)
        return real(u, options)

    monkeypatch.setattr(remote, "listing", listing)
    _dcp_save(url, _dcp_state(2), s3)
    names = set(_shard_names(s3, url))
    assert later.rsplit("/", 1)[1] in names and stray.rsplit("/", 1)[1] not in names
    _dcp_load(url, s3, 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("writer", ["ckptio", "torch"])
def test_dcp_reader_reads_a_store_straight_into_the_state_dict(s3, tmp_path, scratch, writer):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    g = torch.Generator().manual_seed(5)
    sd = {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB: a 4 KiB-aligned item of ckptio's
        "bf": torch.randn(77, 5, generator=g).bfloat16(),
        "m": torch.randn(40, 30, generator=g),
        "empty": torch.zeros(0),
        "step": 9,
        "name": "run-1",
    }
    url = s3.url(f"dcp-straight-{writer}")
    if writer == "ckptio":  # streamed from memory, nothing written locally
        w = FileSystemWriter(url, storage_options=s3.options)
        dcp.save(sd, storage_writer=w, no_dist=True)
        assert w.last_stats and all(s["backend"] == "store" for s in w.last_stats)
        assert os.listdir(scratch) == []
        with pytest.raises(CheckpointException, match="overwrite"):  # torch's check, in the store
            w = FileSystemWriter(url, storage_options=s3.options, overwrite=False)
            dcp.save(sd, storage_writer=w, no_dist=True)
        # Byte for byte the file the local writer makes of the same plan
        # (the data file's token aside), CRC-32s included: torch's reader reads it.
        [data] = [u for u, _, _, _ in remote.listing(url, s3.options) if u.endswith(".distcp")]
        local = tmp_path / "local"
        dcp.save(sd, storage_writer=FileSystemWriter(local), no_dist=True)
        [mine] = [n for n in os.listdir(local) if n.endswith(".distcp")]
        assert remote.get_bytes(data, s3.options)[0] == (local / mine).read_bytes()
        remote.download(data, tmp_path / "t.distcp", s3.options)
        remote.download(remote.join(url, ".metadata"), tmp_path / ".metadata", s3.options)
        os.rename(tmp_path / "t.distcp", tmp_path / os.path.basename(data))
        back = {"big": torch.zeros(3 << 18)}
        dcp.load(back, storage_reader=dcp.FileSystemReader(tmp_path), no_dist=True)
        assert torch.equal(back["big"], sd["big"])
    else:  # torch's own writer, its files uploaded as they are
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "t"), no_dist=True)
        for name in os.listdir(tmp_path / "t"):
            remote.upload(tmp_path / "t" / name, remote.join(url, name), s3.options)
    out = {
        "big": torch.zeros(3 << 18), "bf": torch.zeros(77, 5, dtype=torch.bfloat16),
        "m": torch.zeros(30, 40).t(),  # strided: through a temporary, then copied
        "empty": torch.zeros(0), "step": 0, "name": "",
    }  # fmt: skip
    ptr = out["big"].data_ptr()
    r = FileSystemReader(url, storage_options=s3.options)
    dcp.load(out, storage_reader=r, no_dist=True)
    assert os.listdir(scratch) == []  # no local copy, none left behind
    assert out["big"].data_ptr() == ptr and out["step"] == 9 and out["name"] == "run-1"
    for k in ("big", "bf", "m", "empty"):
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]), k
    assert r.last_stats and all(s["backend"] == "store" for s in r.last_stats)
    # verify=True: every item's CRC-32 checked on the way, still with no local copy.
    out["big"].zero_()
    r = FileSystemReader(url, storage_options=s3.options, verify=True)
    dcp.load(out, storage_reader=r, no_dist=True)
    assert torch.equal(out["big"], sd["big"]) and os.listdir(scratch) == []
    verified = [n for st in r.last_stats for n in st["verified"]]
    assert r.last_stats[0]["backend"] == "store", r.last_stats
    assert {"big", "bf", "m"} <= set(verified)
    # A flipped byte in the big tensor's data: a FormatError naming the file and the item.
    [data] = [u for u, _, _, _ in remote.listing(url, s3.options) if u.endswith(".distcp")]
    raw = bytearray(remote.get_bytes(data, s3.options)[0])
    item = r.storage_data[next(k for k in r.storage_data if k.fqn == "big")]
    raw[item.offset + item.length // 2] ^= 0xFF
    remote.put_bytes(data, bytes(raw), s3.options)
    r = FileSystemReader(url, storage_options=s3.options, verify=True)
    with pytest.raises(CheckpointException, match="item 'big' at bytes .* CRC-32"):
        dcp.load(out, storage_reader=r, no_dist=True)
    assert os.listdir(scratch) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reader_from_a_store_checks_non_tensor_values(s3, scratch):
    """verify=True from a store checks each non-tensor value's archive against
    its CRC-32s in the bytes fetched, as the local reader does: an intact one
    in "verified" (a BytesIO saved as it is, no zip, in "unchecked"); a flipped
    byte in one (which loads silently as another value without verify) a
    FormatError naming the object and the item. No local copy either way."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        DefaultSavePlanner,
    )

    class RawSave(DefaultSavePlanner):  # "raw" saved as its bytes, not torch.save'd
        def transform_object(self, write_item, object):
            if isinstance(object, io.BytesIO):
                return object
            return super().transform_object(write_item, object)

    class RawLoad(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            if read_item.dest_index.fqn == "raw":
                self.original_state_dict["raw"] = value.getvalue()
            else:
                super().load_bytes(read_item, value)

    w = torch.randn(64, 33, generator=torch.Generator().manual_seed(3))
    sd = {"w": w, "sched": {"last_epoch": 1000, "name": "cosine"}, "raw": io.BytesIO(b"as is")}
    url = s3.url("dcp-values")
    writer = FileSystemWriter(url, storage_options=s3.options)
    dcp.save(sd, storage_writer=writer, planner=RawSave(), no_dist=True)

    def load(verify: bool) -> tuple[dict, FileSystemReader]:
        out = {"w": torch.zeros(64, 33), "sched": {"last_epoch": 0, "name": ""}, "raw": b""}
        r = FileSystemReader(url, storage_options=s3.options, verify=verify)
        dcp.load(out, storage_reader=r, planner=RawLoad(), no_dist=True)
        return out, r

    out, r = load(True)
    assert torch.equal(out["w"], w) and out["sched"] == sd["sched"] and out["raw"] == b"as is"
    [st] = r.last_stats
    assert st["backend"] == "store" and st["path"].endswith(".distcp"), st
    assert sorted(st["verified"]) == ["sched.last_epoch", "sched.name", "w"], st
    assert st["unchecked"] == ["raw"], st
    # One byte of the value "sched.name" flipped inside its item (its pickle).
    [data] = [u for u, _, _, _ in remote.listing(url, s3.options) if u.endswith(".distcp")]
    raw = bytearray(remote.get_bytes(data, s3.options)[0])
    item = r.storage_data[next(k for k in r.storage_data if k.fqn == "sched.name")]
    raw[raw.index(b"cosine", item.offset, item.offset + item.length)] ^= 0x20
    remote.put_bytes(data, bytes(raw), s3.options)
    assert load(False)[0]["sched"]["name"] == "Cosine"  # unchecked: another value
    with pytest.raises(CheckpointException) as ei:
        load(True)
    e = ei.value.failures[0][0] if hasattr(ei.value, "failures") else ei.value
    assert isinstance(e, ckptio.FormatError), repr(e)
    assert f"{data}, item 'sched.name'" in str(e) and "CRC-32" in str(e), str(e)
    assert os.listdir(scratch) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reader_reads_a_store_in_batches_while_it_plans(s3, scratch, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader
    from ckptio.formats import dcp as dcp_format

    g = torch.Generator().manual_seed(11)
    sd = {f"t{i:02d}": torch.randn(64 + i, 33, generator=g) for i in range(45)}  # 8+32+5
    url = s3.url("dcp-batches")
    _dcp_save(url, sd, s3)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    r = FileSystemReader(url, storage_options=s3.options, verify=True)
    dcp.load(out, storage_reader=r, no_dist=True)
    _same(out, sd)
    [st] = r.last_stats  # one file: its batches' stats as one
    assert st["backend"] == "store" and sorted(st["verified"]) == sorted(sd)
    assert st["bytes"] >= sum(t.nbytes for t in sd.values())
    # An item of the third batch not where predicted: every item read again
    # from the scratch copy, after the batches in flight are done.
    real = dcp_format.item_zip

    def wrong(dtype, shape, align=dcp_format.ALIGN):
        z = real(dtype, shape, align)
        return z._replace(head=bytes(len(z.head))) if shape == (64 + 42, 33) else z

    monkeypatch.setattr(dcp_format, "item_zip", wrong)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    r = FileSystemReader(url, storage_options=s3.options)
    dcp.load(out, storage_reader=r, no_dist=True)
    _same(out, sd)
    assert all(s["backend"] != "store" for s in r.last_stats) and os.listdir(scratch) == []


def _zstd_ext():
    from torch.distributed.checkpoint import _extension as ext

    if not ext.ZStandard.is_available():
        pytest.skip("torch's ZStandard needs zstandard or pyzstd")
    return ext.ZStandard()


def _no_copy(*args):
    raise AssertionError("a scratch copy went through")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_zstd_items_go_both_ways_with_no_local_copy(s3, tmp_path, scratch, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter, _Remote

    g = torch.Generator().manual_seed(8)
    sd = {
        "big": torch.randn(3 << 18, generator=g),  # 3 MiB
        "m": torch.randn(40, 30, generator=g),
        "bf": torch.randn(77, 5, generator=g).bfloat16(),
        "step": 9,
    }
    url = s3.url("dcp-zstd")
    monkeypatch.setattr(_Remote, "upload", _no_copy)
    monkeypatch.setattr(_Remote, "download", _no_copy)
    w = FileSystemWriter(url, storage_options=s3.options, _extensions=[_zstd_ext()])
    dcp.save(sd, storage_writer=w, no_dist=True)
    assert [(s["backend"], s["compressed"]) for s in w.last_stats] == [("store", "zstd")]
    assert os.listdir(scratch) == []
    # The frames the local writer writes of the same plan, byte for byte.
    local = tmp_path / "local"
    dcp.save(sd, storage_writer=FileSystemWriter(local, _extensions=[_zstd_ext()]), no_dist=True)
    [mine] = [n for n in os.listdir(local) if n.endswith(".distcp")]
    [data] = [u for u, _, _, _ in remote.listing(url, s3.options) if u.endswith(".distcp")]
    assert remote.get_bytes(data, s3.options)[0] == (local / mine).read_bytes()
    monkeypatch.setattr(ckptio.dcp, "CODED_BATCH", 1 << 20)  # the big item alone, then the rest
    out = {
        "big": torch.zeros(3 << 18), "m": torch.zeros(30, 40).t(),  # strided: copied into
        "bf": torch.zeros(77, 5, dtype=torch.bfloat16), "step": 0,
    }  # fmt: skip
    r = FileSystemReader(url, storage_options=s3.options)
    dcp.load(out, storage_reader=r, no_dist=True)
    for k in ("big", "m", "bf"):
        assert out[k].dtype == sd[k].dtype and torch.equal(out[k], sd[k]), k
    assert out["step"] == 9 and os.listdir(scratch) == []
    assert len(r.last_stats) >= 2 and all(s["backend"] == "store" for s in r.last_stats)
    # An object cut short: a FormatError naming it and the item past its end.
    [data] = [u for u, _, _, _ in remote.listing(url, s3.options) if u.endswith(".distcp")]
    raw = remote.get_bytes(data, s3.options)[0]
    remote.put_bytes(data, raw[: len(raw) // 2], s3.options)
    r = FileSystemReader(url, storage_options=s3.options)
    with pytest.raises(CheckpointException, match="lies beyond the object's end"):
        dcp.load(out, storage_reader=r, no_dist=True)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_files_torchs_writer_makes_go_straight_into_objects(s3, scratch, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter, _Remote
    from test_dcp_fidelity import Xor, assert_same, state, zeros_like
    from torch.distributed.checkpoint import _extension as ext

    monkeypatch.setattr(_Remote, "upload", _no_copy)
    monkeypatch.setattr(_Remote, "download", _no_copy)
    sd = state()
    url = s3.url("dcp-xor")
    w = FileSystemWriter(url, storage_options=s3.options, _extensions=[Xor()], thread_count=2)
    dcp.save(sd, storage_writer=w, no_dist=True)  # torch's writer code, each file an object
    assert os.listdir(scratch) == []
    names = [u.rsplit("/", 1)[1] for u, _, _, _ in remote.listing(url, s3.options)]
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names), names
    registry = ext.ExtensionRegistry()
    registry.register(Xor)
    out = zeros_like(sd)
    r = FileSystemReader(url, storage_options=s3.options, _extension_registry=registry)
    dcp.load(out, storage_reader=r, no_dist=True)
    assert_same(sd["w"], out["w"]) and assert_same(sd["t"], out["t"])

    # A transform failing midway: the save fails, its objects are gone (the
    # file torch was writing aborted, those it had closed removed), the
    # checkpoint as it was.
    class Broken(Xor):
        def transform_to(self, output):
            raise OSError(5, "transform failed")

    before = sorted(remote.listing(url, s3.options))
    w = FileSystemWriter(url, storage_options=s3.options, _extensions=[Broken()])
    with pytest.raises(CheckpointException, match="transform failed"):
        dcp.save(sd, storage_writer=w, no_dist=True)
    assert sorted(remote.listing(url, s3.options)) == before
    client = _boto3_client(s3)
    bucket, _, key = url.split("://", 1)[1].partition("/")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_streamed_zstd_save_cut_into_parts_or_failing(s3, scratch, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter, _Remote
    from s3server import FaultProxy

    monkeypatch.setattr(_Remote, "upload", _no_copy)
    g = torch.Generator().manual_seed(4)
    # 40 MiB that do not compress: frames over three 16 MiB parts, the big
    # item compressed by several zstd workers.
    sd = {"noise": torch.randint(0, 255, (40 << 20,), dtype=torch.uint8, generator=g), "n": 1}
    url = s3.url("dcp-zstd-parts")
    w = FileSystemWriter(url, storage_options=s3.options, _extensions=[_zstd_ext()])
    dcp.save(sd, storage_writer=w, no_dist=True)
    [st] = w.last_stats
    assert st["parts"] == 3 and st["size"] > 40 << 20, st
    out = {"noise": torch.zeros(40 << 20, dtype=torch.uint8), "n": 0}
    dcp.load(out, storage_reader=FileSystemReader(url, storage_options=s3.options), no_dist=True)
    assert torch.equal(out["noise"], sd["noise"]) and out["n"] == 1
    # Every part throttled past the retries: a typed error, the save's upload
    # aborted, the checkpoint as it was.
    proxy = FaultProxy(s3.endpoint, lambda line: "slowdown" if "partNumber" in line else "pass")
    try:
        opts = dict(s3.options, endpoint=proxy.endpoint, max_retries="1", retry_timeout="5")
        w = FileSystemWriter(url, storage_options=opts, _extensions=[_zstd_ext()])
        with pytest.raises(CheckpointException, match="StoreThrottledError|SlowDown|throttled"):
            new = {"noise": torch.zeros(40 << 20, dtype=torch.uint8), "n": 2}
            dcp.save(new, storage_writer=w, no_dist=True)
    finally:
        proxy.close()
    out["noise"].zero_()
    dcp.load(out, storage_reader=FileSystemReader(url, storage_options=s3.options), no_dist=True)
    assert torch.equal(out["noise"], sd["noise"]) and out["n"] == 1
    client = _boto3_client(s3)
    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_reader_of_another_layout_reads_the_scratch_copy(s3, scratch, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader
    from ckptio.formats import dcp as dcp_format

    url = s3.url("dcp-other-layout")
    _dcp_save(url, _dcp_state(6), s3)
    real = dcp_format.item_zip

    def wrong(dtype, shape, align=dcp_format.ALIGN):
        z = real(dtype, shape, align)
        return z._replace(head=bytes(len(z.head)))  # a head the object does not have

    monkeypatch.setattr(dcp_format, "item_zip", wrong)
    out = {"a": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.int64), "n": -1}
    r = FileSystemReader(url, storage_options=s3.options)
    dcp.load(out, storage_reader=r, no_dist=True)
    want = _dcp_state(6)
    assert torch.equal(out["a"], want["a"]) and torch.equal(out["b"], want["b"])
    assert all(s["backend"] != "store" for s in r.last_stats)  # read from the copy
    assert os.listdir(scratch) == []  # which is removed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_id_takes_a_url(s3, tmp_path):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    url = s3.url("by-id")
    w = FileSystemWriter(tmp_path / "unused")
    w._store.options = s3.options  # options for the URL given by checkpoint_id
    dcp.save(_dcp_state(4), checkpoint_id=url, storage_writer=w, no_dist=True)
    assert ".metadata" in _shard_names(s3, url)
    out = {"a": torch.zeros(64, 64), "b": torch.zeros(100, dtype=torch.int64), "n": -1}
    r = FileSystemReader(url, storage_options=s3.options)
    dcp.load(out, checkpoint_id=url, storage_reader=r, no_dist=True)
    assert out["n"] == 4


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_racing_dcp_save_is_a_conflict(s3, monkeypatch):
    from ckptio import dcp as ckdcp

    url = s3.url("dcp-race")
    _dcp_save(url, _dcp_state(1), s3)
    before = set(_shard_names(s3, url))
    real = ckdcp.FileSystemWriter._upload_files

    def upload_then_race(self, plan, planner):
        got = real(self, plan, planner)
        remote.put_bytes(url + "/.metadata", b"another writer", s3.options)
        return got

    monkeypatch.setattr(ckdcp.FileSystemWriter, "_upload_files", upload_then_race)
    # DCP reports a failed step as its CheckpointException, the cause named.
    with pytest.raises(CheckpointException, match="CommitConflictError"):
        _dcp_save(url, _dcp_state(2), s3)
    assert set(_shard_names(s3, url)) == before


@pytest.mark.slow
def test_dcp_over_two_ranks_in_the_store(s3):
    from test_dcp import _run_ranks

    url = s3.url("ranks")
    _run_ranks(2, "store", url, **s3.env)
    # Two ranks' files per generation; the sync save's and the async saves' own.
    names = _shard_names(s3, url + "/async")
    assert names.count(".metadata") == 1 and len(names) == 5  # 2 generations x 2 ranks
    _run_ranks(1, "store_load", url, **s3.env)  # one rank loads what two saved


# --------------------------------------------------------------------------- tools


def _cli(s3, *argv):
    import subprocess
    import sys

    env = dict(os.environ, **s3.env, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-m", "ckptio", *argv], capture_output=True, text=True, env=env,
        timeout=300, check=False,
    )  # fmt: skip


def test_verify_and_listing_take_urls(s3):
    url = s3.url("tools.pt")
    ckptio.save(_state(7), url, storage_options=s3.options)
    rep = ckptio.verify(url, storage_options=s3.options)
    assert rep.ok and rep.records
    assert [t.name for t in ckptio.listing(url, storage_options=s3.options).entries] != []
    st_url = s3.url("tools-sharded")
    sd = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    ckptio.safetensors.save_sharded(sd, st_url, max_shard_size="10KB", storage_options=s3.options)
    assert ckptio.verify(st_url, storage_options=s3.options).ok
    with pytest.raises(ckptio.StoreNotFoundError):
        ckptio.verify(s3.url("nothing"), storage_options=s3.options)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    "marker", ["", "notes/", "notes/deeper/"], ids=["own", "subfolder", "nested"]
)
def test_folder_markers_are_not_objects_of_a_dcp_folder(s3, marker):
    """Empty objects whose key ends in "/" (the S3 console's "Create folder")
    in a DCP folder: verify and listing skip them as the store's listing does."""
    url = s3.url("dcp-marker")
    _dcp_save(url, _dcp_state(1), s3)
    bucket, key = remote.bucket_and_key(url)
    _boto3_client(s3).put_object(Bucket=bucket, Key=key + "/" + marker, Body=b"")
    listed = [u for u, *_ in remote.listing(url, s3.options)]
    assert url not in listed  # the folder's own marker
    assert ckptio.verify(url, storage_options=s3.options).ok
    assert ckptio.listing(url, storage_options=s3.options).format == "DCP"
    _dcp_load(url, s3, 1)


def test_a_bucket_url_is_the_folder_of_the_buckets_objects(s3):
    """``s3://bucket`` (no key) names a folder, not an empty object: verify and
    listing read the checkpoint at the bucket's root."""
    import uuid

    bucket = "ckptio-root-" + uuid.uuid4().hex[:12]
    client = _boto3_client(s3)
    client.create_bucket(Bucket=bucket)
    try:
        st = ckptio.safetensors
        sd = {"a": torch.ones(300), "b": torch.zeros(300)}
        for url in (f"s3://{bucket}", f"s3://{bucket}/"):
            st.save_sharded(sd, url, max_shard_size="1KB", storage_options=s3.options)
            _same(st.load_sharded(url, storage_options=s3.options), sd)
            rep = ckptio.verify(url, storage_options=s3.options)
            assert rep.ok, rep.summary()
            lst = ckptio.listing(url, storage_options=s3.options)
            assert lst.format == "sharded safetensors" and lst.path == url
            with pytest.raises(ckptio.StoreNotFoundError, match="names the bucket"):
                remote.head(url, s3.options)
    finally:
        for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=bucket)


def test_listing_and_verify_read_a_torch_object_straight(s3, tmp_path, scratch):
    sd = _torch_state(13)
    sd["big"] = torch.randn(5 << 20)  # 20 MiB: hashed in pieces of the part size
    url = s3.url("listed.pt")
    ckptio.save(sd, url, storage_options=s3.options)
    ckptio.save(sd, tmp_path / "local.pt")
    here = ckptio.listing(tmp_path / "local.pt")
    there = ckptio.listing(url, storage_options=s3.options)
    assert there.path == url and there.format == here.format

    def rows(lst):  # the serialization id is new for each save
        return [(e.name, e.offset, e.nbytes, e.crc32 if "serial" not in e.name else 0) for e in lst]

    assert rows(there.entries) == rows(here.entries)
    assert [e.tensors for e in there.entries] == [e.tensors for e in here.entries]
    seen = []
    rep = ckptio.verify(url, storage_options=s3.options, progress=seen.append)
    assert rep.ok and sum(seen) > 20 << 20
    assert [(r.name, r.state) for r in rep.records] == [
        (r.name, r.state) for r in ckptio.verify(tmp_path / "local.pt").records
    ]
    assert os.listdir(scratch) == []  # no scratch copy for either
    data = bytearray((tmp_path / "local.pt").read_bytes())
    data[-(3 << 20)] ^= 1  # inside "big", the last storage
    remote.put_bytes(url, bytes(data), s3.options)
    bad = ckptio.verify(url, storage_options=s3.options)
    assert not bad.ok and [r.name.rsplit("/", 1)[1] for r in bad.bad] == [
        next(e.name for e in here.entries if e.nbytes == 20 << 20).rsplit("/", 1)[1]
    ]
    with pytest.raises(ckptio.FormatError, match="records do not match"):
        bad.raise_if_bad()


def test_listing_and_verify_read_safetensors_headers_straight(s3, tmp_path, scratch):
    st = ckptio.safetensors
    g = torch.Generator().manual_seed(15)
    sd = {f"t{i}": torch.randn(2000 + i, generator=g) for i in range(6)}
    one, many = s3.url("listed.safetensors"), s3.url("listed-sharded")
    st.save_file(sd, one, metadata={"k": "v"}, storage_options=s3.options)
    st.save_file(sd, tmp_path / "one.safetensors", metadata={"k": "v"})
    st.save_sharded(sd, many, max_shard_size="20KB", storage_options=s3.options)
    st.save_sharded(sd, tmp_path / "many", max_shard_size="20KB")

    def rows(lst):
        return [(e.name, e.offset, e.nbytes, e.tensors) for e in lst.entries]

    for url, local in [
        (one, tmp_path / "one.safetensors"),
        (many, tmp_path / "many"),
        (many + "/model.safetensors.index.json", tmp_path / "many"),
    ]:
        there, here = ckptio.listing(url, storage_options=s3.options), ckptio.listing(local)
        assert there.format == here.format and rows(there) == rows(here), url
        assert [n for _, n in there.files] == [n for _, n in here.files]
        assert there.metadata == here.metadata
        rep = ckptio.verify(url, storage_options=s3.options)
        assert rep.ok and len(rep.unchecked) == len(sd) and rep.format == here.format
    assert os.listdir(scratch) == []  # headers and index only


def test_the_command_line_takes_urls(s3):
    url = s3.url("cli.pt")
    ckptio.save(_state(8), url, storage_options=s3.options)
    r = _cli(s3, "ls", url)
    assert r.returncode == 0 and "w" in r.stdout, r.stderr
    r = _cli(s3, "inspect", url)
    assert r.returncode == 0 and "archive/data.pkl" in r.stdout, r.stderr
    r = _cli(s3, "verify", url)
    assert r.returncode == 0 and ": ok: " in r.stdout, r.stdout + r.stderr
    dst = s3.url("cli.safetensors")
    r = _cli(s3, "convert", url, dst)
    assert r.returncode == 0, r.stderr
    _same(ckptio.safetensors.load_file(dst, storage_options=s3.options), _state(8))
    r = _cli(s3, "verify", s3.url("missing.pt"))
    assert r.returncode == 1 and "no such key" in r.stderr and r.stderr.count("\n") == 1


def test_convert_moves_objects_with_no_local_copy(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_SCRATCH", str(tmp_path / "none"))  # a scratch copy would fail
    sd = _state(8)
    src, st, back = s3.url("conv.pt"), s3.url("conv.safetensors"), s3.url("conv-back.pt")
    ckptio.save(sd, src, storage_options=s3.options)
    r = _cli(s3, "convert", src, st)
    assert r.returncode == 0, r.stderr
    _same(ckptio.safetensors.load_file(st, storage_options=s3.options), sd)
    assert ckptio.safetensors.metadata(st, storage_options=s3.options) == {"format": "pt"}
    r = _cli(s3, "convert", st, back)
    assert r.returncode == 0 and "is not kept" in r.stdout + r.stderr, r.stderr
    _same(ckptio.load(back, storage_options=s3.options), sd)
    local = tmp_path / "local.safetensors"
    r = _cli(s3, "convert", src, str(local))  # a store to a file, and back
    assert r.returncode == 0, r.stderr
    _same(ckptio.safetensors.load_file(local), sd)
    r = _cli(s3, "convert", str(local), s3.url("from-local.pt"))
    assert r.returncode == 0, r.stderr
    _same(ckptio.load(s3.url("from-local.pt"), storage_options=s3.options), sd)
    r = _cli(s3, "convert", s3.url("missing.pt"), str(tmp_path / "x.safetensors"))
    assert r.returncode == 1 and "no such key" in r.stderr and r.stderr.count("\n") == 1
    ckptio.save({"n": 1}, s3.url("odd.pt"), storage_options=s3.options)  # not a tensor
    r = _cli(s3, "convert", s3.url("odd.pt"), s3.url("odd.safetensors"))
    assert r.returncode == 1 and "not a tensor" in r.stderr, r.stderr
    assert not remote.listing(s3.url("odd.safetensors"), s3.options)  # nothing published


def _boto3_client(s3):
    boto3 = pytest.importorskip("boto3")
    return boto3.client(
        "s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.options["access_key_id"],
        aws_secret_access_key=s3.options["secret_access_key"], region_name="us-east-1",
    )  # fmt: skip


def test_clean_aborts_dangling_uploads(s3):
    client = _boto3_client(s3)
    bucket, _, prefix = s3.url("dangling").split("://", 1)[1].partition("/")
    up = client.create_multipart_upload(Bucket=bucket, Key=prefix + "/dead.pt")
    client.upload_part(
        Bucket=bucket, Key=prefix + "/dead.pt", UploadId=up["UploadId"], PartNumber=1, Body=b"x"
    )
    r = _cli(s3, "clean", s3.url("dangling"))  # younger than a day: kept
    assert r.returncode == 0 and "0 dangling uploads aborted" in r.stdout, r.stderr
    r = _cli(s3, "clean", s3.url("dangling"), "--older-than", "0")
    assert r.returncode == 0 and "1 dangling uploads aborted" in r.stdout, r.stderr
    left = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert left == []


# --------------------------------------------------------------------------- faults


def _once(match, action):
    """A proxy rule: ``action`` for the first request whose line holds ``match``."""
    done = []

    def rule(line):
        if match in line and not done:
            done.append(line)
            return action
        return "pass"

    return rule


@pytest.mark.parametrize("action", ["slowdown", "drop"])
def test_a_failed_part_is_retried_and_the_object_is_whole(s3, action):
    from s3server import FaultProxy

    url = s3.url("retry.pt")
    proxy = FaultProxy(s3.endpoint, _once("partNumber=2", action))
    try:
        opts = dict(s3.options, endpoint=proxy.endpoint, max_retries="3")
        sd = _state(9, big=40 << 20)
        ckptio.save(sd, url, storage_options=opts)
        assert sum("partNumber=2" in line for line in proxy.lines) == 2  # failed, then retried
        _same(ckptio.load(url, storage_options=s3.options, verify=True), sd)
    finally:
        proxy.close()


def test_throttling_past_the_retries_is_typed_and_leaves_the_old_object(s3):
    from s3server import FaultProxy

    url = s3.url("throttled.pt")
    ckptio.save(_state(1), url, storage_options=s3.options)
    proxy = FaultProxy(s3.endpoint, lambda line: "slowdown" if "partNumber" in line else "pass")
    try:
        opts = dict(s3.options, endpoint=proxy.endpoint, max_retries="1", retry_timeout="5")
        with pytest.raises(ckptio.StoreThrottledError) as e:
            ckptio.save(_state(2, big=1 << 20), url, storage_options=opts)
        assert isinstance(e.value, ConnectionError) and e.value.filename == url
    finally:
        proxy.close()
    _same(ckptio.load(url, storage_options=s3.options), _state(1))


def test_a_412_on_the_commit_is_a_conflict(s3):
    from s3server import FaultProxy

    url = s3.url("commit-412")
    sd = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    ckptio.safetensors.save_sharded(sd, url, max_shard_size="10KB", storage_options=s3.options)
    before = set(_shard_names(s3, url))
    index_put = "PUT /" + url.split("://", 1)[1] + "/model.safetensors.index.json"
    proxy = FaultProxy(s3.endpoint, _once(index_put, "conflict"))
    try:
        opts = dict(s3.options, endpoint=proxy.endpoint)
        with pytest.raises(ckptio.CommitConflictError):
            ckptio.safetensors.save_sharded(
                {k: v + 1 for k, v in sd.items()}, url, max_shard_size="10KB",
                storage_options=opts,
            )  # fmt: skip
    finally:
        proxy.close()
    assert set(_shard_names(s3, url)) == before
    _same(ckptio.safetensors.load_sharded(url, storage_options=s3.options), sd)


@pytest.mark.parametrize("first", [True, False], ids=["new", "over-old"])
def test_a_lost_reply_to_the_index_put_is_the_saves_commit(s3, first):
    """The conditional index PUT reaches the store and commits, but its reply is
    lost: the client's retry gets a 412 of its own making. The save reads the
    index back, finds its own bytes there and is committed; it neither raises
    nor removes the shards the committed index names."""
    from s3server import FaultProxy

    st = ckptio.safetensors
    url = s3.url("index-reply-lost")
    if not first:
        st.save_sharded(_four(1.0), url, max_shard_size="10KB", storage_options=s3.options)
    index_put = "PUT /" + url.split("://", 1)[1] + "/model.safetensors.index.json"
    proxy = FaultProxy(s3.endpoint, _once(index_put, "forward-drop"))
    try:
        opts = dict(s3.options, endpoint=proxy.endpoint, max_retries="3")
        st.save_sharded(_four(2.0), url, max_shard_size="10KB", storage_options=opts)
        assert sum(index_put in line for line in proxy.lines) == 2  # landed, then retried
    finally:
        proxy.close()
    assert _index_names(s3, url) <= set(_shard_names(s3, url))
    _same(st.load_sharded(url, storage_options=s3.options), _four(2.0))


def test_a_conflict_keeps_the_shards_the_winning_index_names(s3, monkeypatch):
    """On a real conflict the loser's shards go, but never one that the index
    now in the store names."""
    st = ckptio.safetensors
    url = s3.url("conflict-named")
    st.save_sharded(_four(1.0), url, max_shard_size="10KB", storage_options=s3.options)
    real = remote.upload
    mine: list[str] = []

    def upload_then_race(path, obj, options=None):
        info = real(path, obj, options)
        mine.append(obj.rsplit("/", 1)[1])
        if len(mine) == 2:  # another writer commits an index naming the first shard
            index = {"weight_map": {"t0": mine[0], "t1": mine[0]}}
            remote.put_bytes(
                url + "/model.safetensors.index.json", json.dumps(index).encode(), options
            )
        return info

    monkeypatch.setattr(remote, "upload", upload_then_race)
    with pytest.raises(ckptio.CommitConflictError):
        st.save_sharded(_four(2.0), url, max_shard_size="10KB", storage_options=s3.options)
    names = set(_shard_names(s3, url))
    assert mine[0] in names and mine[1] not in names


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
@pytest.mark.parametrize("first", [True, False], ids=["new", "over-old"])
def test_a_lost_reply_to_the_metadata_put_is_the_dcp_saves_commit(s3, first):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter
    from s3server import FaultProxy

    url = s3.url("dcp-reply-lost")
    if not first:
        _dcp_save(url, _dcp_state(1), s3)
    put = "PUT /" + url.split("://", 1)[1] + "/.metadata"
    proxy = FaultProxy(s3.endpoint, _once(put, "forward-drop"))
    try:
        opts = dict(s3.options, endpoint=proxy.endpoint, max_retries="3")
        w = FileSystemWriter(url, storage_options=opts)
        dcp.save(_dcp_state(2), storage_writer=w, no_dist=True)
        assert sum(put in line for line in proxy.lines) == 2  # landed, then retried
    finally:
        proxy.close()
    _dcp_load(url, s3, 2)


@pytest.mark.slow
def test_a_server_stopped_mid_save_is_a_typed_error_and_the_old_object_survives(tmp_path):
    import s3server

    binary = s3server.weed_binary()
    if binary is None:
        pytest.skip("no SeaweedFS binary")
    server = s3server.start(binary)
    try:
        url = server.url("stopped.pt")
        ckptio.save(_state(1), url, storage_options=server.options)
        opts = dict(server.options, max_retries="1", retry_timeout="5", concurrency="1")
        import threading

        errors = []

        def save():
            try:
                ckptio.save(_state(2, big=96 << 20), url, storage_options=opts)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        t = threading.Thread(target=save)
        t.start()
        time.sleep(0.5)
        server.proc.kill()  # the server dies while the parts go up
        server.proc.wait()
        t.join(120)
        assert len(errors) == 1 and isinstance(errors[0], ckptio.StoreError), errors
        server.restart(url)
        _same(ckptio.load(url, storage_options=server.options, verify=True), _state(1))
    finally:
        server.stop()


GROUP_WORKER = """
import json, os, sys
import torch, torch.distributed as dist
import ckptio
base, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
opts = json.loads(os.environ["GROUP_TEST_S3_OPTIONS"])
st = ckptio.safetensors
calls = {
    "pt": lambda: ckptio.load(base + "/group.pt", group=dist.group.WORLD, storage_options=opts),
    "st": lambda: st.load_file(base + "/group.safetensors", group=dist.group.WORLD,
                               storage_options=opts),
    "sharded": lambda: st.load_sharded(base + "/sharded", group=dist.group.WORLD,
                                       storage_options=opts),
    "verified": lambda: ckptio.load(base + "/group.pt", group=dist.group.WORLD, verify=True,
                                    storage_options=opts),
}
# In place: a torch.save object, a safetensors object, a module (built before the call).
ref = st.load_file(base + "/group.safetensors", storage_options=opts)
outs = [{k: torch.zeros_like(v) for k, v in ref.items()} for _ in range(2)]
model = torch.nn.Module()
for k, v in ref.items():
    model.register_parameter(k, torch.nn.Parameter(torch.zeros_like(v)))
calls["pt_out"] = lambda: ckptio.load(base + "/flat.pt", out=outs[0], group=dist.group.WORLD,
                                      verify=True, storage_options=opts)
calls["st_out"] = lambda: st.load_file(base + "/group.safetensors", out=outs[1],
                                       group=dist.group.WORLD, storage_options=opts)
calls["module"] = lambda: (ckptio.load_state_dict(model, base + "/flat.pt",
                                                  group=dist.group.WORLD, storage_options=opts),
                           model.state_dict())[1]
reps = {}
for name, call in calls.items():
    got = call()
    rep = ckptio.last_report()
    torch.save(got, f"{out}/{name}{dist.get_rank()}.pt")
    reps[name] = {"read": rep.bytes_read, "received": rep.bytes_received, "bytes": rep.nbytes,
                  "backend": rep.backend, "verified": rep.verified, "unchecked": rep.unchecked}
try:  # a flipped byte: the rank that reads it says where, the other that a peer failed
    ckptio.load(base + "/bad.pt", group=dist.group.WORLD, verify=True, storage_options=opts)
    reps["bad"] = "loaded"
except Exception as e:
    reps["bad"] = type(e).__name__ + ": " + str(e)
with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(reps, f)
# As torch asks: a gloo group left to the interpreter's exit can abort the process
# ("terminate called without an active exception", pytorch/pytorch#190489).
dist.destroy_process_group()
"""


def test_a_group_reads_an_object_once_and_shares_it(s3, tmp_path):
    from test_dcp import _run_ranks

    sd = _torch_state(12)
    sd["big"] = torch.randn(6 << 20)  # 24 MiB: split between the ranks
    flat = {f"t{i}": torch.randn(1 << 18) for i in range(12)}  # 12 MiB in 1 MiB tensors
    base = s3.url("grouped")
    ckptio.save(sd, base + "/group.pt", storage_options=s3.options)
    ckptio.safetensors.save_file(flat, base + "/group.safetensors", storage_options=s3.options)
    ckptio.save(flat, base + "/flat.pt", storage_options=s3.options)
    ckptio.safetensors.save_sharded(
        flat, base + "/sharded", max_shard_size="5MB", storage_options=s3.options
    )
    bad = tmp_path / "bad.pt"
    ckptio.save(sd, bad)
    data = bytearray(bad.read_bytes())
    big = next(r for r in ckptio.records(bad) if any(t.name == "big" for t in r.tensors))
    data[big.offset + 1000] ^= 0xFF
    remote.put_bytes(base + "/bad.pt", bytes(data), s3.options)
    argv = ["-c", GROUP_WORKER, base, str(tmp_path)]
    _run_ranks(
        2, "store-group", str(tmp_path), argv=argv, GROUP_TEST_S3_OPTIONS=json.dumps(s3.options)
    )
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    named = [("pt", sd), ("st", flat), ("sharded", flat), ("verified", sd)]
    named += [("pt_out", flat), ("st_out", flat), ("module", flat)]
    for name, want in named:
        got = [r[name] for r in reps]
        assert all(g["backend"] == "store" for g in got), got  # straight, no scratch copy
        total = got[0]["bytes"]
        assert sum(g["read"] for g in got) == total, (name, got)  # each byte from the store once
        assert all(g["read"] + g["received"] == total and g["read"] < total for g in got), got
        for r in range(2):
            _same_tree(want, torch.load(tmp_path / f"{name}{r}.pt", weights_only=True))
    assert all(r["verified"]["verified"] and r["verified"]["unchecked"] == [] for r in reps)
    bad = sorted(r["bad"] for r in reps)
    assert bad[0].startswith("FormatError") and "is corrupt" in bad[0], bad
    assert bad[1].startswith("PeerLoadError"), bad


def test_load_in_place_reads_straight_into_the_destinations(s3, tmp_path, scratch):
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024))
    sd = {"model": model.state_dict(), "step": 7, "big": torch.randn(5 << 20)}
    url = s3.url("inplace.pt")
    ckptio.save(sd, url, storage_options=s3.options)
    other = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024))
    out = {"model": other.state_dict(), "step": 0, "big": torch.zeros(5 << 20)}
    ptrs = [t.data_ptr() for t in out["model"].values()]
    got = ckptio.load(url, out=out, storage_options=s3.options, verify=True)
    rep = ckptio.last_report()
    assert rep.backend == "store" and rep.verified
    assert os.listdir(scratch) == []  # straight, no scratch copy
    assert got["step"] == 7 and torch.equal(got["big"], sd["big"])
    assert [t.data_ptr() for t in got["model"].values()] == ptrs  # filled in place
    for k, v in sd["model"].items():
        assert torch.equal(other.state_dict()[k], v), k
    # What the straight path leaves to the scratch copy still loads, or fails as there.
    half = {"model": {k: v.half() for k, v in other.state_dict().items()}, "step": 0,
            "big": torch.zeros(5 << 20)}  # fmt: skip
    with pytest.raises(ckptio.DtypeMismatchError):
        ckptio.load(url, out=half, storage_options=s3.options)
    ckptio.load(url, out=half, storage_options=s3.options, cast=True)
    assert torch.equal(half["big"], sd["big"])
    with pytest.raises(ckptio.KeyMismatchError):
        ckptio.load(url, out={"big": torch.zeros(5 << 20)}, storage_options=s3.options)
    assert os.listdir(scratch) == []


def test_safetensors_in_place_from_a_store_reads_straight(s3, tmp_path, scratch):
    st = ckptio.safetensors
    g = torch.Generator().manual_seed(14)
    sd = {f"t{i}": torch.randn(3000 + i, generator=g) for i in range(8)}
    sd["bf"] = torch.randn(40, generator=g).bfloat16()
    sd["empty"] = torch.zeros(0)
    one, many = s3.url("inplace.safetensors"), s3.url("inplace-sharded")
    st.save_file(sd, one, storage_options=s3.options)
    st.save_sharded(sd, many, max_shard_size="30KB", storage_options=s3.options)
    for load, url in [(st.load_file, one), (st.load_sharded, many)]:
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        ptrs = {k: v.data_ptr() for k, v in out.items()}
        got = load(url, out=out, storage_options=s3.options)
        assert ckptio.last_report().backend == "store"
        assert {k: v.data_ptr() for k, v in got.items()} == ptrs
        _same(got, sd)
        with pytest.raises(ckptio.DtypeMismatchError):  # the scratch copy's checks
            load(url, out=dict(out, bf=torch.zeros(40)), storage_options=s3.options)
        with pytest.raises(ckptio.KeyMismatchError):
            load(url, out={"t0": out["t0"]}, storage_options=s3.options)
    assert os.listdir(scratch) == []


def test_load_state_dict_takes_a_url(s3):
    model = torch.nn.Linear(16, 4)
    url = s3.url("module.pt")
    ckptio.save({"model": model.state_dict()}, url, storage_options=s3.options)
    other = torch.nn.Linear(16, 4)
    ckptio.load_state_dict(other, url, key="model", storage_options=s3.options)
    assert torch.equal(other.weight, model.weight)


class _Tied(torch.nn.Module):
    """An LLM's shape in small: tied embedding and head, bf16 matrices, 1-D norms."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32, dtype=torch.bfloat16)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {"q": torch.nn.Linear(32, 32, dtype=torch.bfloat16),
                 "norm": torch.nn.LayerNorm(32, dtype=torch.bfloat16)}
            ) for _ in range(3)
        )  # fmt: skip
        self.head = torch.nn.Linear(32, 64, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor(5))


def _fresh_tied(seed: int) -> _Tied:
    torch.manual_seed(seed)
    return _Tied()


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "sharded"])
def test_load_state_dict_reads_straight_into_the_module(s3, scratch, fmt):
    model = _fresh_tied(1)
    sd = model.state_dict()
    if fmt == "torch":
        url = s3.url("tied.pt")
        ckptio.save({"model": sd, "step": 3}, url, storage_options=s3.options)
        kw = dict(key="model", verify=True)
    else:  # safetensors keeps one of the tied names (load_state_dict's strict=False finds it)
        flat = {k: v for k, v in sd.items() if k != "head.weight"}
        url = s3.url("tied.safetensors" if fmt == "safetensors" else "tied-sharded")
        if fmt == "safetensors":
            ckptio.safetensors.save_file(flat, url, storage_options=s3.options)
        else:
            ckptio.safetensors.save_sharded(flat, url, max_shard_size="4KB",
                                            storage_options=s3.options)  # fmt: skip
        kw = dict(strict=False)
    other = _fresh_tied(2)
    ptrs = [t.data_ptr() for t in other.state_dict().values()]
    versions = other.embed.weight._version
    got = ckptio.load_state_dict(other, url, storage_options=s3.options, **kw)
    rep = ckptio.last_report()
    assert rep.backend == "store" and rep.verified == (fmt == "torch")
    assert os.listdir(scratch) == []  # straight, no scratch copy
    assert [t.data_ptr() for t in other.state_dict().values()] == ptrs  # in place
    assert other.embed.weight._version > versions  # autograd sees the write
    _same(other.state_dict(), sd)
    if fmt == "torch":
        assert tuple(got) == ([], [])
    else:  # as torch says it: the head's name is missing, though tied to the embedding
        assert tuple(got) == (["head.weight"], []) and rep.missing_keys == ("head.weight",)
    assert other.head.weight is other.embed.weight


def test_load_state_dict_from_a_store_falls_back_where_torchs_steps_must_run(s3, scratch):
    model = _fresh_tied(3)
    url = s3.url("fallback.pt")
    ckptio.save(model.state_dict(), url, storage_options=s3.options)
    opts = s3.options
    # A load_state_dict post-hook: torch's own steps, from the scratch copy.
    other, seen = _fresh_tied(4), []
    other.register_load_state_dict_post_hook(lambda m, keys: seen.append(keys))
    ckptio.load_state_dict(other, url, storage_options=opts)
    assert len(seen) == 1 and os.listdir(scratch) == []  # the scratch copy is removed
    _same(other.state_dict(), model.state_dict())
    # Another dtype: the scratch copy's typed error, then its cast.
    half = _fresh_tied(5).float()
    with pytest.raises(ckptio.DtypeMismatchError):
        ckptio.load_state_dict(half, url, storage_options=opts)
    ckptio.load_state_dict(half, url, storage_options=opts, cast=True)
    assert torch.equal(half.embed.weight, model.embed.weight.float())
    # Keys torch's strict check refuses: torch's message, as from a local file.
    small = torch.nn.Linear(32, 64, bias=False, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        ckptio.load_state_dict(small, url, storage_options=opts)
    got = ckptio.load_state_dict(_fresh_tied(6), url, storage_options=opts, strict=False)
    assert tuple(got) == ([], [])
    got = ckptio.load_state_dict(torch.nn.Linear(2, 2), url, storage_options=opts, strict=False)
    assert tuple(got) == (["weight", "bias"], list(model.state_dict()))
    # verify=True of safetensors: the scratch copy's error.
    st_url = s3.url("fallback.safetensors")
    ckptio.safetensors.save_file({"w": torch.ones(3)}, st_url, storage_options=opts)
    with pytest.raises(ValueError, match="verify=True"):
        ckptio.load_state_dict(torch.nn.Linear(3, 1), st_url, storage_options=opts, verify=True)
    assert os.listdir(scratch) == []


@pytest.mark.parametrize("cast", [False, True])
def test_load_state_dict_of_an_index_url_copies_its_shards(s3, scratch, cast):
    """The scratch copy of an index's URL (a module with a _load_from_state_dict
    override, BatchNorm's, or cast=True) held the index alone, so the shards it
    names were missing: now the index and its shards, as load_sharded copies."""

    def model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))

    torch.manual_seed(0)
    src = model()
    src[1].running_mean.fill_(3.0)
    url = s3.url("bn")
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    ckptio.safetensors.save_sharded(sd, url, max_shard_size="200B", storage_options=s3.options)
    index = url + "/model.safetensors.index.json"
    dst = model() if not cast else model().double()
    got = ckptio.load_state_dict(dst, index, storage_options=s3.options, cast=cast)
    assert tuple(got) == ([], [])
    assert torch.equal(dst[1].running_mean, src[1].running_mean.to(dst[1].running_mean.dtype))
    assert torch.equal(dst[0].weight, src[0].weight.to(dst[0].weight.dtype))
    assert os.listdir(scratch) == []  # the scratch copy is removed


# --------------------------------------------------------------------------- straight reads


def test_load_file_reads_straight_into_the_tensors(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTIO_SCRATCH", str(tmp_path))
    url = s3.url("many.safetensors")
    g = torch.Generator().manual_seed(3)
    # 3,000 small tensors (neighbours share GETs) around two of 6 MiB, a bf16 one.
    sd = {f"n{i}": torch.randn(17 + i % 5, generator=g) for i in range(3000)}
    sd["big"] = torch.randn(6 << 18, generator=g)
    sd["bf"] = torch.randn(3 << 20, generator=g).bfloat16()
    ckptio.safetensors.save_file(sd, url, storage_options=s3.options)
    opts = dict(s3.options, part_size="1M")  # GETs of at most 1 MiB
    got = ckptio.safetensors.load_file(url, storage_options=opts)
    _same(got, sd)
    assert ckptio.last_report().backend == "store"
    assert os.listdir(tmp_path) == []  # no scratch copy
    remote.download(url, tmp_path / "local.safetensors", s3.options)
    assert list(got) == list(ckptio.safetensors.load_file(tmp_path / "local.safetensors"))


def test_a_header_past_the_first_read_is_read_whole(s3):
    url = s3.url("long-header.safetensors")
    sd = {f"a_long_tensor_name_{i:06d}_" + "x" * 200: torch.ones(1) for i in range(6000)}
    ckptio.safetensors.save_file(sd, url, storage_options=s3.options)
    head, _ = remote.read(url, 0, 8, s3.options)
    assert int.from_bytes(head, "little") > 1 << 20  # longer than the first read
    _same(ckptio.safetensors.load_file(url, storage_options=s3.options), sd)


def test_a_bad_remote_header_is_a_safetensor_error_naming_the_url(s3):
    url = s3.url("bad.safetensors")
    remote.put_bytes(url, (50).to_bytes(8, "little") + b"{not json" + b" " * 41, s3.options)
    with pytest.raises(ckptio.safetensors.SafetensorError, match="bad.safetensors.*JSON"):
        ckptio.safetensors.load_file(url, storage_options=s3.options)
    remote.put_bytes(url, (1 << 40).to_bytes(8, "little"), s3.options)
    with pytest.raises(ckptio.safetensors.SafetensorError, match="header length"):
        ckptio.safetensors.load_file(url, storage_options=s3.options)


def test_straight_reads_refuse_bad_destinations(s3):
    url = s3.url("dest.bin")
    remote.put_bytes(url, bytes(range(256)) * 64, s3.options)
    t = torch.zeros(1024, dtype=torch.uint8)
    p = t.data_ptr()
    transfer.read_from_store(url, [(0, p, 512, -1), (512, p + 512, 512, -1)], [t], s3.options)
    assert bytes(t.numpy()) == (bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="overlap"):
        transfer.read_from_store(url, [(0, p, 512, -1), (0, p + 256, 512, -1)], [t], s3.options)
    with pytest.raises(ValueError, match="segment 0"):
        transfer.read_from_store(url, [(0, p + 1000, 512, -1)], [t], s3.options)  # past the tensor
    with pytest.raises(ValueError, match="segment 0"):  # host memory said to be device 0's
        transfer.read_from_store(url, [(0, p, 16, 0)], [t], s3.options)
    with pytest.raises(ValueError, match="past the object's end"):
        transfer.read_from_store(url, [(16000, p, 1000, -1)], [t], s3.options)
    _, info = remote.read(url, 0, 1, s3.options)
    remote.put_bytes(url, b"replaced", s3.options)  # a new version: a read of the old fails
    with pytest.raises(ckptio.CommitConflictError, match="changed while it was read"):
        transfer.read_from_store(url, [(0, p, 8, -1)], [t], s3.options, e_tag=info["e_tag"])


def _torch_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1000, generator=g)
    sd: dict = {
        "w": torch.randn(256, 64, generator=g),
        "base": base,
        "view": base[10:20],  # shares base's storage
        "empty": torch.zeros(0),
        "bf": torch.randn(3 << 18, generator=g).bfloat16(),
        "nested": {"l": [torch.ones(3), 4, "x"], "t": (torch.arange(5), 2.5)},
    }
    sd.update({f"n{i}": torch.randn(5 + i % 3, generator=g) for i in range(600)})
    return sd


def _same_tree(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same_tree(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_tree(x, y)
    else:
        assert a == b


def test_load_reads_torch_objects_straight_into_the_tensors(s3, tmp_path, scratch):
    sd = _torch_state(4)
    opts = dict(s3.options, part_size="1M")  # GETs of at most 1 MiB
    torch.save(sd, tmp_path / "plain.pt")
    for name, put in [
        ("ours.pt", lambda url: ckptio.save(sd, url, storage_options=s3.options)),
        ("torch.pt", lambda url: remote.upload(tmp_path / "plain.pt", url, s3.options)),
    ]:
        url = s3.url(name)
        put(url)
        for map_location in (None, "cpu", {"cpu": "cpu"}, torch.device("cpu")):
            got = ckptio.load(url, map_location=map_location, storage_options=opts)
            _same_tree(sd, got)
            assert ckptio.last_report().backend == "store", (name, map_location)
            assert (
                got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
            )
            assert os.listdir(scratch) == []  # no scratch copy


def _rezip(src, dst, extra: bytes = b"") -> None:
    """The records of ``src`` written again by Python's zipfile (no data
    descriptors, no alignment; ``extra`` in every local header)."""
    import zipfile

    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w") as zo:
        for info in zi.infolist():
            new = zipfile.ZipInfo(info.filename, info.date_time)
            new.extra = extra
            zo.writestr(new, zi.read(info.filename))


def test_another_zip_layout_is_confirmed_or_read_through_a_copy(s3, tmp_path):
    sd = _torch_state(5)
    torch.save(sd, tmp_path / "plain.pt")
    # Python's zipfile without extra fields: the offsets guessed hold, checked.
    _rezip(tmp_path / "plain.pt", tmp_path / "bare.pt")
    url = s3.url("bare.pt")
    remote.upload(tmp_path / "bare.pt", url, s3.options)
    _same_tree(sd, ckptio.load(url, storage_options=s3.options))
    assert ckptio.last_report().backend == "store"
    # An extra field in each local header: the guesses are wrong, the headers
    # read with the data say so, and the object is read through a local copy.
    _rezip(tmp_path / "plain.pt", tmp_path / "extra.pt", extra=b"\xfe\xca\x03\x00abc")
    url = s3.url("extra.pt")
    remote.upload(tmp_path / "extra.pt", url, s3.options)
    _same_tree(sd, ckptio.load(url, storage_options=s3.options))
    assert ckptio.last_report().backend != "store"
    # Loads in place: the headers come with the data; where they say the layout
    # is another, the copy writes every destination again.
    from torch.utils._pytree import tree_map

    for name, straight in [("bare.pt", True), ("extra.pt", False)]:
        out = tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, sd)
        _same_tree(sd, ckptio.load(s3.url(name), out=out, storage_options=s3.options))
        assert (ckptio.last_report().backend == "store") == straight, name


def test_an_object_file_goes_up_as_it_is_written_and_only_a_commit_publishes_it(s3):
    url = s3.url("stream.bin")
    remote.put_bytes(url, b"old", s3.options)
    big = torch.randint(0, 255, (40 << 20,), dtype=torch.uint8)  # three 16 MiB parts
    with remote.ObjectFile(url, s3.options) as f:
        f.write(b"head")
        f.write(memoryview(big.numpy()))  # read in place, not copied into bytes
        f.write(bytearray(b"tail"))
        assert f.tell() == 8 + big.numel()
        assert remote.get_bytes(url, s3.options)[0] == b"old"  # not yet published
    assert f.committed["parts"] == 3 and f.committed["size"] == 8 + big.numel()
    data = remote.get_bytes(url, s3.options)[0]
    assert data[:4] == b"head" and data[-4:] == b"tail" and data[4:-4] == big.numpy().tobytes()
    # A block that raises, or a close with no commit: nothing published.
    with pytest.raises(RuntimeError, match="stop"), remote.ObjectFile(url, s3.options) as f:
        f.write(b"x" * (20 << 20))
        raise RuntimeError("stop")
    f = remote.ObjectFile(url, s3.options)
    f.write(b"y")
    f.close()
    with pytest.raises(ValueError):
        f.write(b"z")  # closed
    assert remote.get_bytes(url, s3.options)[0] == data
    # torch.save failing midway into an object (a lambda does not pickle): the
    # old object stays.
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ckptio.save({"w": big, "f": lambda: 0}, url, storage_options=s3.options, pickle_protocol=4)
    assert remote.get_bytes(url, s3.options)[0] == data
    client = _boto3_client(s3)
    bucket, _, key = url.split("://", 1)[1].partition("/")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []


def test_torch_objects_that_need_torch_load_go_through_a_copy(s3):
    url = s3.url("odd.pt")
    sd = {"w": torch.ones(4), "size": torch.Size([2, 3]), "set": {1, 2}}
    ckptio.save(sd, url, storage_options=s3.options)
    got = ckptio.load(url, storage_options=s3.options, weights_only=False)
    assert got["size"] == torch.Size([2, 3]) and got["set"] == {1, 2}
    assert torch.equal(got["w"], sd["w"])
    # torch's legacy (non-zip) format: torch.load reads the local copy.
    legacy = s3.url("legacy.pt")
    opts = s3.options
    ckptio.save({"w": sd["w"]}, legacy, storage_options=opts, _use_new_zipfile_serialization=False)
    assert torch.equal(ckptio.load(legacy, storage_options=opts)["w"], sd["w"])
    # verify=True checks CRC-32s over a local copy
    _same_tree(
        {"w": sd["w"]},
        {"w": ckptio.load(url, storage_options=s3.options, verify=True, weights_only=False)["w"]},
    )


def test_verify_checks_every_crc_of_a_straight_load(s3, tmp_path, scratch):
    sd = _torch_state(11)
    sd["big"] = torch.randn(5 << 20)  # 20 MiB: two parts
    url = s3.url("verified.pt")
    ckptio.save(sd, url, storage_options=s3.options)
    _same_tree(sd, ckptio.load(url, storage_options=s3.options, verify=True))
    rep = ckptio.last_report()
    assert rep.backend == "store" and rep.verified and rep.unchecked == ()
    assert os.listdir(scratch) == []  # straight, no scratch copy
    # A byte flipped in a storage, and one in the pickle: FormatErrors naming
    # the record; without verify the storage's flip loads unnoticed.
    ckptio.save(sd, tmp_path / "x.pt")
    data = bytearray((tmp_path / "x.pt").read_bytes())
    import zipfile

    with zipfile.ZipFile(tmp_path / "x.pt") as z:
        infos = {i.filename.split("/", 1)[1]: i for i in z.infolist()}
    big_key = next(k for k, i in infos.items() if i.file_size == 20 << 20)
    for record in [big_key, "data.pkl"]:
        bad = bytearray(data)
        i = infos[record]
        at = i.header_offset + 30 + len(i.filename.encode()) + len(i.extra) + i.file_size // 2
        bad[at] ^= 0x40
        remote.put_bytes(url, bytes(bad), s3.options)
        with pytest.raises(ckptio.FormatError, match=f"{record}.*is corrupt"):
            ckptio.load(url, storage_options=s3.options, verify=True)
    assert os.listdir(scratch) == []


def test_a_damaged_torch_object_is_a_format_error_naming_the_url(s3, tmp_path):
    sd = _torch_state(6)
    ckptio.save(sd, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    for name, bad in [
        ("cut.pt", data[: len(data) // 2]),  # no end record
        ("short.pt", data[:100]),
        ("nopkl.pt", data.replace(b"/data.pkl", b"/data.pkx")),
    ]:
        url = s3.url(name)
        remote.put_bytes(url, bad, s3.options)
        with pytest.raises(ckptio.FormatError, match=f"s3://.*{name}"):  # the URL
            ckptio.load(url, storage_options=s3.options)


def test_save_streams_the_archive_from_memory_byte_for_byte(s3, tmp_path, scratch):
    sd = _torch_state(7)
    sd["big"] = torch.randint(0, 255, (40 << 20,), dtype=torch.uint8)  # 3 parts of 16 MiB
    url = s3.url("streamed.pt")
    ckptio.save(sd, url, storage_options=s3.options)
    assert ckptio.last_report().backend == "store"
    assert os.listdir(scratch) == []  # no local copy
    # The archive a save to a file makes: layout, records, CRC-32s, comment
    # (all but the serialization id, new for each save).
    ckptio.save(sd, tmp_path / "local.pt")
    remote.download(url, tmp_path / "back.pt", s3.options)
    import zipfile

    with zipfile.ZipFile(tmp_path / "back.pt") as a, zipfile.ZipFile(tmp_path / "local.pt") as b:
        assert a.comment == b.comment
        ia, ib = a.infolist(), b.infolist()
        assert [
            (i.filename, i.header_offset, i.CRC) for i in ia if "serialization_id" not in i.filename
        ] == [
            (i.filename, i.header_offset, i.CRC) for i in ib if "serialization_id" not in i.filename
        ]
        assert a.testzip() is None
    assert os.path.getsize(tmp_path / "back.pt") == os.path.getsize(tmp_path / "local.pt")
    assert ckptio.verify(url, storage_options=s3.options).ok
    _same_tree(sd, ckptio.load(url, storage_options=s3.options))
    # torch's own pickling arguments and its legacy format: torch.save writes
    # into the object's parts as they go up (no scratch file), torch reads it.
    for kw in ({"pickle_protocol": 4}, {"_use_new_zipfile_serialization": False}):
        ckptio.save(sd, url, storage_options=s3.options, **kw)
        assert ckptio.last_report().backend == "store" and os.listdir(scratch) == []
        remote.download(url, tmp_path / "torch.pt", s3.options)
        # (protocol 4 frames are beyond the weights-only unpickler; our own bytes)
        _same_tree(sd, torch.load(tmp_path / "torch.pt", weights_only=False))


def test_safetensors_save_file_streams_from_memory_byte_for_byte(s3, tmp_path, scratch):
    g = torch.Generator().manual_seed(8)
    sd = {f"t{i}": torch.randn(100 + i, generator=g) for i in range(50)}
    sd["big"] = torch.randn(10 << 20, generator=g)  # 40 MiB: three parts
    sd["empty"] = torch.zeros(0)
    sd["bf"] = torch.randn(77, generator=g).bfloat16()
    url = s3.url("streamed.safetensors")
    ckptio.safetensors.save_file(sd, url, metadata={"k": "v"}, storage_options=s3.options)
    assert ckptio.last_report().backend == "store"
    assert os.listdir(scratch) == []  # no local copy
    ckptio.safetensors.save_file(sd, tmp_path / "local.safetensors", metadata={"k": "v"})
    remote.download(url, tmp_path / "back.safetensors", s3.options)
    assert (tmp_path / "back.safetensors").read_bytes() == (
        tmp_path / "local.safetensors"
    ).read_bytes()
    _same(ckptio.safetensors.load_file(url, storage_options=s3.options), sd)


# --------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


def _to(tree, device: str):
    """``tree`` with every tensor moved to ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to(v, device) for v in tree)
    return tree


@gpu
def test_cuda_save_streams_from_device_memory_after_the_callers_stream(s3, tmp_path, scratch):
    sd = _to(_torch_state(9), "cuda")
    sd["view"] = sd["base"][10:20]  # shares "base"'s storage (``_to`` copied each apart)
    sd["host"] = torch.arange(1000)  # host and device storages in one archive
    a = torch.randn(2048, 2048, device="cuda")
    # 40 MiB across three parts, made by a kernel still queued when save is called.
    sd["big"] = (a @ a).flatten().repeat(3)[: 10 << 20]
    url = s3.url("cuda.pt")
    ckptio.save(sd, url, storage_options=s3.options)
    rep = ckptio.last_report()  # the parts copied from device memory into pinned buffers
    assert rep.backend == "store" and rep.device_path == "bounce" and rep.fallback_reason is None
    assert os.listdir(scratch) == []  # no local copy
    ckptio.save(sd, tmp_path / "local.pt")  # what a file save of the same tensors makes
    remote.download(url, tmp_path / "back.pt", s3.options)
    import zipfile

    with zipfile.ZipFile(tmp_path / "back.pt") as x, zipfile.ZipFile(tmp_path / "local.pt") as y:
        # The same records (a file save through cuFile stores no CRC-32 to compare:
        # the streamed archive's CRC-32s are checked against its bytes).
        assert [(i.filename, i.file_size) for i in x.infolist()] == [
            (i.filename, i.file_size) for i in y.infolist()
        ]
        assert x.testzip() is None and all(i.CRC for i in x.infolist() if i.file_size)
    assert ckptio.verify(url, storage_options=s3.options).ok
    back = ckptio.load(url, storage_options=s3.options, verify=True)
    rep = ckptio.last_report()  # straight into the CUDA storages, CRC-32s checked on the way
    assert rep.backend == "store" and rep.verified and rep.unchecked == ()
    assert rep.device_path == "bounce" and rep.fallback_reason is None  # pinned slots
    assert os.listdir(scratch) == []
    assert back["big"].is_cuda and back["host"].is_cpu
    _same_tree(_to(sd, "cpu"), _to(back, "cpu"))
    assert back["view"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()


@gpu
def test_cuda_safetensors_save_file_streams_byte_for_byte(s3, tmp_path, scratch):
    g = torch.Generator().manual_seed(10)
    sd = {f"t{i}": torch.randn(100 + i, generator=g) for i in range(50)}
    sd["big"] = torch.randn(10 << 20, generator=g)
    sd["bf"] = torch.randn(77, generator=g).bfloat16()
    sd["empty"] = torch.zeros(0)
    on_gpu = {k: (v.cuda() if i % 2 else v) for i, (k, v) in enumerate(sd.items())}
    url = s3.url("cuda.safetensors")
    ckptio.safetensors.save_file(on_gpu, url, storage_options=s3.options)
    rep = ckptio.last_report()
    assert rep.backend == "store" and rep.device_path == "bounce" and rep.fallback_reason is None
    assert os.listdir(scratch) == []
    ckptio.safetensors.save_file(sd, tmp_path / "local.safetensors")
    remote.download(url, tmp_path / "back.safetensors", s3.options)
    assert (tmp_path / "back.safetensors").read_bytes() == (
        tmp_path / "local.safetensors"
    ).read_bytes()
    back = ckptio.safetensors.load_file(url, device="cuda", storage_options=s3.options)
    assert ckptio.last_report().device_path == "bounce"
    assert os.listdir(scratch) == []
    assert all(t.is_cuda for t in back.values())
    _same(_to(back, "cpu"), sd)


@gpu
def test_cuda_store_transfers_fall_back_to_pageable_buffers_and_say_so(s3, tmp_path):
    """Under a pinned-memory cap of 0 the host buffers of a store transfer of GPU
    memory are pageable: the bytes are the same, the report says why."""
    from test_soundness import run_python

    code = f"""
        import json, torch, ckptio
        url, opts = {s3.url("capped.pt")!r}, {s3.options!r}
        g = torch.Generator().manual_seed(12)
        sd = {{"big": torch.randn(10 << 20, generator=g).cuda(), "host": torch.arange(9)}}
        ckptio.save(sd, url, storage_options=opts)
        saved = ckptio.last_report()
        back = ckptio.load(url, storage_options=opts)
        loaded = ckptio.last_report()
        same = all(torch.equal(back[k].cpu(), v.cpu()) for k, v in sd.items())
        print(json.dumps([saved.device_path, saved.fallback_reason, loaded.device_path,
                          loaded.fallback_reason, back["big"].is_cuda, same]))
    """
    run = run_python(code, tmp_path, {"CKPTIO_PINNED_LIMIT": "0"}, 300)
    assert run.returncode == 0, run.stderr[-3000:]
    saved_path, saved_why, loaded_path, loaded_why, on_cuda, same = json.loads(
        run.stdout.strip().splitlines()[-1]
    )
    assert saved_path == loaded_path == "bounce" and on_cuda and same
    assert "pinned-memory cap" in saved_why and "pinned-memory cap" in loaded_why


@gpu
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_cuda_dcp_save_and_load_stream_with_the_stores_crc32s(s3, tmp_path, scratch):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    g = torch.Generator().manual_seed(11)
    sd = {f"t{i}": torch.randn(300 + i, generator=g) for i in range(20)}
    sd["big"] = torch.randn(10 << 20, generator=g)  # 40 MiB across three parts
    sd["bf"] = torch.randn(77, 5, generator=g).bfloat16()
    on_gpu = {k: (v.cuda() if i % 2 else v) for i, (k, v) in enumerate(sd.items())}
    url = s3.url("cuda-dcp")
    w = FileSystemWriter(url, storage_options=s3.options)
    dcp.save(on_gpu, storage_writer=w, no_dist=True)
    assert all(s["backend"] == "store" for s in w.last_stats)
    assert any(s["device_path"] == "bounce" for s in w.last_stats), w.last_stats
    assert os.listdir(scratch) == []
    # The CRC-32s the parts computed from device memory: verify=True checks each.
    out = {k: torch.zeros_like(v) for k, v in on_gpu.items()}
    r = FileSystemReader(url, storage_options=s3.options, verify=True)
    dcp.load(out, storage_reader=r, no_dist=True)
    assert all(s["backend"] == "store" and not s["unchecked"] for s in r.last_stats)
    _same(_to(out, "cpu"), sd)
    out = {k: torch.zeros_like(v) for k, v in on_gpu.items()}
    r = FileSystemReader(url, storage_options=s3.options)
    dcp.load(out, storage_reader=r, no_dist=True)  # straight into CUDA memory
    assert all(s["backend"] == "store" for s in r.last_stats)
    assert os.listdir(scratch) == []
    _same(_to(out, "cpu"), sd)


def test_keys_are_stored_as_written_in_the_url(s3):
    """A key is the URL's text after the bucket, as the AWS CLI and boto3 take
    it: '%', '#', '?', '~', brackets and non-ASCII are part of it (not escaped
    again), so objects written by either side are found by the other."""
    client = _boto3_client(s3)
    sd = {"w": torch.arange(8.0)}
    folder = s3.url("keys-\u00e8")
    bucket, _, prefix = folder.split("://", 1)[1].partition("/")
    for name in ("a%b.pt", "a%20b.pt", "\u00fcn\u00ef.pt", "x~y[1].pt", "a#1?v=2.pt"):
        ckptio.save(sd, f"{folder}/{name}", storage_options=s3.options)
        head = client.head_object(Bucket=bucket, Key=f"{prefix}/{name}")
        assert head["ContentLength"] > 0, name
        client.copy_object(
            Bucket=bucket, Key=f"{prefix}/copy-{name}",
            CopySource={"Bucket": bucket, "Key": f"{prefix}/{name}"},
        )  # fmt: skip
        got = ckptio.load(f"{folder}/copy-{name}", storage_options=s3.options)
        assert torch.equal(got["w"], sd["w"]), name
    listed = {u[len(folder) + 1 :] for u, _, _, _ in remote.listing(folder, s3.options)}
    assert "a%b.pt" in listed and "\u00fcn\u00ef.pt" in listed


def test_a_url_without_an_objects_key_is_refused_by_single_object_calls(s3):
    bucket = s3.url("x").split("://", 1)[1].partition("/")[0]
    sd = {"w": torch.ones(2)}
    for url in (f"s3://{bucket}", f"s3://{bucket}/", s3.url("folder") + "/"):
        for call, args in (
            (ckptio.save, (sd, url)),
            (ckptio.load, (url,)),
            (ckptio.safetensors.save_file, (sd, url)),
            (ckptio.safetensors.load_file, (url,)),
        ):
            with pytest.raises(ValueError, match="not an object"):
                call(*args, storage_options=s3.options)


def test_file_urls_are_local_and_other_schemes_a_value_error(tmp_path, monkeypatch):
    """file:///x was saved into ./file:/x under the working folder; memory:// (a
    scheme ckptio has no client for) was saved there too, and a load of it
    raised FileNotFoundError."""
    monkeypatch.chdir(tmp_path)
    sd = {"w": torch.ones(2)}
    target = tmp_path / "d" / "m.pt"
    target.parent.mkdir()
    for call, args in (
        (ckptio.save, (sd, f"file://{target}")),
        (ckptio.load, (f"file://{target}",)),
        (ckptio.safetensors.save_file, (sd, f"file://{target}.st")),
        (ckptio.safetensors.load_file, (f"file://{target}.st",)),
    ):
        call(*args)
    assert torch.equal(ckptio.load(target)["w"], sd["w"])
    assert sorted(os.listdir(target.parent)) == ["m.pt", "m.pt.st"]
    for url in ("memory://run/x.pt", "hdfs://nn/x.pt", "S3://b/x.pt"):
        for call, args in (
            (ckptio.save, (sd, url)),
            (ckptio.load, (url,)),
            (ckptio.safetensors.save_file, (sd, url)),
            (ckptio.safetensors.load_file, (url,)),
        ):
            with pytest.raises(ValueError, match=re.escape(url) + ".*s3://, .*gs://"):
                call(*args)
    assert os.listdir(tmp_path) == ["d"]


def test_an_object_file_whose_publish_fails_is_aborted_and_closed(s3):
    url = s3.url("publish-fails.bin")
    f = remote.ObjectFile(url, s3.options, publish_on_close=True)
    f.write(b"x" * 100)
    real = f._w

    class Failing:
        def __getattr__(self, name):
            return getattr(real, name)

        def commit(self):
            raise ckptio.StoreError(5, "completion lost (injected)")

    f._w = Failing()
    with pytest.raises(ckptio.StoreError, match="injected"):
        f.close()
    assert f.closed
    f.close()  # no second try
    with pytest.raises(FileNotFoundError):
        remote.head(url, s3.options)


@pytest.mark.parametrize("verify", [False, True])
def test_dcp_from_the_store_loads_tied_weights_and_casts(s3, verify):
    """The store's DCP reader as the file's: two keys of one tensor (2 MiB: read
    straight, then through a temporary) and a destination of another dtype."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    emb = torch.nn.Embedding(2048, 256)
    sd = {"emb": emb.weight, "head": emb.weight, "b": torch.randn(1 << 19)}
    url = s3.url("tied-dcp")
    dcp.save(sd, storage_writer=FileSystemWriter(url, storage_options=s3.options), no_dist=True)
    w = torch.zeros(2048, 256)
    out = {"emb": w, "head": w, "b": torch.zeros(1 << 19, dtype=torch.bfloat16)}
    reader = FileSystemReader(url, storage_options=s3.options, verify=verify)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert torch.equal(w, emb.weight.detach()) and out["head"] is w
    assert torch.equal(out["b"], sd["b"].bfloat16())
    assert all(s["backend"] == "store" for s in reader.last_stats)


# --------------------------------------------------------------------------- review of the CLI


def test_convert_refuses_an_existing_object_without_force(s3, tmp_path):
    """convert replaced an existing object at DST without a word; now one line, exit 1,
    the object as it was, unless --force; the source's own URL is refused even then."""
    src, dst = s3.url("keep.pt"), s3.url("keep.safetensors")
    ckptio.save(_state(1), src, storage_options=s3.options)
    ckptio.save({"other": torch.zeros(2)}, dst, storage_options=s3.options)
    before = remote.head(dst, s3.options)["e_tag"]
    r = _cli(s3, "convert", src, dst)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "exists" in r.stderr, r.stderr
    assert remote.head(dst, s3.options)["e_tag"] == before
    r = _cli(s3, "convert", "-q", "--force", src, dst)
    assert r.returncode == 0, r.stderr
    _same(ckptio.safetensors.load_file(dst, storage_options=s3.options), _state(1))
    r = _cli(s3, "convert", "--force", src, src, "--to", "safetensors")
    assert r.returncode == 1 and "the source itself" in r.stderr, r.stderr
    _same(ckptio.load(src, storage_options=s3.options), _state(1))


def test_convert_verifies_a_source_object(s3, tmp_path):
    """convert of a damaged torch.save object wrote its rotten bytes with fresh CRC-32s;
    now it fails naming the bad record, nothing written."""
    src = tmp_path / "rotted.pt"
    torch.save({"w": torch.zeros(1024)}, src)
    rec = next(r for r in ckptio.records(src) if r.name.endswith("/data/0"))
    b = bytearray(src.read_bytes())
    b[rec.offset + 2] ^= 0x40
    url = s3.url("rotted.pt")
    remote.put_bytes(url, bytes(b), s3.options)
    r = _cli(s3, "convert", url, s3.url("copy.safetensors"))
    assert r.returncode == 1 and rec.name in r.stderr and "CRC-32" in r.stderr, r.stderr
    assert not remote.listing(s3.url("copy.safetensors"), s3.options)


def test_clean_aborts_only_the_uploads_of_its_own_folder(s3):
    """clean s3://b/run1 aborted the uploads of run10/ and run1-eval/ too (a prefix
    without its '/'); a folder is now the folder, and an object's URL its own uploads."""
    client = _boto3_client(s3)
    bucket, _, prefix = s3.url("").rstrip("/").split("://", 1)[1].partition("/")
    keys = ["run1/model.pt", "run1/sub/x.pt", "run10/model.pt", "run1-eval/model.pt"]
    for key in keys:
        client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{key}")

    def left():
        ups = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
        return sorted(u["Key"].removeprefix(prefix + "/") for u in ups)

    r = _cli(s3, "clean", "--older-than", "0", "--json", s3.url("run1"))
    assert r.returncode == 0, r.stderr
    assert sorted(a.split(" (")[0] for a in json.loads(r.stdout)["aborted"]) == [
        f"{prefix}/run1/model.pt", f"{prefix}/run1/sub/x.pt",
    ]  # fmt: skip
    assert left() == ["run1-eval/model.pt", "run10/model.pt"]
    r = _cli(s3, "clean", "--older-than", "0", s3.url("run10/model.pt"))  # one object's
    assert r.returncode == 0 and "1 dangling uploads aborted" in r.stdout, r.stdout + r.stderr
    assert left() == ["run1-eval/model.pt"]


def _cli_names_the_dcp_url(s3, url):
    """ckptio ls, verify and verify --json of a sound DCP folder at ``url`` name
    ``url`` as given."""
    r = _cli(s3, "ls", url)
    assert r.returncode == 0 and r.stdout.startswith(f"DCP: {url}\n"), r.stdout + r.stderr
    r = _cli(s3, "verify", url)
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith(f"{url}: ok: "), r.stdout
    r = _cli(s3, "verify", "--json", url)
    assert r.returncode == 0 and json.loads(r.stdout)["path"] == url, r.stdout + r.stderr


def test_reports_of_a_dcp_folder_url_name_the_url(s3):
    """ls and verify of a DCP folder in a store (read from a scratch copy) named the
    scratch copy (/dev/shm/...) instead of the URL; so did verify's error."""
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter

    url = s3.url("named-dcp")
    dcp.save(
        {"w": torch.arange(10.0)},
        storage_writer=FileSystemWriter(url, storage_options=s3.options),
        no_dist=True,
    )
    assert ckptio.listing(url, storage_options=s3.options).path == url
    assert ckptio.verify(url, storage_options=s3.options).path == url
    _cli_names_the_dcp_url(s3, url)
    md, _ = remote.get_bytes(url + "/.metadata", s3.options)
    remote.put_bytes(url + "/.metadata", md[: len(md) // 2], s3.options)
    rep = ckptio.verify(url, storage_options=s3.options)
    assert not rep.ok and rep.error.startswith(f"{url}/.metadata: "), rep.error
    r = _cli(s3, "verify", url)
    assert r.returncode == 1 and r.stderr.startswith(f"ckptio verify: {url}: BAD: "), r.stderr


_SLASH_SCRIPT = """
import json, sys, torch, ckptio
from ckptio.io import remote
out = {}
for url in sys.argv[1:]:  # each folder with a trailing '/' first, then without
    for u in (url + "/", url):
        lst = ckptio.listing(u)
        rep = ckptio.verify(u)
        out[u] = [lst.format, lst.path, len(lst.entries), rep.ok, rep.path, rep.error]
    out[url + " objects"] = [o[0] for o in remote.listing(url)]
print(json.dumps(out))
"""


def test_listing_errors_name_the_url_not_the_scratch_copy(s3, scratch):
    """ckptio.listing of a folder URL that holds no checkpoint, or a DCP folder
    whose .metadata is damaged: the error names the URL, as verify's does."""
    ckptio.save({"w": torch.ones(2)}, s3.url("no-ckpt", "inner.pt"), storage_options=s3.options)
    remote.put_bytes(s3.url("bad-dcp", ".metadata"), b"garbage", s3.options)
    remote.put_bytes(s3.url("bad-dcp", "__0_0.distcp"), b"x", s3.options)
    for url, obj in (
        (s3.url("no-ckpt"), s3.url("no-ckpt")),
        (s3.url("bad-dcp"), s3.url("bad-dcp", ".metadata")),
    ):
        for asked in (url, url + "/"):
            with pytest.raises(ckptio.FormatError) as e:
                ckptio.listing(asked, storage_options=s3.options)
            text = str(e.value)
            assert text.startswith(obj + ":") and str(scratch) not in text, text
            rep = ckptio.verify(asked, storage_options=s3.options)
            assert not rep.ok and obj in rep.error and str(scratch) not in rep.error


class _Kept:  # a class torch's weights_only unpickler refuses
    pass


def test_errors_raised_on_a_scratch_copy_name_the_url(s3, scratch):
    """A legacy-format object loaded with verify=True, and one that weights_only
    refuses, go through a scratch copy: their errors named the copy
    (/dev/shm/ckptio-stage-.../x.pt), gone by then. Now the URL."""
    legacy = s3.url("legacy.pt")
    ckptio.save(_state(), legacy, storage_options=s3.options, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="legacy format.*stores no CRC-32") as e:
        ckptio.load(legacy, verify=True, storage_options=s3.options)
    assert legacy in str(e.value) and str(scratch) not in str(e.value)
    refused = s3.url("refused.pt")
    buf = io.BytesIO()
    torch.save({"o": _Kept()}, buf, _use_new_zipfile_serialization=False)
    remote.put_bytes(refused, buf.getvalue(), s3.options)
    with pytest.raises(pickle.UnpicklingError) as e:
        ckptio.load(refused, weights_only=True, storage_options=s3.options)
    assert refused in str(e.value) and str(scratch) not in str(e.value)
    assert os.listdir(scratch) == []


def test_a_sharded_url_missing_a_shard_is_refused_naming_it_before_any_copy(
    s3, scratch, monkeypatch
):
    """verify and listing of a sharded folder whose index names a shard the
    store lacks downloaded every other shard first (the docs say the index and
    headers are read), then named the missing one in the scratch copy."""
    url = s3.url("holed")
    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(3)}
    ckptio.safetensors.save_sharded(sd, url, max_shard_size="5KB", storage_options=s3.options)
    shard = sorted(u for u, *_ in remote.listing(url, s3.options) if u.endswith(".safetensors"))[1]
    remote.delete(shard, s3.options)
    copied = []
    real = remote.download
    monkeypatch.setattr(remote, "download", lambda u, *a, **k: copied.append(u) or real(u, *a, **k))
    for call in (ckptio.verify, ckptio.listing):
        with pytest.raises(FileNotFoundError) as e:
            call(url, storage_options=s3.options)
        assert e.value.filename == shard and str(scratch) not in str(e.value)
    assert copied == []


def test_cli_convert_refuses_a_folder_url_before_downloading_it(s3, tmp_path, monkeypatch):
    """convert of a sharded folder's URL copied the whole folder, then refused it
    naming the copy. Now refused from the folder's names, naming the URL."""
    url = s3.url("conv-sharded")
    sd = {f"t{i}": torch.zeros(1000) for i in range(3)}
    ckptio.safetensors.save_sharded(sd, url, max_shard_size="5KB", storage_options=s3.options)
    blocked = tmp_path / "not-a-folder"
    blocked.write_bytes(b"")
    monkeypatch.setenv("CKPTIO_SCRATCH", str(blocked))  # any scratch copy would fail
    r = _cli(s3, "convert", url, str(tmp_path / "out.pt"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"{url} is a sharded safetensors checkpoint" in r.stderr, r.stderr
    r = _cli(s3, "convert", s3.url("nothing-here"), str(tmp_path / "out.pt"))
    assert r.returncode == 1 and s3.url("nothing-here") in r.stderr, r.stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_folder_url_with_a_trailing_slash_is_the_same_folder(s3):
    """s3://b/p/dcp/ made the core's client of the bucket take s3://b/p/dcp as its base:
    the call failed (a doubled key), and so did every later call of the process without
    the '/'. Both forms now list and verify the same checkpoint, in one process, and the
    reports name the URL, not the scratch copy."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemWriter

    d, sh = s3.url("slash-dcp"), s3.url("slash-sharded")
    dcp.save(
        {"w": torch.arange(10.0)},
        storage_writer=FileSystemWriter(d, storage_options=s3.options),
        no_dist=True,
    )
    sd = {"a": torch.ones(300), "b": torch.zeros(300)}
    ckptio.safetensors.save_sharded(sd, sh, max_shard_size="1KB", storage_options=s3.options)
    env = dict(os.environ, **s3.env, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run(
        [sys.executable, "-c", _SLASH_SCRIPT, d, sh], capture_output=True, text=True, env=env,
        timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for url, fmt in ((d, "DCP"), (sh, "sharded safetensors")):
        for u in (url + "/", url):
            assert got[u][0] == fmt and got[u][3] is True and got[u][5] is None, (u, got[u])
            assert got[u][1] == u and got[u][4] == u, got[u]  # the URL, as given
        assert got[url + "/"][2] == got[url][2] > 0
        assert all(o.startswith(url + "/") and "//" not in o[5:] for o in got[url + " objects"])
    for u in (d + "/", d):
        _cli_names_the_dcp_url(s3, u)
    r = _cli(s3, "ls", sh + "/")
    assert r.returncode == 0 and "a: float32 [300]" in r.stdout, r.stdout + r.stderr
