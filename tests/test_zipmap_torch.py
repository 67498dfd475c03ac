"""The Rust zip mapper against torch's own idea of where each storage lives.

For files written by torch.save, every storage's ``_checkpoint_offset`` (set by
``torch.load(map_location="meta")`` without reading data) must equal the data
offset that ``ckptio._native.map_archive`` reports for ``<prefix>/data/<key>``,
and the record size must equal the storage's nbytes.
"""

from __future__ import annotations

import shutil
import zipfile

import pytest
import torch
import torch.utils.serialization

native = pytest.importorskip("ckptio._native")
map_archive = getattr(native, "map_archive", None)
pytestmark = pytest.mark.skipif(map_archive is None, reason="ckptio._native.map_archive missing")

GIB = 2**30


@pytest.fixture(params=[64, 4096], ids=["align64", "align4096"])
def alignment(request):
    """Sets torch.save's storage alignment for one test and restores it afterwards."""
    cfg = torch.utils.serialization.config.save
    old = cfg.storage_alignment
    cfg.storage_alignment = request.param
    try:
        yield request.param
    finally:
        cfg.storage_alignment = old


def storage_keys(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    """The record key torch.save gives each tensor's storage.

    torch numbers storages in the order the pickler first meets them (dict order
    here), and views of one storage share its key.
    """
    ids: dict[int, str] = {}
    return {
        name: ids.setdefault(t.untyped_storage()._cdata, str(len(ids)))
        for name, t in state_dict.items()
    }


def check(path, state_dict: dict[str, torch.Tensor], alignment: int) -> None:
    records = map_archive(str(path))
    names = [name for name, _, _ in records]
    assert len(set(names)) == len(names)
    by_name = {name: (offset, size) for name, offset, size in records}

    # Same records, order and sizes as Python's zipfile sees them.
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
    assert names == [i.filename for i in infos]
    assert [size for _, _, size in records] == [i.file_size for i in infos]
    assert all(offset % alignment == 0 for _, offset, _ in records)

    prefix = names[0].split("/", 1)[0]
    keys = storage_keys(state_dict)
    assert sum(n.startswith(f"{prefix}/data/") for n in names) == len(set(keys.values()))

    loaded = torch.load(path, map_location="meta", weights_only=True)
    assert loaded.keys() == state_dict.keys()
    for name, t in loaded.items():
        storage = t.untyped_storage()
        offset, size = by_name[f"{prefix}/data/{keys[name]}"]
        assert storage._checkpoint_offset == offset, name
        assert storage.nbytes() == size, name
        assert t.storage_offset() == state_dict[name].storage_offset(), name


def test_tiny(tmp_path, alignment):
    sd = {"x": torch.tensor([1.5])}
    path = tmp_path / "tiny.pt"
    torch.save(sd, path)
    check(path, sd, alignment)


def test_multi_tensor(tmp_path, alignment):
    base = torch.arange(100, dtype=torch.float32)
    sd = {
        "weight": torch.randn(17, 33),
        "bias": torch.zeros(33, dtype=torch.float64),
        "half": torch.ones(5, 7, dtype=torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "base": base,
        "view": base[10:20],
        "strided": base.view(10, 10).t(),
        "empty": torch.empty(0, dtype=torch.float32),
        "scalar": torch.tensor(3, dtype=torch.uint8),
    }
    path = tmp_path / "multi.pt"
    torch.save(sd, path)
    check(path, sd, alignment)


def test_over_4_gib_sparse(tmp_path, alignment):
    """A record of more than 4 GiB and records past 4 GiB: the zip64 paths.

    Saved under skip_data, so the file is sparse and nothing is written or read
    for the big tensor; torch.empty does not touch its pages either.
    """
    if shutil.disk_usage(tmp_path).free < 10 * GIB:
        pytest.skip("needs 10 GiB free in the temporary directory")
    sd = {
        "small_before": torch.arange(10, dtype=torch.float32),
        "big": torch.empty(4 * GIB + 1000, dtype=torch.uint8),
        "small_after": torch.ones(3, 3),
        "tail": torch.arange(7, dtype=torch.int16),
    }
    path = tmp_path / "big.pt"
    with torch.serialization.skip_data():
        torch.save(sd, path)
    assert path.stat().st_size > 4 * GIB
    check(path, sd, alignment)
    records = {name: (offset, size) for name, offset, size in map_archive(str(path))}
    assert records["big/data/1"][1] == 4 * GIB + 1000
    assert records["big/data/2"][0] > 2**32
