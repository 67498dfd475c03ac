"""Drop-in fidelity (issue 20): ckptio.save/load and ckptio.safetensors take the peers'
arguments with the peers' meaning, their dtypes, their file objects, their error classes."""

import inspect
import io
import os
import pickle
import subprocess
import threading
import warnings

import ckptio
import ckptio.safetensors as cst
import pytest
import torch

st = pytest.importorskip("safetensors.torch")
safetensors = pytest.importorskip("safetensors")


def sample():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 33, generator=g)
    return {"w": w, "view": w[3:9], "i": torch.arange(70_000), "h": torch.ones(5).half()}


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------- signatures


def _params(f):
    return inspect.signature(f).parameters


@pytest.mark.parametrize("name", ["save_file", "load_file", "save", "load"])
def test_safetensors_signatures_take_every_argument_of_the_peer(name):
    """Every parameter of safetensors.torch's function, same kind and default."""
    ours, theirs = _params(getattr(cst, name)), _params(getattr(st, name))
    for p in theirs.values():
        assert p.name in ours, p.name
        q = ours[p.name]
        assert (q.kind, q.default) == (p.kind, p.default), p.name
    # ckptio's own knobs are keyword-only
    extra = [q for n, q in ours.items() if n not in theirs]
    assert all(q.kind == inspect.Parameter.KEYWORD_ONLY for q in extra)


@pytest.mark.parametrize(("ours", "theirs"), [(ckptio.save, torch.save), (ckptio.load, torch.load)])
def test_torch_signatures_take_every_argument_of_the_peer(ours, theirs):
    o, t = _params(ours), _params(theirs)
    for p in t.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD:
            assert any(q.kind == p.kind for q in o.values())
            continue
        assert p.name in o and o[p.name].kind == p.kind, p.name
        assert o[p.name].default == p.default, p.name


# --------------------------------------------------------------------------- safetensors


def test_load_file_takes_safetensors_backend_and_load_model_works(tmp_path):
    p = tmp_path / "m.safetensors"
    sd = {"a": torch.randn(4, 4), "b": torch.arange(3)}
    st.save_file(sd, p)
    for backend in ("mmap", "pread"):
        same(cst.load_file(p, backend=backend), sd)
        same(cst.load_file(p, "cpu", backend=backend), sd)
    with pytest.raises(safetensors.SafetensorError, match='backend "bogus" is invalid'):
        cst.load_file(p, backend="bogus")
    # safetensors' load_model passes backend= to the load_file it finds in its module
    model = torch.nn.Linear(4, 4)
    st.save_model(model, str(p))
    m2 = torch.nn.Linear(4, 4)
    orig = st.load_file
    st.load_file = cst.load_file
    try:
        assert st.load_model(m2, p) == (set(), [])
        assert st.load_model(m2, p, backend="pread") == (set(), [])
    finally:
        st.load_file = orig
    assert torch.equal(m2.weight, model.weight)


def test_device_backend_and_the_old_spelling(tmp_path):
    p = tmp_path / "x.safetensors"
    sd = {"a": torch.randn(10)}
    assert cst.save_file(sd, p, device_backend="posix") is None
    same(cst.load_file(p, device_backend="auto"), sd)
    with pytest.warns(DeprecationWarning, match="device_backend"):
        same(cst.load_file(p, backend="posix"), sd)
    with pytest.warns(DeprecationWarning):
        cst.save_file(sd, p, backend="auto")
    with pytest.raises(TypeError, match="together"):
        cst.load_file(p, backend="posix", device_backend="auto")
    with pytest.raises(ValueError, match="backend must be auto, cufile or bounce"):
        cst.load_file(p, device_backend="mmap")


def _peer_dtypes():
    """safetensors.torch's own dtype table (what its save_file takes)."""
    return sorted((d for d in st._SIZE if d is not None), key=str)


@pytest.mark.parametrize("dtype", _peer_dtypes(), ids=str)
def test_every_safetensors_dtype_round_trips_both_ways(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (3, 4 * dtype.itemsize), dtype=torch.uint8, generator=g)
    t = raw.view(dtype) if dtype != torch.bool else raw.bool()
    sd = {"t": t, "e": torch.empty(0, 2, dtype=dtype)}
    ours, theirs = tmp_path / "o.safetensors", tmp_path / "t.safetensors"
    cst.save_file(sd, ours)
    st.save_file(sd, theirs)
    for got in (st.load_file(ours), cst.load_file(theirs), cst.load_file(ours)):
        for k in sd:
            assert got[k].dtype == dtype and got[k].shape == sd[k].shape, k
            assert torch.equal(got[k].view(torch.uint8), sd[k].view(torch.uint8)), k
    # bytes: the very bytes safetensors makes (8-byte alignment), read back by both
    assert cst.save(sd) == st.save(sd)
    back = cst.load(st.save(sd))
    assert torch.equal(back["t"].view(torch.uint8), t.view(torch.uint8))


def test_in_memory_save_uses_8_byte_alignment_files_4k(tmp_path):
    b = cst.save({"test": torch.zeros((2, 2), dtype=torch.int32)})
    assert len(b) == 88 and b == st.save({"test": torch.zeros((2, 2), dtype=torch.int32)})
    p = tmp_path / "x.safetensors"
    cst.save_file({"t": torch.zeros(4)}, p)
    n = int.from_bytes(p.read_bytes()[:8], "little")
    assert (8 + n) % 4096 == 0


