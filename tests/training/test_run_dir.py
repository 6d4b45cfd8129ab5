"""read_metrics: the one reader of metrics.jsonl. Only a torn last line (a run killed mid-write) is forgiven."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.training.run_dir import MetricsUnreadable, read_metrics, rewrite_metrics


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def test_rows_in_order_blank_lines_skipped(tmp_path: Path) -> None:
    assert read_metrics(_write(tmp_path, '{"step": 1, "tokens": 8}\n\n{"step": 2, "loss": 3.5, "tokens": 8}\n')) == [
        {"step": 1, "tokens": 8}, {"step": 2, "loss": 3.5, "tokens": 8}]


def test_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    assert read_metrics(_write(tmp_path, '{"step": 1, "tokens": 8}\n{"step": 2, "lo')) == [{"step": 1, "tokens": 8}]


def test_an_unterminated_last_line_that_parses_is_a_row(tmp_path: Path) -> None:
    assert read_metrics(_write(tmp_path, '{"step": 1, "tokens": 8}\n{"step": 2, "tokens": 8}')) == [
        {"step": 1, "tokens": 8}, {"step": 2, "tokens": 8}]


@pytest.mark.parametrize("text, line, reason", [
    ('{"step": 1, "tokens": 8}\nnot json\n{"step": 3}\n', 2, "is not valid JSON"),
    ('{"step": 1, "tokens": 8}\n{"step": 2, "lo\n', 2, "is not valid JSON"),  # complete line (with its newline)
    ('{"step": 1, "tokens": 8}\n[1, 2]\n', 2, "is not a metrics row"),
    ('{"loss": 1.0}\n', 1, "is not a metrics row"),
])
def test_any_other_bad_line_names_the_file_and_line(tmp_path: Path, text: str, line: int, reason: str) -> None:
    with pytest.raises(MetricsUnreadable) as caught:
        read_metrics(_write(tmp_path, text))
    assert caught.value.line == line and f"metrics.jsonl:{line} {reason}" in str(caught.value)
    assert caught.value.path == tmp_path / "metrics.jsonl"


def test_rewrite_then_read(tmp_path: Path) -> None:
    rows = [{"step": 1, "window": 1, "tokens": 8}, {"step": 2, "window": 2, "tokens": 8}]
    rewrite_metrics(tmp_path, rows)
    assert read_metrics(tmp_path) == rows
    rewrite_metrics(tmp_path, [])
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.parametrize(("resume", "earlier", "kept"), [
    (True, "/plans/plan.json", "/plans/plan.json"),  # a resume keeps the plan the run started with on record
    (False, "/plans/plan.json", None),  # a new run over the folder is not the planned one
    (True, None, None),
])
def test_a_resumed_run_keeps_its_plan_on_record(tmp_path: Path, resume: bool, earlier: str | None,
                                                kept: str | None) -> None:
    """Issue 41: after --resume the run report lost the comparison with the plan's prediction, because --plan is not
    given again at a resume and config.json was written without it."""
    import json

    from cadence.training.run_dir import CONFIG_FILE, RunWriter

    (tmp_path / CONFIG_FILE).write_text(json.dumps({"effective_batch_size": 8, "plan": earlier}))
    writer = RunWriter(tmp_path, tensorboard=False)
    writer.write_config({"effective_batch_size": 8, "resume": resume, "plan": None})
    writer.close()
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["plan"] == kept
