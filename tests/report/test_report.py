"""Run and plan reports (cadence.report.runs, cadence.plan.report): a real tiny run, a hand-made run with skipped fp16 steps, a plan fixture."""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from helpers import run_cli
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.image import imread
from matplotlib.lines import Line2D

from cadence.cli import main
from cadence.errors import UsageError
from cadence.formatting import format_hms as fmt_hms
from cadence.memory.estimate import ESTIMATE_CATEGORIES
from cadence.plan.report import quality_verdict as plan_quality_verdict
from cadence.rebuild import build_report
from cadence.report import render
from cadence.report.runs import next_steps
from cadence.training.run_dir import read_metrics

FIXTURE_PLAN = Path(__file__).resolve().parents[1] / "fixtures" / "plan" / "plan.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_PNGS = ["report-loss.png", "report-lr.png", "report-throughput.png", "report-grad-norm.png"]
PLAN_PNGS = ["report-diagnosis.png", "report-memory.png", "report-throughput.png", "report-quality.png"]
PAGE_WIDTH_PX = 1100  # the HTML body's max-width (render.CSS): a wider image is shrunk, its text with it
ROW_PX = 20  # the least height per candidate row for one line of small text and its bars
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
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "32", "--micro-batch-size", "4",
                              "--grad-accum-steps", "2", "--max-steps", "4", "--eval-every", "2",
                              "--out", str(base / "run")])
    assert status == 0, err
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


def _run_pngs(run: Path) -> list[str]:
    """The run report's plots: with accumulation the run measures the gradient noise scale, plotted once it has a
    value."""
    noise = any(row.get("grad_noise_scale") for row in _metrics_rows(run))
    return RUN_PNGS + (["report-noise-scale.png"] if noise else [])


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, which always follows the 8-byte signature."""
    assert data.startswith(PNG_MAGIC) and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------------------------------- run report
def test_run_report_writes_markdown_html_and_plots(run_dir: Path, run_report: list[Path]) -> None:
    assert run_report == [run_dir / "report.md", run_dir / "report.html",
                          *(run_dir / name for name in _run_pngs(run_dir))]
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
    assert "offload none; optimizer state fp32; loss over whole logits" in md and "LoRA" not in md
    for name in RUN_PNGS:
        assert f"]({name})" in md
    assert md.index("## Totals") < md.index("## What to try next") < md.index("## Plots")
    table = [line for line in md.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [1, 2, 3, 4]


def test_run_html_is_self_contained(run_dir: Path, run_report: list[Path]) -> None:
    page = (run_dir / "report.html").read_text()
    _assert_html_page(page)
    assert _embedded_pngs(page) == [(run_dir / name).read_bytes() for name in _run_pngs(run_dir)]


def test_run_pngs_are_images(run_dir: Path, run_report: list[Path]) -> None:
    for name in RUN_PNGS:
        assert (run_dir / name).read_bytes().startswith(PNG_MAGIC)
        height, width, _ = imread(run_dir / name).shape
        assert 400 < width <= PAGE_WIDTH_PX and height > 200


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


def _cadence_config(run: Path, **fields: Any) -> None:
    """The least config.json that cadence train's own carries (is_cadence_config), with ``fields``."""
    run.mkdir(parents=True, exist_ok=True)
    config = {"effective_batch_size": 8, "grad_accum_steps": 1, "world_size": 1, "data_fingerprint": "x",
              "versions": {"cadence": "0"}, **fields}
    (run / "config.json").write_text(json.dumps(config))


