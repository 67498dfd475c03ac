"""``ckptio.load_state_dict``: what ``module.load_state_dict(torch.load(path))`` and
``optimizer.load_state_dict(torch.load(path))`` do, with the checkpoint's tensors
read straight into the module's and optimizer's own tensors (the planning and
reading of :mod:`ckptio.inplace`).

Modules run torch's own steps: ``Module.load_state_dict``'s walk (replayed here,
without ``assign``) calls each submodule's ``_load_from_state_dict`` (overrides
and load_state_dict pre-hooks included) under :class:`_Deferred`, a torch
function mode that records each ``copy_`` from the checkpoint's mapping instead
of running it; the copies are planned and read in one engine pass before the
post-hooks, after every check passed. Where every submodule loads with torch's
default steps alone, :func:`_plain_walk` gives the same copies, keys and messages
without running them (torch's walk costs 50 ms per 512 tensors). Optimizers replay
``Optimizer.load_state_dict``'s steps with destinations chosen by its rules.
:func:`lazy_load` hands over a checkpoint whose large tensors are read on use
(the Lightning plugin's restore path). See docs/inplace.md.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from copy import deepcopy
from typing import Any, NoReturn

import torch
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from ckptio.errors import CkptioError, FormatError
from ckptio.formats import detect, torchzip, unpickled
from ckptio.formats import safetensors as st_format
from ckptio.formats.mapped import Mapped
from ckptio.formats.unpickled import Placeholder
from ckptio.io import devices, memory, paths, remote, reports
from ckptio.io.engines import IoOptions
from ckptio.loading import sharing, stored
from ckptio.loading.inplace import (
    Files,
    Plan,
    Problem,
    check_flags,
    detach_kept,
    execute,
    fill,
    key_name,
    materialize,
    plan,
    raise_problems,
    replace_tensors,
    report_plan,
)

__all__ = ["load_state_dict"]


#: Tensor methods and attributes that read no element: calls of these on a
#: destination with a copy pending do not run the pending copies first.
_INERT = frozenset(
    {
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.stride,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.storage_offset,
        torch.Tensor.is_contiguous,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.get_device,
        torch.Tensor.__len__,
        torch.Tensor.requires_grad_,
    }
)


def _inert(func: Any) -> bool:
    return func in _INERT or getattr(func, "__name__", None) == "__get__"


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage (wrapper subclasses)
        return None


def _touches(obj: Any, storages: set[Any]) -> bool:
    if isinstance(obj, torch.Tensor):
        return _storage_key(obj) in storages
    if isinstance(obj, (list, tuple)):
        return any(_touches(o, storages) for o in obj)
    if isinstance(obj, dict):
        return any(_touches(o, storages) for o in obj.values())
    return False


#: Dunder methods that write their first argument.
_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ "
    "__iand__ __ior__ __ixor__ __ilshift__ __irshift__ __imatmul__".split()
)


#: In-place methods that leave the elements as they are.
_NOT_DATA = frozenset({"requires_grad_", "share_memory_", "retain_grad_"})

#: Calls that hand a tensor's memory to code no torch function mode sees (NumPy,
#: DLPack): a write through what they return cannot be seen, so they count as one.
_HANDED_OUT = frozenset({"numpy", "__array__", "__dlpack__"})


def _written(func: Any, args: Sequence[Any], kwargs: Any) -> list[Any]:
    """What a call writes in place: an in-place method's tensor (``mul_``,
    ``__setitem__``), a functional's with ``inplace=True`` (``F.relu``), the
    tensors of ``torch._foreach_*_``, ``out=``; or may write later: a tensor
    handed to NumPy or DLPack (:data:`_HANDED_OUT`)."""
    name = getattr(func, "__name__", "")
    found: list[Any] = []
    if args and (
        name in _INPLACE_DUNDERS
        or name in _HANDED_OUT
        or (name.endswith("_") and name[:1] != "_" and name not in _NOT_DATA)
        or (kwargs and kwargs.get("inplace") is True)
    ):
        found.append(args[0])
    if args and name.startswith("_foreach_") and name.endswith("_"):
        found.extend(args[0] if isinstance(args[0], (tuple, list)) else (args[0],))
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        found.extend(out if isinstance(out, (tuple, list)) else (out,))
    return found


class _Changes(TorchFunctionMode):
    """While active, a call that writes a view of a checkpoint mapping in
    place (user code: a hook, an override; :func:`_written`) makes that file's
    tensors copied from the mapping from then on (``Files.changed``), so that
    they hold the change as torch.load's tensors would; :meth:`before_change`
    runs first. Writes that pass no torch function are not seen: through
    ``data_ptr()`` (ctypes), ``untyped_storage()``'s methods,
    ``torch.utils.dlpack.to_dlpack``."""

    def __init__(self, files: Files) -> None:
        super().__init__()
        self.files = files

    def before_change(self) -> None:
        pass

    def note_changes(self, func: Any, args: Sequence[Any], kwargs: Any) -> None:
        changed = [t for t in _written(func, args, kwargs) if self.files.locate(t) is not None]
        if changed:
            self.before_change()
            for t in changed:
                self.files.changed(t)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self.note_changes(func, args, kwargs)
        return func(*args, **kwargs)


class _Deferred(_Changes):
    """While active, ``dest.copy_(src)`` from a view of a checkpoint mapping into
    a tensor that is not one (and that autograd lets be written: no grad mode
    with a ``dest`` that requires grad) is recorded instead of run (``eager``:
    read at once through the engine); any
    other call that uses a destination with a recorded copy runs the recorded
    copies first (:meth:`flush`, through ``read``), so code that reads what it
    copied sees the data. ``read`` and ``eager`` run with the mode passing every
    call through; they must not refer to the mode (a cycle would keep the
    load's tensors and mappings alive until the next garbage collection)."""

    def __init__(
        self,
        files: Files,
        names: dict[int, str],
        read: Callable[[list[tuple[str, torch.Tensor, torch.Tensor]]], None],
        eager: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        super().__init__(files)
        self.names = names
        self.read = read
        self.eager = eager
        self.pending: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.storages: set[Any] = set()
        self.passthrough = False

    def before_change(self) -> None:
        self.flush()  # the copies recorded before a change read the file's bytes

    def flush(self) -> None:
        """Read the recorded copies (if any)."""
        pending, self.pending, self.storages = self.pending, [], set()
        if pending:
            self._through(self.read, pending)

    def _through(self, fn: Callable[..., None], *args: Any) -> None:
        self.passthrough = True
        try:
            fn(*args)
        finally:
            self.passthrough = False

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.passthrough:
            return func(*args, **kwargs)
        if (
            func is torch.Tensor.copy_
            and len(args) == 2
            and isinstance(args[0], torch.Tensor)
            and args[0].device.type != "meta"
            and self.files.locate(args[1]) is not None
            # (into a checkpoint tensor: a change of the checkpoint, run below)
            and self.files.locate(args[0]) is None
            # (autograd's to check: torch refuses a leaf that requires grad)
            and not (torch.is_grad_enabled() and args[0].requires_grad)
        ):
            dest, src = args
            key = self.names.get(id(dest), "<tensor>")
            if self.eager is not None:
                self._through(self.eager, key, src, dest)
                return dest
            self.pending.append((key, src, dest))
            k = _storage_key(dest)
            if k is not None:
                self.storages.add(k)
            return dest
        if self.storages and not _inert(func) and _touches((args, kwargs), self.storages):
            self.flush()
        self.note_changes(func, args, kwargs)
        return func(*args, **kwargs)


def _replay(
    mod: torch.nn.Module,
    local_state_dict: Mapping[str, Any],
    prefix: str,
    metadata: Any,
    mode: _Deferred,
    missing: list[str],
    unexpected: list[str],
    error_msgs: list[str],
) -> None:
    """torch's walk of ``load_state_dict`` (its ``load``), under ``mode``: each
    submodule's ``_load_from_state_dict`` and post hooks run as torch runs them.
    A function of the module, not a closure: a recursive closure is a cycle."""
    from torch.nn.modules.module import _IncompatibleKeys

    local_metadata = {} if metadata is None else metadata.get(prefix[:-1], {})
    mod._load_from_state_dict(
        local_state_dict, prefix, local_metadata, True, missing, unexpected, error_msgs
    )
    for name, child in mod._modules.items():
        if child is not None:
            child_prefix = prefix + name + "."
            child_state_dict = {
                k: v for k, v in local_state_dict.items() if k.startswith(child_prefix)
            }
            _replay(
                child,
                child_state_dict,
                child_prefix,
                metadata,
                mode,
                missing,
                unexpected,
                error_msgs,
            )
    hooks = list(mod._load_state_dict_post_hooks.values())
    if hooks:
        mode.flush()  # a post hook sees the data, as after torch's copies
        incompatible_keys = _IncompatibleKeys(missing, unexpected)
        for hook in hooks:
            out = hook(mod, incompatible_keys)
            if out is not None:
                raise AssertionError(
                    "Hooks registered with ``register_load_state_dict_post_hook`` are not "
                    "expected to return new values, if incompatible_keys need to be modified, "
                    "it should be done inplace."
                )


_SIZE_MISMATCH = re.compile(r"size mismatch for (\S+?):")
_COPYING = re.compile(r'While (?:copying|swapping) the parameter named "([^"]+)"')


def _torch_problem(msg: str) -> Problem:
    m = _SIZE_MISMATCH.match(msg)
    if m:
        return ("shape", m.group(1), msg)
    m = _COPYING.match(msg)
    return ("error", m.group(1) if m else "", msg)


class _Run:
    """One load_state_dict: its files, options, reads and problems."""

    def __init__(self, files: list[Mapped], io: IoOptions, cast: bool, verify: bool) -> None:
        self.files = files
        self.located = Files(files)
        self.io = io
        self.cast = cast
        self.verify = verify
        self.stats: list[dict[str, Any]] = []
        self.plans: list[Plan] = []
        self.problems: list[Problem] = []
        self.wrote = False
        #: Whether user code (hooks, overrides) got the checkpoint's tensors,
        #: views of the files' mappings that it may keep: see detach_kept.
        self.exposed = False

    def expose(self, state_dict: Any) -> Any:
        """``state_dict`` with its tensors made, for user code (see ``exposed``)."""
        self.exposed = True
        return materialize(state_dict)

    def run(
        self, pairs: list[tuple[str, torch.Tensor, Any]], *, exact_shape: bool, fresh: bool = False
    ) -> bool:
        """Plan and read ``pairs``; False (nothing read) where the plan has problems.
        ``fresh``: the destinations are new tensors of the load's own, not the
        caller's (nothing of the caller's is written)."""
        if not pairs:
            return True
        p = plan(pairs, self.files, cast=self.cast, exact_shape=exact_shape)
        if p.problems:
            self.problems += p.problems
            return False
        self.wrote = self.wrote or not fresh
        self.plans.append(p)
        self.stats += execute(p, self.io, verify=self.verify)
        return True

    def report(
        self, t0: float, missing: Sequence[str] = (), unexpected: Sequence[str] = ()
    ) -> None:
        items = [it for p in self.plans for it in p.items]
        whole = Plan(self.files, items, [], [])
        report_plan(whole, self.io, self.stats, t0, self.verify, missing, unexpected)


def _load_module(
    module: torch.nn.Module, state_dict: Any, run: _Run, *, strict: bool, t0: float
) -> Any:
    """``module.load_state_dict(state_dict, strict)`` (torch's own steps, and its
    hooks and ``_load_from_state_dict`` overrides), each copy from the
    checkpoint read straight into the parameter or buffer."""
    from torch.nn.modules.module import _IncompatibleKeys

    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    names: dict[int, str] = {}  # a destination's first name, for messages

    def name_all() -> None:
        for n, t in itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        ):
            names.setdefault(id(t), n)

    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        state_dict = run.expose(state_dict)
        name_all()

        # An override of load_state_dict: it runs as is, each copy read at once.
        def now(key: str, src: torch.Tensor, dest: torch.Tensor) -> None:
            if not run.run([(key, src, dest)], exact_shape=False):
                p = run.problems[-1]
                raise_problems("", [p[2]], [p], partial=run.wrote)

        mode = _Deferred(run.located, names, lambda _: None, eager=now)
        # A copy refused here (a dtype unless cast=True) raises inside torch's
        # _load_from_state_dict, which makes any error of a copy a line of its
        # RuntimeError and goes on copying (an override may even let that
        # pass): the typed error then, saying whether some were written.
        try:
            with mode:
                result = module.load_state_dict(state_dict, strict)
        except Exception:
            if run.problems:
                _refused(module, run)  # (torch's error as its context)
            raise
        if run.problems:
            _refused(module, run)
        # What the override returns, as torch's call returns it (None from one
        # that does not return super()'s).
        missing_keys = getattr(result, "missing_keys", ())
        run.report(t0, missing_keys, getattr(result, "unexpected_keys", ()))
        return result

    missing: list[str] = []
    unexpected: list[str] = []
    error_msgs: list[str] = []

    def read(pending: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        if not error_msgs and not run.problems:
            run.run(pending, exact_shape=False)

    mode = _Deferred(run.located, names, read)

    # torch.nn.Module.load_state_dict, without assign: a copy so that
    # _load_from_state_dict may change it; children get the keys under their prefix.
    metadata = getattr(state_dict, "_metadata", None)
    state_dict = OrderedDict(state_dict)
    if metadata is not None:
        state_dict._metadata = metadata  # type: ignore[attr-defined]
    # set_extra_state keeps what it is given: tensors of its own, as from torch.load.
    extra: list[tuple[str, torch.Tensor, Any]] = []
    for k in state_dict:
        if k.endswith(_EXTRA_STATE_KEY_SUFFIX):
            state_dict[k] = replace_tensors(state_dict[k], _fresh_into(run, extra, (k,)))
    if not run.run(extra, exact_shape=True, fresh=True):
        raise_problems(
            f"Error(s) in loading state_dict for {module.__class__.__name__}:",
            [t for _, _, t in run.problems],
            run.problems,
            partial=False,
        )

    fast = _plain_walk(module, state_dict, metadata)
    if fast is not None:
        mode.pending, missing, unexpected, error_msgs = fast
    else:
        run.expose(state_dict)  # (its values, in place)
        name_all()
        with mode:
            _replay(module, state_dict, "", metadata, mode, missing, unexpected, error_msgs)
    if strict:
        if unexpected:
            error_msgs.insert(
                0,
                "Unexpected key(s) in state_dict: {}. ".format(
                    ", ".join(f'"{k}"' for k in unexpected)
                ),
            )
        if missing:
            error_msgs.insert(
                0,
                "Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)),
            )
    if not error_msgs and not run.problems:
        mode.flush()
    if error_msgs or run.problems:
        problems: list[Problem] = []
        keyed = 0  # the key lines inserted above
        if strict:
            problems += [("missing", k, "") for k in missing]
            problems += [("unexpected", k, "") for k in unexpected]
            keyed = bool(missing) + bool(unexpected)
        problems += [_torch_problem(m) for m in error_msgs[keyed:]]
        problems += run.problems
        lines = error_msgs + [t for _, _, t in run.problems]
        raise_problems(
            f"Error(s) in loading state_dict for {module.__class__.__name__}:",
            lines,
            problems,
            missing=missing,
            unexpected=unexpected,
            partial=run.wrote,
        )
    run.report(t0, missing, unexpected)
    return _IncompatibleKeys(missing, unexpected)


def _refused(module: torch.nn.Module, run: _Run) -> NoReturn:
    _raise_run(f"Error(s) in loading state_dict for {module.__class__.__name__}:", run)


def _raise_run(head: str, run: _Run) -> NoReturn:
    """The typed error of ``run``'s problems, under ``head`` (torch's first line)."""
    raise_problems(head, [t for _, _, t in run.problems], run.problems, partial=run.wrote)


def _plain_module(m: torch.nn.Module) -> bool:
    """Whether ``m`` loads with torch's default steps alone: no
    ``_load_from_state_dict`` or ``set_extra_state`` override, no load hooks,
    no lazy or meta tensors."""
    return _plain_state(m) is not None


_Module = torch.nn.Module
_DEFAULT_LOAD = _Module._load_from_state_dict
_DEFAULT_EXTRA = _Module.set_extra_state
# what is_lazy() tests (in torch.nn.parameter's __all__; its .pyi stub omits it)
_LAZY = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]
_Tensor = torch.Tensor


def _plain_state(m: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """What a :func:`_plain_module` ``m``'s default ``_load_from_state_dict``
    loads (its parameters, then its persistent buffers, by name); None where
    ``m`` is not plain."""
    cls = type(m)
    # torch's walk calls the instance's method (an override may be set on the
    # instance); it looks set_extra_state up on the class.
    if (
        cls._load_from_state_dict is not _DEFAULT_LOAD
        or "_load_from_state_dict" in m.__dict__
        or getattr(cls, "set_extra_state", _DEFAULT_EXTRA) is not _DEFAULT_EXTRA
        or m._load_state_dict_pre_hooks
        or m._load_state_dict_post_hooks
    ):
        return None
    own: dict[str, torch.Tensor] = {}
    for k, t in m._parameters.items():
        if t is not None:
            if t.is_meta or isinstance(t, _LAZY):
                return None
            own[k] = t
    if m._buffers:  # two loops: one over both tables cost the walk 8-10%
        skip = m._non_persistent_buffers_set
        for k, b in m._buffers.items():
            if b is not None:
                if b.is_meta or isinstance(b, _LAZY):
                    return None
                if k not in skip:
                    own[k] = b
    return own


class _Keys:
    """A state dict's keys split at their dots, once: ``leaves`` (the last
    part -> (position in the dict, key, value)) and ``kids`` (a first part ->
    the keys below it). torch's walk looks at every key once per module above
    it (686 modules, 512 keys: 6 ms on the dev VM); this, once per key."""

    __slots__ = ("leaves", "kids")

    def __init__(self) -> None:
        self.leaves: dict[str, tuple[int, str, Any]] = {}
        self.kids: dict[str, _Keys] = {}

    @staticmethod
    def of(state_dict: Mapping[str, Any]) -> _Keys | None:
        """None where a key is not a str (torch's walk then decides)."""
        root = _Keys()
        for i, (key, value) in enumerate(state_dict.items()):
            if not isinstance(key, str):
                return None
            *path, leaf = key.split(".")
            node = root
            for part in path:
                kid = node.kids.get(part)
                if kid is None:
                    kid = node.kids[part] = _Keys()
                node = kid
            node.leaves[leaf] = (i, key, value)
        return root

    def all(self) -> Iterable[tuple[int, str, Any]]:
        yield from self.leaves.values()
        for kid in self.kids.values():
            yield from kid.all()


_NO_KEYS = _Keys()


def _plain_walk(
    module: torch.nn.Module, state_dict: Mapping[str, Any], metadata: Any
) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list[str], list[str], list[str]] | None:
    """(copies, missing, unexpected, error messages) of ``Module.load_state_dict``
    where every submodule is :func:`_plain_module` (and no swap or assign):
    torch's walk and default ``_load_from_state_dict`` (called with strict=True
    whatever the caller's, as torch does) in the same order, each own tensor's
    key looked up (:func:`_walk_keys`; where some key is no module's own
    tensor, every key looked at once in a key tree, :class:`_Keys`, to list the
    unexpected ones in torch's order) instead of every key once per module
    above it, and no torch function mode around every call (together 50 ms per
    512 tensors on the H200 host). Copies are named by a destination's first name, as ``names`` in
    :func:`_load_module`; a source that is not a view of the checkpoint's mapping
    is copied after the reads (the plan keeps the last copy into a destination,
    as torch's copies leave it). None where it does not apply (then torch's walk
    runs)."""
    if torch.__future__.get_swap_module_params_on_conversion():
        return None
    if isinstance(metadata, Mapping) and _assigns(metadata):
        return None
    found: _Found = ([], [], [], [], {})
    matched = _walk_keys(module, state_dict, "", found)
    if matched is None:
        return None
    if matched != len(state_dict):
        # Keys that are no module's own tensor: the walk over the key tree,
        # which finds them in torch's order.
        keys = _Keys.of(state_dict)
        if keys is None:
            return None
        found = ([], [], [], [], {})
        if not _walk_plain(module, keys, "", found):
            return None
    copies, missing, unexpected, errors, _ = found
    return copies, missing, unexpected, errors


def _assigns(metadata: Mapping[str, Any]) -> bool:
    """Whether a module's metadata asks torch to assign (not copy) its tensors."""
    for m in metadata.values():  # a loop: a generator cost 0.6 ms per 690 modules
        if isinstance(m, Mapping) and m.get("assign_to_params_buffers"):
            return True
    return False


#: What :func:`_walk_plain` finds: copies, missing keys, unexpected keys, error
#: messages, and each destination's first name (by id).
_Found = tuple[
    list[tuple[str, torch.Tensor, torch.Tensor]], list[str], list[str], list[str], dict[int, str]
]


def _walk_plain(mod: torch.nn.Module, node: _Keys, prefix: str, found: _Found) -> bool:
    """:func:`_plain_walk`'s visit of ``mod`` and its children (False: a child
    is not plain). A function of the module, not a closure: a recursive closure
    is a cycle, which would keep the load's tensors alive until the next
    garbage collection."""
    missing, unexpected, first = found[1], found[2], found[4]
    own = _plain_state(mod)
    if own is None:
        return False
    leaves = node.leaves
    hits = 0  # own tensors the checkpoint has: fewer than leaves means unexpected ones
    for name, dest in own.items():
        key = prefix + name
        leaf = leaves.get(name)
        if leaf is None:
            first.setdefault(id(dest), key)
            missing.append(key)
            continue
        hits += 1
        _take(key, leaf[2], dest, found)
    # torch lists the extra state first, then the others in the dict's order.
    odd = []
    if _EXTRA in leaves:
        unexpected.append(leaves[_EXTRA][1])
        hits += _EXTRA not in own  # (a parameter may bear that name)
    if hits < len(leaves):
        odd = [v for k, v in leaves.items() if k not in own and k != _EXTRA]
    children = mod._modules
    kids = node.kids
    for head, kid in kids.items():
        if head not in children:
            odd.extend(kid.all())
    if odd:
        unexpected.extend(key for _, key, _ in sorted(odd, key=lambda leaf: leaf[0]))
    for name, child in children.items():
        if child is not None and not _walk_plain(
            child, kids.get(name, _NO_KEYS), f"{prefix}{name}.", found
        ):
            return False
    return True


def _walk_keys(
    mod: torch.nn.Module, state_dict: Mapping[str, Any], prefix: str, found: _Found
) -> int | None:
    """:func:`_walk_plain` without the key tree: each own tensor looked up by
    its key, unexpected keys not looked for. The number of keys that were own
    tensors (none an ``_extra_state``: torch lists those as unexpected), or
    None where a module is not plain. Where it is the number of keys, no key
    is unexpected and this walk found what :func:`_walk_plain` would."""
    missing, first = found[1], found[4]
    own = _plain_state(mod)
    if own is None:
        return None
    hits = 0
    for name, dest in own.items():
        key = prefix + name
        src = state_dict.get(key, _ABSENT)
        if src is _ABSENT:
            first.setdefault(id(dest), key)
            missing.append(key)
            continue
        hits += name != _EXTRA
        _take(key, src, dest, found)
    for name, child in mod._modules.items():
        if child is not None:
            n = _walk_keys(child, state_dict, f"{prefix}{name}.", found)
            if n is None:
                return None
            hits += n
    return hits


_ABSENT = object()


def _take(key: str, src: Any, dest: torch.Tensor, found: _Found) -> None:
    """The copy of checkpoint value ``src`` into own tensor ``dest`` at ``key``
    (torch's default ``_load_from_state_dict``), or the error it raises."""
    copies, errors, first = found[0], found[3], found[4]
    named = first.setdefault(id(dest), key)
    kind = type(src)
    if kind is not Placeholder and kind is not _Tensor and not torch.overrides.is_tensor_like(src):
        errors.append(
            f'While copying the parameter named "{key}", expected torch.Tensor or '
            f"Tensor-like object from checkpoint but received {type(src)}"
        )
        return
    shape = dest.shape
    if src.shape != shape:
        if not shape and src.shape == (1,):
            src = unpickled.tensor(src)[0]
        else:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {src.shape} "
                f"from checkpoint, the shape in current model is {shape}."
            )
            return
    copies.append((named, src, dest))


