"""How cadence writes bytes, durations and numbers for people: each format defined once, for the console lines, the
reports and the error messages alike.

The lowest layer (beside ``errors``): it imports nothing from cadence. Every function but ``format_duration`` and
``format_mib`` accepts anything and writes "-" for a value that is not a finite number: metrics and plan files write
null for missing or non-finite values, and a report shows those as "-".
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

MIB = 2**20


def finite(value: Any) -> TypeGuard[float]:
    """A real, finite number (metrics write non-finite values as null; bools are not numbers here). A type guard:
    where it holds, the value is a number to the type checker too (an int is one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------------------------------------------- bytes
def format_bytes(value: Any) -> str:
    """Whole bytes as B, or KiB/MiB/GiB with one decimal (``512 B``, ``3.0 GiB``); "-" when unknown."""
    if not finite(value):
        return "-"
    size = float(int(value))
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def format_mib(value: float) -> str:
    """Always in MiB with one decimal (``12.5 MiB``): memory breakdowns, whose parts compare at a glance."""
    return f"{value / MIB:.1f} MiB"


# --------------------------------------------------------------------------------------------------- durations
def format_duration(seconds: float) -> str:
    """m:ss below an hour, h:mm:ss above (the progress line's ETA)."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_hms(seconds: Any) -> str:
    """Always h:mm:ss, hours unbounded (1e9 tokens can take days); "-" when unknown."""
    if not finite(seconds):
        return "-"
    total = max(0, int(round(seconds)))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def format_seconds(value: Any) -> str:
    """A duration in ms below 10 s (step phases are ms-sized), in s above; "-" when unknown."""
    if not finite(value):
        return "-"
    return f"{value * 1000:,.1f} ms" if abs(value) < 10 else f"{value:,.2f} s"


# ----------------------------------------------------------------------------------------------------- numbers
def format_number(value: Any, spec: str = ".4f") -> str:
    """A number in the format ``spec``; "-" when unknown."""
    return format(value, spec) if finite(value) else "-"


def format_share(value: Any) -> str:
    """A fraction as a percentage with one decimal (0.123 -> ``12.3%``); "-" when unknown."""
    return f"{100 * value:.1f}%" if finite(value) else "-"


def format_si(value: Any, unit: str) -> str:
    """``value`` with an SI prefix (8.31 MFLOP, 1.12 TFLOP/s): FLOP counts span fifteen orders of magnitude."""
    if not finite(value):
        return "-"
    for power, prefix in ((15, "P"), (12, "T"), (9, "G"), (6, "M"), (3, "k")):
        if abs(value) >= 10**power:
            return f"{value / 10**power:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"