def test_unfinished_run_is_reported_from_its_metrics(tmp_path: Path) -> None:
    rows = _fp16_rows_with_skips()
    text = "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 6, "win'  # killed mid-write
    (tmp_path / "metrics.jsonl").write_text(text)
    _cadence_config(tmp_path)
    build_report(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "the run did not finish" in md
    assert "**Steps:** 5 optimizer steps, 2 skipped, 7 windows" in md
    assert "**Final loss:** 4.3000" in md  # window 7, the last one that stepped


# --------------------------------------------------------------------------------------- run report: what next
ADVICE_HEADS = ("**Padding:**", "**fp16 overflows:**", "**Non-finite gradients:**", "**Out of memory:**",
                "**Memory to spare:**", "**Compile:**", "**Continue:**")
MIB = 2**20


def _skip_rows(window: int, reason: str) -> list[dict]:
    """Rows of a run whose window ``window`` was skipped for ``reason`` (the rest stepped)."""
    return [{"step": min(w, window - 1) if w >= window else w, "window": w, "skipped": w == window,
             "skip_reason": reason if w == window else None, "tokens": 256, "padded_positions": 0}
            for w in range(1, window + 2)]


# (case, config changes, summary changes, rows (None: the run's own), advice heads expected, texts in it, not in it)
ADVICE_CASES: list[tuple[str, dict, dict, list | None, set[str], list[str], list[str]]] = [
    ("as run: text, fp32, CPU, no budget", {}, {}, None, set(), [], ["less recompute", "--activation-checkpointing"]),
    ("padding, drawn order", {"micro_batch_order": "drawn"}, {"padding_fraction": 0.4}, None, {"**Padding:**"},
     ["40% of the positions", "`--micro-batch-order by-length`", "`--packing`", "`--micro-batch-tokens N`"], []),
    ("padding, already by length", {}, {"padding_fraction": 0.4}, None, {"**Padding:**"},
     ["`--packing`", "`--micro-batch-tokens N`"], ["--micro-batch-order by-length"]),
    ("padding, packed with a token budget already", {"packing": True, "micro_batch_tokens": 64},
     {"padding_fraction": 0.3}, None, set(), ["--micro-batch-tokens 64 --packing"], []),
    ("padding below the share", {}, {"padding_fraction": 0.1}, None, set(), [], []),
    ("fp16 overflows after the scale settled", {"precision": "fp16"}, {}, _skip_rows(20, "fp16 overflow"),
     {"**fp16 overflows:**"}, ["`--precision bf16`", "a lower `--lr` than 0.001"], []),
    ("fp16 overflow while the scale calibrates", {"precision": "fp16"}, {}, _skip_rows(3, "fp16 overflow"), set(),
     [], ["bf16"]),
    ("non-finite gradients in fp32", {}, {}, _skip_rows(3, "non-finite gradients"), {"**Non-finite gradients:**"},
     ["a lower `--lr` than 0.001, or a warmup (`--warmup-steps`)"], ["bf16"]),
    ("out-of-memory retries", {"auto_micro_batch": True, "micro_batch_size": 8, "grad_accum_steps": 1},
     {"oom_retries": 2, "final_micro_batch_size": 2}, None, {"**Out of memory:**"},
     ["Start at `--micro-batch-size 2 --grad-accum-steps 4`", "profile --model gpt-tiny --data",
      "--micro-batch-size 2 --grad-accum-steps 4 --precision fp32 --out DIR"], []),
    ("far below the budget, no recompute", {"memory_budget": "64MiB", "memory_budget_bytes": 64 * MIB},
     {"peak_memory_bytes": 16 * MIB}, None, {"**Memory to spare:**"},
     ["16.0 MiB, is 25% of --memory-budget 64.0 MiB", "`--micro-batch-size 8 --grad-accum-steps 1`",
      "--effective-batch-size 8 --memory-budget 64MiB`"], ["less recompute", "SIZE"]),
    ("far below the budget, full recompute",
     {"memory_budget": "64MiB", "memory_budget_bytes": 64 * MIB, "activation_checkpointing": "full"},
     {"peak_memory_bytes": 16 * MIB}, None, {"**Memory to spare:**"},
     ["less recompute, `--activation-checkpointing selective`", "--precision fp32 --activation-checkpointing full"],
     []),
    ("near the budget", {"memory_budget": "64MiB", "memory_budget_bytes": 64 * MIB},
     {"peak_memory_bytes": 60 * MIB}, None, set(), [], []),
    ("CUDA without --compile", {"resolved_device": "cuda:0"}, {}, None, {"**Compile:**"}, ["`--compile`"], []),
    ("CUDA with --compile", {"resolved_device": "cuda:0", "compile": True}, {}, None, set(),
     ["--precision fp32 --compile --out DIR"], []),
    ("stopped by a signal", {}, {"stopped_by": "SIGTERM"}, None, {"**Continue:**"}, ["`cadence train --resume --out "],
     []),
    # Issue 41: the suggested commands carry every lever of the run, or following them measures another job. LoRA
    # and the chat data are the job (profile and plan both); the optimizer state and loss chunking are this run's
    # configuration (profile), which a plan searches itself (said in its note).
    ("LoRA on chat data, 8-bit state, chunked loss",
     {"lora_rank": 8, "lora_alpha": 16.0, "lora_targets": ["q_proj", "v_proj"], "lora_base_precision": "nf4",
      "train_on": "last", "optimizer_state": "8bit", "loss_chunk_tokens": 128}, {}, None, set(),
     ["--lora-rank 8 --lora-alpha 16.0 --lora-targets q_proj,v_proj --lora-base-precision nf4 --micro-batch-size",
      "--train-on last", "--optimizer-state 8bit --loss-chunk-tokens 128", "this run's --optimizer-state 8bit "
      "--loss-chunk-tokens 128 left to the plan"], []),
]


@pytest.mark.parametrize(("config_changes", "summary_changes", "rows", "heads", "present", "absent"),
                         [case[1:] for case in ADVICE_CASES], ids=[case[0] for case in ADVICE_CASES])
def test_what_to_try_next_applies_to_this_run(run_dir: Path, config_changes: dict, summary_changes: dict,
                                              rows: list | None, heads: set[str], present: list[str],
                                              absent: list[str]) -> None:
    config = {**json.loads((run_dir / "config.json").read_text()), **config_changes}
    summary = {**json.loads((run_dir / "summary.json").read_text()), **summary_changes}
    items = next_steps(run_dir, config, summary, _metrics_rows(run_dir) if rows is None else rows)
    assert {head for head in ADVICE_HEADS if any(item.startswith(head) for item in items)} == heads
    assert items[-2].startswith("**Where the step time goes:** `cadence profile --model gpt-tiny --data ")
    assert items[-1].startswith("**Alternatives:** `cadence plan --model gpt-tiny --data ")
    text = "\n".join(items)
    for part in present:
        assert part in text
    for part in absent:
        assert part not in text


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
    # The decision leads: right after the title, before the setup and the 9-row candidate table.
    decision = md[md.index("## Decision"):md.index("## Setup")]
    assert md.split("\n")[2] == "## Decision" and md.index("## Setup") < md.index("| candidate |")
    assert f"**Chosen: {chosen}**" in decision and plan["choice"]["reason"] in decision
    assert (f"**Train with it:** `cadence train --plan {plan_dir / 'plan.json'}`" in decision
            and "--micro-batch-size 16 --grad-accum-steps 2 --precision fp32 --activation-checkpointing selective "
                "--offload none --micro-batch-order drawn`" in decision)
    assert [line for line in decision.splitlines() if line.startswith("**Quality check: ")] == [
        "**Quality check: PASS**: gradient PASS (relative error 2.30e-07), loss over 10 steps PASS (largest "
        "difference 0.04%), against the reference; details below."]
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
        width, _ = _png_size((plan_dir / name).read_bytes())
        assert width <= PAGE_WIDTH_PX, name


def test_the_plan_report_says_where_the_plan_s_time_went(plan_dir: Path) -> None:
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan.update(time_budget_s=60, time_spent_s={"start-up": 4.0, "trials": 20.0, "rounds": 0.0,
                                                 "quality check": 9.5})
    (plan_dir / "plan.json").write_text(json.dumps(plan))
    build_report(plan_dir)
    planned = next(line for line in (plan_dir / "report.md").read_text().splitlines() if "**Planned:**" in line)
    assert planned.endswith(" of a 60 s --time-budget (trials 20.0 s, quality check 9.5 s, start-up 4.0 s)")


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
    decision = md[md.index("## Decision"):md.index("## Setup")]
    assert decision.strip().splitlines()[-1] == (
        "**No candidate was chosen.** Of 9 candidates: 9 over budget (estimate). The smallest estimated peak is "
        "c04's 26.4 MiB, against a budget of 64.0 MiB. See each candidate's status below and the notes.")
    assert "No quality check was recorded." in md and "(chosen)" not in md


def test_decision_line_of_the_quality_check() -> None:
    passed, failed = {"passed": True}, {"passed": False}
    cases = [({"gradient": passed, "loss": passed}, "PASS"), ({"gradient": passed, "loss": failed}, "FAIL"),
             ({"gradient": {"passed": None}, "loss": failed}, "FAIL"), ({"gradient": passed, "loss": {}}, "not checked"),
             (None, "not checked"), ({}, "not checked")]
    assert [plan_quality_verdict(quality) for quality, _ in cases] == [verdict for _, verdict in cases]


def _many_candidates(count: int) -> dict[str, Any]:
    """The fixture plan with ``count`` candidates (its nine repeated under new ids and shapes), c23 chosen."""
    plan = json.loads(FIXTURE_PLAN.read_text())
    shapes = [(32, 1), (16, 2), (8, 4), (4, 8), (2, 16), (1, 32)]
    candidates = []
    for index in range(count):
        candidate = copy.deepcopy(plan["candidates"][index % len(plan["candidates"])])
        candidate["id"] = f"c{index + 1:02d}"
        candidate["micro_batch_size"], candidate["grad_accum_steps"] = shapes[index % len(shapes)]
        candidates.append(candidate)
    plan["candidates"] = candidates
    plan["choice"]["id"] = "c23"
    return plan


def _assert_rows_legible(fig: Figure, rows: int) -> None:
    """One tick label per row, none overlapping another, all inside the figure; the legend clear of the axes.
    The figure must have been drawn (render.png_bytes): the positions checked are those of its image."""
    assert isinstance(fig.canvas, FigureCanvasAgg)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    labels = [label.get_window_extent(renderer) for label in ax.get_yticklabels()]
    assert len(labels) == rows
    for box in labels:
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    assert not any(upper.overlaps(lower) for upper, lower in zip(labels, labels[1:]))
    legend = fig.legends[0].get_window_extent(renderer)
    assert not legend.overlaps(ax.get_window_extent(renderer))
    assert not legend.overlaps(ax.xaxis.label.get_window_extent(renderer))
    assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)


