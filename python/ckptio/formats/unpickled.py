"""The tensors of a natively read pickle (``_native.unpickle``), made over
their storages as torch's unpickler makes them: all at once
(:func:`build`), or, for a load in place, as :class:`Placeholder` objects
that carry what the plan needs (dtype, shape, where the bytes are) and make
their tensor only where something asks for it
(``ckptio.loading.inplace.materialize``). A load in place of a plain module
reads every tensor straight from the file and never needs the tensor objects:
making 516 of them took 40% of opening the checkpoint (1.8 of 4.6 ms on the
dev VM)."""

from __future__ import annotations

import collections
from typing import Any, final

import torch

from ckptio import _native
from ckptio.errors import corrupt


class _Maker:
    """Makes the tensors of one pickle over its storages (the calls torch's
    unpickler makes: ``_rebuild_tensor_v2``, ``_rebuild_parameter``)."""

    __slots__ = (
        "storages",
        "dtypes",
        "path",
        "parsed",
        "sizes",
        "itemsizes",
        "addresses",
        "devices",
        "made",
        "_news",
    )

    def __init__(
        self,
        storages: list[torch.UntypedStorage],
        dtypes: list[torch.dtype],
        path: str,
        parsed: _native.Unpickled,
        addresses: bool = False,
        devices: list[torch.device] | None = None,
    ) -> None:
        self.storages = storages
        self.dtypes = dtypes
        self.path = path
        self.parsed = parsed  # its storages' records, named in messages
        self.sizes = [st.nbytes() for st in storages]
        self.itemsizes = [dtype.itemsize for dtype in dtypes]
        #: Each storage's address, for placeholders (the eager build needs none).
        self.addresses = [st.data_ptr() for st in storages] if addresses else []
        self.devices = devices  # each storage's, where the caller knows them
        self.made: list[int] = []  # the storages of the tensors made here
        self._news: list[Any] | None = None  # made on the first tensor

    def news(self) -> list[Any]:
        """``new`` of an empty tensor of each storage's (dtype, device): it makes
        another as torch.empty((0,), dtype=, device=) does, in a third of the time."""
        if self._news is not None:
            return self._news
        protos: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        news = []
        # A storage's device is a new object each time asked (0.4 us): the
        # caller's list where it has one.
        devices = self.devices or [st.device for st in self.storages]
        for dev, dtype in zip(devices, self.dtypes, strict=True):
            key = (dtype, dev)
            proto = protos.get(key)
            if proto is None:
                proto = protos[key] = torch.empty((0,), dtype=dtype, device=dev)
            news.append(proto.new)
        self._news = news
        return news

    def check(
        self, i: int, offset: Any, size: Any, stride: Any, need: int = -1, contiguous: bool = False
    ) -> bool:
        """Whether (size, stride) is contiguous; a FormatError naming the record
        where the view is none a checkpoint holds (:func:`view_layout`) or reaches
        past its storage's record: set_ would grow (reallocate) the storage, which
        the engine may be filling at this moment (ckptio.load makes the tensors
        during the read); torch.load's storages cannot grow and it raises.
        ``need`` and ``contiguous``: the layout as the native reader computed it
        (``_native.Unpickled.build``; -1: none, or a view it refused)."""
        if need < 0:
            try:
                need, contiguous = view_layout(offset, size, stride)
            except ValueError as e:
                raise corrupt(self.where(i), f"a tensor's {e}") from None
        need *= self.itemsizes[i]
        if need > self.sizes[i]:
            raise corrupt(
                self.where(i),
                f"a tensor reaches past its storage's record "
                f"({need} bytes needed, the record holds {self.sizes[i]})",
            )
        return contiguous

    def where(self, i: int) -> str:
        """Storage ``i``'s record, in messages (listed only then: a list of every
        key took 8 ms for 20,000 tensors)."""
        return f"{self.path}, record data/{self.parsed.storages()[i][0]}"

    def tensor(
        self,
        i: int,
        offset: Any,
        size: Any,
        stride: Any,
        requires_grad: bool,
        hooks: Any,
        need: int = -1,
        contiguous: bool = False,
    ) -> torch.Tensor:
        if need < 0 or need * self.itemsizes[i] > self.sizes[i]:
            self.check(i, offset, size, stride, need, contiguous)  # raises, or a view it takes
        self.made.append(i)
        t = self.news()[i]().set_(self.storages[i], offset, size, stride)
        if requires_grad:  # a new tensor's is False
            t.requires_grad = True
        t._backward_hooks = hooks
        return t

    def grown(self, i: int) -> None:
        """What :meth:`check` prevents: storage ``i`` made larger by set_."""
        n = self.sizes[i]
        if self.storages[i].nbytes() != n:
            raise corrupt(
                self.where(i),
                f"a tensor reaches past its storage's record "
                f"({self.storages[i].nbytes()} bytes needed, the record holds {n})",
            )


def _parameter(data: torch.Tensor, requires_grad: bool, hooks: Any) -> torch.nn.Parameter:
    p = torch.nn.Parameter(data, requires_grad)
    p._backward_hooks = hooks
    return p


