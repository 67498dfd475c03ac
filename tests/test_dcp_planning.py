"""ckptio.dcp.DefaultLoadPlanner makes torch's plans (ckptio.loading.planning), and
the reader's resolver finds torch's destinations."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptio.dcp import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from ckptio.loading import planning
from torch.distributed.checkpoint import default_planner as torch_planner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def flat(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(64, 32, generator=g).bfloat16(),
        "w": torch.randn(32, 32, generator=g),
        "norm": torch.randn(32, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.randn(5, 3, generator=g)),
        "t": torch.randn(8, 6, generator=g).t(),  # a strided destination
    }


def saved(tmp_path, sd: dict) -> Metadata:
    folder = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(folder), no_dist=True)
    return FileSystemReader(folder).read_metadata()


def plans(dest: dict, md: Metadata, **kw) -> tuple:
    """(torch's planner, ours), each set up over its own copy of ``dest`` and planned."""
    got = []
    for cls in (torch_planner.DefaultLoadPlanner, DefaultLoadPlanner):
        p = cls(**kw)
        p.set_up_planner(dict(dest), md, True)
        got.append((p, p.create_local_plan()))
    return tuple(got)


def same_plans(dest: dict, md: Metadata, **kw) -> DefaultLoadPlanner:
    (theirs, want), (ours, got) = plans(dest, md, **kw)
    assert got.items == want.items  # every field of every read, in torch's order
    assert [r.dest_index.index for r in got.items] == [r.dest_index.index for r in want.items]
    assert ours.mappings == theirs.mappings
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    return ours


def test_plans_of_a_plain_state_dict_are_torchs(tmp_path, monkeypatch):
    sd = flat()
    md = saved(tmp_path, sd)
    by_torch = []
    torchs = planning.create_default_local_load_plan
    monkeypatch.setattr(
        planning,
        "create_default_local_load_plan",
        lambda d, *a: by_torch.append(*d) or torchs(d, *a),
    )
    same_plans({k: torch.empty_like(v) for k, v in sd.items()}, md)
    assert by_torch == ["empty"]  # torch plans no read of an empty tensor: it decides


def test_plans_of_nested_and_non_tensor_entries_are_torchs(tmp_path):
    sd = {
        **flat(),
        "step": 7,
        "optim": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]},
        "lst": [torch.arange(4), "x"],
    }
    md = saved(tmp_path, sd)
    same_plans(sd, md)
    part = {k: v for k, v in sd.items() if k in flat()}
    same_plans({**part, "step": 0}, md, allow_partial_load=True)


def test_plans_of_a_tensor_saved_in_chunks_are_torchs():
    # A checkpoint of a tensor saved as two row shards (as a 2-rank save stores it).
    w = torch.randn(4, 6)
    props = TensorProperties.create_from_tensor(w)
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 6])),
        ChunkStorageMetadata(offsets=torch.Size([2, 0]), sizes=torch.Size([2, 6])),
    ]
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(properties=props, size=torch.Size([4, 6]), chunks=chunks),
            "v": TensorStorageMetadata(
                properties=props,
                size=torch.Size([4]),
                chunks=[ChunkStorageMetadata(torch.Size([1]), torch.Size([3]))],
            ),
        }
    )
    ours = same_plans({"w": torch.empty(4, 6), "v": torch.empty(4)}, md)
    assert len(ours.create_local_plan().items) == 3


def test_entries_with_attributes_or_subclasses_go_through_torch(tmp_path):
    sd = flat()
    md = saved(tmp_path, sd)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    dest["w"].note = "an attribute"  # DCP's shard hooks and checkpointable fields are attributes

    class Sub(torch.Tensor):
        pass

    dest["norm"] = torch.empty(32).as_subclass(Sub)
    same_plans(dest, md)
    assert not planning._plain(dest["w"]) and not planning._plain(dest["norm"])


def test_missing_and_extra_keys_and_size_mismatches_raise_as_torchs(tmp_path):
    sd = flat()
    md = saved(tmp_path, sd)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    cases = [
        ({**dest, "extra": torch.ones(2)}, {}),  # not in the checkpoint, strict
        ({**dest, "w": torch.empty(3, 3)}, {}),  # another size
    ]
    for d, kw in cases:
        errors = []
        for cls in (torch_planner.DefaultLoadPlanner, DefaultLoadPlanner):
            p = cls(**kw)
            p.set_up_planner(d, md, True)
            with pytest.raises((RuntimeError, ValueError)) as e:
                p.create_local_plan()
            errors.append((type(e.value), str(e.value)))
        assert errors[0] == errors[1]
    # Keys the state dict lacks: torch's rules (older checkpoints), and allow_partial_load.
    part = {k: v for k, v in dest.items() if k != "w"}
    same_plans({**part, "extra": torch.ones(2)}, md, allow_partial_load=True)
    same_plans(part, md, allow_partial_load=True)


@pytest.mark.parametrize("reader", ["ckptio", "torch"])
def test_dcp_load_with_the_planner_loads_what_torchs_loads(tmp_path, reader):
    sd = {**flat(1), "step": 3, "nested": {"a": torch.arange(6).view(2, 3)}}
    folder = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=FileSystemWriter(folder), no_dist=True)
    got = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0)
        for k, v in sd.items()
        if k != "nested"
    }
    got["nested"] = {"a": torch.zeros(2, 3, dtype=torch.long)}
    read = FileSystemReader(folder) if reader == "ckptio" else dcp.FileSystemReader(folder)
    dcp.load(got, storage_reader=read, planner=DefaultLoadPlanner(), no_dist=True)
    for k, v in flat(1).items():
        assert torch.equal(got[k], v), k
    assert got["step"] == 3 and torch.equal(got["nested"]["a"], torch.arange(6).view(2, 3))


def test_the_resolver_finds_torchs_destinations_and_defers_to_overrides(tmp_path):
    sd = flat()
    md = saved(tmp_path, sd)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    for cls in (torch_planner.DefaultLoadPlanner, DefaultLoadPlanner):
        p = cls()
        p.set_up_planner(dest, md, True)
        resolve = planning.resolver(p)
        assert resolve is not p.resolve_tensor  # taken straight from the state dict
        for r in p.create_local_plan().items:
            a, b = resolve(r), p.resolve_tensor(r)
            assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())

    class Mine(torch_planner.DefaultLoadPlanner):
        def lookup_tensor(self, index):
            return super().lookup_tensor(index)

    p = Mine()
    p.set_up_planner(dest, md, True)
    assert planning.resolver(p) == p.resolve_tensor  # an override decides
    p = DefaultLoadPlanner()
    p.set_up_planner(dest, md, True)
    p.transform_tensor = lambda req, t: t  # on the instance, too
    assert planning.resolver(p) == p.resolve_tensor
    # a missing destination: torch's lookup raises its error
    p = DefaultLoadPlanner()
    p.set_up_planner(dest, md, True)
    item = p.create_local_plan().items[0]
    del p.state_dict[item.dest_index.fqn]
    with pytest.raises(ValueError, match="Could not find FQN"):
        planning.resolver(p)(item)
