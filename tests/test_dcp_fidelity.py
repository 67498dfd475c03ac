"""ckptio.dcp takes torch's FileSystemWriter/Reader arguments with their meaning (issue 20):
``_extensions`` (stream transforms: torch's ZStandard, compressed in Rust; any other
through torch's own code) and ``serialization_format``; checkpoints cross both ways."""

import io
import os
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import FileSystemReader, FileSystemWriter
from test_dcp import assert_same, state, zeros_like

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
ext = pytest.importorskip("torch.distributed.checkpoint._extension")
from torch.distributed.checkpoint.filesystem import SerializationFormat  # noqa: E402

KEYS = ("w", "h", "i", "t", "e", "z", "view", "step")


def zstd_ext():
    if not ext.ZStandard.is_available():
        pytest.skip("torch's ZStandard needs zstandard or pyzstd")
    return ext.ZStandard()


def load_both(path, sd):
    for reader in (dcp.FileSystemReader(path), FileSystemReader(path)):
        out = zeros_like(sd)
        dcp.load(out, storage_reader=reader, no_dist=True)
        for k in KEYS:
            assert_same(sd[k], out[k], k)
        assert_same(sd["nested"]["lst"][0], out["nested"]["lst"][0])


@pytest.mark.parametrize("thread_count", [1, 2])
def test_zstd_items_are_frames_torch_decodes(tmp_path, thread_count):
    sd = state()
    sd["big"] = torch.zeros(3 << 20, dtype=torch.uint8)  # compresses to almost nothing
    w = FileSystemWriter(tmp_path, thread_count=thread_count, _extensions=[zstd_ext()])
    dcp.save(sd, storage_writer=w, no_dist=True)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    for info in md.storage_data.values():
        assert info.transform_descriptors == ["stream.zstd/1"]
    total = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))
    assert total < 1 << 20  # compressed, not 3 MiB
    assert all(s.get("compressed") == "zstd" for s in w.last_stats)
    load_both(tmp_path, {**sd})
    # each tensor item, decoded, is a torch.save zip whose CRC-32s check
    info = next(v for k, v in md.storage_data.items() if k.fqn == "w")
    with open(tmp_path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        frame = f.read(info.length)
    raw = ext.ZStandard().transform_from(io.BytesIO(frame)).read(-1)
    assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), sd["w"])


def test_torch_zstd_checkpoints_read_by_ours(tmp_path):
    sd = state()
    w = dcp.FileSystemWriter(tmp_path, thread_count=2, _extensions=[zstd_ext()])
    dcp.save(sd, storage_writer=w, no_dist=True)
    load_both(tmp_path, sd)


class Xor(ext.StreamTransformExtension):
    """A stream transform of the user's own: byte-wise xor."""

    @staticmethod
    def registry_name():
        return "test.xor"

    @staticmethod
    def from_descriptor(version):
        return Xor()

    def get_descriptor(self):
        return "test.xor/1"

    def transform_to(self, output):
        class W(io.RawIOBase):
            def writable(self):
                return True

            def write(self, b):
                output.write(bytes(x ^ 0x5A for x in bytes(b)))
                return len(b)

            def close(self):
                output.close()

        return W()

    def transform_from(self, input):
        return io.BytesIO(bytes(x ^ 0x5A for x in input.read()))


def test_other_transforms_go_through_torchs_code_both_ways(tmp_path):
    sd = state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[Xor()]), no_dist=True)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    assert {tuple(i.transform_descriptors) for i in md.storage_data.values()} == {("test.xor/1",)}
    registry = ext.ExtensionRegistry()
    registry.register(Xor)
    for reader in (
        dcp.FileSystemReader(tmp_path, _extension_registry=registry),
        FileSystemReader(tmp_path, _extension_registry=registry),
    ):
        out = zeros_like(sd)
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert_same(sd["w"], out["w"]) and assert_same(sd["t"], out["t"])


def test_safetensors_format_is_torchs(tmp_path):
    """serialization_format=SAFETENSORS: the files torch's own writer makes."""
    pytest.importorskip("safetensors")
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.int32)}
    kw = dict(serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "ours", **kw), no_dist=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "torch", **kw), no_dist=True)
    import safetensors
    import safetensors.torch as st

    (ours,) = (tmp_path / "ours").glob("*.distcp")  # under this generation's name
    theirs = tmp_path / "torch" / "__0_0.distcp"
    # the same blob (safetensors orders header metadata as it likes: compare parsed)
    assert ours.stat().st_size == theirs.stat().st_size
    for k, v in st.load(ours.read_bytes()).items():
        assert torch.equal(v, sd[k])
    with safetensors.safe_open(ours, "pt") as a, safetensors.safe_open(theirs, "pt") as b:
        assert a.metadata() == b.metadata()


def test_writer_takes_torchs_positional_arguments(tmp_path):
    w = FileSystemWriter(tmp_path, True, True, 1, 10_000_000, False, True, None)
    assert w.transforms.extensions == ()
    assert w.serialization_format == SerializationFormat.TORCH_SAVE


def test_conjugate_and_negative_views_torch_wrote_read_as_torch_reads_them(tmp_path):
    # torch's writer stores a conjugate (or negative) view's storage as it is and
    # the bit in the item's pickle: ours applies it, small items and large ones.
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    big = torch.randn(1 << 18, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    sd = {"conj": c.conj(), "neg": c.conj().imag, "big": big.conj()}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    want = {k: v.resolve_conj().resolve_neg() for k, v in sd.items()}
    for verify in (False, True):
        out = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(out, storage_reader=FileSystemReader(tmp_path, verify=verify), no_dist=True)
        for k, v in want.items():
            assert torch.equal(out[k], v), (k, verify)


def test_saves_without_collectives_leave_one_generation_and_no_temp(tmp_path):
    import subprocess
    import sys
    import textwrap

    from test_dcp import _free_port

    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from ckptio.dcp import FileSystemWriter
        dist.init_process_group(
            "gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{_free_port()}"
        )
        for i in range(3):
            sd = {{"a": torch.full((1000,), float(i))}}
            dcp.save(sd, storage_writer=FileSystemWriter(sys.argv[1]), use_collectives=False)
        dist.destroy_process_group()
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=120)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and names[0] == "__0.metadata" and names[1].endswith(".distcp"), names
