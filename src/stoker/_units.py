"""Byte sizes written for people: ``parse_size("64MiB")`` and ``format_size(67108864)``.

Units (case-insensitive, a space before the unit allowed):

* binary: ``KiB MiB GiB TiB PiB`` (powers of 1024), and the one-letter forms ``K M G T P``,
  which mean the same (as in ``dd``, ``docker --shm-size`` and ``ulimit``);
* decimal: ``kB MB GB TB PB`` (powers of 1000, as SI and disk makers use them);
* ``B``, ``byte``, ``bytes`` or no unit: bytes.

So ``"100gb"`` is 100 * 10**9 bytes and ``"1.5 GiB"`` is 1.5 * 2**30. A size must come to a
whole, non-negative number of bytes: ``"1.5B"`` or ``"-1MiB"`` raise ValueError rather than
being rounded. The sizes the API takes (``open_dataset(cache_bytes=...)``, the Loader's byte
budgets) go through :func:`parse_size`, so they accept these strings as well as ints.
This module imports nothing from stoker.
"""

from __future__ import annotations

import numbers
import re
from fractions import Fraction

__all__ = ["parse_size", "format_size"]

#: The largest size accepted, bytes: 2**63 - 1 (8 EiB), the largest file offset a 64-bit signed
#: integer holds (POSIX ``off_t``, Parquet's int64 offsets).
MAX_BYTES = (1 << 63) - 1

_UNITS = {"": 1, "b": 1, "byte": 1, "bytes": 1}
for _power, _prefix in enumerate("kmgtp", start=1):  # k = kib = 2**10, kb = 10**3, m = mib = 2**20, ...
    _UNITS.update({_prefix: 1 << 10 * _power, f"{_prefix}ib": 1 << 10 * _power, f"{_prefix}b": 10 ** (3 * _power)})
_SIZE = re.compile(r"\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value, name: str = "size") -> int:
    """A byte count from an int or a string such as ``"64MiB"``, ``"100gb"``, ``"1.5 GiB"``.

    Args:
        value: an int (returned as is), a float with no fractional bytes, or a string: a number
            (digits, optionally a decimal point and an exponent) and an optional unit from the
            module docstring. At most :data:`MAX_BYTES`.
        name: what the value is, for the error message (e.g. ``"cache_bytes"``).

    Returns:
        The size in bytes (int, >= 0).

    Raises:
        ValueError: naming ``name`` and the value, for an unknown unit, text that is not a
            number, a negative size, a size over :data:`MAX_BYTES`, or a size that is not a
            whole number of bytes.
        TypeError: for a value that is neither a number nor a string (bool included).
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str, bytes)):
        raise TypeError(
            f"{name} must be a byte count or a string such as '64MiB', got {type(value).__name__} {value!r}"
        )
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, numbers.Integral):
        n = Fraction(int(value))
    elif isinstance(value, numbers.Real):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
        n = Fraction(float(value))
    else:
        m = _SIZE.fullmatch(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{name}: cannot read {value!r} as a size; write bytes or a number "
                "with a unit, such as 1048576, '64MiB', '1.5 GiB' or '100GB'"
            )
        if abs(float(m.group(1))) * _UNITS[unit] > MAX_BYTES:  # checked first: Fraction("1e99999999") is huge
            raise ValueError(f"{name}: {value!r:.40} is over the largest size, {MAX_BYTES} bytes (8 EiB)")
        n = Fraction(m.group(1)) * _UNITS[unit]
    if n > MAX_BYTES:
        raise ValueError(f"{name}: {value!r:.40} is over the largest size, {MAX_BYTES} bytes (8 EiB)")
    if n < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    if n.denominator != 1:
        raise ValueError(f"{name}: {value!r} is not a whole number of bytes ({float(n)})")
    return int(n)


def format_size(n_bytes: int) -> str:
    """A byte count for people, in binary units with one decimal: ``"64.0 MiB"``, ``"512 B"``.

    Args:
        n_bytes: a size in bytes.

    Returns:
        ``"<n> B"`` under 1 KiB, else the count in the largest of KiB, MiB, GiB, TiB that keeps it
        at or above 1 (TiB for anything larger), with one decimal.
    """
    v = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n_bytes} B"  # not reached
