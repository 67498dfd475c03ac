"""A checkpoint file opened as a mapped view: what every reader of a format hands on.

Each format opens a checkpoint the same way: its tensors decoded over one lazy
mapping of the file that nothing reads (a view at address ``a`` holds the
file's bytes from offset ``a - base``), next to the native file the engine
reads from. ``ckptio.load`` in place, ``load_state_dict``, ``describe``,
``verify`` and ``convert`` start from such a view; only the bytes that are
needed are then read, straight into their destinations.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from ckptio import _native
from ckptio.formats.unpickled import Placeholder


@dataclasses.dataclass
class Mapped:
    """A checkpoint file and a lazy mapping of it: a view of the mapping at
    address ``a`` holds the file's bytes from offset ``a - base``."""

    path: str
    #: What the engine reads from: a ``Reader`` (torch.save archives: ranges
    #: checked against the records) or a ``DeviceFile`` (safetensors).
    file: _native.Reader | _native.DeviceFile
    base: int
    size: int
    #: False where the mapping's bytes differ from the file's (torch byte-swapped
    #: them in its private mapping): such tensors are copied from the mapping.
    exact: bool = True
    #: The location torch.save recorded for each mapped storage (by file offset).
    locations: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Storages that every tensor over the mapping holds (the whole mapping, or
    #: each slice torch.load made of it): a use count above ours is a view alive.
    holders: tuple[Any, ...] = ()  # (torch.UntypedStorage; from_file's stubs say others)

    def viewed(self) -> bool:
        """Whether a tensor over the mapping is alive (beyond ``holders``)."""
        return any(torch._C._storage_Use_Count(h._cdata) > 1 for h in self.holders)

    def detach(self) -> None:
        """Make the mapping private memory holding the same bytes at the same
        address: the tensors over it stop depending on the file."""
        _native.detach_mapping(self.base, self.size, self.path, self.file.fileno())

    def location(self, t: torch.Tensor | Placeholder) -> str:
        at = t.storage_address if type(t) is Placeholder else storage_address(t)
        return self.locations.get(at - self.base, "cpu")


def storage_address(t: torch.Tensor) -> int:
    """The address of a strided tensor's storage, without making the storage's
    Python object (``untyped_storage()``: 0.5 us a tensor)."""
    return t.data_ptr() - cast(int, t.storage_offset()) * t.element_size()
