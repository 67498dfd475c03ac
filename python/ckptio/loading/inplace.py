"""Loads into tensors that exist already: ``ckptio.load(path, out=...)``,
``ckptio.load_state_dict(module_or_optimizer, path)`` and
``ckptio.safetensors.load_file(path, out=...)`` / ``load_sharded(..., out=...)``.

A load in place runs in three steps, each a function of its own so that
variants (one that reads only a share of the records and shares them over
torch.distributed) reuse them:

1. **Sources** (``ckptio.formats.torchzip.open_torch``,
   ``ckptio.formats.safetensors.open_file``): the checkpoint's
   pickle (or header) decoded over a lazy mapping of the file that nothing
   reads (``torch.load(mmap=True)`` with a ``map_location`` that keeps the
   mapped storages). Every tensor of the result is a view of the mapping: its
   address, less the mapping's base (:class:`Mapped`), is the file offset of
   its bytes. Non-tensor values are what torch.load returns. For
   ``load_state_dict`` a natively read pickle gives placeholders instead
   (:class:`ckptio.formats.unpickled.Placeholder`: dtype, shape, address), made into
   those views only where a step needs the tensor.
2. **Pairs** ``(key, source view, destination)``: by walking the checkpoint
   and ``out`` together (:func:`pair_structure`), or, for ``load_state_dict``
   (:mod:`ckptio.state_dict`), by running torch's own
   ``Module._load_from_state_dict`` with each ``copy_`` from the mapping
   recorded instead of run, or by the optimizer's rules.
3. :func:`plan` checks every pair (shape, dtype, a destination that can be
   written) and decides per pair: read straight into the destination, or into
   a temporary on its device and then ``copy_`` (destinations that share
   memory one by one, in order, as torch's copies fill them). Nothing is
   written before every pair passed. :func:`execute` reads the plan's items
   (all, or any share of them) through ``ckptio.io.transfer.read_files``.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import gc
import os
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn, cast

import torch

from ckptio import _native
from ckptio.errors import (
    DestinationError,
    DtypeMismatchError,
    FormatError,
    InPlaceLoadError,
    KeyMismatchError,
    PartialLoadError,
    ShapeMismatchError,
)
from ckptio.formats import unpickled
from ckptio.formats.mapped import Mapped, storage_address
from ckptio.formats.unpickled import Placeholder
from ckptio.io import devices, memory, reports, transfer
from ckptio.io.engines import IoOptions
from ckptio.loading import sharing

#: Bytes of temporaries (destinations that cannot be read into directly) alive
#: at once; a larger tensor gets a batch of its own.
TEMP_BUDGET = 64 << 20


_CLASSES: dict[str, type[InPlaceLoadError]] = {
    "missing": KeyMismatchError,
    "unexpected": KeyMismatchError,
    "shape": ShapeMismatchError,
    "dtype": DtypeMismatchError,
    "destination": DestinationError,
}


Problem = tuple[str, str, str]


def raise_problems(
    head: str,
    lines: list[str],
    problems: list[Problem],
    *,
    missing: Sequence[str] = (),
    unexpected: Sequence[str] = (),
    partial: bool,
) -> NoReturn:
    cls = next((_CLASSES[k] for k, _, _ in problems if k in _CLASSES), InPlaceLoadError)
    state = "the destinations are partially filled" if partial else "no destination was written"
    msg = head + "\n\t" + "\n\t".join(lines) + f"\n\t({state})"
    raise cls(msg, problems, missing_keys=missing, unexpected_keys=unexpected, partial=partial)


def partial_error(what: str, e: BaseException) -> PartialLoadError:
    return PartialLoadError(
        f"{what}; the destinations are partially filled: {type(e).__name__}: {e}",
        [("error", "", str(e))],
        partial=True,
    )


def _keys_line(what: str, keys: Sequence[str]) -> str:
    return f"{what}: {', '.join(f'{k!r}' for k in keys)}."


class Files:
    """The mapped files of one load, found by address."""

    def __init__(self, files: Sequence[Mapped]) -> None:
        self.files = list(files)
        order = sorted(range(len(self.files)), key=lambda i: self.files[i].base)
        self._bases = [self.files[i].base for i in order]
        self._order = order

    def locate(self, t: Any) -> tuple[int, int] | None:
        """(file index, file offset of the first element) of a plain CPU tensor
        viewing one of the mappings (or a :class:`Placeholder`), else None."""
        if type(t) is Placeholder:
            fi = self._file_at(t.storage_address)
            return None if fi is None else (fi, t.address - self.files[fi].base)
        if not isinstance(t, torch.Tensor) or not t.is_cpu or not _plain(t):
            return None
        try:
            # The storage's: an element's would do for a view within the mapping,
            # not for one outside it.
            sp = storage_address(t)
        except (RuntimeError, NotImplementedError):
            return None
        fi = self._file_at(sp)
        return None if fi is None else (fi, t.data_ptr() - self.files[fi].base)

    def changed(self, t: Any) -> None:
        """``t`` (a view of one of the mappings) is being written in memory (a
        hook or an override changing the checkpoint's tensors, as it may with
        torch.load's): from now on that file's tensors are copied from the
        mapping, changes included, not read from the file."""
        where = self.locate(t)
        if where is not None:
            self.files[where[0]].exact = False

    def _file_at(self, storage_address: int) -> int | None:
        """The index of the mapping holding a storage at that address, if its
        bytes are the file's as stored (not byte-swapped)."""
        i = bisect.bisect_right(self._bases, storage_address) - 1
        if i < 0:
            return None
        fi = self._order[i]
        m = self.files[fi]
        if not (m.base <= storage_address < m.base + m.size) or not m.exact:
            return None
        return fi

    def direct(self, key: str, src: Any, dest: Any) -> Item | None:
        """The usual pair, checked and placed in one step (a tenth of the calls
        of :func:`_check` and :func:`_item`, a third of a plan's time): a plain
        contiguous source viewing one of the mappings (a tensor, or a
        :class:`Placeholder` not made yet), and a plain contiguous CPU or CUDA
        destination of its dtype and shape, writable here. None: ask
        :func:`_check` and :func:`_item`."""
        if not direct_destination(dest):
            return None
        if type(src) is Placeholder:
            if not src.contiguous or src.dtype != dest.dtype or src.shape != dest.shape:
                return None
            nbytes, ptr, storage = src.nbytes, src.address, src.storage_address
        elif (
            type(src) not in _PLAIN_TYPES
            or not src.is_cpu
            or src.dtype != dest.dtype
            or src.shape != dest.shape
            or src.layout != _STRIDED
            or src.is_conj()
            or src.is_neg()
            or not src.is_contiguous()
        ):
            return None
        else:
            nbytes = src.numel() * src.element_size()
            ptr = src.data_ptr()
            storage = ptr - src.storage_offset() * src.element_size()
        if not nbytes:
            return None
        fi = self._file_at(storage)
        if fi is None:
            return None
        return Item(key, dest, src, fi, ptr - self.files[fi].base, nbytes, True)


_STRIDED = torch.strided


def direct_destination(dest: Any) -> bool:
    """Whether bytes may be read straight into ``dest``'s memory: a plain
    contiguous CPU or CUDA tensor, writable here (no inference tensor)."""
    return not (
        type(dest) not in _PLAIN_TYPES
        or not (dest.is_cpu or dest.is_cuda)
        or dest.layout != _STRIDED
        or dest.is_quantized  # copy_ sets its quantizer too: bytes alone would not
        or dest.is_conj()
        or dest.is_neg()
        or dest.is_inference()
        or not dest.is_contiguous()
    )


#: Returned by a walk's function: leave this entry out (None in a sequence).
_DROP = object()


def replace_tensors(
    obj: Any,
    fn: Callable[[tuple[Any, ...], Any], Any],
    path: tuple[Any, ...] = (),
    memo: dict[int, Any] | None = None,
) -> Any:
    """``obj`` with every tensor ``t`` at key path ``p`` replaced by ``fn(p, t)``:
    dicts, lists, deques and objects' ``__dict__`` and ``__slots__`` changed in
    place, tuples rebuilt (named tuples too). Shared containers are walked once
    (``memo``: an :class:`_Unsharing`, at each key path instead). Other
    containers (sets, objects keeping values elsewhere) are not entered.
    ``t`` is a tensor, or a :class:`Placeholder` where ``obj`` holds any (so
    ``fn`` takes ``Any``: most walks' objects hold tensors only)."""
    r = _walk(obj, path, fn, {} if memo is None else memo)
    return None if r is _DROP else r


def _walk(
    o: Any,
    p: tuple[Any, ...],
    fn: Callable[[tuple[Any, ...], Any], Any],
    memo: dict[int, Any],
) -> Any:
    """:func:`replace_tensors` of ``o`` at key path ``p`` (``memo``: the containers seen).
    A function of the module, not a closure: a recursive closure is a cycle,
    which would keep a load's tensors alive until the next garbage collection.
    A :class:`Placeholder` is a tensor here (``fn`` decides whether to make it)."""
    if isinstance(o, torch.Tensor) or type(o) is Placeholder:
        return fn(p, o)
    if id(o) in memo:
        if type(memo) is _Unsharing and id(o) in memo.before and id(o) not in memo.open:
            before = memo.before[id(o)]
            if isinstance(before, tuple):
                # Rebuilt, never changed: walked again as it is (a copy of a tuple
                # is the tuple itself, which _walk would find here again, for ever).
                return _walk_open(before, p, fn, memo)
            return _walk(copy.copy(before), p, fn, memo)
        return memo[id(o)]
    if type(memo) is _Unsharing and isinstance(o, (dict, list, deque, tuple)):
        memo.before[id(o)] = o if isinstance(o, tuple) else copy.copy(o)
        return _walk_open(o, p, fn, memo)
    return _walk_container(o, p, fn, memo)


def _walk_open(
    o: Any,
    p: tuple[Any, ...],
    fn: Callable[[tuple[Any, ...], Any], Any],
    memo: _Unsharing,
) -> Any:
    """:func:`_walk_container` of ``o``, marked open meanwhile (a cycle back to it
    is not walked again)."""
    memo.open.add(id(o))
    try:
        return _walk_container(o, p, fn, memo)
    finally:
        memo.open.discard(id(o))


class _Unsharing(dict):  # type: ignore[type-arg]
    """A memo of :func:`_walk` for pairing: a container reached again by another
    key path is walked again, as a copy of what it held before the first walk
    changed it (each path pairs its own tensors, as torch.load's tensors then
    ``copy_`` would fill both destinations); one reached again inside itself
    (a cycle) is not."""

    def __init__(self) -> None:
        super().__init__()
        self.before: dict[int, Any] = {}
        self.open: set[int] = set()


def _walk_container(
    o: Any,
    p: tuple[Any, ...],
    fn: Callable[[tuple[Any, ...], Any], Any],
    memo: dict[int, Any],
) -> Any:
    """:func:`_walk` of a value that is not a tensor, seen the first time."""
    if type(o) in _ATOMS:
        return o
    if isinstance(o, dict):
        memo[id(o)] = o
        for k in list(o):
            v = _walk(o[k], (*p, k), fn, memo)
            if v is _DROP:
                del o[k]
            else:
                o[k] = v
        return o
    if isinstance(o, (list, deque)):
        memo[id(o)] = o
        for i, v in enumerate(o if isinstance(o, list) else list(o)):
            r = _walk(v, (*p, i), fn, memo)
            o[i] = None if r is _DROP else r
        return o
    if isinstance(o, tuple):
        memo[id(o)] = o  # (what a cycle back to it finds: the tuple is not rebuilt yet)
        items = [_walk(v, (*p, i), fn, memo) for i, v in enumerate(o)]
        items = [None if r is _DROP else r for r in items]
        if all(a is b for a, b in zip(items, o, strict=True)):
            new: Any = o
        elif hasattr(o, "_fields"):
            new = type(o)(*items)
        else:
            new = type(o)(items)
        memo[id(o)] = new
        return new
    if isinstance(o, _NOT_WALKED):
        return o
    slots = _slot_names(type(o))
    if hasattr(o, "__dict__") or slots:
        memo[id(o)] = o
        attrs = getattr(o, "__dict__", {})
        for k in list(attrs):
            v = _walk(attrs[k], (*p, k), fn, memo)
            attrs[k] = None if v is _DROP else v
        for k in slots:
            try:
                old = object.__getattribute__(o, k)
            except AttributeError:  # (a slot not set)
                continue
            v = _walk(old, (*p, k), fn, memo)
            if v is not old:  # (past a __setattr__ of the class, as pickle sets them)
                object.__setattr__(o, k, None if v is _DROP else v)
        return o
    return o


_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType)
#: Values that hold nothing to walk (most of a checkpoint's other values): no
#: look for ``__slots__`` in their classes.
_ATOMS = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device})