_EXTRA = _EXTRA_STATE_KEY_SUFFIX


def _load_optimizer(opt: torch.optim.Optimizer, state_dict: Any, run: _Run, *, t0: float) -> None:
    """``optimizer.load_state_dict(state_dict)`` (torch 2.15's steps and hooks),
    its state tensors filled in place: a state tensor the optimizer has already
    (same shape, and the dtype and device torch's rules give it) is filled;
    others are made as torch makes them, then filled."""
    if type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        # An override: it gets the checkpoint's tensors, read first (as
        # torch.load would give them).
        fresh: list[tuple[str, torch.Tensor, Any]] = []
        state_dict = replace_tensors(state_dict, _fresh_into(run, fresh))
        if not run.run(fresh, exact_shape=True, fresh=True):
            _raise_optimizer(opt, run)
        opt.load_state_dict(state_dict)
        run.report(t0)
        return
    state_dict = state_dict.copy()
    if opt._optimizer_load_state_dict_pre_hooks:  # user code: it gets tensors
        state_dict = run.expose(state_dict)
    with _Changes(run.located):  # a hook may change the checkpoint's tensors in place
        for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(opt, state_dict)
            if hook_result is not None:
                state_dict = hook_result
    groups = opt.param_groups
    # Tensors in param_groups (a tensor lr) are read now: they are deep-copied.
    early: list[tuple[str, torch.Tensor, Any]] = []
    state_dict["param_groups"] = replace_tensors(
        state_dict["param_groups"], _fresh_into(run, early, ("param_groups",))
    )
    if not run.run(early, exact_shape=True, fresh=True):
        _raise_optimizer(opt, run)
    saved_groups = deepcopy(state_dict["param_groups"])
    if len(groups) != len(saved_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    param_lens = (len(g["params"]) for g in groups)
    saved_lens = (len(g["params"]) for g in saved_groups)
    if any(p_len != s_len for p_len, s_len in zip(param_lens, saved_lens, strict=True)):
        raise ValueError(
            "loaded state dict contains a parameter group "
            "that doesn't match the size of optimizer's group"
        )
    id_map = dict(
        zip(
            itertools.chain.from_iterable(g["params"] for g in saved_groups),
            itertools.chain.from_iterable(g["params"] for g in groups),
            strict=True,
        )
    )
    pairs: list[tuple[str, torch.Tensor, Any]] = []
    shapes: list[Problem] = []
    # Each parameter id's (fused, capturable): its first saved group's, as
    # Optimizer._process_value_according_to_param_policy finds it by searching
    # every group's ids for each tensor.
    policy: dict[Any, tuple[Any, Any]] = {}
    for pg in state_dict["param_groups"]:
        flags = (pg.get("fused", False), pg.get("capturable", False))
        for i in pg["params"]:
            if isinstance(i, Hashable):  # (a state key is)
                policy.setdefault(i, flags)

    reused: set[int] = set()  # the optimizer's state tensors taken as destinations

    def destination(
        param: torch.Tensor,
        value: Any,
        param_id: Any,
        key: Any,
        path: tuple[Any, ...],
    ) -> torch.Tensor:
        # Optimizer._process_value_according_to_param_policy's dtype and device.
        fused, capturable = policy.get(param_id, (False, False))
        where = run.located.locate(value)
        if where is None:
            value = unpickled.tensor(value)
        if key == "step":
            if capturable or fused:
                dtype, device = torch.float32, param.device
            elif where is None:
                return value
            else:  # kept as loaded: on the device torch.load restores it to
                dtype = value.dtype
                device = devices.engine_device(run.files[where[0]].location(value)) or torch.device(
                    "cpu"
                )
        else:
            dtype = param.dtype if param.is_floating_point() else value.dtype
            device = param.device
        if where is None:  # not the checkpoint's bytes (a pre-hook made it)
            return value.to(dtype=dtype, device=device)
        state: Any = opt.state.get(param)  # (None: the optimizer has none for it)
        # A state tensor the optimizer has: a top-level one (a nested key of the
        # same name is another tensor), and one no other entry of this load
        # fills (torch makes a tensor per entry: state tensors shared before
        # the load are not after it).
        top = isinstance(state, dict) and key is not None and len(path) == 3
        have = state.get(key) if top else None
        if isinstance(have, torch.Tensor) and id(have) in reused:
            have = None
        name = key_name(path)
        if isinstance(have, torch.Tensor) and have.shape != value.shape:
            shapes.append(
                (
                    "shape",
                    name,
                    f"size mismatch for {name!r}: the checkpoint holds {tuple(value.shape)}, "
                    f"the optimizer's state is {tuple(have.shape)}",
                )
            )
            return have
        if (
            isinstance(have, torch.Tensor)
            and have.dtype == dtype
            and have.device == torch.device(device)
        ):
            dest = have
            reused.add(id(have))
        elif type(value) is Placeholder and value.contiguous:
            dest = torch.empty(value.shape, dtype=dtype, device=device)  # (empty_like's)
        else:
            dest = torch.empty_like(unpickled.tensor(value), dtype=dtype, device=device)
        pairs.append((name, value, dest))
        return dest

    state: defaultdict[Any, Any] = defaultdict(dict)
    for k, v in state_dict["state"].items():
        if k in id_map:
            param = id_map[k]
            state[param] = _cast(destination, param, v, k, path=("state", k))
        else:  # kept as loaded
            state[k] = replace_tensors(v, _fresh_into(run, pairs, ("state", k)))
    run.problems += shapes
    if run.problems or not run.run(pairs, exact_shape=True):
        _raise_optimizer(opt, run)

    def update_group(group: dict[str, Any], new_group: dict[str, Any]) -> dict[str, Any]:
        new_group["params"] = group["params"]
        if "param_names" in group and "param_names" not in new_group:
            new_group["param_names"] = group["param_names"]
        return new_group

    param_groups = [update_group(g, ng) for g, ng in zip(groups, saved_groups, strict=True)]
    opt.__setstate__({"state": state, "param_groups": param_groups})
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
    run.report(t0)


def _cast(
    destination: Callable[..., torch.Tensor],
    param: torch.Tensor,
    value: Any,
    param_id: Any,
    key: Any = None,
    path: tuple[Any, ...] = (),
) -> Any:
    """Optimizer.load_state_dict's _cast, each tensor's destination from
    ``destination`` (:func:`_load_optimizer`'s). A function of the module, not
    a closure: a recursive closure is a cycle."""
    if isinstance(value, torch.Tensor) or type(value) is Placeholder:
        return destination(param, value, param_id, key, path)
    elif isinstance(value, dict):
        return {
            k: _cast(destination, param, v, param_id, key=k, path=(*path, k))
            for k, v in value.items()
        }
    elif isinstance(value, Iterable):
        return type(value)(  # type: ignore[call-arg]
            _cast(destination, param, v, param_id, path=(*path, i)) for i, v in enumerate(value)
        )
    else:
        return value


def _raise_optimizer(opt: torch.optim.Optimizer, run: _Run) -> NoReturn:
    _raise_run(f"Error(s) in loading the optimizer state of {type(opt).__name__}:", run)


def _fresh_into(
    run: _Run, pairs: list[tuple[str, torch.Tensor, Any]], prefix: tuple[Any, ...] = ()
) -> Callable[[tuple[Any, ...], torch.Tensor], torch.Tensor]:
    """A walk function: a checkpoint tensor becomes a new tensor on the device
    torch.load restores it to, paired for reading (what torch.load returns)."""

    def fresh(p: tuple[Any, ...], t: Any) -> torch.Tensor:
        t = unpickled.tensor(t)  # (what torch.load returns: the tensor itself)
        where = run.located.locate(t)
        if where is None:
            return t
        loc = run.files[where[0]].location(t)
        dest = torch.empty_like(t, device=devices.engine_device(loc) or torch.device("cpu"))
        if isinstance(t, torch.nn.Parameter):
            dest = torch.nn.Parameter(dest, requires_grad=t.requires_grad)
        pairs.append((key_name((*prefix, *p)), t, dest))
        return dest

    return fresh


def open_source(
    path: str, *, weights_only: bool, io: IoOptions, verify: bool
) -> tuple[Any, list[Mapped]]:
    """A checkpoint of any format ckptio reads in place, found from its content
    (``formats.detect``) and decoded over lazy mappings: a torch.save archive, a
    safetensors file, or a sharded safetensors checkpoint (its index, or a
    folder holding one)."""
    found = detect.detect(path)
    detect.check_verify(found, verify)
    if found.format == detect.TORCH:
        obj, m = torchzip.open_torch(
            path,
            direct=io.direct,
            backend=io.backend,
            verify_engine=io.engine() if verify else None,
            torch_kw={"weights_only": weights_only},
            lazy=True,
        )
        return obj, [m]
    if found.format == detect.SAFETENSORS:
        tensors, _, m = st_format.open_file(path, direct=io.direct, backend=io.backend)
        return tensors, [m]
    if found.format == detect.SHARDED:
        folder, wm = st_format.shard_files(path)
        names = ["model.safetensors"] if wm is None else list(dict.fromkeys(wm.values()))
        out: dict[str, torch.Tensor] = {}
        files = []
        for n in names:
            tensors, _, m = st_format.open_file(
                os.path.join(folder, n), direct=io.direct, backend=io.backend
            )
            out.update(tensors)
            files.append(m)
        return out, files
    raise FormatError(
        f"{path}: a {found.format} checkpoint: load_state_dict reads torch.save and "
        "safetensors checkpoints (dcp.load reads DCP folders)"
    )


@sharing.groupable("ckptio.load_state_dict", path_arg=1)
@memory.gc_paused()  # objects per tensor and per module, no cycles: see memory.gc_paused
def load_state_dict(
    obj: torch.nn.Module | torch.optim.Optimizer,
    f: str | os.PathLike[str],
    *,
    strict: bool = True,
    cast: bool = False,
    key: Any = None,
    weights_only: bool | None = None,
    threads: int | None = None,
    chunk_size: int | None = None,
    direct: bool | str | None = None,
    backend: str | None = None,
    verify: bool = False,
    group: Any = None,
    storage_options: remote.StorageOptions = None,
) -> Any:
    """``obj.load_state_dict(torch.load(f))``, with every tensor of the checkpoint
    read straight into ``obj``'s own tensors: no second copy of the checkpoint
    in memory, host or device.

    ``obj``: an ``nn.Module`` (parameters and persistent buffers; torch's
    ``_load_from_state_dict``, its overrides and load_state_dict pre- and post-
    hooks run as with torch; returns ``(missing_keys, unexpected_keys)``, or
    what an override of ``load_state_dict`` returns; ``strict`` as torch's) or
    a ``torch.optim.Optimizer`` (param_groups restored and state made as
    ``Optimizer.load_state_dict`` does them, existing state
    tensors filled in place, pre- and post-hooks; returns None).
    ``f``: a torch.save archive, a safetensors file, or a sharded safetensors
    checkpoint (its ``*.index.json`` or the folder). ``key``: a key, or a tuple
    of keys, into the checkpoint for the state dict (``key="model"``).

    Unlike torch, a dtype that differs from the destination's is an error
    (``DtypeMismatchError``) unless ``cast=True``. Every mismatch is found
    before anything is written: the error (an :class:`InPlaceLoadError`
    subclass and a RuntimeError, naming the keys, torch's message where torch
    has one) says "no destination was written"; only where a module has
    load_state_dict post-hooks (which must see the data loaded before them) or
    overrides ``load_state_dict`` (each copy is read at once) can an error
    come after some were, and then says so. ``verify``,
    ``weights_only`` and the engine knobs are ``ckptio.load``'s; so is
    ``group`` (every rank of a process group loads the same checkpoint into
    its own ``obj``, each byte read from storage by one rank and shared).
    ``f`` may be an object URL (a torch.save or safetensors object, or a
    sharded checkpoint's folder or index; with ``storage_options``): for a
    module whose submodules all load with torch's default steps (no hooks or
    overrides), each tensor read by ranged GETs straight into its parameter
    or buffer where it has the same dtype and shape (with ``group``, once over
    it); else (an optimizer, a cast, a mismatch to report) from a local
    scratch copy.
    """
    # As ckptio.load's (TORCH_FORCE_*_WEIGHTS_ONLY_LOAD too); the warning points
    # past the group and gc wrappers at the caller.
    weights_only = torchzip.resolve_weights_only(weights_only, None)
    if remote.is_url(f) or storage_options is not None:
        remote.check_options(f, storage_options)
        check_flags(strict=strict, cast=cast, verify=verify)
        url = os.fsdecode(os.fspath(f))
        got = _load_stored(obj, url, strict, key, verify, storage_options)
        if got is not _NOT_STRAIGHT:
            return got
        kw: dict[str, Any] = dict(
            strict=strict, cast=cast, key=key, weights_only=weights_only, threads=threads,
            chunk_size=chunk_size, direct=direct, backend=backend, verify=verify, group=group,
        )  # fmt: skip
        with st_format.local_copy(f, storage_options) as local:
            return load_state_dict(obj, local, **kw)
    t0 = time.perf_counter()
    check_flags(strict=strict, cast=cast, verify=verify)
    if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        raise TypeError(
            "ckptio.load_state_dict needs a torch.nn.Module or a torch.optim.Optimizer, "
            f"not {type(obj).__name__}"
        )
    path = paths.path(f, "load_state_dict")
    io = IoOptions.of(threads, chunk_size, direct, backend)
    state_dict, files = open_source(path, weights_only=weights_only, io=io, verify=verify)
    run = _Run(files, io, cast, verify)
    try:
        for k in () if key is None else key if isinstance(key, tuple) else (key,):
            state_dict = unpickled.tensor(state_dict[k])
        # A checkpoint that is a bare tensor: torch's messages name its type.
        state_dict = unpickled.tensor(state_dict)
        if isinstance(obj, torch.nn.Module):
            return _load_module(obj, state_dict, run, strict=strict, t0=t0)
        return _load_optimizer(obj, state_dict, run, t0=t0)
    finally:
        exposed = run.exposed
        del state_dict, run  # (the tensors a hook kept are counted without ours)
        if exposed:
            _release_own_frames(sys.exc_info()[2])
            detach_kept(files)


def _release_own_frames(tb: Any) -> None:
    """A failed load's traceback holds ckptio's finished frames, and their
    locals the checkpoint's tensors: cleared, so that they do not count as kept
    (a copy of the whole file, detach_kept). The caller's frames and user
    code's (a hook that raised) keep theirs."""
    own = os.path.dirname(os.path.abspath(__file__))
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(own):
            with contextlib.suppress(RuntimeError):  # a frame still running
                frame.clear()
        tb = tb.tb_next


#: What :func:`_load_stored` returns where the scratch copy must load it.
_NOT_STRAIGHT = object()


def _load_stored(
    obj: Any, url: str, strict: bool, key: Any, verify: bool, options: remote.StorageOptions
) -> Any:
    """``load_state_dict(module, url)`` with no local copy, where every submodule
    is plain (:func:`_plain_walk`) and each of the checkpoint's tensors it takes
    is of its destination's dtype and shape (``loading.stored``): torch's
    ``IncompatibleKeys``. ``_NOT_STRAIGHT`` otherwise, and where strict finds
    keys missing or unexpected (the scratch copy raises torch's error)."""
    t0 = time.perf_counter()
    if not isinstance(obj, torch.nn.Module) or (
        type(obj).load_state_dict is not torch.nn.Module.load_state_dict
    ):
        return _NOT_STRAIGHT
    opened = stored.open_source(url, options, verify)
    if opened is None:
        return _NOT_STRAIGHT
    state_dict, files, small_unchecked = opened
    for k in () if key is None else key if isinstance(key, tuple) else (key,):
        if not isinstance(state_dict, Mapping) or k not in state_dict:
            return _NOT_STRAIGHT
        state_dict = state_dict[k]
    if not isinstance(state_dict, Mapping) or any(
        isinstance(k, str) and k.endswith(_EXTRA) for k in state_dict
    ):
        return _NOT_STRAIGHT
    fast = _plain_walk(obj, state_dict, getattr(state_dict, "_metadata", None))
    if fast is None:
        return _NOT_STRAIGHT
    copies, missing, unexpected, errors = fast
    if errors or (strict and (missing or unexpected)):
        return _NOT_STRAIGHT
    got = stored.read_pairs(url, files, copies, options, verify)
    if got is None:
        return _NOT_STRAIGHT
    stats, unchecked, n = got
    from torch.nn.modules.module import _IncompatibleKeys

    reports.report(
        url, t0, stats, n, verify, (*small_unchecked, *unchecked), tuple(missing),
        tuple(unexpected),
    )  # fmt: skip
    return _IncompatibleKeys(missing, unexpected)


# --------------------------------------------------------------------------- read on use

#: Attributes of a tensor that say nothing of its elements.
_META_ATTRS = frozenset(
    "shape dtype device is_cuda is_cpu is_meta is_sparse is_quantized is_nested is_mkldnn "
    "layout ndim requires_grad is_leaf grad_fn grad itemsize nbytes".split()
)


def _metadata_call(func: Any) -> bool:
    if getattr(func, "__name__", None) == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _META_ATTRS
    return func in _INERT and func is not torch.Tensor.requires_grad_


class _Lazy(torch.Tensor):
    """A tensor of a checkpoint not read yet (see :func:`lazy_load`).

    ``dest.copy_(it)`` reads its bytes straight into ``dest`` (what
    ``Module.load_state_dict`` does with it); ``it.to(device, dtype)`` reads
    them straight into a new tensor there (what ``Optimizer.load_state_dict``
    does); its shape, dtype and device are known without reading. Anything
    else reads it once, into memory of its own on its device, and runs on
    that (the answer is then what a loaded tensor gives).
    """

    _key: str
    _src: torch.Tensor
    _files: list[Mapped]
    _io: IoOptions
    _dev: torch.device
    _real: torch.Tensor | None
    _stamp: tuple[int, ...]

    @staticmethod
    def __new__(
        cls,
        key: str,
        src: torch.Tensor,
        files: list[Mapped],
        io: IoOptions,
        device: torch.device,
        stamp: tuple[int, ...],
    ) -> _Lazy:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            src.shape,
            strides=src.stride(),
            storage_offset=src.storage_offset(),
            dtype=src.dtype,
            device=device,
        )
        t._key, t._src, t._files, t._io, t._dev, t._real = key, src, files, io, device, None
        t._stamp = stamp
        return t  # type: ignore[no-any-return]

    def _materialize(self) -> torch.Tensor:
        if self._real is None:
            dest = torch.empty_like(self._src, device=self._dev)
            self._fill(dest)
            self._real = dest
        return self._real

    def _fill(self, dest: torch.Tensor) -> None:
        if _rewritten(self._stamp, _stamp(self._files[0])):
            raise CkptioError(
                f"{self._files[0].path}: the file lazy_load opened may have been written "
                f"since (its size, modification or change time moved while it still has a "
                f"name: written again in place, as torch.save to the same path does): "
                f"{self._key!r} cannot be read from it; load the checkpoint again"
            )
        # copy_ and to() convert dtypes: so does this read.
        fill(
            [(self._key, self._src, dest)],
            self._files,
            self._io,
            what=self._files[0].path,
            cast=True,
            exact_shape=False,
        )

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _metadata_call(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if (
            func is torch.Tensor.copy_
            and len(args) == 2
            and isinstance(args[1], _Lazy)
            and not isinstance(args[0], _Lazy)
            and args[1]._real is None
            and args[0].device.type != "meta"
            and not (torch.is_grad_enabled() and args[0].requires_grad)
        ):
            args[1]._fill(args[0])
            return args[0]
        if _wants_grad(func, args, kwargs):
            raise RuntimeError(
                "ckptio.lazy_load: a tensor read on use does not take part in autograd; "
                "read it first (t = t.clone(), or ckptio.load)"
            )
        if (
            func is torch.Tensor.to
            and args
            and isinstance(args[0], _Lazy)
            and args[0]._real is None
        ):
            lz = args[0]
            kw = {k: v for k, v in kwargs.items() if k not in ("copy", "non_blocking")}
            # Always a tensor of its own, read now (Optimizer.load_state_dict's to()
            # must leave no lazy tensor in the state), copy= or not.
            device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
            dest = torch.empty_like(
                lz._src,
                dtype=dtype or lz._src.dtype,
                device=device or lz._dev,
                memory_format=memory_format or torch.preserve_format,
            )
            lz._fill(dest)
            return dest
        args, kwargs = tree_map_only(_Lazy, _Lazy._materialize, (args, kwargs))
        return func(*args, **kwargs)

    # torch's stubs declare Tensor's __torch_dispatch__ as a plain function
    # (the disabled impl); subclasses override it as a classmethod, as here.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        args, kwargs = tree_map_only(_Lazy, _Lazy._materialize, (args, kwargs or {}))
        return func(*args, **kwargs)


def _wants_grad(func: Any, args: Sequence[Any], kwargs: Any) -> bool:
    """Whether a call asks a lazy tensor to require grad (``requires_grad_()``,
    ``t.requires_grad = True``): its values live elsewhere until read."""
    if not args or not isinstance(args[0], _Lazy):
        return False
    if func is torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    if getattr(func, "__name__", None) == "__set__":
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", None) == "requires_grad" and bool(args[1])
    return False


def _stamp(m: Mapped) -> tuple[int, ...]:
    """(size, modification time, change time, links) of the file a lazy tensor
    reads from, by its held descriptor: see :func:`_rewritten`."""
    st = os.fstat(m.file.fileno())
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink)