def test_candidate_plots_fit_the_page_with_36_candidates() -> None:
    """The issue's 36-candidate plan: the per-candidate images within the page width, never shrunk, growing in
    height instead, ROW_PX or more per candidate, with labels that do not overlap and a legend clear of the bars.
    (The report's other plots do not depend on the count: test_plan_report checks their width.)"""
    plan = _many_candidates(36)
    measured = [c for c in plan["candidates"] if (c.get("measured") or {}).get("tokens_per_s")]
    for fig, rows in ((render.memory_figure(plan["candidates"], budget=plan["memory_budget_bytes"], chosen="c23"), 36),
                      (render.throughput_plan_figure(plan["candidates"], chosen="c23"), len(measured))):
        width, height = _png_size(render.png_bytes(fig))
        assert width <= PAGE_WIDTH_PX and height >= ROW_PX * rows, (fig.axes[0].get_title(), width, height)
        _assert_rows_legible(fig, rows)
    with pytest.raises(ValueError, match="shrunk to the page"):
        render.new_figure((render.MAX_FIGURE_WIDTH_IN + 1, 4.0))


def _seen_colors(fig: Figure) -> list[tuple[float, ...]]:
    """The colour each legend entry shows, as seen on white (a faint bar is a different colour from a solid one)."""
    legend = fig.legends[0] if fig.legends else fig.axes[0].get_legend()
    seen = []
    for handle in legend.legend_handles:
        # A bar's face colour carries its alpha; a line (the budget, the chosen star) is opaque.
        red, green, blue, alpha = to_rgba(handle.get_color() if isinstance(handle, Line2D) else handle.get_facecolor())
        seen.append(tuple(round(alpha * c + 1 - alpha, 3) for c in (red, green, blue)))
    return seen


