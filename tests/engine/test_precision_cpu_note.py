"""Issue 41 item 4: a half precision the CPU would emulate is said before the first step, with its cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.engine.precision import cpu_emulation_note


@pytest.mark.parametrize("flags, precision, warned", [
    ("fpu sse avx2 fma", "bf16", True), ("fpu avx2 avx512f avx512_bf16", "bf16", False),
    ("avx2 amx_bf16 amx_tile", "bf16", False), ("avx2 avx512_bf16", "fp16", True),
    ("avx2 avx512_fp16", "fp16", False), ("avx2", "fp32", False),
])
def test_emulated_half_precision_is_named_with_its_cost(tmp_path: Path, flags: str, precision: str,
                                                        warned: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    note = cpu_emulation_note(precision, cpuinfo)
    assert (note is not None) == warned
    if warned:
        assert f"--precision {precision}" in note and "slower than fp32" in note and "--precision fp32" in note


def test_unreadable_cpu_flags_say_nothing(tmp_path: Path) -> None:
    assert cpu_emulation_note("bf16", tmp_path / "missing") is None
