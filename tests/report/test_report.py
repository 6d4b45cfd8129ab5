"""Run and plan reports (cadence.report.runs, cadence.plan.report): a real tiny run, a hand-made run with skipped fp16 steps, a plan fixture."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from matplotlib.image import imread

from cadence.cli import main
from cadence.errors import UsageError
from cadence.formatting import format_hms as fmt_hms
from cadence.rebuild import build_report
from cadence.report import render
from cadence.training.run_dir import read_metrics

FIXTURE_PLAN = Path(__file__).resolve().parents[1] / "fixtures" / "plan" / "plan.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_PNGS = ["report-loss.png", "report-lr.png", "report-throughput.png", "report-grad-norm.png"]
PLAN_PNGS = ["report-diagnosis.png", "report-memory.png", "report-throughput.png", "report-quality.png"]
PARAGRAPH = (
    "A window is the set of micro-batches that make one optimizer step. Gradients are accumulated in fp32 over the "
    "window and divided by the number of target tokens in it, so the step does not depend on how the window was "
    "cut into micro-batches.\n"
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 4-step run of the tiny GPT through the CLI, with validation every 2 steps."""
    base = tmp_path_factory.mktemp("report")
    data = base / "tiny.txt"
    data.write_text(PARAGRAPH * 16, encoding="utf-8")  # ~3.5 KB: ~100 sequences of 32 bytes
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["train", "--data", str(data), "--seq-len", "32", "--micro-batch-size", "4",
                       "--grad-accum-steps", "2", "--max-steps", "4", "--eval-every", "2", "--out", str(base / "run")])
    assert status == 0, err.getvalue()
    return base / "run"


@pytest.fixture(scope="module")
def run_report(run_dir: Path) -> list[Path]:
    return build_report(run_dir)


