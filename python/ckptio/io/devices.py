"""Devices as the core and torch.load name them.

The core takes a device code per segment: -1 for host memory, the CUDA ordinal
for device memory, and the current CUDA stream of each device a transfer
touches. A storage saved at a location tag (``"cpu"``, ``"cuda:1"``) lands
where ``map_location`` sends it, as torch.load decides: :func:`fill_device` is
that decision, the one place it is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

MapLocation = (
    None | str | torch.device | dict[str, str] | Callable[[torch.UntypedStorage, str], Any]
)


def device_code(storage: torch.UntypedStorage | torch.Tensor, what: str) -> int:
    """-1 for host memory, the CUDA ordinal for device memory."""
    if isinstance(storage, torch.Tensor):  # 40 ns each, where .device costs 0.5 us
        if storage.is_cpu:
            return -1
        if storage.is_cuda:
            return storage.get_device()
    dev = storage.device
    if dev.type == "cpu":
        return -1
    if dev.type == "cuda":
        return dev.index if dev.index is not None else torch.cuda.current_device()
    raise ValueError(f"{what} is on device {dev}; ckptio moves cpu and cuda storages only")


def streams(devices: Iterable[int]) -> list[tuple[int, int]]:
    """(device, raw CUstream) of the current stream of each CUDA device in
    ``devices``; none without CUDA (the core then refuses the device memory)."""
    wanted = sorted({d for d in devices if d >= 0})
    if not wanted or not torch.cuda.is_available():
        return []
    return [(d, torch.cuda.current_stream(d).cuda_stream) for d in wanted]


def engine_device(location: str) -> torch.device | None:
    """The device the engine fills for ``location``: cpu, or a present CUDA device."""
    dev = torch.device(location)
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index < torch.cuda.device_count():
            return torch.device("cuda", index)
    return None


def relocated(map_location: MapLocation, location: str) -> str:
    """The location string after a str / device / dict map_location."""
    if isinstance(map_location, dict):
        return map_location.get(location, location)
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return location


def restorable(location: Any) -> bool:
    """Whether torch.load's default_restore_location knows storage location tag
    ``location`` (a string: "cpu" exactly, or a device of another type)."""
    if not isinstance(location, str):
        return False
    if location == "cpu":
        return True
    try:
        dev = torch.device(location)
    except (RuntimeError, ValueError):
        return False
    return dev.type != "cpu" and location.startswith(dev.type)


def fill_device(map_location: MapLocation, location: str) -> torch.device | None:
    """The device the engine fills for a storage saved at ``location`` once
    ``map_location`` applied; None where torch.load must restore it: a device the
    engine does not fill, or a location torch cannot restore (a tag of the file's,
    or the caller's ``"cpu:0"``, which torch.load refuses), so that torch raises
    its own error."""
    loc = relocated(map_location, location)
    return engine_device(loc) if restorable(loc) else None