def test_every_series_has_its_own_colour() -> None:
    plan = json.loads(FIXTURE_PLAN.read_text())
    assert set(ESTIMATE_CATEGORIES) | set(render.HOST_CATEGORIES) <= set(render.CATEGORY_COLORS)
    assert len(set(render.CATEGORY_COLORS.values())) == len(render.CATEGORY_COLORS)
    # Categories of a newer plan.json: colours of their own, none a known category's.
    colors = render.category_colors(["parameters", "a_new_category", "another"])
    assert colors["parameters"] == render.CATEGORY_COLORS["parameters"]
    new = {colors["a_new_category"], colors["another"]}
    assert len(new) == 2 and not new & set(render.CATEGORY_COLORS.values())
    every = {name: (index + 1) * MIB for index, name in enumerate(ESTIMATE_CATEGORIES)}
    figures = {
        "breakdown": render.breakdown_figure([("baseline", every), ("chosen", every)], budget=64 * MIB),
        "memory": render.memory_figure(plan["candidates"], budget=plan["memory_budget_bytes"], chosen="c05"),
        "throughput": render.throughput_plan_figure(plan["candidates"], chosen="c05"),
        "quality": render.quality_figure([5.0, 4.0], [5.0, 4.1]),
    }
    entries = {"breakdown": len(ESTIMATE_CATEGORIES) + 1, "memory": 6, "throughput": 3, "quality": 2}
    for name, fig in figures.items():
        colors = _seen_colors(fig)
        assert len(colors) == entries[name] and len(set(colors)) == len(colors), (name, colors)


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
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "tokens": 8}\nnot json\n{"step": 2}\n')
    _cadence_config(tmp_path)
    assert "metrics.jsonl:2 is not valid JSON" in str(_usage_error(tmp_path))


