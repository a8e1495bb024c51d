"""Sizes: parsing "8GiB"-style strings once, formatting bytes for messages.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB,
GB, TB) powers of 1000; a bare number is bytes.  Case of the suffix letters is
not significant ("8gib" == "8GiB"); a trailing "B" may be omitted ("64M" is
64 MiB, matching what sysadmins type into systemd and fio).
"""

from __future__ import annotations

import re

__all__ = ["KiB", "MiB", "GiB", "TiB", "PAGE_SIZE", "align_up", "format_size", "parse_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PAGE_SIZE = 4096

_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes in ``value``: an int, or a string such as "8GiB", "512 MiB", "4k".

    Raises ``ValueError`` naming the value when it is not a size.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as '8GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if not match:
        raise ValueError(f"expected a size such as '8GiB' or '512MiB', got {value!r}")
    number, unit = match.groups()
    scale = _UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown size unit {unit!r} in {value!r}; use B, KiB, MiB, GiB or TiB")
    nbytes = float(number) * scale
    if nbytes != int(nbytes):
        raise ValueError(f"size {value!r} is not a whole number of bytes")
    return int(nbytes)


def format_size(nbytes: int | float) -> str:
    """A short human form: 0B, 4KiB, 1.5GiB."""
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= scale:
            scaled = value / scale
            text = f"{scaled:.0f}" if scaled == int(scaled) else f"{scaled:.1f}"
            return f"{sign}{text}{unit}"
    return f"{sign}{int(value)}B"


def align_up(nbytes: int, alignment: int = PAGE_SIZE) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (nbytes + alignment - 1) & ~(alignment - 1)