def test_f4_header_counts_values_as_safetensors_does():
    t = torch.zeros(3, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    b = cst.save({"x": t})
    assert b'"shape":[3,8]' in b and b == st.save({"x": t})
    with pytest.raises(safetensors.SafetensorError, match="0-dimensional"):
        cst.save({"x": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})


def test_safetensors_errors_are_catchable_as_the_peers(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\x10" + bytes(7) + b'{"a":1}')
    for call in (lambda: cst.load_file(p), lambda: cst.load(p.read_bytes())):
        with pytest.raises(safetensors.SafetensorError) as e:
            call()
        assert isinstance(e.value, ckptio.FormatError) and isinstance(e.value, RuntimeError)
        assert isinstance(e.value, cst.SafetensorError)
    with pytest.raises(FileNotFoundError):
        cst.load_file(tmp_path / "missing.safetensors")


def test_save_file_returns_none_like_the_peer(tmp_path):
    assert cst.save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors") is None
    assert ckptio.last_report().nbytes == 8
    assert cst.save_sharded({"a": torch.ones(2)}, tmp_path / "s") is None
    assert ckptio.last_report().storages == 1


# --------------------------------------------------------------------------- torch.save / load


def test_format_error_is_a_runtime_error_as_torch_load_raises(tmp_path):
    p = tmp_path / "c.pt"
    ckptio.save(sample(), p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError):
        torch.load(p)
    with pytest.raises(RuntimeError) as e:
        ckptio.load(p)
    assert isinstance(e.value, ckptio.FormatError) and isinstance(e.value, ckptio.CkptioError)
    assert issubclass(ckptio.CudaError, RuntimeError)


def test_save_returns_none_and_reports_through_last_report(tmp_path):
    assert ckptio.save(sample(), tmp_path / "c.pt") is None
    rep = ckptio.last_report()
    assert rep.path == str(tmp_path / "c.pt") and rep.storages == 3
    assert "Engine" not in ckptio.__all__ and not hasattr(ckptio, "Engine")


def test_file_objects_with_a_descriptor_go_through_the_engine(tmp_path):
    sd, p = sample(), tmp_path / "f.pt"
    with open(p, "wb") as f:
        assert ckptio.save(sd, f) is None
        end = f.tell()
    rep = ckptio.last_report()
    assert rep.path == str(p) and rep.storages == 3 and rep.nbytes > 0
    assert end == p.stat().st_size
    same(torch.load(p), sd)
    assert ckptio.verify(p).ok
    with open(p, "rb") as f:
        out = ckptio.load(f)
    same(out, sd)
    assert ckptio.last_report().path == str(p)
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert ckptio.last_report().storages == 3 and ckptio.last_report().nbytes > 0
    with open(p, "rb") as f:
        same(ckptio.load(f, verify=True), sd)


def test_file_objects_without_a_descriptor_go_through_the_object(tmp_path):
    sd = sample()
    b = io.BytesIO()
    ckptio.save(sd, b)
    assert ckptio.last_report().direct_reason == "a file object without a usable descriptor"
    b.seek(0)
    same(torch.load(b), sd)
    b.seek(0)
    same(ckptio.load(b), sd)
    b.seek(0)
    with pytest.raises(ValueError, match=r"verify=True\) needs a path"):
        ckptio.load(b, verify=True)
    # a stream past its start, an append-mode file: through the object too, as torch does
    p = tmp_path / "a.pt"
    with open(p, "ab") as f:
        ckptio.save(sd, f)
    same(torch.load(p), sd)
    same(ckptio.load(p), sd)


@pytest.mark.parametrize("opener", ["gzip", "bz2", "lzma"])
def test_compressing_file_objects_go_through_the_object(tmp_path, opener):
    """A gzip/bz2/lzma stream's fileno() is the compressed file's: its bytes are
    not the descriptor's, so they go through the object, as torch's do (the
    engine once wrote the raw file under the compressor: a loadable archive of
    zeros, and loads of valid streams said "corrupted")."""
    import importlib

    mod = importlib.import_module(opener)
    sd, p = sample(), tmp_path / f"c.pt.{opener}"
    with mod.open(p, "wb") as f:
        ckptio.save(sd, f)
    assert ckptio.last_report().direct_reason == "a file object without a usable descriptor"
    with mod.open(p, "rb") as f:
        same(torch.load(f), sd)
    with mod.open(p, "rb") as f:
        same(ckptio.load(f), sd)
    with mod.open(p, "wb") as f:
        torch.save(sd, f)
    with mod.open(p, "rb") as f:
        same(ckptio.load(f), sd)


def test_a_named_temporary_file_still_goes_through_the_engine(tmp_path):
    import tempfile

    sd = sample()
    with tempfile.NamedTemporaryFile(dir=tmp_path, suffix=".pt") as f:
        ckptio.save(sd, f)
        assert ckptio.last_report().path == f.name
        f.flush()
        same(torch.load(f.name), sd)


def test_torch_positional_arguments_and_legacy_format(tmp_path):
    sd, p = sample(), tmp_path / "c.pt"
    ckptio.save(sd, p, pickle, 2)
    same(ckptio.load(p, None, None), sd)
    # an explicit pickle_module means weights_only=False, as in torch.load
    same(ckptio.load(p, "cpu", pickle), sd)
    with pytest.raises(RuntimeError, match="pickle_module"):
        ckptio.load(p, None, pickle, weights_only=True)
    ckptio.save(sd, p, _use_new_zipfile_serialization=False)
    same(torch.load(p), sd)
    same(ckptio.load(p), sd)
    torch.save(sd, p, _disable_byteorder_record=True)
    same(ckptio.load(p), sd)
    ckptio.save(sd, p, _disable_byteorder_record=True)
    same(torch.load(p), sd)


def test_fake_tensor_mode_and_meta_as_torch_load(tmp_path):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    p = tmp_path / "c.pt"
    ckptio.save(sample(), p)
    with FakeTensorMode():
        out = ckptio.load(p)
        ref = torch.load(p)
    assert all(isinstance(v, FakeTensor) for v in out.values())
    assert {k: v.shape for k, v in out.items()} == {k: v.shape for k, v in ref.items()}
    for ml in ("meta", torch.device("meta")):
        out = ckptio.load(p, map_location=ml)
        assert all(v.device.type == "meta" for v in out.values())
        assert out["w"].untyped_storage()._checkpoint_offset is not None


@pytest.mark.parametrize(
    "ml",
    [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}, lambda s, loc: s, lambda s, loc: None],
    ids=["none", "str", "device", "dict", "callable", "callable-none"],
)
def test_every_map_location_form_matches_torch_load(tmp_path, ml):
    p = tmp_path / "c.pt"
    ckptio.save(sample(), p)
    same(ckptio.load(p, map_location=ml), torch.load(p, map_location=ml))


def test_a_callable_map_location_returns_memory_of_the_process(tmp_path):
    """``lambda s, loc: s`` once returned views of the load's private mapping of
    the file: a save over it changed the values, a truncation killed the process
    with SIGBUS. As torch.load's, the callable's storages are in memory."""
    p = tmp_path / "c.pt"
    torch.save({"w": torch.ones(1 << 18)}, p)
    out = ckptio.load(p, map_location=lambda s, loc: s)
    with open("/proc/self/maps") as f:
        assert str(p) not in f.read()  # nothing of the file stays mapped
    with open(p, "r+b") as f:  # rewritten in place, then cut short
        f.seek(0)
        f.write(b"\0" * os.path.getsize(p))
        f.truncate(100)
    assert out["w"].sum().item() == 1 << 18


class Wrapper(torch.Tensor):
    """A wrapper subclass torch rebuilds with _rebuild_wrapper_subclass (from map_location)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError


def test_wrapper_subclass_falls_back_to_torch_load(tmp_path):
    t = Wrapper(torch.ones(2, 3))
    p = tmp_path / "c.pt"
    torch.save({"m": t, "x": torch.ones(2)}, p)
    for ml in (None, "cpu"):
        ref = torch.load(p, map_location=ml, weights_only=False)
        out = ckptio.load(p, map_location=ml, weights_only=False)
        assert type(out["m"]) is Wrapper and out["m"].shape == ref["m"].shape
        assert torch.equal(out["x"], ref["x"])
        assert "torch.load read it" in ckptio.last_report().direct_reason


def test_crc32_off_still_verifies(tmp_path):
    p = tmp_path / "c.pt"
    torch.serialization.set_crc32_options(False)
    try:
        ckptio.save(sample(), p)
    finally:
        torch.serialization.set_crc32_options(True)
    rep = ckptio.verify(p)
    assert rep.ok and not rep.unchecked, rep.summary()
    same(ckptio.load(p, verify=True), sample())
    assert torch.serialization.get_crc32_options()


def test_safetensors_path_goes_to_load_file_as_torch_load_does(tmp_path):
    p = tmp_path / "m.safetensors"
    sd = {"a": torch.randn(3)}
    st.save_file(sd, p)
    same(ckptio.load(p), sd)
    same(ckptio.load(p, map_location="cpu"), sd)
    with pytest.raises(RuntimeError, match="dict map_location"):
        ckptio.load(p, map_location={"cpu": "cpu"})


def test_torchscript_archive_goes_to_torch(tmp_path):
    p = tmp_path / "s.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = ckptio.load(p, weights_only=False)
    assert isinstance(m, torch.jit.ScriptModule)
    with pytest.raises(RuntimeError, match="TorchScript"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckptio.load(p)
    assert os.path.exists(p)


def test_verify_reports_a_bad_file_and_raises_on_request(tmp_path):
    p = tmp_path / "c.pt"
    ckptio.save(sample(), p)
    ckptio.verify(p).raise_if_bad()
    data = bytearray(p.read_bytes())
    p.write_bytes(data[: len(data) // 2])
    rep = ckptio.verify(p)
    assert not rep.ok and rep.error
    with pytest.raises(ckptio.FormatError, match="BAD"):
        rep.raise_if_bad()
    with pytest.raises(FileNotFoundError):
        ckptio.verify(tmp_path / "missing.pt")


@pytest.mark.gpu
def test_gpu_file_objects_fake_mode_and_safetensors_backend(tmp_path):
    sd = {"w": torch.randn(1000, 777, device="cuda"), "i": torch.arange(5, device="cuda")}
    p = tmp_path / "f.pt"
    with open(p, "wb") as f:
        ckptio.save(sd, f)
    assert ckptio.last_report().device_path in ("bounce", "cufile")
    with open(p, "rb") as f:
        out = ckptio.load(f, map_location="cuda")
    assert ckptio.last_report().device_path in ("bounce", "cufile")
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    b = io.BytesIO()
    ckptio.save(sd, b)
    b.seek(0)
    assert torch.equal(ckptio.load(b)["w"], sd["w"])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = ckptio.load(p)
    assert fake["w"].device.type == "cuda"
    s = tmp_path / "m.safetensors"
    cst.save_file(sd, s, device_backend="posix")
    got = cst.load_file(s, device="cuda", backend="pread", device_backend="posix")
    assert ckptio.last_report().device_path == "bounce"
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    assert cst.save(sd) == st.save({k: v.cpu() for k, v in sd.items()})


@pytest.mark.gpu
def test_gpu_dcp_zstd_from_cuda_tensors(tmp_path):
    import torch.distributed.checkpoint as dcp
    from ckptio.dcp import FileSystemReader, FileSystemWriter

    ext = pytest.importorskip("torch.distributed.checkpoint._extension")
    if not ext.ZStandard.is_available():
        pytest.skip("torch's ZStandard needs zstandard or pyzstd")
    sd = {"w": torch.randn(512, 1024, device="cuda"), "z": torch.zeros(1 << 20, device="cuda")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[ext.ZStandard()]),
                 no_dist=True)  # fmt: skip
        for reader in (dcp.FileSystemReader(tmp_path), FileSystemReader(tmp_path)):
            out = {k: torch.empty_like(v) for k, v in sd.items()}
            dcp.load(out, storage_reader=reader, no_dist=True)
            assert all(torch.equal(out[k], sd[k]) for k in sd)


# --------------------------------------------------------------------------- review of 2026-12-06


def test_tensors_whose_unpickling_reads_values_load_as_torch_loads_them(tmp_path):
    # Sparse tensors are validated inside torch.load, a nested tensor reads its sizes,
    # a Generator its state: their storages must hold the bytes while the pickle decodes.
    g = torch.Generator().manual_seed(1234)
    sd = {
        "coo": torch.randn(4, 4).to_sparse(),
        "csr": torch.randn(4, 4).to_sparse_csr(),
        "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "gen": g,
    }
    torch.save(sd, tmp_path / "s.pt")
    for weights_only in (False, True):
        if weights_only:
            del sd["gen"], sd["nested"]  # refused by torch's weights_only unpickler
            torch.save(sd, tmp_path / "s.pt")
        want = torch.load(tmp_path / "s.pt", weights_only=weights_only)
        got = ckptio.load(tmp_path / "s.pt", weights_only=weights_only)
        for k in ("coo", "csr"):
            assert torch.equal(got[k].to_dense(), want[k].to_dense()), k
        if not weights_only:
            pairs = zip(got["nested"].unbind(), want["nested"].unbind(), strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
            ours, theirs = got["gen"], want["gen"]
            assert torch.equal(torch.randn(3, generator=ours), torch.randn(3, generator=theirs))


def test_save_into_a_pipe(tmp_path):
    r, w = os.pipe()
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    with open(w, "wb") as f:
        ckptio.save({"a": torch.arange(5)}, f)
    reader.join(30)
    os.close(r)
    assert torch.equal(torch.load(io.BytesIO(bytes(got)))["a"], torch.arange(5))


def test_a_bad_map_location_is_the_callers_error_not_a_damaged_file(tmp_path):
    """torch.load's classes for a map_location it cannot take (TypeError for a
    dict of non-strings, RuntimeError for a device it cannot restore to), not a
    FormatError blaming the checkpoint."""
    p = tmp_path / "c.pt"
    ckptio.save(sample(), p)
    for ml in ({"cpu": torch.device("cpu")}, {"cpu": 3}):
        with pytest.raises(TypeError):
            torch.load(p, map_location=ml)
        with pytest.raises(TypeError, match="map_location"):
            ckptio.load(p, map_location=ml)
    for ml in ("xla", {"cpu": "mps"}, "cpu:0", torch.device("cpu", 0), {"cpu": "cpu:0"}):
        with pytest.raises(RuntimeError):
            torch.load(p, map_location=ml)
        with pytest.raises(ckptio.LocationError, match="map_location") as ei:
            ckptio.load(p, map_location=ml)
        assert not isinstance(ei.value, ckptio.FormatError)


def test_records_of_equal_sizes_are_told_apart_on_torchs_path(tmp_path):
    """A pickle torch.load decodes (a set in it) whose storage is record data/1,
    beside an unreferenced data/0 of the same size: the storage's offset came
    from sizes alone, and data/0's bytes were loaded."""

    class Pickler(pickle.Pickler):  # torch.save's pickling, the storage under key "1"
        def persistent_id(self, o):
            if isinstance(o, torch.storage.TypedStorage):
                return ("storage", torch.FloatStorage, "1", "cpu", o._size())
            return None

    buf = io.BytesIO()
    Pickler(buf, 2).dump({"w": torch.zeros(4), "s": {1, 2}})
    p = tmp_path / "x.pt"
    w = torch._C.PyTorchFileWriter(str(p))
    records = [
        ("data.pkl", buf.getvalue()),
        ("byteorder", b"little"),
        ("data/0", torch.full((4,), 7.0).numpy().tobytes()),
        ("data/1", torch.full((4,), 1.0).numpy().tobytes()),
        ("version", b"3\n"),
    ]
    for name, data in records:
        w.write_record(name, data, len(data))
    w.write_end_of_file()
    del w
    ref = torch.load(p, weights_only=False)["w"]
    assert torch.equal(ref, torch.ones(4))
    assert torch.equal(ckptio.load(p, weights_only=False)["w"], ref)


