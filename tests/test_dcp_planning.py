"""ckptio.dcp.DefaultLoadPlanner makes torch's plans (ckptio.loading.planning), and
the reader's resolver finds torch's destinations."""

from collections import OrderedDict

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


def same_plans(dest: dict, md: Metadata, **kw) -> DefaultLoadPlanner:
    """Our planner's plan of ``dest`` is torch's: every field of every read in
    torch's order, the same flattening (mappings, the planned state dict's keys
    and tensors), the state dict given kept as the original."""
    got = []
    for cls in (torch_planner.DefaultLoadPlanner, DefaultLoadPlanner):
        p = cls(**kw)
        given = dest.copy()
        p.set_up_planner(given, md, True)
        assert p.original_state_dict is given
        got.append((p, p.create_local_plan()))
    (theirs, want), (ours, plan) = got
    assert plan.items == want.items
    for a, b in zip(plan.items, want.items, strict=True):
        assert (a.dest_index.index, a.storage_index.index) == (
            b.dest_index.index,
            b.storage_index.index,
        )
    assert ours.mappings == theirs.mappings
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    assert all(ours.state_dict[k] is v for k, v in theirs.state_dict.items())
    return ours


def by_torch(monkeypatch) -> list:
    """The entries torch's own code plans from now on (their names, in order)."""
    names: list = []
    torchs = torch_planner.create_default_local_load_plan
    monkeypatch.setattr(
        torch_planner,
        "create_default_local_load_plan",
        lambda d, *a: names.extend(d) or torchs(d, *a),
    )
    return names


def test_plans_of_a_plain_state_dict_are_torchs(tmp_path, monkeypatch):
    sd = flat()
    md = saved(tmp_path, sd)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    # model.state_dict() is an OrderedDict; a subset of the checkpoint's keys
    # (the weights of a model + optimizer checkpoint) keeps the fast path
    part = OrderedDict((k, v) for k, v in dest.items() if k != "w")
    for d in (dest, part):
        same_plans(d, md)
        planned = by_torch(monkeypatch)
        ours = DefaultLoadPlanner()
        ours.set_up_planner(d, md, True)
        reads = {r.dest_index.fqn for r in ours.create_local_plan().items}
        assert planned == ["empty"]  # torch plans no read of an empty tensor: it decides
        assert reads == d.keys() - {"empty"}
        monkeypatch.undo()


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


def test_chunk_offsets_of_another_rank_raise_as_torchs():
    props = TensorProperties.create_from_tensor(torch.empty(3))
    chunk = ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([3]))
    md = Metadata({"bad": TensorStorageMetadata(props, torch.Size([3]), [chunk])})
    errors = []
    for cls in (torch_planner.DefaultLoadPlanner, DefaultLoadPlanner):
        p = cls()
        p.set_up_planner({"bad": torch.empty(3)}, md, True)
        with pytest.raises(Exception) as e:
            p.create_local_plan()
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]


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
    p = DefaultLoadPlanner()
    p.set_up_planner(dest, md, True)
    with pytest.MonkeyPatch.context() as mp:  # and on torch's class
        mp.setattr(torch_planner.DefaultLoadPlanner, "lookup_tensor", Mine.lookup_tensor)
        assert planning.resolver(p) == p.resolve_tensor
    # a missing destination: torch's lookup raises its error
    p = DefaultLoadPlanner()
    p.set_up_planner(dest, md, True)
    item = p.create_local_plan().items[0]
    del p.state_dict[item.dest_index.fqn]
    with pytest.raises(ValueError, match="Could not find FQN"):
        planning.resolver(p)(item)