def _slot_names(cls: type) -> tuple[str, ...]:
    """The attributes that ``__slots__`` of ``cls`` and its bases declare, each
    as the class stores it (a private name mangled), as pickle finds them."""
    names: list[str] = []
    for c in cls.__mro__:
        declared = c.__dict__.get("__slots__")
        if declared is None:
            continue
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__") and c.__name__.lstrip("_"):
                name = f"_{c.__name__.lstrip('_')}{name}"
            names.append(name)
    return tuple(names)


def materialize(obj: Any) -> Any:
    """``obj`` with every :class:`Placeholder` made into its tensor (:func:`replace_tensors`:
    dicts and lists changed in place, tuples rebuilt)."""
    return replace_tensors(obj, _made)


def _made(p: tuple[Any, ...], t: Any) -> Any:
    return unpickled.tensor(t)


def key_name(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path)) if path else "<root>"


def _index(obj: Any) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of ``obj`` by key path (a container at two paths: at both)."""
    found: dict[tuple[Any, ...], torch.Tensor] = {}

    def note(p: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        found.setdefault(p, t)
        return t

    replace_tensors(obj, note, memo=_Unsharing())
    return found


def pair_structure(
    src: Any, out: Any
) -> tuple[Any, list[tuple[str, torch.Tensor, torch.Tensor]], list[str], list[str]]:
    """Match the tensors of a decoded checkpoint ``src`` with those of ``out``
    by key path: (``src`` with each paired tensor replaced by its destination
    and unpaired ones left out, pairs, missing keys (destinations the
    checkpoint has no tensor for), unexpected keys (checkpoint tensors
    without a destination)). Where ``out`` holds another value than a tensor
    (or None) at a checkpoint tensor's key path, the two are paired:
    :func:`plan` refuses that destination by its type."""
    dests = _index(out)
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    unexpected: list[str] = []

    def match(p: tuple[Any, ...], t: torch.Tensor) -> Any:
        d = dests.pop(p, None)
        if d is None:
            d = _value_at(out, p)
            if d is _ABSENT or d is None or isinstance(d, torch.Tensor):
                unexpected.append(key_name(p))
                return _DROP
            # out holds another value than a tensor (or None: no destination)
            # there: a pair that plan refuses ("the destination is a int"),
            # not a key out lacks.
        pairs.append((key_name(p), t, d))
        return d

    result = replace_tensors(src, match, memo=_Unsharing())
    return result, pairs, [key_name(p) for p in dests], unexpected


_ABSENT = object()


def _value_at(obj: Any, path: tuple[Any, ...]) -> Any:
    """What ``obj`` holds at key path ``path``, as :func:`replace_tensors` walks
    it (dict keys, list, deque and tuple indices, objects' attributes); ``_ABSENT``
    where it holds nothing there."""
    for k in path:
        if isinstance(obj, torch.Tensor):
            return _ABSENT
        if isinstance(obj, dict):
            if k not in obj:
                return _ABSENT
            obj = obj[k]
        elif isinstance(obj, (list, deque, tuple)):
            if type(k) is not int or not 0 <= k < len(obj):
                return _ABSENT
            obj = obj[k]
        elif not isinstance(k, str) or isinstance(obj, _NOT_WALKED):
            return _ABSENT
        elif k in getattr(obj, "__dict__", {}):
            obj = vars(obj)[k]
        elif k in _slot_names(type(obj)):
            try:
                obj = object.__getattribute__(obj, k)
            except AttributeError:
                return _ABSENT
        else:
            return _ABSENT
    return obj


@dataclasses.dataclass(slots=True)
class Item:
    """One destination to fill."""

    key: str
    dest: torch.Tensor
    #: A :class:`Placeholder` only in a direct item (its bytes are read, its tensor
    #: never needed).
    src: torch.Tensor | Placeholder
    #: Index of the file in ``Plan.files`` the bytes come from; None: the
    #: destination is copied from ``src`` (not a view of the mapping's bytes).
    file: int | None
    #: File offset of the first byte read, and how many.
    offset: int = 0
    nbytes: int = 0
    #: Read straight into ``dest``'s memory; else into a temporary on its
    #: device, then ``dest.copy_``.
    direct: bool = False
    #: Its destination shares memory with another item's (views of one buffer):
    #: such items are filled one by one in their order, after the others, so
    #: that the later copy of a shared byte wins, as torch's copies leave it.
    ordered: bool = False


@dataclasses.dataclass
class Plan:
    files: list[Mapped]
    items: list[Item]
    #: Problems found; a plan with any must not be executed.
    problems: list[Problem]
    #: Keys whose destination a later pair fills too (tied weights): not read.
    skipped: list[str]


def _plain(t: torch.Tensor) -> bool:
    """A strided tensor whose memory is its own storage (not a wrapper subclass)."""
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg():
        return False
    # Tensors and Parameters never carry the Python key (a subclass with
    # __torch_dispatch__ does); asking costs 0.7 us, several times per item.
    return type(t) in _PLAIN_TYPES or not torch._C._dispatch_keys(t).has(
        torch._C.DispatchKey.Python
    )


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _device_key(t: torch.Tensor) -> tuple[str, int]:
    """A key of ``t``'s device that sorts ((type, index); ``t.device`` costs 0.5 us)."""
    if t.is_cpu:
        return ("cpu", -1)
    if t.is_cuda:
        return ("cuda", t.get_device())
    return (t.device.type, t.get_device())


def _check(key: str, src: torch.Tensor, dest: Any, cast: bool, exact_shape: bool) -> Problem | None:
    if not isinstance(dest, torch.Tensor):
        return ("destination", key, f"{key!r}: the destination is a {type(dest).__name__}")
    if dest.layout != torch.strided or src.layout != torch.strided:
        lay = dest.layout if dest.layout != torch.strided else src.layout
        return ("destination", key, f"{key!r}: {lay} tensors are not loaded in place")
    if dest.is_meta:
        return ("destination", key, f"{key!r}: the destination is on the meta device")
    if any(st == 0 and n > 1 for n, st in zip(dest.shape, dest.stride(), strict=True)):
        # torch's copy_ refuses it midway (after the other destinations were written)
        return (
            "destination",
            key,
            f"{key!r}: elements of the destination share memory (an expanded tensor), "
            "which a copy cannot write",
        )
    if dest.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "destination",
            key,
            f"{key!r}: the destination is an inference tensor (made under "
            "torch.inference_mode()), which cannot be written outside it",
        )
    if src.shape != dest.shape:
        ok = False
        if not exact_shape:
            try:
                ok = torch.broadcast_shapes(src.shape, dest.shape) == dest.shape
            except RuntimeError:
                ok = False
        if not ok:
            return (
                "shape",
                key,
                f"size mismatch for {key!r}: the checkpoint holds {tuple(src.shape)}, "
                f"the destination is {tuple(dest.shape)}",
            )
    if src.dtype != dest.dtype and not cast:
        return (
            "dtype",
            key,
            f"dtype mismatch for {key!r}: the checkpoint holds {src.dtype}, the destination "
            f"is {dest.dtype} (cast=True converts)",
        )
    return None


