"""Run and plan reports (``cadence report RUN_DIR``): report.md and a self-contained report.html, plots as PNGs.

This module decides what a report says: it reads the run (config.json, metrics.jsonl, summary.json) or the plan
(plan.json) and turns it into one list of blocks (heading, paragraph, bullets, table, plot). report_plots.py draws
the figures and renders the blocks, so the markdown and the HTML always say the same thing. The HTML embeds every plot
as a base64 data URI and can be mailed or archived alone; the markdown links the same PNG files, written beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cadence import report_plots as plots
from cadence.errors import UsageError
from cadence.progress import format_bytes
from cadence.report_plots import Block, Bullets, Heading, Paragraph, Plot, Report, Table, to_html, to_markdown
from cadence.run_dir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, atomic_write_bytes

PLAN_FILE = "plan.json"
PROFILE_FILE = "profile.json"
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
RUN_PLOTS = ("report-loss.png", "report-lr.png", "report-throughput.png", "report-grad-norm.png",
             "report-loss-scale.png")
PLAN_PLOTS = ("report-diagnosis.png", "report-memory.png", "report-throughput.png", "report-quality.png")
LAST_ROWS = 10
WHERE = "RUN_DIR"


# ------------------------------------------------------------------------------------------------ entry point
def build_report(path: Path) -> list[Path]:
    """Write report.md, report.html and the report-*.png plots into a run, plan or profile directory; return them.

    Raises UsageError (naming RUN_DIR) when ``path`` is missing, is not a directory, holds no run (metrics.jsonl),
    plan (plan.json) or profile (profile.json), or holds files that are not valid JSON.
    """
    root = Path(path)
    if not root.exists():
        raise UsageError.single(WHERE, f"{root} does not exist")
    if not root.is_dir():
        raise UsageError.single(WHERE, f"{root} is a file; give the run or plan directory that holds it")
    if (root / PLAN_FILE).is_file():
        report = plan_report(root)
    elif (root / PROFILE_FILE).is_file():  # before metrics.jsonl: a profile directory may hold one as well
        from cadence.profile_report import profile_report  # here, not on top: profile_report imports this module
        report = profile_report(root)
    elif (root / METRICS_FILE).is_file():
        report = run_report(root)
    else:
        raise UsageError.single(
            WHERE, f"{root} holds neither a run ({METRICS_FILE}, written by cadence train), a plan ({PLAN_FILE}, "
                   f"written by cadence plan) nor a profile ({PROFILE_FILE}, written by cadence profile)")
    try:
        return write_report(report, root)
    except OSError as err:  # a read-only or full disk is the user's to fix, not a traceback
        raise UsageError.single(WHERE, f"cannot write the report into {root}: {err.strerror or err}") from None


def write_report(report: Report, root: Path) -> list[Path]:
    """Write the report's files atomically; plots of an earlier build that this one lacks are removed."""
    plotted = [block for block in report.blocks if isinstance(block, Plot)]
    written = [root / REPORT_MD, root / REPORT_HTML, *(root / plot.name for plot in plotted)]
    for plot in plotted:
        atomic_write_bytes(root / plot.name, plot.png)
    for stale in set(RUN_PLOTS + PLAN_PLOTS) - {plot.name for plot in plotted}:
        (root / stale).unlink(missing_ok=True)  # e.g. a loss-scale plot from before the run was re-made in bf16
    atomic_write_bytes(root / REPORT_MD, to_markdown(report).encode("utf-8"))
    atomic_write_bytes(root / REPORT_HTML, to_html(report).encode("utf-8"))
    return written