# --------------------------------------------------------------------------- native unpickler
# src/format/pickle.rs reads what torch's weights_only unpickler reads, no more: anything
# outside (protocol 3-5 opcodes, DUP/POP/POP_MARK, a storage class torch does not allow
# by name, a PROTO other than 2) goes to torch.load, which refuses it under
# weights_only=True and loads it under weights_only=False.


def _with_pickle(path, pkl: bytes, records: dict[str, bytes]) -> None:
    """A torch.save zip of the given data.pkl and storage records (Python's zipfile,
    stored records, as torch.load reads them)."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for k, data in records.items():
            z.writestr(f"archive/data/{k}", data)
        z.writestr("archive/version", "3\n")


def _records(path) -> dict[str, bytes]:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _saved_pickle(path, obj, protocol: int = 2) -> tuple[bytes, dict[str, bytes]]:
    """torch.save's data.pkl of ``obj`` and its storage records by key."""
    torch.save(obj, path, pickle_protocol=protocol)
    recs = _records(path)
    pkl = next(c for n, c in recs.items() if n.endswith("/data.pkl"))
    data = {n.rsplit("/", 1)[1]: c for n, c in recs.items() if "/data/" in n}
    return pkl, data


def _edited(path, obj, edit, protocol: int = 2) -> None:
    pkl, data = _saved_pickle(path, obj, protocol)
    _with_pickle(path, edit(pkl), data)


