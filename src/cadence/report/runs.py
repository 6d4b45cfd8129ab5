"""The report of a training run (``cadence report RUN_DIR``): configuration, totals, plots per step, last rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.errors import UsageError
from cadence.formatting import format_bytes, format_hms, format_number
from cadence.report import render as plots
from cadence.report.document import WHERE, plot_block, read_json_object
from cadence.report.render import Block, Bullets, Heading, Paragraph, Report, Table
from cadence.training.run_dir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, MetricsUnreadable, read_metrics

LAST_ROWS = 10


def _metrics_rows(root: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows (a torn last line of a killed run dropped); any other bad line is a UsageError."""
    try:
        return read_metrics(root)
    except MetricsUnreadable as err:
        raise UsageError.single(WHERE, str(err)) from None


# --------------------------------------------------------------------------------------------------- run report
def run_report(root: Path) -> Report:
    """The report of a training run: configuration, totals, plots per step and the last metrics rows."""
    rows = _metrics_rows(root)
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
        items.append(f"**Memory budget:** {format_bytes(get('memory_budget_bytes'))}")
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
        f"**Tokens:** {format_number(get('tokens'), ',.0f')}" + (
            f" ({format_number(get('targets'), ',.0f')} targets)" if get("targets") else ""),
        f"**Wall time:** {format_hms(get('wall_time_s'))}" + (
            f" ({get('wall_time_s'):.1f} s)" if plots.finite(get("wall_time_s")) else "")
        + f"; **throughput:** {speed}",
        f"**Peak memory:** {format_bytes(get('peak_memory_bytes'))}" + (
            f" ({get('peak_memory_source')})" if get("peak_memory_source") else "") + (
            f"; max RSS {format_bytes(get('max_rss_bytes'))}" if get("max_rss_bytes") else ""),
        f"**Final loss:** {format_number(get('final_loss'))}; "
        f"**final val loss:** {format_number(get('final_val_loss'))}",
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
        plot_block("report-loss.png", "Training loss per optimizer step (token mean); validation loss as orange dots."
              + skip_note, plots.loss_figure(rows)),
        plot_block("report-lr.png", "Learning rate used by each optimizer step.", plots.lr_figure(rows)),
        plot_block("report-throughput.png", "Tokens per second per optimizer step"
              + ("; squares mark steps slowed by the memory profiler." if profiled else "."),
              plots.throughput_figure(rows, average=summary.get("tokens_per_s"), profiled_steps=profiled)),
        plot_block("report-grad-norm.png", "Total gradient norm before clipping (log scale); red x: not finite.",
              plots.grad_norm_figure(rows, clip=clip if plots.finite(clip) else None)),
    ]
    if any(plots.finite(row.get("loss_scale")) for row in rows):
        blocks.append(plot_block("report-loss-scale.png", "fp16 loss scale per window (log2 scale); red x: skipped.",
                            plots.loss_scale_figure(rows)))
    return blocks


def _last_rows(rows: list[dict[str, Any]]) -> Table:
    fp16 = any(plots.finite(row.get("loss_scale")) for row in rows)
    header = ["step", "window", "loss", "val loss", "grad norm", "lr"] + (["loss scale"] if fp16 else [])
    header += ["tokens", "tokens/s", "step time", "peak memory", "skipped"]
    table = []
    for row in rows[-LAST_ROWS:]:
        cells = [str(row.get("step")), str(row.get("window", "-")), format_number(row.get("loss")),
                 format_number(row.get("val_loss")), format_number(row.get("grad_norm"), ".3g"),
                 format_number(row.get("lr"), ".3g")]
        cells += [format_number(row.get("loss_scale"), "g")] if fp16 else []
        cells += [format_number(row.get("tokens"), ",.0f"), format_number(row.get("tokens_per_s"), ",.0f"),
                  f"{format_number(row.get('step_time_s'), '.3f')} s", format_bytes(row.get("peak_memory_bytes")),
                  f"**skipped** ({row.get('skip_reason') or '?'})" if row.get("skipped") else ""]
        table.append(cells)
    return Table(header=header, rows=table)


