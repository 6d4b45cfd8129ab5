"""The profile report (cadence.profiling.report via cadence.rebuild.build_report), on the profile.json fixtures."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
from matplotlib.image import imread

from cadence.errors import UsageError
from cadence.formatting import format_seconds as fmt_seconds
from cadence.formatting import format_si as fmt_si
from cadence.profiling.report import PHASE_PLOT, PHASES, effective_batch, phase_names, profile_report
from cadence.rebuild import build_report
from cadence.report.render import Plot, Table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _copy(tmp_path: Path, name: str = "profile_a", edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """A copy of a fixture profile directory, its profile.json changed by ``edit``."""
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    if edit is not None:
        profile = json.loads((target / "profile.json").read_text())
        edit(profile)
        (target / "profile.json").write_text(json.dumps(profile))
    return target


def _usage_error(path: Path) -> UsageError:
    with pytest.raises(UsageError) as info:
        build_report(path)
    return info.value


def test_fixtures_are_consistent() -> None:
    """The fixtures obey the schema's own rules: shares add up to 1, phases add up to each step time."""
    for name in ("profile_a", "profile_b"):
        profile = json.loads((FIXTURES / name / "profile.json").read_text())
        assert abs(profile["phase_shares_sum"] - 1) <= 0.05
        assert len(profile["step_times_s"]) == profile["schedule"]["active"] == 8
        for index, step in enumerate(profile["step_times_s"]):
            assert sum(p["per_step"][index] for p in profile["phases"].values()) == pytest.approx(step, abs=1e-4)
        assert set(profile["phases"]) == set(PHASES)


def test_build_report_writes_markdown_html_and_plot_for_a_profile_directory(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    written = build_report(root)
    assert written == [root / "report.md", root / "report.html", root / PHASE_PLOT]
    md = (root / "report.md").read_text()
    verdict = json.loads((root / "profile.json").read_text())["verdict"]
    assert "## Verdict: compute-bound" in md
    assert verdict["figure"] in md and verdict["advice"] in md
    for phase in PHASES:
        assert f"| {phase} |" in md, phase
    # The verdict comes before the numbers: it is what the reader came for.
    assert md.index("Verdict") < md.index("## Phases") < md.index("## Top operators")
    for text in ("gpt-tiny", "cpu", "fp32", "32 = 8 micro-batch x 4 accumulation x 1 process(es)",
                 "8,192 tokens per optimizer step", "256 tokens", "19,841 tokens/s", "**MFU:** 14.7%",
                 "PaLM appendix B: 6N + 12 L H Q T", "measured: fp32 matmul 1024x1024 on cpu", "`aten::mm`",
                 "`trace.json`", "https://ui.perfetto.dev", "chrome://tracing", f"]({PHASE_PLOT})"):
        assert text in md, text
    assert "not found" not in md
    page = (root / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "compute-bound" in page
    embedded = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [base64.b64decode(data) for data in embedded] == [(root / PHASE_PLOT).read_bytes()]
    png = (root / PHASE_PLOT).read_bytes()
    assert png.startswith(PNG_MAGIC)
    height, width = imread(root / PHASE_PLOT).shape[:2]
    assert width > 600 and height > 400


def test_phase_table_has_mean_share_and_peak_memory_per_phase(tmp_path: Path) -> None:
    report = profile_report(_copy(tmp_path))
    table = next(b for b in report.blocks if isinstance(b, Table) and b.header[0] == "phase")
    rows = {row[0]: row for row in table.rows}
    assert rows["forward"][1:] == ["128.5 ms", "31.1%", "61.5 MiB"]
    assert rows["gradient_sync"][3] == "-"  # null in phase_peak_memory_bytes
    assert rows["logging_checkpointing"][3] == "-"  # absent from it
    assert rows["**step**"][1:3] == ["**412.9 ms**", "**100.0%**"]
    assert [b.name for b in report.blocks if isinstance(b, Plot)] == [PHASE_PLOT]


def test_profile_directory_with_metrics_gets_the_profile_report(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    build_report(root)
    assert (root / "report.md").read_text().startswith("# Profile report: gpt-tiny")


def test_shares_far_from_one_warn_and_missing_fields_show_dashes(tmp_path: Path) -> None:
    def edit(profile: dict[str, Any]) -> None:
        profile["phase_shares_sum"] = 0.8
        for key in ("phase_peak_memory_bytes", "mfu", "peak_flops", "top_operators", "verdict"):
            del profile[key]
        del profile["phases"]["other"]["mean_s"]  # computed from per_step instead
        profile["trace"] = "missing-trace.json"

    root = _copy(tmp_path, edit=edit)
    build_report(root)
    md = (root / "report.md").read_text()
    assert "add up to 80.0%, not 100%" in md
    assert "**No verdict**" in md and "records no operators" in md and "**MFU:** -" in md
    assert "| other | 6.3 ms |" in md
    assert "**not found in this directory**" in md


def test_phase_order_known_first_unknown_before_other() -> None:
    profile = {"phases": {"other": {}, "compile": {}, "backward": {}, "forward": {}}}
    assert phase_names(profile) == ["forward", "backward", "compile", "other"]
    assert phase_names(profile, {"phases": {"data_wait": {}}})[0] == "data_wait"


def test_effective_batch_is_the_product_when_not_recorded() -> None:
    profile = {"config": {"micro_batch_size": 4, "grad_accum_steps": 2}, "world_size": 2}
    assert effective_batch(profile) == "16 = 4 micro-batch x 2 accumulation x 2 process(es)"


def test_units() -> None:
    assert fmt_seconds(0.0123) == "12.3 ms" and fmt_seconds(12.5) == "12.50 s" and fmt_seconds(None) == "-"
    assert fmt_si(8.31e6, "FLOP") == "8.31 MFLOP" and fmt_si(1.12e12, "FLOP/s") == "1.12 TFLOP/s"


def test_invalid_profile_json_is_a_usage_error_naming_run_dir(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "profile.json").write_text("{not json")
    error = _usage_error(root)
    assert error.problems[0].where == "RUN_DIR" and "not valid JSON" in str(error)
    (root / "profile.json").write_text("[1, 2]")
    assert "JSON object" in str(_usage_error(root))
    assert not (root / "report.md").exists()


def test_empty_directory_names_the_profile_too(tmp_path: Path) -> None:
    assert "profile.json" in str(_usage_error(tmp_path))


def test_a_field_of_another_type_is_one_line_naming_the_field_and_nothing_is_written(tmp_path: Path) -> None:
    """Issue 50 item 6: profile.json is read by its record (cadence.records.PROFILE), not parsed by hand: a field of
    another type is refused naming it, where the report used to take it for missing or fail on it."""
    root = _copy(tmp_path, edit=lambda profile: profile.update(tokens_per_s="fast"))
    error = _usage_error(root)
    assert "field 'tokens_per_s' is 'fast', not a finite number" in str(error)
    assert not (root / "report.md").exists()
    other = _copy(tmp_path, "profile_b", edit=lambda profile: profile.pop("step_times_s"))
    assert "was not written by cadence profile (no step_times_s)" in str(_usage_error(other))
