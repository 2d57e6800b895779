"""How sizes, times, counts and percentages are written for people: the one home of it.

The compiler's commands, `embarkc diff` and `report`, the generated program's comments and
the trainer's log all write numbers through these functions (`format_number`: a number
quoted in a message or a field change, as Python writes it unless huge), so a size reads the same
everywhere. Torch-free and compiler-free (the runtime may not import the compiler).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: float) -> str:
    """A size with binary prefixes, one decimal: 85899345920 -> '80.0 GiB', 12 -> '12 B'."""
    sign = "-" if n < 0 else ""
    v = abs(float(n))
    for unit in _BINARY:
        if v < 1024 or unit == _BINARY[-1]:
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")


def format_mib(n: float) -> str:
    """A size in MiB with two decimals (the trainer's traffic): 3145728 -> '3.00 MiB'."""
    return f"{n / 2**20:.2f} MiB"


def format_count(n: float) -> str:
    """A count with decimal suffixes as specs write them: 114572800000 -> '114.57 B'."""
    for factor, suffix in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {suffix}"
    return f"{n:g}"


def format_seconds(seconds: float) -> str:
    """A duration in the unit that suits it: '1.250 s', '12.34 ms', '56.7 us'."""
    s = abs(seconds)
    if s >= 1:
        return f"{seconds:.3f} s"
    if s >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_ms(seconds: float) -> str:
    """A step time in milliseconds with three decimals: 0.0169142 -> '16.914 ms'."""
    return f"{seconds * 1e3:.3f} ms"


def format_pct(pct: float, signed: bool = False) -> str:
    """A percentage (already x100) with one decimal, compact when huge (+3.91e+10)."""
    if abs(pct) >= 1e6:
        return f"{pct:+.2e}" if signed else f"{pct:.2e}"
    return f"{pct:+.1f}" if signed else f"{pct:.1f}"


def format_number(x: Any) -> str:
    """A number as messages show it: as Python writes it below 1e15, compactly beyond
    (1.0e+30), so that a huge hand-edited value does not print as 300 digits."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not abs(x) >= 1e15:
        return str(x)  # NaN too
    if isinstance(x, float) and math.isinf(x):
        return str(x)
    # Decimal: an int may lie beyond a float's range
    mantissa, exponent = format(Decimal(x), ".6e").split("e")
    mantissa = mantissa.rstrip("0")
    return f"{mantissa}{'0' if mantissa.endswith('.') else ''}e{exponent}"