def _before_stop(ops: bytes):
    def edit(pkl: bytes) -> bytes:
        assert pkl.endswith(b".")
        return pkl[:-1] + ops + b"."

    return edit


def _replacing(old: bytes, new: bytes):
    def edit(pkl: bytes) -> bytes:
        assert old in pkl
        return pkl.replace(old, new, 1)

    return edit


def _memoize_pickle(path, obj) -> None:
    # {'x': 'a' (BINPUT 0), 'y': 'b' (MEMOIZE: memo index 1), 'z': BINGET 0}: 'a' at 'z'
    s = lambda t: b"X" + len(t).to_bytes(4, "little") + t  # noqa: E731
    pkl = b"\x80\x02}(" + s(b"x") + s(b"a") + b"q\x00" + s(b"y") + s(b"b") + b"\x94"
    _with_pickle(path, pkl + s(b"z") + b"h\x00u.", {})


_W = {"w": torch.arange(4.0), "n": [1, (2, "three")]}
OUTSIDE_WEIGHTS_ONLY = {
    "protocol 4": lambda p: torch.save(_W, p, pickle_protocol=4),
    "protocol 5": lambda p: torch.save(_W, p, pickle_protocol=5),
    # FRAME, MEMOIZE, STACK_GLOBAL, SHORT_BINUNICODE under a PROTO 2 header
    "protocol 4 opcodes": lambda p: _edited(
        p, _W, lambda pkl: b"\x80\x02" + pkl.removeprefix(b"\x80\x04"), protocol=4
    ),
    "BINUNICODE8": lambda p: _edited(
        p, _W, _replacing(b"X\x01\x00\x00\x00w", b"\x8d\x01" + bytes(7) + b"w")
    ),
    "DUP": lambda p: _edited(p, _W, _before_stop(b"2\x86")),  # (root, root)
    "POP": lambda p: _edited(p, _W, _before_stop(b"N0")),
    "MARK POP_MARK": lambda p: _edited(p, _W, _before_stop(b"(NN1")),
    "torch.UntypedStorage": lambda p: _edited(
        p,
        {"b": torch.arange(16, dtype=torch.uint8)},
        _replacing(b"ctorch\nByteStorage\n", b"ctorch\nUntypedStorage\n"),
    ),
    "MEMOIZE numbering": lambda p: _memoize_pickle(p, None),
}