def _item(key: str, src: torch.Tensor, dest: torch.Tensor, files: Files) -> Item:
    where = files.locate(src)
    if where is None or src.numel() == 0 or dest.numel() == 0:
        return Item(key, dest, src, None)
    fi, off = where
    if (
        _plain(dest)
        and (dest.is_cpu or dest.is_cuda)
        and dest.is_contiguous()
        and src.is_contiguous()
        and src.dtype == dest.dtype
        and src.shape == dest.shape
    ):
        return Item(key, dest, src, fi, off, src.numel() * src.element_size(), True)
    lo, hi = memory.extent(src)
    return Item(key, dest, src, fi, off, hi - lo, False)


def plan(
    pairs: Iterable[tuple[str, torch.Tensor, Any]],
    files: Sequence[Mapped],
    *,
    cast: bool = False,
    exact_shape: bool = True,
) -> Plan:
    """Which bytes of which file go into which destination.

    ``pairs``: (key, source, destination), the source a tensor of a decoded
    checkpoint (a view of one of ``files``' mappings, or any tensor, then
    copied). Finds every problem (shape, dtype unless ``cast``, destinations
    that cannot be written); where two pairs fill the very same destination
    (tied weights), only the later one is kept, and destinations that share
    memory otherwise (views of one buffer) are filled one by one in order
    (:attr:`Item.ordered`), as torch's copies leave them. ``exact_shape=False``
    allows sources that broadcast to the destination (``copy_``'s rule). A plan
    with problems writes nothing.
    """
    located = Files(files)
    problems: list[Problem] = []
    items: list[Item] = []
    for key, src, dest in pairs:
        it = located.direct(key, src, dest)
        if it is not None:
            items.append(it)
            continue
        src = unpickled.tensor(src)
        p = _check(key, src, dest, cast, exact_shape)
        if p is not None:
            problems.append(p)
        else:
            items.append(_item(key, src, dest, located))
    items, skipped = _overlaps(items)
    problems += _read_only(items)
    return Plan(list(files), items, problems, skipped)


