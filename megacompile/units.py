"""Byte sizes as users write them and as megatrain prints them: one parser, one formatter.

    parse_bytes("1.5T") -> 1500000000000        fmt_bytes(3 * 2**30) -> "3.00 GiB"
    GivenBytes(parse_bytes("1T"), "1T")         fmt_bytes(3 * 2**30, unit="GiB", digits=1) -> "3.0 GiB"

Imported by the options, the command line, the planner, the passes' budget messages and the
trainer alike; it imports only the errors.
"""
from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_bytes(value) -> int:
    """1024, "80GiB", "75GB", "1.5T" -> bytes."""
    if isinstance(value, (int, float)) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{value!r} is not a byte size; write e.g. 80GiB, 75GB or 1.5T.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def fmt_bytes(n: float, unit: str | None = None, digits: int = 2) -> str:
    """`n` bytes in the largest binary unit it reaches ("1.50 GiB", "512 B"), or in `unit`
    (a table's column keeps one unit: "0.25 GiB")."""
    if unit is not None:
        return f"{n / dict(_BINARY)[unit]:.{digits}f} {unit}"
    for name, size in _BINARY:
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {name}"
    return f"{n:.0f} B"


class GivenBytes(int):
    """A byte count that remembers how the user wrote it (`1T`), so output can say it back in
    their unit next to ours (1T is 931.32 GiB, and a bare "931.32 GiB" reads like a mistake)."""
    given: str

    def __new__(cls, value: int, given: str):
        obj = super().__new__(cls, value)
        obj.given = given.strip()
        return obj