def _rewritten(then: tuple[int, ...], now: tuple[int, ...]) -> bool:
    """Whether the file may have been written in place since ``then`` (its bytes
    no longer those the tensor was opened over): its size or modification time
    moved, or its change time did while it still has a name (a same-size
    rewrite whose mtime was set back, ``rsync --inplace -t``, moves only that).
    Once it has no name (the path removed, or a new file renamed over it, as
    ``ModelCheckpoint`` and ckptio.save do) nothing writes it through one any
    more: its change time moved with the unlink, and its bytes are as they
    were. (A chmod or a new hard link moves the change time too: refused, an
    error rather than bytes that may be others.)"""
    size, mtime, ctime, _ = then
    size2, mtime2, ctime2, links = now
    return (size, mtime) != (size2, mtime2) or (ctime != ctime2 and links > 0)


#: Checkpoint tensors smaller than this are read when the checkpoint is opened.
LAZY_MIN_BYTES = 1 << 20


def lazy_load(
    path: str,
    *,
    map_location: Any = None,
    weights_only: bool = True,
    io: IoOptions,
    min_bytes: int | None = None,
) -> Any:
    """What ``ckptio.load(path, map_location)`` returns, but the large tensors
    are read on use (:class:`_Lazy`): ``module.load_state_dict`` copies each
    straight from the file into the parameter, ``optimizer.load_state_dict``
    moves each straight into its new state tensor, and no copy of the
    checkpoint is ever held. Small tensors, and tensors sharing their storage
    with another (views, which must stay views), are read when the file is
    opened, in one engine pass, as ``ckptio.load`` reads them.
    ``map_location``: None, a str, a torch.device or a dict."""
    t0 = time.perf_counter()
    min_bytes = LAZY_MIN_BYTES if min_bytes is None else min_bytes
    obj, mapped = torchzip.open_torch(
        path, direct=io.direct, backend=io.backend, torch_kw={"weights_only": weights_only}
    )
    files = [mapped]
    stamp = _stamp(mapped)
    located = Files(files)
    users: dict[int, int] = {}

    def count(p: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        if located.locate(t) is not None:
            st = t.untyped_storage().data_ptr()
            users[st] = users.get(st, 0) + 1
        return t

    replace_tensors(obj, count)

    def device_of(t: torch.Tensor) -> torch.device:
        loc = mapped.location(t)
        dev = devices.fill_device(map_location, loc)
        if dev is None:
            where = devices.relocated(map_location, loc)
            raise RuntimeError(
                f"{path}: cannot restore a tensor to {where!r} (no such device here)"
            )
        return dev

    records: dict[int, torch.Tensor] = {}  # storage address -> its bytes, read now
    pairs: list[tuple[str, torch.Tensor, Any]] = []
    memo: dict[int, torch.Tensor] = {}

    def replace(p: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        if id(t) in memo:
            return memo[id(t)]
        if located.locate(t) is None:
            memo[id(t)] = t
            return t
        dev = device_of(t)
        st = t.untyped_storage()
        if type(t) is torch.Tensor and users[st.data_ptr()] == 1 and t.nbytes >= min_bytes:
            new: torch.Tensor = _Lazy(key_name(p), t, files, io, dev, stamp)
        else:
            whole = records.get(st.data_ptr())
            if whole is None:
                whole = torch.empty(st.nbytes(), dtype=torch.uint8, device=dev)
                src = torch.empty(0, dtype=torch.uint8).set_(st)
                pairs.append((key_name(p), src, whole))
                records[st.data_ptr()] = whole
            new = torch.empty(0, dtype=t.dtype, device=whole.device).set_(
                whole.untyped_storage(), t.storage_offset(), t.shape, t.stride()
            )
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            elif t.requires_grad:
                new.requires_grad_(True)
        memo[id(t)] = new
        return new

    obj = replace_tensors(obj, replace)
    # Fresh destinations of the records' own sizes: nothing to find wrong.
    fill(pairs, files, io, what=path, t0=t0)
    return obj