def _assert_equal(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b


def test_tensors_of_many_dims_and_tensors_that_require_grad_load_as_torch_loads_them(tmp_path):
    # 65 dims: more than the native reader takes (src/format/pickle.rs, MAX_DIMS).
    p = tmp_path / "d.pt"
    sd = {
        "many": torch.arange(2.0).reshape([2] + [1] * 64),
        "dims": torch.arange(6.0).reshape([1] * 61 + [2, 1, 3]),
        "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2), requires_grad=False),
    }
    torch.save(sd, p)
    got, want = ckptio.load(p), torch.load(p)
    _assert_equal(got, want)
    for k in sd:
        assert got[k].shape == want[k].shape and got[k].stride() == want[k].stride()
        assert got[k].requires_grad == want[k].requires_grad
        assert got[k]._backward_hooks == want[k]._backward_hooks


@pytest.mark.parametrize("case", sorted(OUTSIDE_WEIGHTS_ONLY))
def test_pickles_outside_weights_only_load_as_torch_loads_them(tmp_path, case):
    """The native unpickler read pickles torch's weights_only unpickler refuses (ckptio.load
    returned them under weights_only=True) and numbered MEMOIZE entries unlike pickle: they
    go to torch.load, which refuses them or loads them as they are."""
    p = tmp_path / "p.pt"
    OUTSIDE_WEIGHTS_ONLY[case](p)
    with pytest.raises(pickle.UnpicklingError) as theirs:
        torch.load(p, weights_only=True)
    with pytest.raises(pickle.UnpicklingError) as ours:
        ckptio.load(p, weights_only=True)
    assert type(ours.value) is type(theirs.value)
    assert "Weights only load failed" in str(ours.value)
    want = torch.load(p, weights_only=False)
    _assert_equal(ckptio.load(p, weights_only=False), want)
    if case == "MEMOIZE numbering":
        assert want == {"x": "a", "y": "b", "z": "a"}


def test_a_protocol_other_than_2_warns_as_torch_load_warns(tmp_path):
    """torch's weights_only unpickler reads protocol 3 (no opcode of its own in a state
    dict) with a warning that the protocol is not 2; ckptio.load read it silently."""
    p = tmp_path / "p3.pt"
    torch.save(_W, p, pickle_protocol=3)
    got = {}
    for name, load in (("torch", torch.load), ("ckptio", ckptio.load)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got[name] = load(p, weights_only=True)
        got[name + " warned"] = [
            str(w.message) for w in seen if "Detected pickle protocol 3" in str(w.message)
        ]
    _assert_equal(got["ckptio"], got["torch"])
    assert got["torch warned"] and got["ckptio warned"] == got["torch warned"]


def test_save_with_pickle_protocol_4_round_trips_as_torch(tmp_path):
    p = tmp_path / "p4.pt"
    obj = {**sample(), "meta": {"step": 3, "names": ["a", "b"], "t": (1.5, None, True)}}
    ckptio.save(obj, p, pickle_protocol=4)
    assert _records(p)[next(n for n in _records(p) if n.endswith("data.pkl"))][:2] == b"\x80\x04"
    _assert_equal(ckptio.load(p, weights_only=False), obj)
    _assert_equal(torch.load(p, weights_only=False), obj)
    for load in (torch.load, ckptio.load):
        with pytest.raises(pickle.UnpicklingError, match="Unsupported operand 149"):
            load(p, weights_only=True)


def test_a_save_inside_an_objects_pickling_does_not_hang(tmp_path):
    """torch pickles (pickle_protocol=4) under ckptio's lock on torch's config and
    its own skip_data; a ckptio.save in an object's __reduce__ waited for that
    lock for ever (and, let through, wrote its tensors without their bytes)."""
    from test_soundness import run_python

    code = f"""
        import io, torch, ckptio

        class Blob:
            def __init__(self):
                self.w = torch.arange(4.0)

            def __reduce__(self):
                buf = io.BytesIO()
                ckptio.save({{"w": self.w}}, buf)
                return (torch.load, (io.BytesIO(buf.getvalue()),), )

        p = {str(tmp_path / "c.pt")!r}
        for protocol in (2, 4):  # ckptio's pickler; torch's, under ckptio's skip_data
            ckptio.save({{"b": Blob()}}, p, pickle_protocol=protocol)
            print("saved", torch.load(p, weights_only=False)["b"]["w"].tolist())
    """
    run = run_python(code, tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # The inner save's bytes too (under ckptio's own skip_data it wrote none).
    assert run.stdout.split("\n")[:2] == ["saved [0.0, 1.0, 2.0, 3.0]"] * 2, run.stdout


def test_a_save_inside_an_objects_pickling_may_wait_for_another_threads_save(tmp_path):
    """An object's __reduce__ that hands a save to another thread and waits for it
    (a save queue): the other thread waited for ever on the lock of torch's config
    the outer save held while torch pickled. Both saves keep ckptio's settings
    (storages at 4 KiB, every CRC-32), and torch's config is restored after."""
    from test_soundness import run_python

    code = f"""
        import threading, torch, ckptio
        from torch.utils.serialization import config

        inner = {str(tmp_path / "inner.pt")!r}

        class Queued:
            def __reduce__(self):
                w = {{"w": torch.arange(8.0)}}
                kw = {{"pickle_protocol": 4}}
                t = threading.Thread(target=ckptio.save, args=(w, inner), kwargs=kw)
                t.start()
                t.join()
                return (int, (7,))

        torch.serialization.set_crc32_options(False)
        for protocol in (2, 4):
            p = {str(tmp_path / "outer.pt")!r}
            ckptio.save({{"q": Queued(), "v": torch.ones(1024)}}, p, pickle_protocol=protocol)
            q = torch.load(p, weights_only=False)["q"]
            w = torch.load(inner, weights_only=False)["w"].tolist()[-1]
            print(q, w, ckptio.verify(p).ok, ckptio.verify(inner).ok)
        print(config.save.storage_alignment, torch.serialization.get_crc32_options())
    """
    run = run_python(code, tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.split("\n")
    assert lines[:3] == ["7 7.0 True True", "7 7.0 True True", "64 False"], run.stdout


def test_a_read_only_checkpoint_is_not_replaced_and_a_folder_name_is_refused(tmp_path):
    """A file this process may not write (chmod a-w) is refused as torch.save's
    open() refuses it: a rename over it needs only the folder's permission, and
    it was replaced without a word. A path ending in "/" names a folder (it made a
    file of that name)."""
    import shutil

    code = f"""
        import os, torch, ckptio
        p = {str(tmp_path / "best.pt")!r}
        ckptio.save({{"best": torch.ones(2)}}, p)
        os.chmod(p, 0o444)
        for save in (torch.save, ckptio.save):
            try:
                save({{"best": torch.zeros(2)}}, p)
                print("saved")
            except (PermissionError, RuntimeError) as e:
                print("refused", type(e).__name__)
        print(torch.load(p)["best"].tolist(), oct(os.stat(p).st_mode & 0o777))
    """
    from test_soundness import run_python

    if os.geteuid() == 0:  # root writes any file: drop the capabilities that allow it
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv")
        import sys
        import textwrap

        run = subprocess.run(
            ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner",
             sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True, text=True, timeout=120,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        )  # fmt: skip
    else:
        run = run_python(code, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:3] == [
        "refused RuntimeError",
        "refused PermissionError",
        "[1.0, 1.0] 0o444",
    ], run.stdout
    with pytest.raises(IsADirectoryError):
        ckptio.save(sample(), str(tmp_path / "out") + "/")
    assert not (tmp_path / "out").exists()


def test_a_long_file_name_is_saved(tmp_path):
    """The temp file's suffix (~35 bytes) made names of 221-255 bytes unsavable;
    its copy of the target's name is cut to fit."""
    p = tmp_path / ("lr0.001_bs64_" * 18 + ".pt")  # 237 bytes
    assert len(p.name) > 230
    ckptio.save(sample(), p)
    same(torch.load(p), sample())
    ckptio.save(sample(), p)  # over it, too
    assert [q.name for q in tmp_path.iterdir()] == [p.name]


def test_records_and_listing_of_sparse_and_quantized_tensors(tmp_path):
    """Tensors torch does not make on the meta device (sparse COO and CSR,
    quantized): records and listing called such valid files corrupt."""
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    for t in (torch.eye(3).to_sparse(), torch.eye(3).to_sparse_csr(), q):
        p = tmp_path / "c.pt"
        ckptio.save({"t": t, "w": torch.ones(2)}, p)
        torch.load(p)
        recs = {r.name.split("/", 1)[1]: r for r in ckptio.records(p)}
        assert any(ti.name == "w" and ti.shape == (2,) for r in recs.values() for ti in r.tensors)
        assert ckptio.listing(p) is not None


def test_an_unknown_byte_order_is_the_value_error_torch_raises(tmp_path):
    """A byteorder record other than little or big: torch.load raises ValueError
    ("Unknown endianness type"); ckptio the same class (a FormatError too), naming
    the file and the record, on every load path."""
    p = tmp_path / "x.pt"
    sd = {"w": torch.arange(4.0)}
    buf = io.BytesIO()
    torch.save(sd, buf)
    import zipfile

    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(p, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"middle"
            dst.writestr(info, data)
    with pytest.raises(ValueError, match="Unknown endianness type: middle"):
        torch.load(p)
    for call in (
        lambda: ckptio.load(p),
        lambda: ckptio.load(p, weights_only=False),
        lambda: ckptio.load(p, out={"w": torch.zeros(4)}),
    ):
        with pytest.raises(ValueError, match="Unknown endianness type: middle") as ei:
            call()
        assert isinstance(ei.value, ckptio.FormatError)
        assert str(p) in str(ei.value) and "byteorder" in str(ei.value)


# --------------------------------------------------------------------------- review of 2026-12-07


class Summed:
    """Reads its tensor's values while the pickle is decoded (as a quantized
    Linear prepacks its weight in __setstate__)."""

    def __init__(self, t):
        self.t = t
        self.total = float(t.sum())

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.seen = float(self.t.sum())


def _read_by_the_engine(n: int) -> None:
    """The last load read its ``n`` storages with the engine, before torch.load
    decoded the pickle (not torch.load reading the file itself)."""
    rep = ckptio.last_report()
    reason = rep.direct_reason or ""
    assert "torch.load read it" not in reason, reason
    assert "before torch.load decoded the pickle" in reason, reason
    assert rep.read_source is not None and rep.storages == n and rep.nbytes > 0, rep


def test_classes_that_read_values_while_unpickling_see_the_bytes(tmp_path):
    # torch.load hands a class's __setstate__ (or reduce callable) storages that
    # hold their bytes: a quantized Linear prepacks (copies) its weight then. The
    # engine reads them all before torch.load runs (review of 2026-12-08).
    torch.manual_seed(0)
    qm = torch.ao.quantization.quantize_dynamic(
        torch.nn.Sequential(torch.nn.Linear(16, 4)), dtype=torch.qint8
    )
    ql = torch.ao.nn.quantized.Linear(16, 4)
    ql.set_weight_bias(
        torch.quantize_per_tensor(torch.randn(4, 16), 0.1, 0, torch.qint8), torch.randn(4)
    )
    x = torch.randn(3, 16)
    for i, obj in enumerate((qm, ql, {"s": Summed(torch.arange(1000.0))})):
        p = tmp_path / f"{i}.pt"
        torch.save(obj, p)
        want = torch.load(p, weights_only=False)
        got = ckptio.load(p, weights_only=False)
        _read_by_the_engine(len(_storage_records(p)))
        if isinstance(obj, dict):
            assert got["s"].seen == want["s"].seen == obj["s"].total
            continue
        if i == 1:
            x_in = torch.quantize_per_tensor(x, 0.05, 64, torch.quint8)
            assert torch.equal(got(x_in).int_repr(), want(x_in).int_repr())
            assert torch.equal(got.weight().int_repr(), want.weight().int_repr())
            assert torch.equal(got.bias(), want.bias())
        else:
            assert torch.equal(got(x), want(x))
            assert torch.equal(got[0].weight().int_repr(), want[0].weight().int_repr())
            assert torch.equal(got[0].bias(), want[0].bias())


def test_pickles_of_inert_globals_stay_on_the_engine(tmp_path):
    # A plain state dict, and a Lightning-style dict of tensors, ints and strings
    # with weights_only=False: the engine reads them, not torch.load.
    sd = {"w": torch.randn(256, 256), "b": torch.arange(10)}
    lightning = {"state_dict": sd, "epoch": 3, "name": "run", "opt": {"lr": 0.1}}
    for obj in (sd, lightning):
        p = tmp_path / "c.pt"
        torch.save(obj, p)
        for weights_only in (True, False):
            got = ckptio.load(p, weights_only=weights_only)
            assert "torch.load read it" not in (ckptio.last_report().direct_reason or "")
            assert ckptio.last_report().nbytes > 0
            want = got["state_dict"] if "state_dict" in got else got
            assert torch.equal(want["w"], sd["w"])


# --------------------------------------------------------------------------- review of 2026-12-08
# A pickle that may read tensor values as it decodes (a global outside torch's
# weights-only allow-list) keeps the engine: every storage is read first, then
# torch.load decodes the pickle over the filled storages.


class HParams(dict):
    """A user's hyperparameters class (as Lightning's AttributeDict: a dict subclass)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _storage_records(path) -> list[str]:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return [n for n in z.namelist() if "/data/" in n and not n.endswith("/")]


def _data_offset(path, name: str) -> int:
    """Where record ``name``'s bytes start in the zip at ``path``."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as z:
        head = z.getinfo(name).header_offset
    with open(path, "rb") as f:
        f.seek(head)
        local = f.read(30)
    n_name, n_extra = struct.unpack_from("<HH", local, 26)
    return head + 30 + n_name + n_extra


def _lightning_checkpoint():
    import argparse

    g = torch.Generator().manual_seed(5)
    sd = {}
    for i in range(120):  # many tensors, dtypes, sizes (some empty)
        dt = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        sd[f"layer{i}.weight"] = torch.randn(i % 7 * 13, 5, generator=g).to(dt)
    sd["embed"] = torch.randn(1000, 64, generator=g)
    return {
        "state_dict": sd,
        "hyper_parameters": HParams(lr=0.1, layers=[64, 64], args=argparse.Namespace(seed=3)),
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(7, generator=g)}}}],
        "epoch": 3,
    }


@pytest.mark.parametrize(
    "ml", [None, "cpu", torch.device("cpu"), {"cpu": "cpu"}], ids=["none", "str", "device", "dict"]
)
def test_a_lightning_checkpoint_with_a_user_class_loads_through_the_engine(tmp_path, ml):
    ckpt, p = _lightning_checkpoint(), tmp_path / "l.ckpt"
    torch.save(ckpt, p)
    want = torch.load(p, map_location=ml, weights_only=False)
    got = ckptio.load(p, map_location=ml, weights_only=False)
    _read_by_the_engine(sum(1 for t in ckpt["state_dict"].values() if t.numel()) + 1)
    _assert_equal(got["state_dict"], want["state_dict"])
    assert type(got["hyper_parameters"]) is HParams
    assert got["hyper_parameters"] == want["hyper_parameters"]
    assert got["hyper_parameters"].args.seed == 3 and got["epoch"] == 3
    opt = got["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(opt, want["optimizer_states"][0]["state"][0]["exp_avg"])


def test_shared_storages_and_views_stay_shared_when_filled_first(tmp_path):
    base = torch.arange(100.0)
    obj = {
        "base": base,
        "view": base[10:20],  # a view at an offset
        "strided": base.view(10, 10)[:, 3],
        "s": Summed(base[50:]),  # the class's tensor views the same storage
        "args": HParams(tied=base[90:]),
    }
    p = tmp_path / "t.pt"
    torch.save(obj, p)
    want = torch.load(p, weights_only=False)
    got = ckptio.load(p, weights_only=False)
    _read_by_the_engine(1)
    ptr = got["base"].untyped_storage().data_ptr()
    for k, t in (("view", got["view"]), ("strided", got["strided"]), ("s", got["s"].t)):
        assert t.untyped_storage().data_ptr() == ptr, k
    assert got["args"]["tied"].untyped_storage().data_ptr() == ptr
    assert got["view"].storage_offset() == 10 and got["strided"].stride() == (10,)
    assert got["s"].seen == want["s"].seen == obj["s"].total
    for k in ("base", "view", "strided"):
        assert torch.equal(got[k], want[k]), k
    got["base"][12] = -1.0  # one storage: the view sees it
    assert got["view"][2] == -1.0


def test_verify_checks_the_records_of_a_load_filled_first(tmp_path):
    obj = {"s": Summed(torch.arange(1000.0)), "w": torch.randn(4096)}
    p = tmp_path / "v.pt"
    torch.save(obj, p)
    got = ckptio.load(p, weights_only=False, verify=True)
    _read_by_the_engine(2)
    rep = ckptio.last_report()
    assert rep.verified and not rep.unchecked, rep
    assert got["s"].seen == obj["s"].total and torch.equal(got["w"], obj["w"])
    name = next(n for n in _storage_records(p) if os.path.basename(n) == "1")
    at = _data_offset(p, name) + 100
    with open(p, "r+b") as f:  # a flipped bit in a storage's bytes
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 1]))
    with pytest.raises(ckptio.FormatError, match="corrupt"):
        ckptio.load(p, weights_only=False, verify=True)


