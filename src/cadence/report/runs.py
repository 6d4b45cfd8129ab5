"""The report of a training run (``cadence report RUN_DIR``): configuration, totals, what to try next, plots per
step, last rows."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cadence.config import TrainConfig
from cadence.config.plan_file import read_plan
from cadence.engine.cut import Cut
from cadence.errors import UsageError
from cadence.formatting import format_bytes, format_hms, format_number
from cadence.records import RUN_CONFIG
from cadence.report import render as plots
from cadence.report.document import WHERE, plot_block
from cadence.report.render import Block, Bullets, Heading, Paragraph, Report, Table
from cadence.training.noise_scale import batch_against_noise_scale
from cadence.training.run_dir import (
    CONFIG_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    MetricsUnreadable,
    read_metrics,
    read_summary,
)

LAST_ROWS = 10
PADDING_ADVICE_SHARE = 0.25
"""A padding share from which cutting the windows by length is worth trying (the profile's padding-bound verdict,
cadence.profiling.profiler, uses the same share)."""
HEADROOM_SHARE = 0.5
"""A peak at most this share of --memory-budget leaves room to double the micro-batch: doubling it at most doubles
the peak (parameters, gradients and optimizer state stay, only activations and temporaries grow)."""
FP16_CALIBRATION_WINDOWS = 16
"""fp16's loss scale starts at 2**16 and halves on each overflow: skips within the first 16 windows are the scale
finding its level, which every fp16 run goes through; later ones mean the values themselves overflow."""


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
    # Its fields of their types: a string where a count belongs is one line naming the field, not a wrong figure.
    config = dict(RUN_CONFIG.read(root / CONFIG_FILE, where=WHERE).data) if (root / CONFIG_FILE).is_file() else {}
    summary = read_summary(root)  # its totals checked: a string where a count belongs is one line, not a traceback
    blocks: list[Block] = [Heading(text="Configuration"), Bullets(items=_config_items(config, rows))]
    blocks += [Heading(text="Totals")]
    if summary is None:
        blocks.append(Paragraph(text=f"**No {SUMMARY_FILE}: the run did not finish.** The totals below are counted "
                                     f"from {METRICS_FILE}."))
        summary = _summary_from_rows(rows)
    blocks.append(Bullets(items=_total_items(summary, rows)))
    blocks += _planned_against_measured(config, summary)
    blocks += [Heading(text="Effective batch and the gradient noise scale"),
               Paragraph(text=noise_scale_words(config, summary, rows))]
    blocks += [Heading(text="What to try next"), Bullets(items=next_steps(root, config, summary, rows))]
    blocks += [Heading(text="Plots"), *_run_plots(rows, config, summary)]
    if rows:
        blocks += [Heading(text=f"Last {min(LAST_ROWS, len(rows))} rows of {METRICS_FILE}"), _last_rows(rows)]
    return Report(title=f"Run report: {root.resolve().name}", blocks=blocks)


def _cut_words(config: dict[str, Any]) -> str:
    """How a window was cut, in words, when it is not rows as given ("" for rows)."""
    if config.get("packing"):
        budget = config.get("micro_batch_tokens")
        return (f"each window packed into rows of {config.get('seq_len', '?')} tokens"
                + (f", micro-batches of at most {budget:,} positions" if isinstance(budget, int) else "")
                + ": the micro-batches per window follow the lengths")
    if isinstance(config.get("micro_batch_tokens"), int):
        return (f"each window cut into micro-batches of at most {config['micro_batch_tokens']:,} padded positions: "
                f"the micro-batches per window follow the lengths")
    return ""


def _config_items(config: dict[str, Any], rows: list[dict[str, Any]] | None = None) -> list[str]:
    if not config:
        return [f"**No {CONFIG_FILE}** in the run directory."]
    get: Callable[..., Any] = config.get  # a JSON value of any type, None when absent
    micro, accum, world = get("micro_batch_size", "?"), get("grad_accum_steps", "?"), get("world_size", 1)
    if get("auto_micro_batch") or micro == "auto":
        micro = "auto"
    effective = get("effective_batch_size", "?")
    # Tokens per step as the windows held them (metrics.jsonl): with variable lengths, packing or a token budget
    # the effective batch x seq-len is only the most a window can hold.
    counted = [row["tokens"] for row in rows or [] if isinstance(row.get("tokens"), int) and not row.get("skipped")]
    most = effective * get("seq_len") if isinstance(effective, int) and isinstance(get("seq_len"), int) else None
    cut = _cut_words(config)
    params = get("model_parameters")
    items = [
        f"**Model:** {get('model', '?')}" + (f", {params:,} parameters" if isinstance(params, int) else ""),
        f"**Device:** {get('resolved_device', get('device', '?'))}; **precision:** {get('precision', '?')}; "
        f"recompute {get('activation_checkpointing', 'none')}; offload {get('offload', 'none')}; "
        + (f"optimizer {get('optimizer')}, " if get("optimizer") not in (None, "adamw") else "")
        + f"optimizer state {get('optimizer_state') or 'fp32'}; loss "
        + (f"in chunks of {get('loss_chunk_tokens'):,} tokens" if isinstance(get("loss_chunk_tokens"), int)
           and get("loss_chunk_tokens") > 0 else "over whole logits"),
        f"**Effective batch:** {effective} sequences = {micro} "
        + ("rows per micro-batch before the cut" if cut else "micro-batch") + f" x {accum} accumulation x {world} "
        f"process(es)" + (f"; {cut}" if cut else "")
        + (f"; {sum(counted) / len(counted):,.0f} tokens per optimizer step on average (at most {most:,})"
           if counted and most else f" = at most {most:,} tokens per optimizer step" if most else ""),
        f"**Sequence length:** {get('seq_len', '?')} tokens",
        f"**Data:** {get('data_description') or get('data') or 'built-in corpus'}",
        f"**Optimizer:** AdamW, lr {get('lr', '?')}, {get('lr_schedule', '?')} schedule, warmup "
        f"{get('warmup_steps', '?')} steps, max grad norm {get('max_grad_norm', '?')}, "
        f"max steps {get('max_steps', '?')}",
    ]
    if isinstance(get("lora_rank"), int) and get("lora_rank") > 0:
        targets = get("lora_targets")
        items.append(f"**LoRA adapters:** rank {get('lora_rank')}, alpha {get('lora_alpha') or get('lora_rank')}, "
                     f"dropout {get('lora_dropout') or 0}, on "
                     + (", ".join(map(str, targets)) if isinstance(targets, list) and targets else "every linear layer")
                     + f"; frozen base in {get('lora_base_precision') or 'fp32'}")
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
        _wall_time_text(summary) + f"; **throughput:** {speed}",
        f"**Peak memory:** {format_bytes(get('peak_memory_bytes'))}" + (
            f" ({get('peak_memory_source')})" if get("peak_memory_source") else "") + (
            f"; max RSS {format_bytes(get('max_rss_bytes'))}" if get("max_rss_bytes") else ""),
        f"**Final loss:** {format_number(get('final_loss'))}; "
        f"**final val loss:** {format_number(get('final_val_loss'))}"
        + (f" (perplexity {get('final_val_perplexity'):,.2f})" if plots.finite(get("final_val_perplexity")) else "")
        + (f"; **best val loss:** {get('best_val_loss'):.4f} at step {get('best_val_step')}"
           if plots.finite(get("best_val_loss")) else ""),
    ]
    segments = [s for s in get("segments") or [] if isinstance(s, dict)]
    if len(segments) > 1:
        parts = [f"steps {s.get('from_step', '?')}-{s.get('to_step', '?')}: "
                 f"{format_number(s.get('tokens'), ',.0f')} tokens, steps {format_hms(s.get('step_time_s'))}, wall "
                 + (format_hms(s["wall_time_s"]) if plots.finite(s.get("wall_time_s")) else "unknown")
                 + (f", {s['stopped_by']}" if s.get("stopped_by") else "") for s in segments]
        items.append(f"**Resumed:** {len(segments) - 1} time(s), last from step {get('resumed_from_step', '?')}; "
                     f"segments: " + "; ".join(parts))
    skipped = [row for row in rows if row.get("skipped")]
    if skipped:
        shown = ", ".join(f"window {row.get('window', '?')} after step {row['step']} "
                          f"({row.get('skip_reason') or 'no reason given'})" for row in skipped[:10])
        items.append(f"**Skipped steps:** {shown}" + (f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""))
    return items


def _wall_time_text(summary: dict[str, Any]) -> str:
    """The wall time: the run's own, or for a resumed run this segment's and the whole run's (when every segment's
    is known: a killed one left none)."""
    get = summary.get
    wall = get("wall_time_s")
    text = f"**Wall time:** {format_hms(wall)}" + (f" ({wall:.1f} s)" if plots.finite(wall) else "")
    segments = [s for s in get("segments") or [] if isinstance(s, dict)]
    if len(segments) <= 1:
        return text
    whole = get("run_wall_time_s")
    steps = sum(float(s.get("step_time_s") or 0.0) for s in segments)
    return (f"**Wall time:** {format_hms(wall)} in this last segment; the whole run "
            + (f"{format_hms(whole)}" if plots.finite(whole) else "unknown (a segment ended without a summary)")
            + f", its steps {format_hms(steps)}")


def noise_scale_words(config: dict[str, Any], summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Which side of the measured gradient noise scale the run's effective batch is on, and what that costs; or why
    there is no measurement. From summary.json (the last moving average), else the last metrics row that has one."""
    effective = config.get("effective_batch_size", summary.get("effective_batch_size"))
    value, windows = summary.get("grad_noise_scale"), summary.get("grad_noise_scale_windows")
    note = summary.get("grad_noise_scale_note")
    if "grad_noise_scale" not in summary:  # an unfinished run: its last step's moving average
        done = [row for row in rows if not row.get("skipped") and "grad_noise_scale" in row]
        value = done[-1]["grad_noise_scale"] if done else None
        windows = None  # not recorded per row
        note = "the run's last step had none" if done else None
    if not (plots.finite(value) and value > 0 and plots.finite(effective) and effective > 0):
        note = note or "this run has no measurement of it (a run from before cadence measured it, or " \
                       "--noise-scale-ema 0)"
        return f"**No estimate:** {note}."
    return batch_against_noise_scale(float(effective), float(value), windows=windows if isinstance(windows, int)
                                     else None)


