"""How review figures are written: "-" for a figure one side lacks, compact rank lists,
field changes; shared by the diff's renderers and `embarkc report`."""

from __future__ import annotations

from embark_runtime.formatting import format_bytes, format_seconds


def fmt_time(seconds: float | None) -> str:
    """`format_seconds`, "-" for a figure one side lacks."""
    return "-" if seconds is None else format_seconds(seconds)


def fmt_rate(per_second: float | None) -> str:
    """Samples per second, grouped (`437,167/s`)."""
    return "-" if per_second is None else f"{per_second:,.0f}/s"


def fmt_bytes(n: float | None) -> str:
    """`format_bytes`, "-" for a figure one side lacks."""
    return "-" if n is None else format_bytes(n)


def ranks_text(ranks: tuple[int, ...], limit: int = 8) -> str:
    """Compact rank list: runs collapsed (0-7,12), cut after `limit` runs."""
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    if len(runs) > limit:
        return ",".join(runs[:limit]) + f",... ({len(ranks)} ranks)"
    return ",".join(runs)


def fields_text(fields: dict[str, tuple[str, str]], limit: int = 6) -> str:
    items = [
        f"{k} {b}" if a == "-" else f"{k} {a}" if b == "-" else f"{k} {a} -> {b}"
        for k, (a, b) in fields.items()
    ]
    if len(items) > limit:
        items = items[:limit] + [f"... ({len(fields) - limit} more)"]
    return ", ".join(items)


def int_or_dash(v: int | None) -> str:
    return "-" if v is None else str(v)


def arrow(a: str, b: str) -> str:
    return a if a == b else f"{a} -> {b}"