@pytest.mark.parametrize("how", ["reversed", "equal sizes swapped", "one left out"])
def test_a_scan_that_disagrees_with_torch_load_falls_back_to_it(tmp_path, monkeypatch, how):
    # The k-th storage torch.load hands over must be the scan's k-th (same size,
    # location and place in the file): anything else never gives a tensor the
    # bytes of another record; torch.load reads the file instead.
    import dataclasses

    from ckptio.formats import torchzip

    g = torch.Generator().manual_seed(9)
    obj = {
        "s": Summed(torch.arange(1000.0)),
        "a": torch.randn(64, generator=g),
        "b": torch.randn(64, generator=g),
        "c": torch.randn(3, generator=g),
    }
    p = tmp_path / "m.pt"
    torch.save(obj, p)
    scan = torchzip.scan_pickle

    def edited(archive):
        got = scan(archive)
        st = list(got.storages)
        assert [x.nbytes for x in st] == [4000, 256, 256, 12]  # torch.load's order
        if how == "reversed":
            st.reverse()
        elif how == "equal sizes swapped":
            st[1], st[2] = st[2], st[1]
        else:
            st.pop()
        return dataclasses.replace(got, storages=st)

    monkeypatch.setattr(torchzip, "scan_pickle", edited)
    want = torch.load(p, weights_only=False)
    got = ckptio.load(p, weights_only=False)
    reason = ckptio.last_report().direct_reason
    assert "torch.load read it" in reason and "not the scan's" in reason, reason
    assert got["s"].seen == want["s"].seen == obj["s"].total
    for k in "abc":
        assert torch.equal(got[k], want[k]), k


def test_a_damaged_archive_filled_first_is_a_format_error(tmp_path):
    obj = {"s": Summed(torch.arange(1000.0)), "w": torch.ones(16)}
    pkl, data = _saved_pickle(tmp_path / "c.pt", obj)
    cases = {
        "missing record": {k: v for k, v in data.items() if k != "1"},
        "short record": {**data, "1": data["1"][:32]},
    }
    for name, records in cases.items():
        p = tmp_path / f"{name}.pt"
        _with_pickle(p, pkl, records)
        with pytest.raises(ckptio.FormatError):
            ckptio.load(p, weights_only=False)
    p = tmp_path / "cut.pt"
    torch.save(obj, p)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)
    with pytest.raises(ckptio.FormatError):
        ckptio.load(p, weights_only=False)


def test_a_pickle_weights_only_refuses_reads_no_storage(tmp_path, monkeypatch):
    # torch.load(weights_only=True) refuses the class before it needs any bytes:
    # the engine reads nothing first.
    import ckptio.serialization as ser

    def no_read(*a, **k):
        raise AssertionError("read before a refusal")

    monkeypatch.setattr(ser, "_read_storages", no_read, raising=False)
    p = tmp_path / "r.pt"
    torch.save({"s": Summed(torch.arange(10.0))}, p)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        ckptio.load(p, weights_only=True)