def _overlaps(items: list[Item]) -> tuple[list[Item], list[str]]:
    spans = []
    for i, it in enumerate(items):
        span = _dest_span(it)
        if span is not None:
            spans.append((_device_key(it.dest), *span, i))
    spans.sort()
    drop: set[int] = set()
    # The destinations whose extents reach past the current start, on one device
    # (one at a time but where extents interleave: strided views of one tensor).
    active: list[tuple[int, int]] = []  # (end, index)
    reach, dev_now = 0, None
    for dev, lo, hi, i in spans:
        if dev != dev_now or lo >= reach:
            active.clear()
            active.append((hi, i))
            reach, dev_now = hi, dev
            continue
        active[:] = [(e, j) for e, j in active if e > lo]
        for _, j in active:
            a, b = items[j], items[i]
            if _same_view(a.dest, b.dest):
                drop.add(min(j, i))  # tied: the later pair is kept, as torch's copies leave it
            elif _share_elements(a.dest, b.dest):
                for it in (a, b):
                    it.ordered, it.direct = True, False
                    it.src = unpickled.tensor(it.src)  # (copied from: its layout needed)
        active.append((hi, i))
        reach = max(reach, hi)
    kept = [it for i, it in enumerate(items) if i not in drop]
    return kept, [items[i].key for i in sorted(drop)]


