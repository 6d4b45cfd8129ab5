"""Profile comparison (cadence.profiling.compare): noise-aware speed verdict, memory threshold, config fairness."""

from __future__ import annotations

import base64
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from cadence.errors import UsageError
from cadence.profiling.compare import (
    MEMORY_THRESHOLD,
    T_THRESHOLD,
    compare_profiles,
    render_comparison,
    speed_verdict,
    welch_t,
    write_comparison,
)
from cadence.profiling.report import PHASES

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
A_TIMES = [0.41229, 0.41399, 0.4202, 0.41805, 0.41273, 0.41301, 0.40237, 0.41037]  # profile_a's step_times_s


def _copy(tmp_path: Path, name: str, source: str = "profile_a",
          edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A copy of a fixture profile directory under ``name``, its profile.json changed by ``edit``."""
    target = tmp_path / name
    shutil.copytree(FIXTURES / source, target)
    if edit is not None:
        profile = json.loads((target / "profile.json").read_text())
        edit(profile)
        (target / "profile.json").write_text(json.dumps(profile))
    return target


def _with_times(times: list[float]) -> Callable[[dict[str, Any]], None]:
    def edit(profile: dict[str, Any]) -> None:
        profile["step_times_s"] = times

    return edit


def test_fixtures_b_is_faster_and_leaner_and_differs_in_precision_only() -> None:
    comparison = compare_profiles(FIXTURES / "profile_a", FIXTURES / "profile_b")
    assert comparison.speed.kind == "faster" and comparison.speed.t is not None and comparison.speed.t < -T_THRESHOLD
    assert comparison.memory.kind == "leaner"
    assert [(d.key, d.a, d.b, d.unfair) for d in comparison.differences] == [("precision", "fp32", "bf16", False)]
    text = render_comparison(comparison)
    assert "**B is faster than A:**" in text and "**B is leaner than A:**" in text
    assert "**B differs from A in:** `precision` (fp32 vs bf16)" in text and "not like for like" not in text
    for phase in PHASES:
        assert f"| {phase} |" in text, phase
    assert "| forward | 128.5 ms | 73.1 ms | 0.57x |" in text
    assert "| gradient_sync | 0.0 ms | 0.0 ms | - |" in text  # 0 / 0 has no ratio
    for row in ("| step time (mean ± sd) |", "| tokens/s | 19,841 | 32,970 | 1.66x |",
                "| peak memory | 74.5 MiB | 55.8 MiB | 0.75x |", "| MFU | 14.7% | 6.0% |"):
        assert row in text, row
    assert "so its ratio is not the speed ratio" in text  # the two MFUs use different peaks


def test_a_against_b_is_slower_and_heavier() -> None:
    comparison = compare_profiles(FIXTURES / "profile_b", FIXTURES / "profile_a")
    assert (comparison.speed.kind, comparison.memory.kind) == ("slower", "heavier")
    assert "**B is slower than A:**" in render_comparison(comparison)


def test_identical_profiles_show_no_difference_beyond_the_noise(tmp_path: Path) -> None:
    comparison = compare_profiles(FIXTURES / "profile_a", _copy(tmp_path, "again"))
    assert comparison.speed.kind == "no difference" and comparison.speed.t == 0
    assert comparison.memory.kind == "same" and comparison.differences == []
    text = render_comparison(comparison)
    assert ("**No difference beyond the noise** in step time (A: 412.9 ms ± 5.3 ms over 8 steps, "
            "B: 412.9 ms ± 5.3 ms over 8 steps") in text
    assert "**Same peak memory** within 2%" in text and "None: A and B ran the same configuration" in text


def test_noisy_pair_whose_means_differ_within_the_noise(tmp_path: Path) -> None:
    noisy_a = [0.40, 0.52, 0.35, 0.47, 0.44, 0.31, 0.55, 0.38]
    noisy_b = [0.36, 0.49, 0.33, 0.45, 0.40, 0.30, 0.50, 0.37]  # 5% lower mean, much smaller than the spread
    a = _copy(tmp_path, "a", edit=_with_times(noisy_a))
    b = _copy(tmp_path, "b", edit=_with_times(noisy_b))
    comparison = compare_profiles(a, b)
    assert comparison.speed.b.mean_s < comparison.speed.a.mean_s
    assert comparison.speed.kind == "no difference" and abs(comparison.speed.t) < T_THRESHOLD
    assert "**No difference beyond the noise**" in render_comparison(comparison)


def test_clear_case_small_difference_with_little_noise_is_real() -> None:
    faster = [t * 0.97 for t in A_TIMES]  # 3% faster, but the steps vary by ~1.3%
    verdict = speed_verdict(A_TIMES, faster)
    assert verdict.kind == "faster" and verdict.t < -T_THRESHOLD


def test_welch_t_against_a_hand_computation() -> None:
    t, df = welch_t([1, 2, 3, 4], [2, 3, 4, 5, 6])
    # mean 2.5 vs 4, variances 5/3 and 2.5: se = sqrt(5/12 + 1/2); df by Welch-Satterthwaite.
    assert t == pytest.approx(1.5 / math.sqrt(5 / 12 + 0.5))
    assert df == pytest.approx((5 / 12 + 0.5) ** 2 / ((5 / 12) ** 2 / 3 + 0.5**2 / 4))
    assert welch_t([1.0], [1.0, 2.0]) is None
    assert welch_t([0.5, 0.5], [0.4, 0.4]) == (-math.inf, None)  # no noise at all: any difference is real


def test_too_few_steps_cannot_be_compared(tmp_path: Path) -> None:
    b = _copy(tmp_path, "b", edit=_with_times([0.2]))
    comparison = compare_profiles(FIXTURES / "profile_a", b)
    assert comparison.speed.kind == "unknown"
    assert "**Step time cannot be compared:**" in render_comparison(comparison)


def test_phase_missing_in_one_profile(tmp_path: Path) -> None:
    def edit(profile: dict[str, Any]) -> None:
        del profile["phases"]["gradient_sync"]
        profile["phases"]["compile"] = {"per_step": [0.001] * 8, "mean_s": 0.001, "share": 0.004}

    comparison = compare_profiles(FIXTURES / "profile_a", _copy(tmp_path, "b", edit=edit))
    names = [p.name for p in comparison.phases]
    assert names[-2:] == ["compile", "other"] and "gradient_sync" in names
    text = render_comparison(comparison)
    assert "| gradient_sync | 0.0 ms | not recorded | - |" in text
    assert "| compile | not recorded | 1.0 ms | - |" in text


@pytest.mark.parametrize(("factor", "kind"), [(1.015, "same"), (0.985, "same"), (1.03, "heavier"),
                                              (0.97, "leaner")])
def test_memory_threshold(tmp_path: Path, factor: float, kind: str) -> None:
    def edit(profile: dict[str, Any]) -> None:
        profile["peak_memory_bytes"] = round(profile["peak_memory_bytes"] * factor)

    assert MEMORY_THRESHOLD == 0.02
    assert compare_profiles(FIXTURES / "profile_a", _copy(tmp_path, "b", edit=edit)).memory.kind == kind


def test_memory_unknown_and_sources_that_differ(tmp_path: Path) -> None:
    missing = _copy(tmp_path, "missing", edit=lambda p: p.update(peak_memory_bytes=None))
    comparison = compare_profiles(FIXTURES / "profile_a", missing)
    assert comparison.memory.kind == "unknown"
    assert "B recorded no peak memory" in render_comparison(comparison)
    cuda = _copy(tmp_path, "cuda", edit=lambda p: p.update(peak_memory_source="torch.cuda.max_memory_allocated"))
    assert "Measured differently" in render_comparison(compare_profiles(FIXTURES / "profile_a", cuda))


def test_unfair_differences_are_named_first_and_output_paths_ignored(tmp_path: Path) -> None:
    def edit(profile: dict[str, Any]) -> None:
        profile["config"].update(seq_len=128, micro_batch_size=16, grad_accum_steps=2, out="elsewhere")
        profile["device"] = "cuda"

    comparison = compare_profiles(FIXTURES / "profile_a", _copy(tmp_path, "b", edit=edit))
    keys = [(d.key, d.unfair) for d in comparison.differences]
    assert keys == [("seq_len", True), ("device", True), ("micro_batch_size", False), ("grad_accum_steps", False)]
    text = render_comparison(comparison)
    assert "**Warning: not like for like.** A and B differ in `seq_len` (256 vs 128), `device` (cpu vs cuda)" in text
    assert "elsewhere" not in text


def test_effective_batch_difference_is_unfair_even_when_not_recorded(tmp_path: Path) -> None:
    def edit(profile: dict[str, Any]) -> None:
        del profile["config"]["effective_batch_size"]
        profile["config"]["grad_accum_steps"] = 8

    def drop(profile: dict[str, Any]) -> None:
        del profile["config"]["effective_batch_size"]

    a, b = _copy(tmp_path, "a", edit=drop), _copy(tmp_path, "b", edit=edit)
    unfair = compare_profiles(a, b).unfair
    assert [(d.key, d.a, d.b) for d in unfair] == [("effective_batch_size", 32, 64)]


def test_bad_directories_are_usage_errors_naming_run_a_or_run_b(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        compare_profiles(tmp_path / "nope", FIXTURES / "profile_b")
    assert info.value.problems[0].where == "RUN_A" and "does not exist" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError) as info:
        compare_profiles(FIXTURES / "profile_a", tmp_path / "empty")
    assert info.value.problems[0].where == "RUN_B" and "holds no profile.json" in str(info.value)
    broken = _copy(tmp_path, "broken")
    (broken / "profile.json").write_text('{"version": 1,')
    with pytest.raises(UsageError) as info:
        compare_profiles(FIXTURES / "profile_a", broken)
    assert info.value.problems[0].where == "RUN_B" and "not valid JSON" in str(info.value)


def test_write_comparison_into_b_by_default_and_into_out_dir(tmp_path: Path) -> None:
    a, b = _copy(tmp_path, "baseline"), _copy(tmp_path, "bf16", source="profile_b")
    written = write_comparison(a, b)[1]
    assert written == [b / "compare-baseline.md", b / "compare-baseline.html", b / "compare-baseline-phases.png"]
    md = written[0].read_text()
    assert "# Profile comparison: B (bf16) against A (baseline)" in md and "](compare-baseline-phases.png)" in md
    page = written[1].read_text()
    embedded = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [base64.b64decode(data) for data in embedded] == [written[2].read_bytes()]
    out = tmp_path / "reports" / "cmp"
    assert write_comparison(a, b, out)[1] == [out / "compare.md", out / "compare.html", out / "compare-phases.png"]
    assert all(path.is_file() for path in out.iterdir())


def test_write_comparison_into_a_file_is_a_usage_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UsageError) as info:
        write_comparison(FIXTURES / "profile_a", FIXTURES / "profile_b", blocker / "sub")
    assert info.value.problems[0].where == "--out"


def test_warm_up_steps_do_not_drown_a_real_speed_up_in_noise(tmp_path: Path) -> None:
    """What a user hit: A's first active steps were still warming up (1.1 s among 0.13 s steps); counted in, A's spread
    hid B's 5x speed-up ("no difference beyond the noise"). Leading steps slower than 1.5x the median of the rest are
    left out, and the statement says so; a slow step in the middle is noise and stays in."""
    a_times = [1.1, 0.9, 0.131, 0.129, 0.133, 0.128, 0.130, 0.132]
    b_times = [0.0232, 0.0228, 0.0231, 0.0229, 0.0230, 0.0233, 0.0227, 0.0230]
    a = _copy(tmp_path, "a", edit=_with_times(a_times))
    b = _copy(tmp_path, "b", edit=_with_times(b_times))
    speed = compare_profiles(a, b).speed
    assert speed.kind == "faster" and speed.a.n == 6 and speed.a.warm_up == (1.1, 0.9) and speed.b.warm_up == ()
    assert "after leaving out 2 warm-up steps of 1,100.0 ms, 900.0 ms" in render_comparison(compare_profiles(a, b))
    assert speed_verdict(a_times[2:5] + [0.5] + a_times[5:], b_times).a.warm_up == ()


def test_compare_prints_the_verdict_and_the_ratios_in_the_terminal(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from cadence.cli import main

    a, b = _copy(tmp_path, "baseline"), _copy(tmp_path, "bf16", source="profile_b")
    assert main(["profile", "--compare", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("B is faster than A: ") and lines[1].startswith("B is leaner than A: peak memory")
    assert lines[2] == "tokens/s B/A 1.66x, peak memory B/A 0.75x, step time B/A 0.60x"
    assert lines[3] == "B differs from A in: precision (fp32 vs bf16)"
    assert lines[4].startswith("written: ") and "compare-baseline.html" in lines[4]