def test_python_2_names_of_allowed_globals_are_told_as_torch_tells_them(tmp_path):
    # Protocol 2 writes a set as __builtin__.set, which torch's unpicklers read as
    # builtins.set (allowed, inert): the engine reads the file (it went to torch.load).
    p = tmp_path / "s.pt"
    torch.save({"w": torch.arange(5.0), "s": {1, 2}}, p)
    for weights_only in (True, False):
        got = ckptio.load(p, weights_only=weights_only)
        assert "torch.load read it" not in ckptio.last_report().direct_reason
        assert got["s"] == {1, 2} and torch.equal(got["w"], torch.arange(5.0))


@pytest.mark.gpu
def test_gpu_classes_that_read_values_are_filled_on_the_device(tmp_path):
    obj = {"s": Summed(torch.arange(1000.0)), "w": torch.randn(4096)}
    p = tmp_path / "g.pt"
    torch.save(obj, p)
    for ml in ("cuda", torch.device("cuda:0"), {"cpu": "cuda:0"}):
        got = ckptio.load(p, map_location=ml, weights_only=False)
        _read_by_the_engine(2)
        assert got["s"].t.is_cuda and got["s"].seen == obj["s"].total
        assert torch.equal(got["w"].cpu(), obj["w"])


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
def test_legacy_files_of_every_pickle_protocol_load_as_torch_loads_them(tmp_path, protocol):
    # torch reads any file that is no zip archive as its legacy format: protocols
    # 4 and 5 start with a FRAME, 1 with no PROTO at all.
    sd, p = sample(), tmp_path / "legacy.pt"
    torch.save(sd, p, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    for weights_only in (True, False):
        if weights_only and protocol in (1, 4, 5):
            # torch's weights-only unpickler knows no LONG (1) nor FRAME (4, 5): refused alike
            with pytest.raises(pickle.UnpicklingError, match="Unsupported operand"):
                torch.load(p, weights_only=True)
            with pytest.raises(pickle.UnpicklingError, match="Unsupported operand"):
                ckptio.load(p, weights_only=True)
            continue
        same(ckptio.load(p, weights_only=weights_only), torch.load(p, weights_only=weights_only))
        with open(p, "rb") as f:
            same(ckptio.load(f, weights_only=weights_only), sd)
    from ckptio.formats import detect

    with pytest.raises(ckptio.FormatError, match="legacy torch.save file"):
        detect.detect(p)  # ckptio's commands say what it is


def test_garbage_is_refused_as_torch_load_refuses_it_and_named(tmp_path):
    # A file that is neither a zip archive nor a pickle: torch.load raises
    # UnpicklingError; ckptio the same class, a FormatError naming the file too.
    p = tmp_path / "junk.pt"
    p.write_bytes(b"\x93\x11 not any checkpoint format" * 3)
    for weights_only in (True, False):
        with pytest.raises(pickle.UnpicklingError):
            torch.load(p, weights_only=weights_only)
        with pytest.raises(pickle.UnpicklingError) as e:
            ckptio.load(p, weights_only=weights_only)
        assert isinstance(e.value, ckptio.FormatError) and str(p) in str(e.value)
    from ckptio.formats import detect

    with pytest.raises(ckptio.FormatError, match="not a checkpoint ckptio reads"):
        detect.detect(p)


def _raises_as_torch(call_torch, call_ours):
    """Both calls raise, the same class and message (ours may add the file after it)."""
    with pytest.raises(Exception) as theirs:
        call_torch()
    with pytest.raises(Exception) as ours:
        call_ours()
    assert type(ours.value) is type(theirs.value), (ours.value, theirs.value)
    assert str(ours.value).startswith(str(theirs.value)[:60])


def test_errors_of_the_callers_code_and_arguments_pass_as_torch_raises_them(tmp_path):
    # Only a damaged file is a FormatError: a class that is gone, the caller's
    # map_location raising, an unknown pickle argument, mmap with a buffer or a
    # map_location torch cannot restore to are torch.load's errors, unchanged.
    import sys
    import types

    mod = types.ModuleType("ckptio_gone_mod")
    exec("class Gone:\n    pass\n", mod.__dict__)
    mod.Gone.__module__ = "ckptio_gone_mod"
    sys.modules["ckptio_gone_mod"] = mod
    gone = tmp_path / "gone.pt"
    try:
        torch.save({"g": mod.Gone(), "w": torch.ones(2)}, gone)
    finally:
        del sys.modules["ckptio_gone_mod"]
    p = tmp_path / "c.pt"
    torch.save(sample(), p)

    def boom(storage, location):
        raise KeyError("the caller's")

    cases = [
        (gone, dict(weights_only=False)),
        (p, dict(map_location=boom)),
        (p, dict(map_location=boom, weights_only=False)),
        (p, dict(fix_imports=False)),
        (p, dict(bogus=1)),
        (None, dict(mmap=True)),
        (p, dict(mmap=True, map_location=3)),
        (p, dict(mmap=True, map_location="bogus")),
        (p, dict(mmap=True, map_location="cpu:0")),
        (p, dict(mmap=True, map_location={"cpu": 0})),
    ]
    data = p.read_bytes()
    for src, kw in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pickle_load_args with weights_only
            _raises_as_torch(
                lambda src=src, kw=kw: torch.load(src or io.BytesIO(data), **kw),
                lambda src=src, kw=kw: ckptio.load(src or io.BytesIO(data), **kw),
            )


def test_save_to_a_path_torch_cannot_write_is_the_runtime_error_torch_raises(tmp_path):
    # torch.save raises RuntimeError for a missing parent folder, a folder and an
    # empty name; ckptio keeps its OSError (or ValueError) class, a RuntimeError too.
    (tmp_path / "adir").mkdir()
    cases = [
        (tmp_path / "nodir" / "x.pt", FileNotFoundError),
        (tmp_path / "adir", IsADirectoryError),
        ("", ValueError),
    ]
    for dst, ours in cases:
        with pytest.raises(RuntimeError):
            torch.save({"a": torch.ones(2)}, dst)
        for kw in ({}, {"pickle_protocol": 4}):  # ckptio's pickle, and torch's
            with pytest.raises(RuntimeError) as e:
                ckptio.save({"a": torch.ones(2)}, dst, **kw)
            assert isinstance(e.value, ours) and isinstance(e.value, ckptio.CkptioError)
            assert not dst or str(dst) in str(e.value) or str(dst.parent) in str(e.value)


def test_hostile_nesting_in_a_pickle_is_refused_or_read_without_recursion(tmp_path):
    """A review of 2026-12-07: a dict key of 300,000 nested tuples overflowed the
    native reader's stack (SIGSEGV), a key made of 60 memoized pairs of itself
    (a 450-byte pickle) took 2^60 steps, and a value nested 5,000 deep (which
    torch.load reads) raised RecursionError in ckptio.records."""
    import subprocess
    import sys

    from ckptio import _native

    dag = b"\x80\x02}N" + b"q\x00h\x00\x86" * 60 + b"Ns."
    assert _native.unpickle(dag) is None  # refused at once: torch.load decides
    # (in a process of its own: a stack overflow kills it)
    code = (
        "from ckptio import _native; "
        "assert _native.unpickle(b'\\x80\\x02}N' + b'\\x85' * 300_000 + b'Ns.') is None"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert got.returncode == 0, got.stderr.decode()[-2000:]
    p = tmp_path / "nested.pt"
    sd = {"w": torch.arange(6.0)}
    pkl, data = _saved_pickle(p, sd)
    # {'w': tensor, 'n': ((((None,),),)...)}: 5,000 levels as the value of 'n'.
    _with_pickle(p, pkl[:-1] + b"X\x01\x00\x00\x00nN" + b"\x85" * 5000 + b"s.", data)
    want = torch.load(p, weights_only=True)
    got = ckptio.load(p)
    assert torch.equal(got["w"], want["w"])
    names = [t.name for r in ckptio.records(p) for t in r.tensors]
    assert names == ["w"]


def _rezipped(src, dst, compression: int = 0, folders: bool = False, extra: str = "") -> None:
    """``src``'s records zipped again as a zip tool would: ``compression``,
    folder entries listed (``zip -r``), one more record named ``extra``."""
    import zipfile

    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", compression) as zo:
        names = zi.namelist()
        if folders:
            for d in sorted({n.rsplit("/", 1)[0] + "/" for n in names}, key=len):
                zo.writestr(zipfile.ZipInfo(d), b"")  # a name ending in "/": a folder
        for n in names:
            zo.writestr(n, zi.read(n))
        if extra:
            zo.writestr(extra, b"notes")


def test_an_archive_zipped_again_with_its_folders_listed_loads_as_torch_loads_it(tmp_path):
    """Info-ZIP's ``zip -r`` of an unzipped checkpoint lists its folders
    ("m/", "m/data/"); torch.load reads it, and so does every load of ckptio."""
    src, p = tmp_path / "m.pt", tmp_path / "folders.pt"
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), src)
    _rezipped(src, p, folders=True)
    want = torch.load(p)
    same(ckptio.load(p, verify=True), want)
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    same(ckptio.load(p, out=out), want)
    ckptio.load_state_dict(torch.nn.Linear(3, 2), p)
    ckptio.verify(p).raise_if_bad()


