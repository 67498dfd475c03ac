"""DCP load plans of plain state dicts without torch's per-item generality.

torch's ``DefaultLoadPlanner`` treats every entry as possibly a DTensor, a
ShardedTensor, a checkpointable tensor or a nested container, and finds each
read's overlap with every saved chunk: 15-30 us an item in Python (30-60 ms of
a 1,995-tensor LLM state dict, as long as a third of the read itself), with
the cyclic collector free to walk the process meanwhile.

:class:`DefaultLoadPlanner` (``ckptio.dcp.DefaultLoadPlanner``) is torch's,
same arguments and the same plans (equal ``ReadItem`` lists, in the same
order), made directly for each entry that is a plain tensor (a ``Tensor`` or
``Parameter`` with no attributes of its own) stored as one whole chunk; torch's
own code plans every other entry. Set-up takes a flat dict of plain tensors
(none on the meta device) as it is; torch's flattening runs for any other
(nested, sharded), and its rules for checkpoints of torch < 2.4 decide where
the checkpoint has keys such a state dict lacks. :func:`resolver` is the
reader's side: ``planner.resolve_tensor`` for each read, without torch's type
checks, for torch's default planner and subclasses that keep its lookup.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import default_planner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner as _TorchPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ckptio.io import memory

__all__ = ["DefaultLoadPlanner", "narrowed", "resolver"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)

_ZEROS = tuple(torch.Size([0] * n) for n in range(9))

#: The methods through which torch's default planner finds a read's destination,
#: as torch defines them (one patched later on torch's class is an override too).
_RESOLVING = {
    m: _TorchPlanner.__dict__[m] for m in ("resolve_tensor", "lookup_tensor", "transform_tensor")
}


def _plain(value: Any) -> bool:
    """A tensor torch's planner takes as one whole local chunk: exactly a
    Tensor or Parameter (DTensor, ShardedTensor and other subclasses plan
    themselves), with no attributes of its own (DCP's shard hooks and a
    checkpointable tensor's fields are attributes)."""
    return type(value) in _PLAIN and not value.__dict__


class DefaultLoadPlanner(_TorchPlanner):
    """torch's ``DefaultLoadPlanner`` (same arguments, same plans), made
    without its per-item checks for the entries that are plain tensors stored
    whole, and without cyclic garbage collection while it plans. Pass it to
    ``dcp.load(..., planner=ckptio.dcp.DefaultLoadPlanner())``."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        with memory.gc_paused():
            self._flat = flat = (
                self.flatten_state_dict
                and self.flatten_sharded_tensors
                and type(state_dict) in (dict, OrderedDict)
                and all(
                    type(k) is str and _plain(v) and not v.is_meta for k, v in state_dict.items()
                )
            )
            if not flat:
                super().set_up_planner(state_dict, metadata, is_coordinator)
                return
            # What torch's flattening makes of a flat dict of plain tensors.
            self.original_state_dict = state_dict
            self.state_dict = dict(state_dict)
            self.mappings = {k: (k,) for k in state_dict}
            self.metadata = metadata
            self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata
        # Keys the checkpoint has and the state dict lacks: torch's rules for
        # checkpoints of torch < 2.4 decide whether to flatten again, unless the
        # state dict was flat (both flattenings give its own keys).
        if md is None or (
            self.flatten_state_dict
            and not getattr(self, "_flat", False)
            and not md.state_dict_metadata.keys() <= self.state_dict.keys()
        ):
            return super().create_local_plan()
        with memory.gc_paused():
            return _local_plan(self.state_dict, md, strict=not self.allow_partial_load)


def _local_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """torch's ``create_default_local_load_plan``: each entry's reads in the
    state dict's order, made here where :func:`_whole_read` can, else by
    torch for that entry alone (its errors included)."""
    items: list[ReadItem] = []
    stored = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        md = stored.get(fqn)
        item = _whole_read(fqn, md, obj) if md is not None else None
        if item is not None:
            items.append(item)
        else:
            items += default_planner.create_default_local_load_plan(
                {fqn: obj}, metadata, strict
            ).items
    return LoadPlan(items)


def _whole_read(fqn: str, md: Any, obj: Any) -> ReadItem | None:
    """The one read torch plans for a plain tensor whose checkpoint entry is
    one chunk of its whole size, or None for anything else (a mismatch of
    sizes, several chunks, an empty tensor: torch plans no read for a chunk
    with an empty dimension)."""
    if type(md) is not TensorStorageMetadata or not _plain(obj):
        return None
    size = obj.size()
    chunks = md.chunks
    if len(chunks) != 1 or md.size != size or 0 in size:
        return None
    saved = chunks[0]
    zeros = _ZEROS[len(size)] if len(size) < len(_ZEROS) else torch.Size([0] * len(size))
    if saved.sizes != size or saved.offsets != zeros:  # (offsets of other dims: torch raises)
        return None
    # torch's dest_index and storage_index are equal here (the whole tensor,
    # chunk 0 of each side): one frozen index serves as both.
    index = MetadataIndex(fqn, zeros, 0)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=index,
        dest_offsets=zeros,
        storage_index=index,
        storage_offsets=zeros,
        lengths=size,
    )


def resolver(planner: Any) -> Callable[[ReadItem], torch.Tensor]:
    """``planner.resolve_tensor``, taken straight from the planner's state dict
    for a plain destination where the planner resolves as torch's default one
    does (its class's own methods, none overridden on it or its instance)."""
    slow: Callable[[ReadItem], torch.Tensor] = planner.resolve_tensor
    cls = type(planner)
    default = isinstance(planner, _TorchPlanner) and all(
        getattr(cls, m) is f and m not in vars(planner) for m, f in _RESOLVING.items()
    )
    state_dict = getattr(planner, "state_dict", None)
    if not default or type(state_dict) is not dict:
        return slow

    def resolve(req: ReadItem) -> torch.Tensor:
        index = req.dest_index
        t = state_dict.get(index.fqn)
        at = index.offset
        if t is None or not _plain(t) or (at is not None and (len(at) != t.dim() or any(at))):
            return slow(req)  # torch's lookup, and its errors
        return narrowed(t, req.dest_offsets, req.lengths)

    return resolve


def narrowed(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """torch's ``narrow_tensor_by_index``: the slice of ``t`` a read names, ``t``
    itself for a whole one (most reads: one C compare instead of a Python loop
    over the dims, twice an item)."""
    if lengths == t.shape:
        return t
    return narrow_tensor_by_index(t, offsets, lengths)