@pytest.mark.parametrize("row", ['{"step": "x"}', '{"step": -3}', '{"step": true}', '{"step": 1.5}'])
def test_report_refuses_metrics_whose_step_is_not_a_count(tmp_path, capsys, row):
    """Issue 29 item 16: a row {"step": "x"} gave exit 0 and a report of "x optimizer steps"."""

    run = tmp_path / "run"
    _cadence_config(run, model="gpt-tiny")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens": 10, "samples": 2}\n' + row + "\n")
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl:2" in err and "not a count of optimizer steps" in err and "Traceback" not in err


def test_the_configuration_names_every_lever_of_the_run(run_dir: Path) -> None:
    """Issue 41: the report left out LoRA, the optimizer state and loss chunking (a LoRA run read as full training)."""
    from cadence.report.runs import _config_items

    config = {**json.loads((run_dir / "config.json").read_text()), "lora_rank": 8, "lora_alpha": None,
              "lora_targets": None, "lora_base_precision": "nf4", "optimizer_state": "bf16", "loss_chunk_tokens": 256}
    text = "\n".join(_config_items(config))
    assert "optimizer state bf16; loss in chunks of 256 tokens" in text
    assert "**LoRA adapters:** rank 8, alpha 8, dropout 0, on every linear layer; frozen base in nf4" in text