#: Elements beyond which two interleaving strided destinations are taken to
#: overlap without checking each element.
_EXACT_BELOW = 1 << 26


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two destinations whose extents overlap share a byte: contiguous
    ones do; strided views of one tensor (column slices of a weight) may not,
    and are checked element by element where they are of one element size and
    grid (else, or where the extent is huge, taken to overlap)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    size = a.element_size()
    lo = min(a.data_ptr(), b.data_ptr())
    hi = max(memory.extent(a)[1], memory.extent(b)[1])
    if (
        b.element_size() != size
        or (a.data_ptr() - lo) % size
        or (b.data_ptr() - lo) % size
        or (hi - lo) // size > _EXACT_BELOW
    ):
        return True
    mask = torch.zeros((hi - lo) // size, dtype=torch.bool)
    mask.as_strided(a.shape, a.stride(), (a.data_ptr() - lo) // size).fill_(True)
    return bool(mask.as_strided(b.shape, b.stride(), (b.data_ptr() - lo) // size).any())


def _dest_span(it: Item) -> tuple[int, int] | None:
    """[first byte, last byte + 1) of a plain destination's elements; None for
    others and for empty ones."""
    d = it.dest
    if it.direct:  # plain and contiguous: its bytes are the ones read
        lo = d.data_ptr()
        return lo, lo + it.nbytes
    if d.numel() and _plain(d):
        return memory.extent(d)
    return None


def _allocated(t: torch.Tensor) -> bool:
    """Whether a plain tensor's memory comes from one of torch's allocators."""
    try:
        return _plain(t) and t.untyped_storage().resizable()
    except (RuntimeError, NotImplementedError):
        return False


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.dtype, a.shape, a.stride()) == (
        b.data_ptr(),
        b.dtype,
        b.shape,
        b.stride(),
    )


def _read_only(items: list[Item]) -> list[Problem]:
    """Host destinations that lie (in part) outside writable mappings of this
    process (a tensor over read-only memory: torch.frombuffer of bytes, a
    read-only mapping). The kernel would refuse the reads (EFAULT), a copy
    would crash. Memory torch's allocators made (a resizable storage: not
    frombuffer, from_numpy or from_file) is writable and not looked up: the
    process's map costs 1.4 ms to read at 500 tensors."""
    spans = ((_dest_span(it), it.key) for it in items if it.dest.is_cpu and not _allocated(it.dest))
    ranges = sorted((*span, key) for span, key in spans if span is not None)
    if not ranges:
        return []
    rows = memory.mappings()
    if rows is None:  # no procfs: the reads report EFAULT instead
        return []
    maps = [(lo, hi, "w" in perms) for lo, hi, perms, _ in rows]
    starts = [m[0] for m in maps]
    bad = []
    for lo, hi, key in ranges:
        i = bisect.bisect_right(starts, lo) - 1
        at = lo
        while at < hi and 0 <= i < len(maps) and maps[i][0] <= at < maps[i][1] and maps[i][2]:
            at = maps[i][1]
            i += 1
        if at < hi:
            bad.append(("destination", key, f"{key!r}: the destination's memory is not writable"))
    return bad


def _temp_device(dest: torch.Tensor) -> torch.device:
    return dest.device if dest.is_cpu or dest.is_cuda else torch.device("cpu")


def _batches(items: list[Item], budget: int) -> list[list[Item]]:
    """Direct reads all in the first batch; temporaries up to ``budget`` bytes a batch."""
    first = [it for it in items if it.direct]
    out: list[list[Item]] = [first]
    used = 0
    for it in items:
        if it.direct:
            continue
        if used and used + it.nbytes > budget:
            out.append([])
            used = 0
        out[-1].append(it)
        used += it.nbytes
    return [b for b in out if b]


def execute(
    p: Plan,
    io: IoOptions,
    *,
    items: Sequence[Item] | None = None,
    verify: bool = False,
    temp_budget: int = TEMP_BUDGET,
) -> list[dict[str, Any]]:
    """Fill the destinations of ``items`` (default: all of the plan's) and
    return the native reports of the reads (one per file and batch, with
    "path"). Direct items are read in one engine pass per file (files in
    parallel); temporaries in batches of at most ``temp_budget`` bytes, each
    copied into its destination on the current stream. The destinations'
    version counters are bumped, as an in-place copy does. Any failure once
    reading began is a :class:`PartialLoadError`."""
    if p.problems:
        raise ValueError("a plan with problems cannot be executed")
    todo = list(p.items if items is None else items)
    ordered = [it for it in todo if it.ordered]
    reads = [it for it in todo if it.file is not None and it.nbytes and not it.ordered]
    copies = [it for it in todo if it.file is None and not it.ordered]
    stats: list[dict[str, Any]] = []
    started = False
    shared = sharing.current()
    if shared is not None:  # read once over the group: every rank agrees first
        pieces = [_piece(it, verify) for it in reads]
        shared.agree(p.files, pieces, verify)
        reads = []
    try:
        if shared is not None:
            started = True
            stats.append(shared.share(p.files, pieces, io, verify))
        for batch in _batches(reads, temp_budget):
            per_file: dict[int, tuple[list[transfer.Segment], list[Any]]] = {}
            temps: list[tuple[Item, torch.Tensor]] = []
            for it in batch:
                assert it.file is not None
                if it.direct:
                    mem: torch.Tensor = it.dest
                else:
                    mem = torch.empty(it.nbytes, dtype=torch.uint8, device=_temp_device(it.dest))
                    temps.append((it, mem))
                segs, owners = per_file.setdefault(it.file, ([], []))
                dev = devices.device_code(mem, it.key)
                segs.append((it.offset, mem.data_ptr(), it.nbytes, dev))
                owners.append(mem)
            started = True
            stats += transfer.read_files(p.files, per_file, io, verify)
            with torch.no_grad():
                for it, tmp in temps:
                    made = cast(torch.Tensor, it.src)  # a Placeholder only in a direct item
                    view = tmp.view(made.dtype).as_strided(made.shape, made.stride())
                    it.dest.copy_(view)
            del temps
        if copies:
            started = True
            with torch.no_grad():
                for it in copies:
                    it.dest.copy_(cast(torch.Tensor, it.src))  # not direct: a tensor
        for it in ordered:  # one by one, in order (see Item.ordered)
            started = True
            src: torch.Tensor = unpickled.tensor(it.src)
            if it.file is not None and it.nbytes:
                tmp = torch.empty(it.nbytes, dtype=torch.uint8, device=_temp_device(it.dest))
                seg = (it.offset, tmp.data_ptr(), it.nbytes, devices.device_code(tmp, it.key))
                stats += transfer.read_files(p.files, {it.file: ([seg], [tmp])}, io, verify)
                src = tmp.view(src.dtype).as_strided(src.shape, src.stride())
            with torch.no_grad():
                it.dest.copy_(src)
    except Exception as e:
        if not started:
            raise
        where = ", ".join(sorted({f.path for f in p.files})) or "the checkpoint"
        raise partial_error(f"reading {where} into the destinations failed midway", e) from e
    direct = [it.dest for it in todo if it.file is not None and it.direct]
    if direct:
        # The engine wrote through the data pointers: tell autograd, as copy_ would.
        torch.autograd.graph.increment_version([d for d in direct if not d.is_inference()])
    return stats


def _piece(it: Item, verify: bool) -> sharing.Piece:
    """An item as the group's read takes it: straight into its destination,
    or through a buffer that is then copied into it."""
    assert it.file is not None
    if it.direct:
        target = sharing.as_bytes(it.dest, it.dest.data_ptr(), it.nbytes)
        return sharing.Piece(
            it.file, it.offset, it.nbytes, it.dest.device, target, splittable=not verify
        )

    def finish(tmp: torch.Tensor) -> None:
        src = cast(torch.Tensor, it.src)  # a Placeholder only in a direct item
        it.dest.copy_(tmp.view(src.dtype).as_strided(src.shape, src.stride()))

    return sharing.Piece(
        it.file, it.offset, it.nbytes, _temp_device(it.dest), None, finish, splittable=False
    )


def _finish_verify(p: Plan, io: IoOptions, stats: list[dict[str, Any]]) -> tuple[str, ...]:
    """After a read with verify=True: check the data records no read covered
    whole; the records that could not be checked."""
    done: set[str] = set()
    unchecked: list[str] = []
    for s in stats:
        done |= set(s.get("verified", ())) | set(s.get("unchecked", ()))
        unchecked += s.get("unchecked", ())
    engine = io.engine()
    for f in p.files:
        if not isinstance(f.file, _native.Reader):
            continue
        data_prefix = f"{f.file.prefix}/data/"
        rest = [n for n, _, _ in f.file.records() if n.startswith(data_prefix) and n not in done]
        if rest:
            try:
                rows = f.file.verify(engine, rest, strict=True)
            except FormatError as e:
                what = f"{f.path}: a record failed its CRC-32 check after it was read"
                raise partial_error(what, e) from e
            unchecked += [n for n, state, _, _ in rows if state == "unchecked"]
    return tuple(unchecked)


def fill(
    pairs: Iterable[tuple[str, torch.Tensor, Any]],
    files: Sequence[Mapped],
    io: IoOptions,
    *,
    what: str,
    cast: bool = False,
    exact_shape: bool = True,
    t0: float | None = None,
    verify: bool = False,
) -> Plan:
    """Plan and execute ``pairs`` (raising the plan's problems, nothing written)
    and leave the report in ``last_report()``."""
    t0 = time.perf_counter() if t0 is None else t0
    p = plan(pairs, files, cast=cast, exact_shape=exact_shape)
    if p.problems:
        raise_problems(
            f"{what}: cannot load in place:",
            [t for _, _, t in p.problems],
            p.problems,
            partial=False,
        )
    stats = execute(p, io, verify=verify)
    report_plan(p, io, stats, t0, verify)
    return p


def report_plan(
    p: Plan,
    io: IoOptions,
    stats: list[dict[str, Any]],
    t0: float,
    verify: bool,
    missing: Sequence[str] = (),
    unexpected: Sequence[str] = (),
) -> reports.IOReport:
    unchecked = _finish_verify(p, io, stats) if verify else ()
    path = (
        p.files[0].path
        if len(p.files) == 1
        else os.path.commonpath([f.path for f in p.files] or ["."])
    )
    stats_ = reports.merged(stats, io.backend)
    return reports.report(
        path, t0, stats_, len(p.items), verify, unchecked, tuple(missing), tuple(unexpected)
    )


def fill_structure(
    what: str,
    src: Any,
    out: Any,
    files: list[Mapped],
    io: IoOptions,
    *,
    strict: bool,
    cast: bool,
    verify: bool = False,
    t0: float,
) -> Any:
    """Pair a decoded checkpoint ``src`` with ``out`` by key path, check
    everything, read; the filled structure (see ``ckptio.load``'s ``out``)."""
    result, pairs, missing, unexpected = pair_structure(src, out)
    problems: list[Problem] = []
    lines: list[str] = []
    if strict and missing:
        problems += [("missing", k, "") for k in missing]
        lines.append(
            _keys_line("Missing key(s): destinations the checkpoint has no tensor for", missing)
        )
    if strict and unexpected:
        problems += [("unexpected", k, "") for k in unexpected]
        lines.append(
            _keys_line("Unexpected key(s): checkpoint tensors without a destination", unexpected)
        )
    p = plan(pairs, files, cast=cast)
    problems += p.problems
    lines += [t for _, _, t in p.problems]
    if problems:
        raise_problems(
            f"{what}: cannot load in place:",
            lines,
            problems,
            missing=missing,
            unexpected=unexpected,
            partial=False,
        )
    stats = execute(p, io, verify=verify)
    report_plan(p, io, stats, t0, verify, missing, unexpected)
    return result


def detach_kept(files: Sequence[Mapped]) -> None:
    """Where a tensor of the checkpoint outlives the load (user code keeping one:
    a hook that stores one, an override passing assign=True; a value of
    ``load(out=)``'s result in a container the walk does not enter, a set), it
    views the file's mapping: a rewrite of the file would change it and a
    truncation kill the process (SIGBUS), where torch.load's tensors are the
    process's own memory. Such a mapping becomes private memory holding the
    same bytes (a copy of the file, as torch.load makes); nothing is copied
    where nothing was kept. The caller holds no source of its own any more."""
    if not any(m.viewed() for m in files):
        return
    gc.collect()  # views held only by cycles of the load's own objects
    for m in files:
        if m.viewed():
            m.detach()


def check_flags(**flags: Any) -> None:
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, not {type(v).__name__}")
