"""The Lightning CheckpointIO plugins: a tiny model trained on CPU, checkpointed
through ckptio, resumed, and the weights equal to an uninterrupted run."""

import dataclasses
import importlib
import os
import sys
import time
import warnings

import ckptio
import pytest
import torch

L = pytest.importorskip("lightning")
from ckptio.lightning import AsyncCkptioCheckpointIO, CkptioCheckpointIO  # noqa: E402
from ckptio.state_dict import _Lazy, lazy_load  # noqa: E402

PLUGINS = {"sync": CkptioCheckpointIO, "async": AsyncCkptioCheckpointIO}


class Tiny(L.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 4, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)  # 3 steps an epoch


def fit(root, epochs, plugin=None, ckpt_path=None, seed=0):
    model = Tiny(seed)
    trainer = L.Trainer(
        plugins=[plugin] if plugin is not None else None,
        max_epochs=epochs,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        accelerator="cpu",
        devices=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers etc.
        trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model, trainer


@pytest.mark.parametrize("kind", sorted(PLUGINS))
def test_trainer_saves_and_resumes_through_ckptio(tmp_path, kind, monkeypatch):
    loads = []

    def spy(path, *a, **kw):
        loads.append(path)
        return ckptio.load(path, *a, **kw)

    def lazy_spy(path, **kw):
        loads.append(path)
        return lazy_load(path, **kw)

    monkeypatch.setattr(ckptio.lightning, "load", spy)
    monkeypatch.setattr(ckptio.lightning, "lazy_load", lazy_spy)
    monkeypatch.setattr(ckptio.state_dict, "LAZY_MIN_BYTES", 0)  # every tensor read on use
    ref, _ = fit(tmp_path / "ref", 2, PLUGINS[kind]())
    # epoch 2's checkpoint replaced epoch 1's (ModelCheckpoint calls remove_checkpoint)
    names = sorted(p.name for p in (tmp_path / "ref" / "checkpoints").iterdir())
    assert names == ["epoch=1-step=6.ckpt"]
    _, t1 = fit(tmp_path / "run", 1, PLUGINS[kind](threads=2))
    ckpt = tmp_path / "run" / "checkpoints" / "epoch=0-step=3.ckpt"
    assert ckpt.exists() and t1.checkpoint_callback.best_model_path == str(ckpt)
    # a ckptio file (large storages 4 KiB-aligned, small ones packed) that plain torch reads
    from ckptio.formats.torchzip import PACK_BELOW

    assert all(
        r.offset % (4096 if r.nbytes >= PACK_BELOW else 64) == 0
        for r in ckptio.records(ckpt, weights_only=False)
        if "/data/" in r.name
    )
    assert torch.load(ckpt, weights_only=False)["global_step"] == 3
    resumed, _ = fit(tmp_path / "run", 2, PLUGINS[kind](), ckpt_path=str(ckpt), seed=123)
    assert loads == [str(ckpt)]  # the resume read it through ckptio
    for (k, a), (_, b) in zip(ref.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_resume_is_in_place_and_reads_on_use(tmp_path, monkeypatch):
    """The restore path: LightningModule.load_state_dict copies each large tensor
    straight from the file into its parameter, Optimizer.load_state_dict moves
    each state tensor straight into its new one; other uses read once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 600), torch.nn.Linear(600, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    p = tmp_path / "c.ckpt"
    extra = torch.arange(300_000.0)
    io = CkptioCheckpointIO()
    io.save_checkpoint(
        {
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
            "extra": extra,
            "view": extra[10:20],
            "epoch": 3,
        },
        p,
    )
    ckpt = io.load_checkpoint(p)
    sd = ckpt["state_dict"]
    assert isinstance(sd["0.weight"], _Lazy) and not isinstance(sd["0.bias"], _Lazy)  # 1.2 MB
    assert sd["0.weight"].shape == (600, 512) and sd["0.weight"].dtype == torch.float32
    # A storage two tensors share is read at once and stays shared.
    assert not isinstance(ckpt["extra"], _Lazy) and ckpt["view"]._base is None
    assert ckpt["view"].untyped_storage().data_ptr() == ckpt["extra"].untyped_storage().data_ptr()
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 600), torch.nn.Linear(600, 4))
    w = fresh[0].weight.data_ptr()
    fresh.load_state_dict(sd)
    assert fresh[0].weight.data_ptr() == w
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert sd["0.weight"]._real is None  # read straight into the parameter
    opt2 = torch.optim.Adam(fresh.parameters())
    opt2.load_state_dict(ckpt["optimizer_states"][0])
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        for k in a:
            assert type(b[k]) is torch.Tensor and torch.equal(a[k], b[k]), k
    # Any other use reads it (once) and answers as a loaded tensor would.
    lz = sd["0.weight"]
    assert torch.equal(lz + 1, model[0].weight + 1) and lz._real is not None
    assert torch.equal(torch.load(_saved(tmp_path, lz)), model[0].weight)
    assert ckpt["epoch"] == 3
    eager = CkptioCheckpointIO(in_place=False).load_checkpoint(p)
    assert type(eager["state_dict"]["0.weight"]) is torch.Tensor


def _saved(tmp_path, t):
    torch.save(t, tmp_path / "t.pt")
    return tmp_path / "t.pt"


def test_load_defaults(tmp_path):
    io = CkptioCheckpointIO()
    p = tmp_path / "sub" / "c.ckpt"
    io.save_checkpoint({"w": torch.ones(3), "hparams": {"lr": 0.1}, "obj": Tiny}, p)
    out = io.load_checkpoint(p, weights_only=False)  # a class in the pickle is fine
    assert out["obj"] is Tiny and out["w"].device.type == "cpu"
    # Lightning passes weights_only=None unless told: torch.load's default decides, as
    # in Lightning's TorchCheckpointIO (it refuses the class; it took it before).
    from lightning.fabric.plugins import TorchCheckpointIO

    for plugin in (TorchCheckpointIO(), io, CkptioCheckpointIO(in_place=False)):
        for weights_only in (None, True):
            with pytest.raises(Exception, match="weights_only|Unsupported|global"):
                plugin.load_checkpoint(p, weights_only=weights_only)
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, p, storage_options={"x": 1})
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "nope.ckpt")
    io.remove_checkpoint(p)
    assert not p.exists()
    io.remove_checkpoint(p)  # gone already: fine


def test_async_snapshots_before_returning_and_reports_errors(tmp_path):
    io = AsyncCkptioCheckpointIO()
    t = torch.zeros(1 << 20)
    p = tmp_path / "a.ckpt"
    io.save_checkpoint({"t": t, "same": t, "step": 1}, p)
    t.add_(1)  # training goes on at once
    out = io.load_checkpoint(p)  # waits for the pending save
    assert torch.equal(out["t"], torch.zeros(1 << 20)) and out["same"] is out["t"]
    io.remove_checkpoint(p)
    io.wait()
    assert not p.exists()
    (tmp_path / "file").write_text("x")
    io.save_checkpoint({"t": t}, tmp_path / "file" / "b.ckpt")  # under a file: fails later
    with pytest.raises(OSError):
        io.teardown()
    io.teardown()  # the error was reported once; nothing pending


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "ckptio.lightning", raising=False)
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "lightning", None)
    with pytest.raises(ImportError, match=r"ckptio\[lightning\]"):
        importlib.import_module("ckptio.lightning")


# ------------------------------------------------------------------- review of 2026-12-06, later


def test_a_failed_async_save_keeps_the_checkpoint_it_would_replace(tmp_path, monkeypatch):
    """ModelCheckpoint saves the new checkpoint, then removes the old one: where
    the background save failed, the removal queued behind it still ran and no
    checkpoint was left (a synchronous save raises before the removal)."""
    import ckptio.lightning as cl

    real, calls = cl.save, []

    def full_disk(obj, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            time.sleep(0.5)  # the disk fills up partway: the removal is queued by then
            raise OSError(28, "No space left on device (injected)", path)
        return real(obj, path, **kw)

    monkeypatch.setattr(cl, "save", full_disk)
    io = AsyncCkptioCheckpointIO()
    old, new = tmp_path / "step=1.ckpt", tmp_path / "step=2.ckpt"
    io.save_checkpoint({"w": torch.ones(2)}, old)
    io.wait()
    io.save_checkpoint({"w": torch.full((2,), 2.0)}, new)  # fails in the background
    io.remove_checkpoint(old)  # queued behind it
    with pytest.raises(OSError, match="No space"):
        io.teardown()
    assert old.exists() and not new.exists()
    assert torch.equal(torch.load(old)["w"], torch.ones(2))


@dataclasses.dataclass
class Ema:
    weights: torch.Tensor


class Box:
    def __init__(self, t):
        self.t = t


def test_the_async_snapshot_copies_tensors_anywhere_in_the_checkpoint(tmp_path):
    """Tensors in a dataclass or another object (a callback's state) were
    pickled later, with training's changes in them."""
    ema, box = Ema(torch.zeros(4)), Box(torch.zeros(3))
    io = AsyncCkptioCheckpointIO()
    p = tmp_path / "c.ckpt"
    io.save_checkpoint({"callbacks": {"ema": ema, "box": box}, "size": torch.Size([2])}, p)
    ema.weights.add_(1)
    box.t.add_(1)
    out = io.load_checkpoint(p, weights_only=False)  # objects of the test's classes
    assert torch.equal(out["callbacks"]["ema"].weights, torch.zeros(4))
    assert torch.equal(out["callbacks"]["box"].t, torch.zeros(3))
    assert type(out["size"]) is torch.Size
    io.teardown()


def test_a_failure_no_call_reported_is_printed_at_exit(tmp_path):
    """A save after fit (no teardown follows) that failed was dropped silently."""
    (tmp_path / "file").write_text("x")
    script = (
        "import torch\n"
        "from ckptio.lightning import AsyncCkptioCheckpointIO\n"
        "io = AsyncCkptioCheckpointIO()\n"
        f"io.save_checkpoint({{'w': torch.ones(2)}}, {str(tmp_path / 'file' / 'c.ckpt')!r})\n"
    )
    import subprocess

    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "ckptio.lightning: a background save failed" in r.stderr, r.stderr[-2000:]


def test_meta_map_location_loads_as_torch_checkpoint_io(tmp_path):
    io = CkptioCheckpointIO()
    p = tmp_path / "c.ckpt"
    io.save_checkpoint({"w": torch.ones(3), "step": 1}, p)
    for where in ("meta", torch.device("meta")):
        out = io.load_checkpoint(p, map_location=where)
        assert out["w"].device.type == "meta" and out["w"].shape == (3,)


def test_object_urls_are_saved_loaded_and_removed(tmp_path, s3, monkeypatch):
    """s3:// paths: the sync plugin made a local ./s3:/bucket/... tree, could not
    load what it saved (FileNotFoundError) and never removed an object."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    io = CkptioCheckpointIO()
    url = s3.url("lightning", "epoch=0.ckpt")
    io.save_checkpoint({"w": torch.ones(4), "step": 1}, url)
    assert os.listdir(tmp_path) == []
    out = io.load_checkpoint(url)
    assert out["step"] == 1 and torch.equal(out["w"], torch.ones(4))
    io.remove_checkpoint(url)
    with pytest.raises(FileNotFoundError):
        ckptio.load(url)


# ------------------------------------------------------------------- review of the APIs replaced


@pytest.mark.parametrize("change", ["remove", "save over"])
def test_a_kept_lazy_tensor_reads_after_the_path_is_removed_or_replaced(tmp_path, change):
    """A large tensor kept from load_checkpoint (a hook's stash) raised "written
    again in place" once the path was removed (save_top_k=1) or saved over
    (last.ckpt: a new file renamed over it): each changes only the held file's
    ctime, and leaves it without a name; TorchCheckpointIO returns the data."""
    io = CkptioCheckpointIO()
    p = tmp_path / "last.ckpt"
    w = torch.randn(512, 1024)  # 2 MiB: read on use
    io.save_checkpoint({"ema": w}, p)
    ck = io.load_checkpoint(p)
    assert isinstance(ck["ema"], _Lazy)
    if change == "remove":
        io.remove_checkpoint(p)
    else:
        io.save_checkpoint({"ema": w * 2}, p)
    assert torch.equal(ck["ema"], w)
    if change == "save over":
        assert torch.equal(io.load_checkpoint(p)["ema"], w * 2)


@pytest.mark.parametrize("change", ["rewrite, mtime set back", "chmod"])
def test_a_kept_lazy_tensor_refuses_a_file_that_may_have_been_rewritten(tmp_path, change):
    """A same-size rewrite in place whose mtime is set back (rsync --inplace -t,
    touch -r) moves only the change time: the kept tensor refuses to read
    (it read the new bytes silently when only size and mtime were compared; a
    review of 2026-12-07). A chmod looks the same from the file: refused too."""
    io = CkptioCheckpointIO()
    p = tmp_path / "last.ckpt"
    w = torch.randn(512, 1024)  # 2 MiB: read on use
    io.save_checkpoint({"ema": w}, p)
    ck = io.load_checkpoint(p)
    st = os.stat(p)
    time.sleep(0.01)
    if change == "chmod":
        os.chmod(p, 0o600)
    else:
        raw = bytearray(p.read_bytes())
        at = raw.find(w[0, :4].numpy().tobytes())
        raw[at : at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
        with open(p, "r+b") as f:
            f.write(raw)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(p).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ckptio.CkptioError, match="written again in place"):
        ck["ema"].sum()


def test_file_urls_are_local_paths_and_other_schemes_go_to_lightnings_plugin(tmp_path, monkeypatch):
    """file:///x/last.ckpt was saved into ./file:/x/... under the working folder;
    memory:// (fsspec) loads raised FileNotFoundError and removals did nothing.
    ckptio writes neither: the plugin hands such URLs to TorchCheckpointIO."""
    fsspec = pytest.importorskip("fsspec")
    monkeypatch.chdir(tmp_path)
    io = CkptioCheckpointIO()
    target = tmp_path / "run" / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(2)}, f"file://{target}")
    assert os.listdir(tmp_path) == ["run"] and target.is_file()
    assert torch.equal(io.load_checkpoint(f"file://{target}")["w"], torch.ones(2))
    io.remove_checkpoint(f"file://{target}")
    assert not target.exists()

    mem = fsspec.filesystem("memory")
    url = "memory://ckptio-test/x.ckpt"
    for plugin in (io, AsyncCkptioCheckpointIO()):
        plugin.save_checkpoint({"w": torch.full((2,), 3.0)}, url)
        assert torch.equal(plugin.load_checkpoint(url)["w"], torch.full((2,), 3.0))
        plugin.remove_checkpoint(url)
        if isinstance(plugin, AsyncCkptioCheckpointIO):
            plugin.teardown()
        assert not mem.exists("/ckptio-test/x.ckpt")
    assert os.listdir(tmp_path) == ["run"]


def test_a_save_after_a_failed_async_save_is_queued_and_teardown_raises_again(tmp_path):
    """The save after a failed one raised the failure and was dropped, and
    teardown then raised nothing: Lightning's AsyncCheckpointIO queues the new
    save, then raises, and raises again at teardown."""
    from concurrent.futures import wait

    io = AsyncCkptioCheckpointIO()
    (tmp_path / "file").write_text("x")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "file" / "sub" / "a.ckpt")  # fails
    wait(list(io._pending))  # (ended: the next call sees the failure)
    with pytest.raises(NotADirectoryError):
        io.save_checkpoint({"w": torch.full((2,), 2.0)}, tmp_path / "b.ckpt")
    with pytest.raises(NotADirectoryError):
        io.teardown()
    assert torch.equal(torch.load(tmp_path / "b.ckpt")["w"], torch.full((2,), 2.0))
    io.teardown()  # raised again once: not for ever


def test_async_saves_meta_tensors_as_they_are(tmp_path):
    """The async snapshot copied every tensor to the host: "Cannot copy out of
    meta tensor"; the sync plugin and Lightning's AsyncCheckpointIO save them."""
    io = AsyncCkptioCheckpointIO()
    p = tmp_path / "m.ckpt"
    io.save_checkpoint({"x": torch.empty(3, device="meta"), "w": torch.ones(2)}, p)
    io.teardown()
    out = torch.load(p)
    assert out["x"].device.type == "meta" and out["x"].shape == (3,)
    assert torch.equal(out["w"], torch.ones(2))