@final  # `type(x) is Placeholder` checks: no subclass may pass for one
class Placeholder:
    """A tensor of the checkpoint not made yet: its ``dtype``, ``shape``,
    whether it is ``contiguous``, the ``address`` of its first byte in the
    file's mapping and its storage's (``storage_address``), its ``nbytes``;
    :meth:`tensor` makes it (once: the same object however often asked)."""

    __slots__ = (
        "shape",
        "dtype",
        "contiguous",
        "address",
        "storage_address",
        "nbytes",
        "_maker",
        "_args",
        "_param",
        "_made",
    )

    def __init__(self, maker: _Maker, args: tuple[Any, ...]) -> None:
        i, offset, size, stride, _, _, *layout = args
        self._maker = maker
        self._args = args
        self._param: tuple[Placeholder, bool, Any] | None = None
        self._made: torch.Tensor | None = None
        self.dtype = maker.dtypes[i]
        self.storage_address = maker.addresses[i]
        itemsize = maker.itemsizes[i]
        self.contiguous = maker.check(i, offset, size, stride, *layout)
        self.shape = torch.Size(size)
        self.address = self.storage_address + offset * itemsize
        self.nbytes = self.shape.numel() * itemsize

    def tensor(self) -> torch.Tensor:
        t = self._made
        if t is None:
            if self._param is not None:  # a Parameter over another placeholder's tensor
                inner, requires_grad, hooks = self._param
                t = _parameter(inner.tensor(), requires_grad, hooks)
            else:
                t = self._maker.tensor(*self._args)
                self._maker.grown(self._args[0])  # its own storage: all would be O(n^2)
            self._made = t
        return t


def _as_parameter(data: Any, requires_grad: bool, hooks: Any) -> Any:
    """``_rebuild_parameter`` of a placeholder: another placeholder (the tensor
    inside keeps its own identity, as the pickle's memo may share it)."""
    if type(data) is not Placeholder:
        return _parameter(data, requires_grad, hooks)
    p = object.__new__(Placeholder)
    for name in ("shape", "dtype", "contiguous", "address", "storage_address", "nbytes"):
        setattr(p, name, getattr(data, name))
    p._maker, p._args, p._made = data._maker, data._args, None
    p._param = (data, requires_grad, hooks)
    return p


def build(
    parsed: _native.Unpickled,
    storages: list[torch.UntypedStorage],
    dtypes: list[torch.dtype],
    path: str,
    *,
    lazy: bool = False,
    devices: list[torch.device] | None = None,
) -> Any:
    """The object of a natively read pickle over its storages (on ``devices``,
    where given); ``lazy``: with a :class:`Placeholder` in place of each tensor."""
    maker = _Maker(storages, dtypes, path, parsed, addresses=lazy, devices=devices)
    if lazy:
        made = lambda *a: Placeholder(maker, a)  # noqa: E731
        return parsed.build(made, _as_parameter, collections.OrderedDict)
    limits = [n // size for n, size in zip(maker.sizes, maker.itemsizes, strict=True)]
    fast = (maker.news(), maker.storages, limits)
    obj = parsed.build(maker.tensor, _parameter, collections.OrderedDict, fast)
    # The native build made only views that fit their storage: set_ grew none.
    for i in set(maker.made):
        maker.grown(i)
    return obj


def tensor(x: Any) -> Any:
    """``x``'s tensor where it is a :class:`Placeholder`, else ``x``."""
    return x.tensor() if type(x) is Placeholder else x


def view_layout(offset: Any, size: Any, stride: Any) -> tuple[int, bool]:
    """(the storage elements ``set_(storage, offset, size, stride)`` needs, as
    torch computes them in ``computeStorageNbytes``; whether the layout is
    row-major, as ``is_contiguous`` says: dimensions of size 1 may have any
    stride, an empty tensor is contiguous). ValueError saying what is wrong with
    a view no checkpoint holds: an offset, sizes or strides that are not
    non-negative ints, as many strides as sizes, a storage past int64."""
    if type(offset) is not int or offset < 0:
        raise ValueError(f"storage offset {offset!r} is not a non-negative int")
    if not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)):
        raise ValueError(f"size {size!r} and stride {stride!r} are not sequences")
    if len(size) != len(stride):
        raise ValueError(f"size {tuple(size)} and stride {tuple(stride)} differ in length")
    if len(size) == 1:  # most tensors: one loop less
        n, st = size[0], stride[0]
        if type(n) is not int or type(st) is not int or n < 0 or st < 0:
            raise ValueError(f"size ({n!r},) or stride ({st!r},) is not a non-negative int")
        need = offset + (n - 1) * st + 1 if n else 0
        contiguous = n < 2 or st == 1
    else:
        for s, st in zip(size, stride, strict=True):
            if type(s) is not int or type(st) is not int or s < 0 or st < 0:
                raise ValueError(
                    f"size {tuple(size)} or stride {tuple(stride)} is not of non-negative ints"
                )
        if 0 in size:
            return 0, True
        need = offset + 1
        expected = 1
        contiguous = True
        for s, st in zip(reversed(size), reversed(stride), strict=True):
            need += (s - 1) * st
            if s != 1 and st != expected:
                contiguous = False
            expected *= s
    if need >= 1 << 63:
        raise ValueError(f"view (size {tuple(size)}, stride {tuple(stride)}) overflows int64")
    return need, contiguous
