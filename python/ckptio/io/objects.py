"""The tensors an object graph holds, for snapshots that deep-copy it.

A snapshot (a stager's, an async save's) is a deep copy of the caller's object
whose tensors are copies taken now: every tensor the object reaches is copied
into ``copy.deepcopy``'s memo under its id first, so that the deep copy takes
the copies and keeps everything else as deepcopy does (container types and
attributes, dataclasses, one object under two names, cycles).
"""

from __future__ import annotations

import gc
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch

# Values that hold no tensor (and that deepcopy returns as they are).
ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
# What deepcopy returns as it is, whose references it does not follow.
_KEPT_BY_DEEPCOPY = (
    type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    types.CodeType, weakref.ref,
)  # fmt: skip


def reachable_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Each tensor ``obj`` reaches (through containers and attributes, not
    through classes, modules or functions), once."""
    seen: set[int] = set()
    todo = [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, ATOMS) or isinstance(o, _KEPT_BY_DEEPCOPY):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            yield o
            continue
        todo.extend(gc.get_referents(o))


def memoize(memo: dict[int, Any], t: torch.Tensor, copy: Any) -> None:
    """``copy`` as what ``copy.deepcopy(..., memo)`` makes of ``t`` (``t`` kept
    alive with the memo, as deepcopy keeps what it copied)."""
    memo[id(t)] = copy
    memo.setdefault(id(memo), []).append(t)