def _embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def _assert_html_page(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for tag in ("html", "head", "body", "table", "ul", "figure"):
        assert page.count(f"<{tag}") == page.count(f"</{tag}>"), tag
    assert "http://" not in page and "https://" not in page, "the page must not load anything"


def _metrics_rows(run: Path) -> list[dict]:
    return read_metrics(run)


# ----------------------------------------------------------------------------------------------------- run report
def test_run_report_writes_markdown_html_and_plots(run_dir: Path, run_report: list[Path]) -> None:
    assert run_report == [run_dir / "report.md", run_dir / "report.html", *(run_dir / name for name in RUN_PNGS)]
    assert all(path.is_file() for path in run_report)
    assert not (run_dir / "report-loss-scale.png").exists(), "fp32 has no loss scale to plot"


def test_run_markdown_has_the_configuration_and_totals(run_dir: Path, run_report: list[Path]) -> None:
    md = (run_dir / "report.md").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "**Effective batch:** 8 sequences = 4 micro-batch x 2 accumulation x 1 process(es)" in md
    assert "**Model:** gpt-tiny, 1,057,152 parameters" in md
    assert f"**Final loss:** {summary['final_loss']:.4f}" in md
    assert f"**final val loss:** {summary['final_val_loss']:.4f}" in md
    assert "**Peak memory:** " in md and summary["peak_memory_source"] in md
    assert "**Steps:** 4 optimizer steps, 0 skipped" in md
    for name in RUN_PNGS:
        assert f"]({name})" in md
    table = [line for line in md.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [1, 2, 3, 4]


def test_run_html_is_self_contained(run_dir: Path, run_report: list[Path]) -> None:
    page = (run_dir / "report.html").read_text()
    _assert_html_page(page)
    assert _embedded_pngs(page) == [(run_dir / name).read_bytes() for name in RUN_PNGS]


def test_run_pngs_are_images(run_dir: Path, run_report: list[Path]) -> None:
    for name in RUN_PNGS:
        assert (run_dir / name).read_bytes().startswith(PNG_MAGIC)
        height, width, _ = imread(run_dir / name).shape
        assert width > 400 and height > 200


def _fp16_rows_with_skips() -> list[dict]:
    """Seven windows of an fp16 run: an overflow (finite loss) after step 2, a non-finite gradient after step 3."""
    scale, rows, step = 65536.0, [], 0
    for window in range(1, 8):
        skipped = window in (3, 5)
        step += 0 if skipped else 1
        loss = None if window == 5 else 5.0 - 0.1 * window
        rows.append({"step": step, "window": window, "skipped": skipped,
                     "skip_reason": {3: "fp16 overflow", 5: "non-finite gradients"}.get(window), "loss": loss,
                     "grad_norm": None if skipped else 2.0 / window, "lr": 1e-3, "loss_scale": scale,
                     "micro_steps": 2, "samples": 8, "tokens": 256, "targets": 256, "step_time_s": 0.1,
                     "tokens_per_s": 2560.0, "peak_memory_bytes": None, "epoch": 0,
                     **({"val_loss": 4.6} if window == 6 else {})})
        scale = scale / 2 if skipped else scale
    return rows


def test_skipped_steps_are_marked(run_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "skips"
    run.mkdir()
    for name in ("config.json", "summary.json"):
        shutil.copy(run_dir / name, run / name)
    rows = _fp16_rows_with_skips()
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    written = build_report(run)
    assert run / "report-loss-scale.png" in written
    md = (run / "report.md").read_text()
    assert ("**Skipped steps:** window 3 after step 2 (fp16 overflow), window 5 after step 3 (non-finite gradients)"
            in md)
    assert "Skipped steps (2) are red dashed lines" in md
    assert "| **skipped** (fp16 overflow) |" in md and "| **skipped** (non-finite gradients) |" in md
    assert "loss scale" in md.splitlines()[[i for i, line in enumerate(md.splitlines()) if "| step |" in line][0]]
    assert len(_embedded_pngs((run / "report.html").read_text())) == 5

    loss = render.loss_figure(rows)
    assert "skipped step (2)" in [text.get_text() for text in loss.axes[0].get_legend().get_texts()]
    lines = [line for line in loss.axes[0].get_lines() if line.get_label() == "skipped step (2)"]
    assert list(lines[0].get_xdata()) == [2.5, 2.5], "a skipped window sits half-way after the step it repeats"
    grad = render.grad_norm_figure(rows, clip=1.0)
    assert "non-finite (2)" in [text.get_text() for text in grad.axes[0].get_legend().get_texts()]

    # Rebuilt as a bf16 run: the stale loss-scale plot of the first build goes away.
    (run / "metrics.jsonl").write_text("".join(json.dumps({**row, "loss_scale": None}) + "\n" for row in rows))
    assert run / "report-loss-scale.png" not in build_report(run)
    assert not (run / "report-loss-scale.png").exists()


def test_unfinished_run_is_reported_from_its_metrics(tmp_path: Path) -> None:
    rows = _fp16_rows_with_skips()
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 6, "win'  # killed mid-write
    (tmp_path / "metrics.jsonl").write_text(text)
    build_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "the run did not finish" in md and "**No config.json**" in md
    assert "**Steps:** 5 optimizer steps, 2 skipped, 7 windows" in md
    assert "**Final loss:** 4.3000" in md  # window 7, the last one that stepped


# ---------------------------------------------------------------------------------------------------- plan report
@pytest.fixture
def plan_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "plan"
    directory.mkdir()
    shutil.copy(FIXTURE_PLAN, directory / "plan.json")
    return directory


def test_plan_report(plan_dir: Path) -> None:
    plan = json.loads((plan_dir / "plan.json").read_text())
    written = build_report(plan_dir)
    assert written == [plan_dir / "report.md", plan_dir / "report.html", *(plan_dir / name for name in PLAN_PNGS)]
    md = (plan_dir / "report.md").read_text()
    rows = {line.split("|")[1].strip().strip("*").split()[0]: line for line in md.splitlines()
            if re.match(r"\| \**c\d\d", line)}
    assert sorted(rows) == sorted(c["id"] for c in plan["candidates"])
    chosen = plan["choice"]["id"]
    assert [cid for cid, line in rows.items() if "(chosen)" in line] == [chosen]
    assert f"**Chosen: {chosen}**" in md and plan["choice"]["reason"] in md
    for note in plan["notes"]:
        assert f"- {note}" in md
    assert plan["diagnosis"]["explanation"] in md
    assert "**Gradient: PASS**" in md and "**Loss over 10 steps: PASS**" in md
    assert "64.0 MiB" in md and "150.6 MiB" in md  # sizes human-readable
    measured = next(c for c in plan["candidates"] if c["id"] == chosen)["measured"]
    assert fmt_hms(measured["seconds_per_epoch"]) in rows[chosen]
    page = (plan_dir / "report.html").read_text()
    _assert_html_page(page)
    assert page.count('<tr class="marked">') == 1
    assert _embedded_pngs(page) == [(plan_dir / name).read_bytes() for name in PLAN_PNGS]
    for name in PLAN_PNGS:
        assert (plan_dir / name).read_bytes().startswith(PNG_MAGIC)


def test_plan_with_nothing_chosen(plan_dir: Path) -> None:
    build_report(plan_dir)  # the full report first: its throughput and quality plots must not linger
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan["choice"], plan["quality"] = None, None
    for candidate in plan["candidates"]:
        candidate["measured"], candidate["status"] = None, "over budget (estimate)"
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    written = build_report(plan_dir)
    assert [p.name for p in written] == ["report.md", "report.html", "report-diagnosis.png", "report-memory.png"]
    assert not (plan_dir / "report-throughput.png").exists() and not (plan_dir / "report-quality.png").exists()
    md = (plan_dir / "report.md").read_text()
    assert "**No candidate was chosen:**" in md and "No quality check was recorded." in md
    assert "(chosen)" not in md


def test_host_memory_is_not_stacked_into_the_device_peak() -> None:
    fig = render.breakdown_figure([("offload", {"activations": 2**20, "offloaded_to_host": 50 * 2**20})],
                                        budget=None)
    ax = fig.axes[0]
    assert [container.get_label() for container in ax.containers] == ["activations"]
    assert ax.get_ylabel() == "MiB" and ax.get_ylim()[1] < 2


def test_hms() -> None:
    assert [fmt_hms(s) for s in (0, 59.6, 3600, 9.26 * 3600, 100 * 3600 + 61)] == [
        "0:00:00", "0:01:00", "1:00:00", "9:15:36", "100:01:01"]
    assert fmt_hms(None) == "-"


# ---------------------------------------------------------------------------------------------------------- errors
def _usage_error(path: Path) -> UsageError:
    with pytest.raises(UsageError) as caught:
        build_report(path)
    assert [problem.where for problem in caught.value.problems] == ["RUN_DIR"]
    return caught.value


def test_missing_directory(tmp_path: Path) -> None:
    assert "does not exist" in str(_usage_error(tmp_path / "nope"))


def test_empty_directory_is_neither_run_nor_plan_and_stays_empty(tmp_path: Path) -> None:
    assert "neither a run" in str(_usage_error(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_file_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    assert "is a file" in str(_usage_error(tmp_path / "metrics.jsonl"))


def test_broken_json_names_the_file_and_line(tmp_path: Path, plan_dir: Path) -> None:
    (plan_dir / "plan.json").write_text('{"version": 1,\n')
    assert "plan.json is not valid JSON" in str(_usage_error(plan_dir))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert "metrics.jsonl:2 is not valid JSON" in str(_usage_error(tmp_path))