def next_steps(root: Path, config: dict[str, Any], summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Advice from this run's own figures, each item only where it applies to this run; then the two tools that
    look further (profile: where the step time goes; plan: the alternatives within a budget), always."""
    get = config.get
    items: list[str] = []
    padding = summary.get("padding_fraction")
    if not plots.finite(padding):  # an unfinished run: counted from metrics.jsonl
        padded = sum(row.get("padded_positions") or 0 for row in rows)
        real = sum(row.get("tokens") or 0 for row in rows)
        padding = padded / (padded + real) if padded + real else None
    if plots.finite(padding) and padding >= PADDING_ADVICE_SHARE:
        levers = []
        if get("micro_batch_order") != "by-length" and not get("packing"):
            levers.append("`--micro-batch-order by-length` (longest first, so each micro-batch pads little)")
        if not get("packing"):
            levers.append("`--packing` (several examples per row of --seq-len, attention kept apart)")
        if not get("micro_batch_tokens"):
            levers.append("`--micro-batch-tokens N` (micro-batches of at most N positions: many short rows or few "
                          "long ones)")
        if levers:
            items.append(f"**Padding:** {padding:.0%} of the positions computed were padding. Cut each window by "
                         f"length: {', or '.join(levers)}; the window's samples and its gradient stay the same, only "
                         f"the padding goes.")
    items += _skip_advice(config, rows)
    items += _memory_advice(config, summary, rows)
    if str(get("resolved_device", "")).startswith("cuda") and get("compile") is False:
        items.append("**Compile:** `--compile` compiles each transformer block (fused kernels); the first steps pay "
                     "the compile time, reported apart.")
    if summary.get("stopped_by"):
        items.append(f"**Continue:** the run was stopped by {summary['stopped_by']} after step "
                     f"{summary.get('steps', '?')}; `cadence train --resume --out {shlex.quote(str(root))}` "
                     f"continues it with its recorded configuration.")
    elif not (root / SUMMARY_FILE).is_file() and any((root / "checkpoints").glob("step-*")):
        items.append(f"**Continue:** the run did not finish; `cadence train --resume --out "
                     f"{shlex.quote(str(root))}` continues it from its newest checkpoint with its recorded "
                     f"configuration.")
    flags = _shape_flags(config, summary)
    items.append(f"**Where the step time goes:** `cadence profile {flags}{' ' if flags else ''}--out DIR` profiles "
                 f"a few steps of this configuration: time per phase, top operators, MFU and a verdict with its own "
                 f"advice.")
    items.append(f"**Alternatives:** `cadence plan {_plan_flags(config)}`{_plan_note(config)} estimates and "
                 f"measures micro-batch, accumulation, recompute, offload and precision side by side within the "
                 f"budget, and checks the chosen one's loss and gradient against fp32.")
    return items


def _skip_advice(config: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """fp16 overflows after the loss scale settled, or non-finite gradients: what made the steps go wrong."""
    skipped = [row for row in rows if row.get("skipped")]
    lr = config.get("lr", "?")
    if config.get("precision") == "fp16":
        late = [row for row in skipped if row.get("skip_reason") == "fp16 overflow"
                and isinstance(row.get("window"), int) and row["window"] > FP16_CALIBRATION_WINDOWS]
        if late:
            return [f"**fp16 overflows:** {len(late)} window(s) after the first {FP16_CALIBRATION_WINDOWS} (where "
                    f"the loss scale settles) were skipped: `--precision bf16` (fp32's range, no loss scale) where "
                    f"the hardware has fast bf16, or a lower `--lr` than {lr}."]
        return []
    bad = [row for row in skipped if row.get("skip_reason") == "non-finite gradients"]
    if not bad:
        return []
    warmup = config.get("warmup_steps")
    return [f"**Non-finite gradients:** {len(bad)} window(s) were skipped: a lower `--lr` than {lr}"
            + (", or a warmup (`--warmup-steps`)" if warmup == 0 else f", or a longer warmup than {warmup} steps")
            + "."]


def _memory_advice(config: dict[str, Any], summary: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Out-of-memory retries (start where the run settled) or a peak far below the budget (use the room)."""
    get: Callable[..., Any] = config.get  # a JSON value of any type, None when absent
    world = get("world_size") if isinstance(get("world_size"), int) else 1
    effective = get("effective_batch_size")
    retries = summary.get("oom_retries")
    if not isinstance(retries, int):
        retries = sum(int(row.get("oom_retries") or 0) for row in rows)
    if retries:
        final, tokens = summary.get("final_micro_batch_size"), summary.get("final_micro_batch_tokens")
        if get("micro_batch_tokens") and isinstance(tokens, int):
            start = f"`--micro-batch-tokens {tokens}`"
        elif isinstance(final, int) and isinstance(effective, int) and effective % (final * world) == 0:
            start = f"`--micro-batch-size {final} --grad-accum-steps {effective // (final * world)}`"
        else:
            start = "the micro-batch size it settled on"
        return [f"**Out of memory:** {retries} window(s) ran out of memory and were computed again with a smaller "
                f"micro-batch. Start at {start} (the same effective batch), so that no window is computed twice."]
    budget, peak = get("memory_budget_bytes"), summary.get("peak_memory_bytes")
    if not (plots.finite(budget) and plots.finite(peak) and budget > 0 and peak <= HEADROOM_SHARE * budget):
        return []
    levers = []
    micro, accum = get("micro_batch_size"), get("grad_accum_steps")
    if (not get("auto_micro_batch") and not get("micro_batch_tokens") and isinstance(micro, int)
            and isinstance(accum, int) and accum % 2 == 0):
        levers.append(f"a larger micro-batch with less accumulation, `--micro-batch-size {2 * micro} "
                      f"--grad-accum-steps {accum // 2}` (the same effective batch, fewer and fuller passes)")
    recompute = get("activation_checkpointing")
    if recompute in ("full", "selective"):
        levers.append(f"less recompute, `--activation-checkpointing {'selective' if recompute == 'full' else 'none'}`")
    if get("offload") not in (None, "none"):
        levers.append("no offload, `--offload none`")
    if not levers:
        return []
    return [f"**Memory to spare:** the peak, {format_bytes(peak)}, is {peak / budget:.0%} of --memory-budget "
            f"{format_bytes(budget)}: {'; or '.join(levers)}."]


def _shape_flags(config: dict[str, Any], summary: dict[str, Any]) -> str:
    """The flags that shape this run's step, for `cadence profile` (empty without config.json)."""
    get = config.get
    if not config:
        return ""
    flags = _model_and_data_flags(config)
    micro, accum = get("micro_batch_size"), get("grad_accum_steps")
    if get("auto_micro_batch") and isinstance(summary.get("final_micro_batch_size"), int):
        micro = summary["final_micro_batch_size"]  # the size the run settled on is the one worth profiling
        world, effective = get("world_size") or 1, get("effective_batch_size")
        accum = effective // (micro * world) if isinstance(effective, int) and micro * world else accum
    if micro is not None:
        flags.append(f"--micro-batch-size {micro}")
    if accum is not None:
        flags.append(f"--grad-accum-steps {accum}")
    if get("precision"):
        flags.append(f"--precision {get('precision')}")
    for name in ("activation_checkpointing", "offload"):
        if get(name) not in (None, "none"):
            flags.append(f"--{name.replace('_', '-')} {get(name)}")
    flags += _lever_flags(config)
    # train's default order (by-length) goes without saying; the record of an older run may lack the cut flags.
    cut = Cut.from_flags({"micro_batch_order": "by-length", **config}, micro_batch_size=1,
                         seq_len=int(get("seq_len") or 1))
    flags += cut.command_line(default_order="by-length")
    if get("compile"):
        flags.append("--compile")
    if get("memory_budget"):
        flags.append(f"--memory-budget {shlex.quote(str(get('memory_budget')))}")
    return " ".join(flags)


def _model_and_data_flags(config: dict[str, Any]) -> list[str]:
    """--model with every --model-config override, --data with its field names, --seq-len: what every command
    needs to build the run's model and read its data as the run did (profile, verify and plan take them all)."""
    get = config.get
    flags = [f"--model {shlex.quote(str(get('model')))}"] if get("model") else []
    for override in get("model_config") or []:
        flags.append(f"--model-config {shlex.quote(str(override))}")
    if get("data"):
        flags.append(f"--data {shlex.quote(str(get('data')))}")
    defaults = TrainConfig()
    for name in ("text_field", "prompt_field", "completion_field", "messages_field", "chat_template", "train_on",
                 "too_long"):
        if get(name) not in (None, getattr(defaults, name)):
            flags.append(f"--{name.replace('_', '-')} {shlex.quote(str(get(name)))}")
    if get("seq_len"):
        flags.append(f"--seq-len {get('seq_len')}")
    return flags + _lora_flags(config) + _optimizer_flags(config)


def _optimizer_flags(config: dict[str, Any]) -> list[str]:
    """The run's optimizer beyond AdamW's defaults: part of the job (a plan or a profile of this run trains with the
    optimizer the user chose, never another), so every suggested command carries it."""
    get = config.get
    flags = [f"--optimizer {get('optimizer')}"] if get("optimizer") not in (None, "adamw") else []
    if get("momentum") is not None:
        flags.append(f"--momentum {get('momentum')}")
    return flags + (["--nesterov"] if get("nesterov") else [])


def _lora_flags(config: dict[str, Any]) -> list[str]:
    """The LoRA adapters of this run: part of the job (which parameters train, the frozen base's precision), so every
    suggested command carries them, or it would measure another job."""
    get: Callable[..., Any] = config.get  # a JSON value of any type, None when absent
    if not (isinstance(get("lora_rank"), int) and get("lora_rank") > 0):
        return []
    flags = [f"--lora-rank {get('lora_rank')}"]
    if get("lora_alpha") is not None:
        flags.append(f"--lora-alpha {get('lora_alpha')}")
    if get("lora_dropout"):
        flags.append(f"--lora-dropout {get('lora_dropout')}")
    if isinstance(get("lora_targets"), list) and get("lora_targets"):
        flags.append(f"--lora-targets {shlex.quote(','.join(map(str, get('lora_targets'))))}")
    if get("lora_base_precision") not in (None, "fp32"):
        flags.append(f"--lora-base-precision {get('lora_base_precision')}")
    return flags


def _lever_flags(config: dict[str, Any]) -> list[str]:
    """The memory levers of this run that are not its cut or recompute: profile measures this configuration, so it
    takes them (a plan searches them itself, so its command leaves them free)."""
    get: Callable[..., Any] = config.get  # a JSON value of any type, None when absent
    flags = []
    if get("optimizer_state") not in (None, "fp32"):
        flags.append(f"--optimizer-state {get('optimizer_state')}")
    if isinstance(get("loss_chunk_tokens"), int) and get("loss_chunk_tokens") > 0:
        flags.append(f"--loss-chunk-tokens {get('loss_chunk_tokens')}")
    return flags


PLAN_MATCH = 0.15
"""A plan's predicted throughput within this share of the run's measured one is a prediction that held."""


def _planned_against_measured(config: dict[str, Any], summary: dict[str, Any]) -> list[Block]:
    """For a run trained with --plan: the plan's predicted throughput and time per epoch beside the run's."""
    plan_path = config.get("plan")
    if not isinstance(plan_path, str):
        return []
    heading = Heading(text="Planned against measured")
    try:
        plan = read_plan(Path(plan_path), where=WHERE)
    except UsageError:
        return [heading, Paragraph(text=f"The plan {plan_path} this run was trained with can no longer be read, so "
                                        f"its prediction cannot be compared.")]
    prediction = plan.prediction
    predicted, measured = (prediction.tokens_per_s if prediction else None), summary.get("tokens_per_s")
    if prediction is None or not (plots.finite(predicted) and plots.finite(measured) and predicted > 0):
        return [heading, Paragraph(text=f"The plan {plan_path} records no predicted throughput (made before plans "
                                        f"did), so there is nothing to compare.")]
    ratio = measured / predicted
    band = prediction.tokens_per_s_band
    items = [f"**Throughput:** planned {predicted:,.0f} tokens/s"
             + (f" (+/- {band:,.0f} over {prediction.rounds} rounds)" if band else "")
             + f", measured {measured:,.0f} tokens/s: {ratio:.2f}x of the prediction, "
             + ("within" if abs(ratio - 1) <= PLAN_MATCH else "outside") + f" {PLAN_MATCH:.0%}"]
    if prediction.seconds_per_epoch is not None:
        items.append(f"**Time per epoch:** planned {format_hms(prediction.seconds_per_epoch)}, at the measured "
                     f"throughput {format_hms(prediction.seconds_per_epoch / ratio)}")
    if prediction.peak_bytes is not None and plots.finite(summary.get("peak_memory_bytes")):
        items.append(f"**Peak memory:** planned {format_bytes(prediction.peak_bytes)}, measured "
                     f"{format_bytes(summary['peak_memory_bytes'])}")
    return [heading, Bullets(items=items)]


def _plan_flags(config: dict[str, Any]) -> str:
    """The model, data and batch of this run for `cadence plan`, which plans one process: each process's share."""
    get = config.get
    flags = _model_and_data_flags(config)
    effective, world = get("effective_batch_size"), get("world_size") or 1
    if isinstance(effective, int) and isinstance(world, int) and world > 0:
        flags.append(f"--effective-batch-size {effective // world}")
    flags.append(f"--memory-budget {shlex.quote(str(get('memory_budget') or 'SIZE'))}")
    return " ".join(flags)


def _plan_note(config: dict[str, Any]) -> str:
    """What the plan command above leaves to the reader: the budget when the run had none, the per-process batch."""
    notes = [] if config.get("memory_budget") else ["SIZE: the memory one process may use, e.g. 2GiB"]
    if isinstance(config.get("world_size"), int) and config["world_size"] > 1:
        notes.append(f"the effective batch is each of the {config['world_size']} processes' share, as a plan is "
                     f"made for one process")
    if _lever_flags(config):
        notes.append(f"this run's {' '.join(_lever_flags(config))} left to the plan, which measures the optimizer "
                     f"state and loss chunking among its candidates")
    return f" ({'; '.join(notes)})" if notes else ""


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
    if any(plots.finite(row.get("grad_noise_scale")) for row in rows):
        effective = config.get("effective_batch_size")
        blocks.append(plot_block(
            "report-noise-scale.png", "The gradient noise scale (sequences, its moving average after each step) "
            "against the run's effective batch: above the line the batch is below the critical batch, below it "
            "above.", plots.noise_scale_figure(rows, effective=effective if plots.finite(effective) else None)))
    if any(row.get("effective_batch") is not None for row in rows):  # --effective-batch-size adaptive
        blocks.append(plot_block("report-adaptive-batch.png", "The adaptive batch of each step, the gradient noise "
                                 "scale it decides from (sequences, log scale) and the LR (dotted, right axis) "
                                 "against the tokens seen; each dashed line a switch, with its decision (the reasons "
                                 "are metrics.jsonl's batch_reason).", plots.adaptive_batch_figure(rows)))
    if any(plots.finite(row.get("rewards/margins")) or plots.finite(row.get("rewards/chosen")) for row in rows):
        blocks.append(plot_block("report-rewards.png", "The preference objective's rewards over each window (beta x "
                                 "the log-ratio to the reference): chosen, rejected and their margin; the dotted grey "
                                 "line is the share of pairs whose chosen reward is the larger (right axis).",
                                 plots.rewards_figure(rows)))
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


