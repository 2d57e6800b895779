"""Numbers with units, as written in specs, and their normalised values.

A number token is digits with optional `_` separators, fraction and exponent, and an
optional count suffix written without a space: `40M` is 40_000_000 (K = 1e3, M = 1e6,
B = 1e9). A unit follows after optional whitespace and says what the number measures:

* bytes: `B`, decimal `KB MB GB TB PB` (powers of 1000), binary `KiB MiB GiB TiB PiB`
  (powers of 1024); bits `b Kb Mb Gb Tb Pb` are 1/8 of the byte forms;
* bandwidth: any of those followed by `/s`, normalised to bytes per second
  (`400 Gb/s` is 5e10, `450 GB/s` is 4.5e11);
* time: `us ms s min h`, normalised to seconds;
* compute rate: `FLOP/s` with a decimal prefix (`67 TFLOP/s` is 6.7e13), normalised
  to floating-point operations per second.

`quantity(...)` returns the value in the base unit or raises `UnitError` (a message
without position; `lower` attaches the span).
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation
from typing import Literal

# Formatting lives in embark_runtime.formatting; re-exported for imports not yet moved.
from embark_runtime.formatting import format_bytes as format_bytes

Kind = Literal["count", "bytes", "bandwidth", "time", "compute"]

MAX_INT = (1 << 63) - 1
"""The largest integer a spec may hold: every size fits a signed 64-bit integer."""

COUNT_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9}

_PREFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}
_BIN_PREFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
TIME_UNITS = {
    "us": Decimal("1e-6"),
    "ms": Decimal("1e-3"),
    "s": Decimal(1),
    "min": Decimal(60),
    "h": Decimal(3600),
}

KIND_WORDS = {
    "count": "a plain number",
    "bytes": "a size (e.g. `80 GiB`)",
    "bandwidth": "a bandwidth (e.g. `450 GB/s`)",
    "time": "a time (e.g. `30 s`)",
    "compute": "a compute rate (e.g. `67 TFLOP/s`)",
}


class UnitError(ValueError):
    """A number or unit that does not fit where it is written; `hint` may help."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def byte_factor(unit: str) -> Decimal | None:
    """Bytes per `unit` for a size unit (B, KiB, Gb, ...), or None if it is not one."""
    bits = unit.endswith("b")
    base = unit[:-1]
    if unit[-1:] not in ("B", "b"):
        return None
    if base in _BIN_PREFIX:
        factor = Decimal(_BIN_PREFIX[base])
    elif base in _PREFIX:
        factor = Decimal(_PREFIX[base])
    else:
        return None
    return factor / 8 if bits else factor


def flop_factor(unit: str) -> Decimal | None:
    """FLOP/s per `unit` for a compute-rate unit (FLOP/s, TFLOP/s, ...), or None."""
    if not unit.endswith("FLOP/s") or unit[:-6] not in _PREFIX:
        return None
    return Decimal(_PREFIX[unit[:-6]])


def unit_kind(unit: str) -> Kind | None:
    if unit in TIME_UNITS:
        return "time"
    if flop_factor(unit) is not None:
        return "compute"
    if unit.endswith("/s"):
        return "bandwidth" if byte_factor(unit[:-2]) is not None else None
    return "bytes" if byte_factor(unit) is not None else None


def shorten(text: str) -> str:
    """A number as quoted in a message: very long ones cut in the middle."""
    if len(text) <= 24:
        return text
    return f"{text[:10]}...{text[-6:]} ({len(text)} characters)"


def parse_number(text: str) -> Decimal:
    """The exact value of a number token (`40M`, `1_000`, `3.35`, `1e-8`)."""
    factor = 1
    if text[-1:] in COUNT_SUFFIX:
        factor = COUNT_SUFFIX[text[-1]]
        text = text[:-1]
    if "__" in text or text.endswith("_") or "_." in text or "._" in text:
        raise UnitError(f"malformed number `{text}`", "write `_` only between digits: `40_000_000`")
    try:
        value = Decimal(text.replace("_", "")) * factor
    except InvalidOperation:
        raise UnitError(f"malformed number `{text}`") from None
    if not value.is_finite() or value.adjusted() > 40:
        raise UnitError(
            f"number `{shorten(text)}` is too large",
            f"a spec's numbers stay below 1e41 (sizes and counts below 2^63, {MAX_INT:.2e})",
        )
    return value


def quantity(number: str, unit: str | None, kind: Kind, *, integer: bool) -> int | float:
    """Normalise `number unit` to the base unit of `kind`.

    count: no unit allowed. bytes: a size unit required (plain 0 allowed). bandwidth,
    compute: a bandwidth or FLOP/s unit required. time: a time unit, or none meaning seconds. With `integer`
    the result must be a whole number within a signed 64-bit integer.
    """
    value = parse_number(number)
    if unit is not None:
        got = unit_kind(unit)
        if got != kind:
            if kind == "count":
                raise UnitError(f"unexpected unit `{unit}`: expected a plain number")
            if got == "bytes" and kind == "bandwidth":
                raise UnitError(
                    f"`{unit}` is a size, expected {KIND_WORDS[kind]}", f"write `{unit}/s`"
                )
            raise UnitError(f"`{unit}` is not {KIND_WORDS[kind]}")
        if kind == "time":
            value *= TIME_UNITS[unit]
        elif kind == "compute":
            rate = flop_factor(unit)
            assert rate is not None
            value *= rate
        else:
            factor = byte_factor(unit[:-2] if kind == "bandwidth" else unit)
            assert factor is not None
            value *= factor
    elif kind in ("bytes", "bandwidth", "compute") and value != 0:
        hint = {
            "bytes": "e.g. `80 GiB`",
            "bandwidth": "e.g. `450 GB/s` or `400 Gb/s`",
            "compute": "e.g. `67 TFLOP/s`",
        }[kind]
        raise UnitError(f"missing unit: expected {KIND_WORDS[kind]}", hint)
    if integer:
        if value != value.to_integral_value():
            if kind == "bytes":
                raise UnitError(
                    f"`{number}{' ' + unit if unit else ''}` is not a whole number of bytes"
                )
            raise UnitError(f"expected a whole number, got `{number}`")
        result = int(value)
        if abs(result) > MAX_INT:
            raise UnitError(
                f"number `{shorten(number)}` is too large",
                f"sizes and counts must be below 2^63 ({MAX_INT:.2e})",
            )
        return result
    f = float(value)
    if not math.isfinite(f):
        raise UnitError(f"number `{shorten(number)}` is too large")
    return f
