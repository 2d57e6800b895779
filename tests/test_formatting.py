"""embark_runtime.formatting: the one way sizes, times, counts and percentages read."""

from __future__ import annotations

import pytest

from embark_runtime.formatting import (
    format_bytes,
    format_count,
    format_mib,
    format_ms,
    format_pct,
    format_seconds,
)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (12, "12 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (85899345920, "80.0 GiB"),
        (-3 * 2**20, "-3.0 MiB"),
        (5 * 2**60, "5.0 EiB"),
        (2**70, "1024.0 EiB"),
    ],
)
def test_bytes(n: float, text: str) -> None:
    assert format_bytes(n) == text


def test_times_counts_and_percentages() -> None:
    assert format_seconds(1.25) == "1.250 s"
    assert format_seconds(0.01234) == "12.34 ms"
    assert format_seconds(5.67e-5) == "56.7 us"
    assert format_seconds(-0.002) == "-2.00 ms"
    assert format_ms(0.0169142) == "16.914 ms"
    assert format_mib(3 * 2**20) == "3.00 MiB"
    assert format_count(114572800000) == "114.57 B"
    assert format_count(999) == "999"
    assert format_pct(3.14159) == "3.1"
    assert format_pct(3.14159, signed=True) == "+3.1"
    assert format_pct(3.91e10, signed=True) == "+3.91e+10"


def test_the_compiler_and_the_trainer_share_it() -> None:
    from embarkc import units
    from embarkc.review import text

    assert units.format_bytes is format_bytes
    assert text.fmt_bytes(None) == "-" and text.fmt_bytes(2048) == "2.0 KiB"
    assert text.fmt_time(None) == "-" and text.fmt_time(0.5) == "500.00 ms"
