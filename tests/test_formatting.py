"""cadence.formatting: every format of bytes, durations and numbers, defined once."""

from __future__ import annotations

import math

import pytest

from cadence.formatting import (
    finite,
    format_bytes,
    format_duration,
    format_hms,
    format_mib,
    format_number,
    format_seconds,
    format_share,
    format_si,
)


def test_finite_is_a_real_finite_number() -> None:
    assert finite(1) and finite(2.5) and finite(0)
    assert not any(finite(v) for v in (None, True, math.nan, math.inf, "1"))


@pytest.mark.parametrize("value, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"),
    (3 * 2**30, "3.0 GiB"), (2048 * 2**30, "2048.0 GiB"), (1536.9, "1.5 KiB"),
])
def test_bytes(value: float, text: str) -> None:
    assert format_bytes(value) == text


def test_unknown_values_are_a_dash() -> None:
    for unknown in (None, math.nan, math.inf):
        assert format_bytes(unknown) == format_hms(unknown) == format_seconds(unknown) == "-"
        assert format_number(unknown) == format_share(unknown) == format_si(unknown, "FLOP") == "-"


def test_mib_durations_and_numbers() -> None:
    assert format_mib(3 * 2**20 + 2**19) == "3.5 MiB" and format_mib(0) == "0.0 MiB"
    assert format_duration(59.6) == "1:00" and format_duration(-3) == "0:00"
    assert format_hms(65) == "0:01:05"
    assert format_seconds(0.5) == "500.0 ms" and format_seconds(12345.0) == "12,345.00 s"
    assert format_number(3.14159) == "3.1416" and format_number(12345, ",.0f") == "12,345"
    assert format_share(0.1234) == "12.3%"
    assert format_si(999, "FLOP") == "999 FLOP" and format_si(2.5e15, "FLOP/s") == "2.5 PFLOP/s"