def test_records_a_zip_tool_compressed_load_through_torch_and_verify(tmp_path):
    """torch's reader inflates deflated records; ckptio.load hands such a file
    to torch.load, verify=True checks its CRC-32s first, and mmap=True (where
    torch.load would hand back the compressed bytes as values) is refused."""
    import zipfile

    src, p = tmp_path / "orig.pt", tmp_path / "deflated.pt"
    sd = {"w": torch.arange(600.0).reshape(20, 30), "b": torch.ones(2)}
    torch.save(sd, src)
    _rezipped(src, p, zipfile.ZIP_DEFLATED)
    same(ckptio.load(p), sd)
    assert "torch.load read it" in str(ckptio.last_report())
    same(ckptio.load(p, verify=True, map_location="cpu"), sd)
    rep = ckptio.verify(p)
    assert rep.ok and {r.state for r in rep.records} == {"ok"} and len(rep.records) > 3, rep
    with pytest.raises(ckptio.FormatError, match="mmap=True cannot map storage records compressed"):
        ckptio.load(p, mmap=True)
    # What ckptio reads itself names the cause, not a damaged file.
    with pytest.raises(ckptio.FormatError, match="torch.load reads it") as ei:
        ckptio.load(p, out={k: torch.zeros_like(v) for k, v in sd.items()})
    assert "corrupted" not in str(ei.value)
    # A flipped bit in the compressed bytes: the CRC-32 check names the record.
    data = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as z:
        info = z.getinfo(f"{z.namelist()[0].split('/')[0]}/data/0")
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
    data[at] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(ckptio.FormatError, match="data/0"):
        ckptio.load(p, verify=True)
    with pytest.raises(ckptio.FormatError, match="data/0"):
        ckptio.load(p)  # torch's reader would not have checked
    bad = [r.name for r in ckptio.verify(p).records if r.state == "mismatch"]
    assert len(bad) == 1 and bad[0].endswith("data/0"), bad


def test_a_record_outside_the_archives_folder_is_refused_as_torch_load_refuses_it(tmp_path):
    src, p = tmp_path / "orig.pt", tmp_path / "notes.pt"
    torch.save({"w": torch.ones(3)}, src)
    _rezipped(src, p, extra="notes/readme.txt")
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        torch.load(p)
    for kw in ({}, {"verify": True}, {"out": {"w": torch.zeros(3)}}):
        with pytest.raises(ckptio.FormatError, match="not in a subdirectory orig/: .notes/readme"):
            ckptio.load(p, **kw)


def test_verify_of_a_file_in_torchs_legacy_format_says_it_holds_no_crc(tmp_path):
    p = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False)
    same(ckptio.load(p), {"w": torch.ones(3)})
    with pytest.raises(ValueError, match="legacy format.*stores no CRC-32"):
        ckptio.load(p, verify=True)


def test_a_map_location_callable_returning_no_storage_is_the_callers_type_error(tmp_path):
    """torch.load raises TypeError deep in its code; ckptio says what was returned,
    as a TypeError too, never that the file is damaged."""
    p = tmp_path / "c.pt"
    torch.save({"w": torch.arange(4.0)}, p)
    with pytest.raises(TypeError):
        torch.load(p, map_location=lambda s, loc: "cpu")
    with pytest.raises(ckptio.MapLocationError, match="map_location returned str") as ei:
        ckptio.load(p, map_location=lambda s, loc: "cpu")
    assert isinstance(ei.value, TypeError) and "corrupted" not in str(ei.value)
    same(ckptio.load(p, map_location=lambda s, loc: None), {"w": torch.arange(4.0)})


@pytest.mark.parametrize("content", [b"", b"\x80\x02"], ids=["empty", "cut-pickle"])
def test_an_empty_or_cut_file_is_an_eof_error_as_torch_load_raises(tmp_path, content):
    p = tmp_path / "c.pt"
    p.write_bytes(content)
    with pytest.raises(EOFError):
        torch.load(p)
    with pytest.raises(ckptio.PickleEndError, match="c.pt: .*ends early") as ei:
        ckptio.load(p)
    assert isinstance(ei.value, (EOFError, ckptio.FormatError))


def test_deflated_pickle_stored_storages_map_and_a_deflated_archive_verifies_its_pickle(tmp_path):
    """mmap=True is refused only where a storage record is compressed (a
    deflated data.pkl alone maps as torch maps it); verify of a deflated
    archive checks what load decodes, as for a stored one."""
    import zipfile

    src, p = tmp_path / "orig.pt", tmp_path / "pkl-deflated.pt"
    sd = {"w": torch.arange(600.0)}
    torch.save(sd, src)
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(p, "w") as zo:
        for n in zi.namelist():
            method = zipfile.ZIP_DEFLATED if n.endswith("data.pkl") else zipfile.ZIP_STORED
            zo.writestr(n, zi.read(n), compress_type=method)
    same(torch.load(p, mmap=True), sd)
    same(ckptio.load(p, mmap=True), sd)
    # A deflated archive whose pickle names a storage it lacks: not ok.
    holed = tmp_path / "holed.pt"
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(holed, "w", zipfile.ZIP_DEFLATED) as zo:
        for n in zi.namelist():
            if not n.endswith("/data/0"):
                zo.writestr(n, zi.read(n))
    rep = ckptio.verify(holed)
    assert not rep.ok and "data/0" in (rep.error or ""), rep


def test_a_cut_legacy_file_names_no_record(tmp_path):
    p = tmp_path / "leg.pt"
    torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False)
    p.write_bytes(p.read_bytes()[:40])
    with pytest.raises(EOFError) as ei:
        ckptio.load(p)
    assert "record data.pkl" not in str(ei.value) and "()" not in str(ei.value), ei.value
