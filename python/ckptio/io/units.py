"""Byte sizes written as text: one reading for every argument that takes one.

:func:`parse_size` reads ``5GB`` / ``500MB`` as powers of ten (as the Hugging
Face hub counts shard sizes), ``4GiB`` and a bare ``4G`` as powers of two (as
``dd`` and ``fio`` do): ``max_shard_size`` and ``ckptio bench --size`` alike.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?B|B)?|(B))?\s*", re.IGNORECASE)


def parse_size(size: int | str, what: str = "size") -> int:
    """Bytes of an int, or of "5GB" (10^9 each), "4GiB" or "4G" (2^30 each),
    "512" or "512B" (whole bytes: "1.5" is refused, "1.5K" is 1536); ValueError
    naming ``what`` for anything else or below 1."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        m = _SIZE.fullmatch(size)
        if not m:
            raise ValueError(f"{what} {size!r} is not a size like 5GB, 500MB, 4GiB or 4G")
        num, unit, suffix, _ = m.groups()
        value = Fraction(num)  # exact: no float rounding
        if not unit and value.denominator != 1:
            raise ValueError(
                f"{what} {size!r} is a fractional number of bytes; give whole bytes "
                "or a unit (1.5G, 1.5GB)"
            )
        power = " KMGT".index(unit.upper()) if unit else 0
        decimal = suffix is not None and suffix.upper() == "B"
        n = int(value * (1000 if decimal else 1024) ** power)  # a unit's fraction of a byte dropped
    else:
        raise TypeError(f"{what} must be an int or a str, not {type(size).__name__}")
    if n < 1:
        raise ValueError(f"{what} must be positive, not {size!r}")
    return n


def size_text(n: int) -> str:
    """A size as :func:`parse_size` reads it back: "64M", "1.5G" (powers of two)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return str(n)


def human_bytes(n: float) -> str:
    """A size for people: "1.50 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def align_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to