# ----------------------------------------------------------------------------------------------------- reading
def read_json_object(path: Path, where: str = WHERE) -> dict[str, Any]:
    """A JSON file that must hold an object; any problem is a UsageError naming ``where``."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError.single(where, f"{path} cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise UsageError.single(where, f"{path} is not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(value, dict):
        raise UsageError.single(where, f"{path} should hold a JSON object, not {type(value).__name__}")
    return value


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows. A run killed mid-write can leave a partial last line without its newline: it is dropped."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise UsageError.single(WHERE, f"{path}:{number} is not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise UsageError.single(WHERE, f"{path}:{number} is not a metrics row (a JSON object with a step)")
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------------------- formatting
def fmt_bytes(value: Any) -> str:
    """Bytes as B/KiB/MiB/GiB with one decimal, as the progress line shows them; "-" when unknown."""
    return format_bytes(int(value)) if plots.finite(value) else "-"


def fmt_hms(seconds: Any) -> str:
    """h:mm:ss (hours unbounded: 1e9 tokens can take days)."""
    if not plots.finite(seconds):
        return "-"
    total = max(0, int(round(seconds)))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def fmt_num(value: Any, spec: str = ".4f") -> str:
    """A number in ``spec``, or "-" for the nulls that metrics write for missing or non-finite values."""
    return format(value, spec) if plots.finite(value) else "-"


def _times(value: Any, factor: float) -> Any:
    return value * factor if plots.finite(value) else None


def _plot(name: str, caption: str, figure: Any) -> Plot:
    """A Plot block from a figure; its title (the figure's own) becomes the image's alt text."""
    return Plot(name=name, title=figure.axes[0].get_title(), caption=caption, png=plots.png_bytes(figure))


# --------------------------------------------------------------------------------------------------- run report
def run_report(root: Path) -> Report:
    """The report of a training run: configuration, totals, plots per step and the last metrics rows."""
    rows = _read_metrics(root / METRICS_FILE)
    config = read_json_object(root / CONFIG_FILE) if (root / CONFIG_FILE).is_file() else {}
    summary = read_json_object(root / SUMMARY_FILE) if (root / SUMMARY_FILE).is_file() else None
    blocks: list[Block] = [Heading(text="Configuration"), Bullets(items=_config_items(config))]
    blocks += [Heading(text="Totals")]
    if summary is None:
        blocks.append(Paragraph(text=f"**No {SUMMARY_FILE}: the run did not finish.** The totals below are counted "
                                     f"from {METRICS_FILE}."))
        summary = _summary_from_rows(rows)
    blocks.append(Bullets(items=_total_items(summary, rows)))
    blocks += [Heading(text="Plots"), *_run_plots(rows, config, summary)]
    if rows:
        blocks += [Heading(text=f"Last {min(LAST_ROWS, len(rows))} rows of {METRICS_FILE}"), _last_rows(rows)]
    return Report(title=f"Run report: {root.resolve().name}", blocks=blocks)


def _config_items(config: dict[str, Any]) -> list[str]:
    if not config:
        return [f"**No {CONFIG_FILE}** in the run directory."]
    get = config.get
    micro, accum, world = get("micro_batch_size", "?"), get("grad_accum_steps", "?"), get("world_size", 1)
    if get("auto_micro_batch") or micro == "auto":
        micro = "auto"
    effective = get("effective_batch_size", "?")
    per_step = effective * get("seq_len") if isinstance(effective, int) and isinstance(get("seq_len"), int) else None
    params = get("model_parameters")
    items = [
        f"**Model:** {get('model', '?')}" + (f", {params:,} parameters" if isinstance(params, int) else ""),
        f"**Device:** {get('resolved_device', get('device', '?'))}; **precision:** {get('precision', '?')}; "
        f"recompute {get('activation_checkpointing', 'none')}; offload {get('offload', 'none')}",
        f"**Effective batch:** {effective} sequences = {micro} micro-batch x {accum} accumulation x {world} "
        f"process(es)" + (f" = {per_step:,} tokens per optimizer step" if per_step else ""),
        f"**Sequence length:** {get('seq_len', '?')} tokens",
        f"**Data:** {get('data_description') or get('data') or 'built-in corpus'}",
        f"**Optimizer:** AdamW, lr {get('lr', '?')}, {get('lr_schedule', '?')} schedule, warmup "
        f"{get('warmup_steps', '?')} steps, max grad norm {get('max_grad_norm', '?')}, "
        f"max steps {get('max_steps', '?')}",
    ]
    if get("memory_budget_bytes"):
        items.append(f"**Memory budget:** {fmt_bytes(get('memory_budget_bytes'))}")
    versions = get("versions")
    if isinstance(versions, dict):
        items.append("**Versions:** " + ", ".join(f"{name} {value}" for name, value in versions.items()))
    return items


def _summary_from_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [row for row in rows if not row.get("skipped")]
    vals = [row["val_loss"] for row in done if plots.finite(row.get("val_loss"))]
    peaks = [row["peak_memory_bytes"] for row in rows if plots.finite(row.get("peak_memory_bytes"))]
    return {"steps": done[-1]["step"] if done else 0, "skipped": len(rows) - len(done), "windows": len(rows),
            "tokens": sum(row.get("tokens") or 0 for row in rows), "peak_memory_bytes": max(peaks, default=None),
            "peak_memory_source": "largest peak_memory_bytes in metrics.jsonl",
            "final_loss": done[-1].get("loss") if done else None, "final_val_loss": vals[-1] if vals else None}


def _total_items(summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    get = summary.get
    speed = f"{get('tokens_per_s'):,.0f} tokens/s" if plots.finite(get("tokens_per_s")) else "-"
    if get("tokens_per_s_includes_profiler") is False and any(plots.finite(r.get("peak_memory_bytes")) for r in rows):
        speed += " (memory-profiled steps excluded)"
    items = [
        f"**Steps:** {get('steps', '?')} optimizer steps, {get('skipped', 0)} skipped, {get('windows', '?')} windows",
        f"**Tokens:** {fmt_num(get('tokens'), ',.0f')}" + (
            f" ({fmt_num(get('targets'), ',.0f')} targets)" if get("targets") else ""),
        f"**Wall time:** {fmt_hms(get('wall_time_s'))}" + (
            f" ({get('wall_time_s'):.1f} s)" if plots.finite(get("wall_time_s")) else "")
        + f"; **throughput:** {speed}",
        f"**Peak memory:** {fmt_bytes(get('peak_memory_bytes'))}" + (
            f" ({get('peak_memory_source')})" if get("peak_memory_source") else "") + (
            f"; max RSS {fmt_bytes(get('max_rss_bytes'))}" if get("max_rss_bytes") else ""),
        f"**Final loss:** {fmt_num(get('final_loss'))}; **final val loss:** {fmt_num(get('final_val_loss'))}",
    ]
    skipped = [row for row in rows if row.get("skipped")]
    if skipped:
        shown = ", ".join(f"window {row.get('window', '?')} after step {row['step']} "
                          f"({row.get('skip_reason') or 'no reason given'})" for row in skipped[:10])
        items.append(f"**Skipped steps:** {shown}" + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""))
    return items


def _run_plots(rows: list[dict[str, Any]], config: dict[str, Any], summary: dict[str, Any]) -> list[Block]:
    if not rows:
        return [Paragraph(text=f"{METRICS_FILE} has no rows yet: nothing to plot.")]
    skipped = sum(1 for row in rows if row.get("skipped"))
    skip_note = (f" Skipped steps ({skipped}) are red dashed lines half-way after the last real step, with an x at "
                 "their loss where it is finite." if skipped else " No step was skipped.")
    # On CPU memory is measured by the profiler on some steps only, and those steps run slower.
    cpu = str(config.get("resolved_device", "")).startswith("cpu")
    profiled = {row["step"] for row in rows if cpu and plots.finite(row.get("peak_memory_bytes"))}
    clip = config.get("max_grad_norm")
    blocks: list[Block] = [
        _plot("report-loss.png", "Training loss per optimizer step (token mean); validation loss as orange dots."
              + skip_note, plots.loss_figure(rows)),
        _plot("report-lr.png", "Learning rate used by each optimizer step.", plots.lr_figure(rows)),
        _plot("report-throughput.png", "Tokens per second per optimizer step"
              + ("; squares mark steps slowed by the memory profiler." if profiled else "."),
              plots.throughput_figure(rows, average=summary.get("tokens_per_s"), profiled_steps=profiled)),
        _plot("report-grad-norm.png", "Total gradient norm before clipping (log scale); red x: not finite.",
              plots.grad_norm_figure(rows, clip=clip if plots.finite(clip) else None)),
    ]
    if any(plots.finite(row.get("loss_scale")) for row in rows):
        blocks.append(_plot("report-loss-scale.png", "fp16 loss scale per window (log2 scale); red x: skipped.",
                            plots.loss_scale_figure(rows)))
    return blocks


def _last_rows(rows: list[dict[str, Any]]) -> Table:
    fp16 = any(plots.finite(row.get("loss_scale")) for row in rows)
    header = ["step", "window", "loss", "val loss", "grad norm", "lr"] + (["loss scale"] if fp16 else [])
    header += ["tokens", "tokens/s", "step time", "peak memory", "skipped"]
    table = []
    for row in rows[-LAST_ROWS:]:
        cells = [str(row.get("step")), str(row.get("window", "-")), fmt_num(row.get("loss")),
                 fmt_num(row.get("val_loss")), fmt_num(row.get("grad_norm"), ".3g"), fmt_num(row.get("lr"), ".3g")]
        cells += [fmt_num(row.get("loss_scale"), "g")] if fp16 else []
        cells += [fmt_num(row.get("tokens"), ",.0f"), fmt_num(row.get("tokens_per_s"), ",.0f"),
                  f"{fmt_num(row.get('step_time_s'), '.3f')} s", fmt_bytes(row.get("peak_memory_bytes")),
                  f"**skipped** ({row.get('skip_reason') or '?'})" if row.get("skipped") else ""]
        table.append(cells)
    return Table(header=header, rows=table)


# -------------------------------------------------------------------------------------------------- plan report
def plan_report(root: Path) -> Report:
    """The report of a plan: diagnosis, candidates (estimated and measured), the choice, its quality, the notes."""
    plan = read_json_object(root / PLAN_FILE)
    candidates = [c for c in plan.get("candidates") or [] if isinstance(c, dict)]
    choice = plan.get("choice") if isinstance(plan.get("choice"), dict) else None
    chosen_id = choice.get("id") if choice else None
    chosen = next((c for c in candidates if c.get("id") == chosen_id), None)
    budget = plan.get("memory_budget_bytes") if plots.finite(plan.get("memory_budget_bytes")) else None
    blocks: list[Block] = [Heading(text="Setup"), Bullets(items=_plan_setup(plan))]
    blocks += _diagnosis(plan.get("diagnosis") or {}, chosen, budget)
    blocks += [Heading(text="Candidates"), _candidate_table(candidates, chosen_id)]
    if candidates:
        blocks.append(_plot("report-memory.png", "Peak memory per candidate: estimated (blue; faint when not "
                            "measured) and measured (green; hatched when over the budget); dashed line: the budget.",
                            plots.memory_figure(candidates, budget=budget, chosen=chosen_id)))
    if any(plots.finite((c.get("measured") or {}).get("tokens_per_s")) for c in candidates):
        blocks.append(_plot("report-throughput.png", "Measured throughput of each measured candidate; the chosen "
                            "one in purple.", plots.throughput_plan_figure(candidates, chosen=chosen_id)))
    blocks += [Heading(text="Choice"), *_choice(choice)]
    blocks += [Heading(text="Quality check"), *_quality(plan.get("quality"))]
    notes = [str(note) for note in plan.get("notes") or []]
    blocks += [Heading(text="Notes"), Bullets(items=notes) if notes else Paragraph(text="None.")]
    title = f"Plan report: {plan.get('model', '?')}" + (f" within {fmt_bytes(budget)}" if budget else "")
    return Report(title=title, blocks=blocks)


def _config_text(item: dict[str, Any]) -> str:
    return (f"{item.get('micro_batch_size', '?')} micro-batch x {item.get('grad_accum_steps', '?')} accumulation, "
            f"{item.get('precision', '?')}, recompute {item.get('activation_checkpointing', 'none')}, "
            f"offload {item.get('offload', 'none')}")


def _plan_setup(plan: dict[str, Any]) -> list[str]:
    get = plan.get
    params = get("parameters")
    items = [
        f"**Model:** {get('model', '?')}" + (f", {params:,} parameters" if isinstance(params, int) else ""),
        f"**Device:** {get('device', '?')}, {get('world_size', 1)} process(es); **sequence length:** "
        f"{get('seq_len', '?')} tokens",
        f"**Effective batch:** {get('effective_batch_size', '?')} sequences; **memory budget:** "
        f"{fmt_bytes(get('memory_budget_bytes'))} per process",
        f"**Data:** {get('data') or 'built-in corpus'}"
        + (f" ({get('tokens_per_epoch'):,} tokens per epoch)" if isinstance(get("tokens_per_epoch"), int) else ""),
        f"**Planned:** {get('created', '?')}, in {fmt_hms(get('duration_s'))}",
    ]
    if get("version") not in (None, 1):
        items.append(f"**Note:** plan.json version {get('version')}; this report reads version 1 and may miss fields")
    return items


def _diagnosis(diagnosis: dict[str, Any], chosen: dict[str, Any] | None, budget: float | None) -> list[Block]:
    baseline = diagnosis.get("baseline") or {}
    estimate = diagnosis.get("estimate") or {}
    peak, categories = estimate.get("peak_bytes"), estimate.get("by_category") or {}
    verdict = f" during {estimate['peak_phase']}" if estimate.get("peak_phase") else ""
    if plots.finite(peak) and budget:
        verdict += f", {peak / budget:.1f}x the budget" + (" (fits)" if peak <= budget else " (does not fit)")
    blocks: list[Block] = [Heading(text="Diagnosis"), Paragraph(
        text=f"**Baseline:** {_config_text(baseline)}: estimated peak **{fmt_bytes(peak)}**{verdict}; dominant: "
             f"**{diagnosis.get('dominant', '?')}**.")]
    on_device = {k: v for k, v in categories.items() if k not in plots.HOST_CATEGORIES and plots.finite(v)}
    total = sum(on_device.values()) or 1
    if categories:
        blocks.append(Table(header=["category", "estimated", "share of the peak"], rows=[
            [name.replace("_", " "), fmt_bytes(value),
             f"{100 * value / total:.0f}%" if name in on_device else "host memory, not in the peak"]
            for name, value in categories.items()]))
    if diagnosis.get("explanation"):
        blocks.append(Paragraph(text=str(diagnosis["explanation"])))
    bars = [("baseline", categories)]
    if chosen and chosen.get("estimated_by_category"):
        bars.append((f"chosen ({chosen.get('id')})", chosen["estimated_by_category"]))
    if categories:
        blocks.append(_plot("report-diagnosis.png", "Estimated peak memory by category: the baseline"
                            + (" and the chosen candidate" if len(bars) > 1 else "") + "; dashed line: the budget.",
                            plots.breakdown_figure(bars, budget=budget)))
    return blocks


def _candidate_table(candidates: list[dict[str, Any]], chosen_id: str | None) -> Table | Paragraph:
    if not candidates:
        return Paragraph(text="The plan holds no candidates.")
    rows, marked = [], None
    for index, cand in enumerate(candidates):
        measured = cand.get("measured") or {}
        if measured:
            fits = {True: "yes (measured)", False: "no (measured)"}.get(measured.get("fits"), "?")
        else:
            fits = {True: "yes (estimate)", False: "no (estimate)"}.get(cand.get("fits_estimate"), "?")
        name = str(cand.get("id", "?"))
        if name == chosen_id:
            name, marked = f"**{name} (chosen)**", index
        rows.append([name, f"{cand.get('micro_batch_size', '?')} x {cand.get('grad_accum_steps', '?')}",
                     str(cand.get("precision", "?")), str(cand.get("activation_checkpointing", "none")),
                     str(cand.get("offload", "none")), fmt_bytes(cand.get("estimated_peak_bytes")),
                     fmt_bytes(measured.get("peak_bytes")), fits, fmt_num(measured.get("tokens_per_s"), ",.0f"),
                     fmt_hms(measured.get("seconds_per_epoch")),
                     fmt_hms(_times(measured.get("hours_per_billion_tokens"), 3600)),
                     str(cand.get("status", "?")) + (f": {measured['error']}" if measured.get("error") else "")])
    header = ["candidate", "micro x accum", "precision", "recompute", "offload", "estimated peak", "measured peak",
              "fits", "tokens/s", "time per epoch", "time per 1B tokens", "status"]
    return Table(header=header, rows=rows, marked_row=marked)


def _choice(choice: dict[str, Any] | None) -> list[Block]:
    if not choice:
        return [Paragraph(text="**No candidate was chosen:** see each candidate's status and the notes.")]
    flags = (f"--micro-batch-size {choice.get('micro_batch_size')} --grad-accum-steps {choice.get('grad_accum_steps')} "
             f"--precision {choice.get('precision')} --activation-checkpointing "
             f"{choice.get('activation_checkpointing', 'none')} --offload {choice.get('offload', 'none')}")
    return [Paragraph(text=f"**Chosen: {choice.get('id', '?')}**: {_config_text(choice)}."),
            Paragraph(text=f"**Reason:** {choice.get('reason', 'not given')}"),
            Paragraph(text=f"To train with it: `cadence train ... {flags}`")]


def _passed(value: Any) -> str:
    return {True: "PASS", False: "FAIL"}.get(value, "not checked")


def _quality(quality: Any) -> list[Block]:
    """Pass/fail of the gradient and loss checks against the reference, with their figures."""
    blocks: list[Block] = []
    quality = quality if isinstance(quality, dict) else {}
    grad = quality.get("gradient")
    if isinstance(grad, dict):
        blocks.append(Paragraph(
            text=f"**Gradient: {_passed(grad.get('passed'))}**: relative error "
                 f"{fmt_num(grad.get('relative_error'), '.2e')} (tolerance {fmt_num(grad.get('tolerance'), '.0e')}), "
                 f"cosine {fmt_num(grad.get('cosine'), '.7f')}, against the reference ({grad.get('reference', '?')})."))
    loss = quality.get("loss")
    if isinstance(loss, dict):
        blocks.append(Paragraph(
            text=f"**Loss over {loss.get('steps', '?')} steps: {_passed(loss.get('passed'))}**: largest relative "
                 f"difference {fmt_num(_times(loss.get('max_relative_difference'), 100), '.2f')}% (tolerance "
                 f"{fmt_num(_times(loss.get('tolerance'), 100), '.2f')}%)"
                 + (f", against {loss['reference_setup']}." if loss.get("reference_setup") else ".")))
        if loss.get("chosen") and loss.get("reference"):
            blocks.append(_plot("report-quality.png", "Loss of the chosen configuration and of the reference over "
                                "the same first steps.", plots.quality_figure(loss["chosen"], loss["reference"])))
    return blocks or [Paragraph(text="No quality check was recorded.")]

