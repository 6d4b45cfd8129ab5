"""The report of a plan (``cadence report PLAN_DIR``): the decision first (the choice, why, how to train with it,
its quality check in one line), then the setup, diagnosis, candidates, cuts, quality details and notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.config.plan_file import PLAN_FILE, CandidateRow, Choice, CutRow, OptimizerLever, PlanRecord, read_plan
from cadence.engine.cut import Cut
from cadence.formatting import format_bytes, format_hms, format_number
from cadence.report import render as plots
from cadence.report.document import WHERE, plot_block, times
from cadence.report.render import Block, Bullets, Heading, Paragraph, Report, Table


def plan_report(root: Path) -> Report:
    """The report of a plan, the decision first: what to train with, why, and whether its quality check passed;
    then the setup, the diagnosis, the candidates (estimated and measured), the cuts, the quality details, the notes.
    plan.json is read through its typed record (``config.plan_file``): a field of the wrong type is one line naming
    the file and the field."""
    plan = read_plan(root / PLAN_FILE, where=WHERE)
    candidates = plan.candidates
    choice, chosen = plan.choice, plan.candidate(plan.choice.id if plan.choice else None)
    chosen_id = choice.id if choice else None
    budget = plan.memory_budget_bytes or None
    rows = [_plotted(row.as_json()) for row in candidates]  # the plots take plan.json's rows
    blocks: list[Block] = [Heading(text="Decision"), *_decision(root, plan, chosen, budget)]
    blocks += [Heading(text="Setup"), Bullets(items=_plan_setup(plan))]
    batch = plan.effective_batch
    if isinstance(batch, dict) and batch.get("given") == "auto":
        blocks += [Heading(text="The effective batch, from the gradient noise scale"), *_effective_batch(batch)]
    blocks += _diagnosis(plan.diagnosis, chosen, budget)
    blocks += [Heading(text="Candidates"), _candidate_table(candidates, chosen_id, plan.quality)]
    if candidates:
        blocks.append(plot_block("report-memory.png", "Peak memory per candidate, one row each: estimated (blue; "
                                 "faint when not measured) and measured (green); hatched: over the budget; dashed "
                                 "line: the budget; the chosen row is shaded and starred.",
                                 plots.memory_figure(rows, budget=budget, chosen=chosen_id)))
    if any(row.measured is not None and plots.finite(row.measured.tokens_per_s) for row in candidates):
        blocks.append(plot_block("report-throughput.png", "Measured throughput of each measured candidate; the "
                                 "chosen one in purple, over-budget ones hatched.",
                                 plots.throughput_plan_figure(rows, chosen=chosen_id)))
    if plan.cuts:
        blocks += [Heading(text="Cutting the windows by length"), *_cuts(plan.cuts)]
    blocks += [Heading(text="Quality check"), *_quality(plan.quality)]
    blocks += [Heading(text="Notes"), Bullets(items=plan.notes) if plan.notes else Paragraph(text="None.")]
    if plan.optimizer_levers:  # listed with their estimates, never tried: the optimizer is the user's choice
        blocks += [Heading(text="Other optimizers (not tried)"),
                   Bullets(items=[_optimizer_lever(lever, plan.optimizer or "?") for lever in plan.optimizer_levers])]
    title = f"Plan report: {plan.model or '?'}" + (f" within {format_bytes(budget)}" if budget else "")
    return Report(title=title, blocks=blocks)


def _optimizer_lever(lever: OptimizerLever, chosen: str) -> str:
    """"adafactor would keep 264.0 KiB of optimizer state against adamw's 83.5 MiB (estimated); not tried: ..."."""
    return (f"{lever.optimizer} would keep {format_bytes(lever.state_bytes)} of optimizer state against {chosen}'s "
            f"{format_bytes(lever.chosen_state_bytes)} (estimated); not tried: the optimizer changes the update, so it "
            f"is the user's choice (--optimizer {lever.optimizer})")


def _effective_batch(batch: dict[str, Any]) -> list[Block]:
    """--effective-batch-size auto: what was measured, the choice and its reason, and the advice on --lr."""
    measured = batch["noise_scale"] if isinstance(batch.get("noise_scale"), dict) else {}
    probe = batch["probe"] if isinstance(batch.get("probe"), dict) else {}
    value, error = measured.get("sequences"), measured.get("sequences_error")
    items = [
        f"**Chosen:** {batch.get('chosen', '?')} sequences per optimizer step: {batch.get('reason', '')}",
        "**Measured:** " + (f"{value:.3g}" if plots.finite(value) else "-")
        + (f" +/- {error:.2g}" if plots.finite(error) else "") + " sequences"
        + (f" ({measured['tokens']:,.0f} tokens)" if plots.finite(measured.get("tokens")) else "")
        + f" over {measured.get('windows', '?')} of {measured.get('windows_run', '?')} windows of "
        f"{probe.get('micro_batch_size', '?')} x {probe.get('grad_accum_steps', '?')} sequences "
        f"({probe.get('precision', '?')}, recompute {probe.get('activation_checkpointing', '?')}), "
        + ("at the weights the run starts from (no optimizer step)" if measured.get("fixed_weights")
           else "training from the start as the run would (--noise-scale-training)"),
        f"**Learning rate:** {batch.get('lr_advice', '')}",
    ]
    return [Bullets(items=items), Paragraph(text=(
        "The noise scale tr(Sigma)/|G|^2 is about the critical batch (McCandlish et al. 2018): below it steps are "
        "noisy and a run takes more of them; above it a doubling of the batch buys little progress per step for twice "
        "the tokens. It grows as the loss falls: the run's own grad_noise_scale (metrics.jsonl, its report) shows "
        "where it goes."))]


def _config_text(item: dict[str, Any]) -> str:
    return (f"{item.get('micro_batch_size', '?')} micro-batch x {item.get('grad_accum_steps', '?')} accumulation, "
            f"{item.get('precision', '?')}, recompute {item.get('activation_checkpointing', 'none')}, "
            f"offload {item.get('offload', 'none')}"
            + (f", loss chunks of {item['loss_chunk_tokens']}" if item.get("loss_chunk_tokens") else "")
            + (f", {item['optimizer_state']} optimizer state" if item.get("optimizer_state", "fp32") != "fp32" else "")
            + (f", {item['lora_base_precision']} LoRA base" if item.get("lora_base_precision", "fp32") != "fp32"
               else ""))


def _plan_setup(plan: PlanRecord) -> list[str]:
    params = plan.parameters
    items = [
        f"**Model:** {plan.model or '?'}" + (f", {params:,} parameters" if params is not None else ""),
        f"**Device:** {plan.device}, {plan.world_size} process(es); **sequence length:** "
        f"{plan.seq_len if plan.seq_len is not None else '?'} tokens",
        f"**Effective batch:** {plan.effective_batch_size or '?'} sequences; **memory budget:** "
        f"{format_bytes(plan.memory_budget_bytes)} per process",
        f"**Data:** {plan.data or 'built-in corpus'}"
        + (f" ({plan.tokens_per_epoch:,} tokens per epoch)" if plan.tokens_per_epoch is not None else ""),
        f"**Planned:** {plan.created}, in {format_hms(plan.duration_s)}"
        + (f" of a {plan.time_budget_s:g} s --time-budget" if plan.time_budget_s is not None else "")
        + _time_spent(plan.time_spent_s),
    ]
    if plan.adaptive_batch is not None:
        items.append(_adaptive_text(plan))
    if plan.version != 1:
        items.append(f"**Note:** plan.json version {plan.version}; this report reads version 1 and may miss fields")
    return items


def _adaptive_text(plan: PlanRecord) -> str:
    """The adaptive range a plan planned for: its bounds, the branch test's snapshot, the throughput at both ends."""
    adaptive = plan.adaptive_batch
    if adaptive is None:
        return ""
    flags, speed = adaptive.flags, adaptive.throughput or {}
    text = (f"**Adaptive batch:** {flags.get('min_effective_batch_size')} to {flags.get('max_effective_batch_size')} "
            f"sequences (LR scaling {flags.get('batch_lr_scaling')}); every candidate computed the minimum")
    if adaptive.snapshot_bytes:
        text += (f"; the branch test's snapshot ({format_bytes(adaptive.snapshot_bytes)}, weights and optimizer "
                 f"state) is counted in every peak")
    low, high = speed.get("tokens_per_s_at_minimum"), speed.get("tokens_per_s_at_maximum")
    if plots.finite(low):
        text += f"; {low:,.0f} tokens/s at the minimum (measured)"
    if plots.finite(high) and plots.finite(speed.get("optimizer_step_share")):
        text += (f", about {high:,.0f} at the maximum (derived: the optimizer step is "
                 f"{speed['optimizer_step_share']:.1%} of a window of the minimum, amortised over the larger window)")
    return text


def _time_spent(spent: dict[str, float]) -> str:
    """Where the plan's time went (plan.json ``time_spent_s``), largest first; empty for a plan without it."""
    phases = sorted(((name, seconds) for name, seconds in spent.items() if seconds >= 0.05), key=lambda item: -item[1])
    return f" ({', '.join(f'{name} {seconds:.1f} s' for name, seconds in phases)})" if phases else ""


def _diagnosis(diagnosis: dict[str, Any], chosen: CandidateRow | None, budget: float | None) -> list[Block]:
    baseline = diagnosis.get("baseline") or {}
    estimate = diagnosis.get("estimate") or {}
    peak, categories = estimate.get("peak_bytes"), estimate.get("by_category") or {}
    verdict = f" during {estimate['peak_phase']}" if estimate.get("peak_phase") else ""
    if plots.finite(peak) and budget:
        verdict += f", {peak / budget:.1f}x the budget" + (" (fits)" if peak <= budget else " (does not fit)")
    blocks: list[Block] = [Heading(text="Diagnosis"), Paragraph(
        text=f"**Baseline:** {_config_text(baseline)}: estimated peak **{format_bytes(peak)}**{verdict}; dominant: "
             f"**{diagnosis.get('dominant', '?')}**.")]
    on_device = {k: v for k, v in categories.items() if k not in plots.HOST_CATEGORIES and plots.finite(v)}
    total = sum(on_device.values()) or 1
    if categories:
        blocks.append(Table(header=["category", "estimated", "share of the peak"], rows=[
            [name.replace("_", " "), format_bytes(value),
             f"{100 * value / total:.0f}%" if name in on_device else "host memory, not in the peak"]
            for name, value in categories.items()]))
    if diagnosis.get("explanation"):
        blocks.append(Paragraph(text=str(diagnosis["explanation"])))
    accumulation = diagnosis.get("accumulation")
    if isinstance(accumulation, dict) and accumulation.get("explanation"):
        verdict = "raises the peak" if accumulation.get("raises_peak") else "lowers the peak"
        blocks.append(Paragraph(text=f"**Accumulation {verdict} on this model:** {accumulation['explanation']}"))
    bars = [("baseline", categories)]
    if chosen is not None and chosen.estimated_by_category:
        bars.append((f"chosen ({chosen.id})", chosen.estimated_by_category))
    if categories:
        blocks.append(plot_block("report-diagnosis.png", "Estimated peak memory by category: the baseline"
                            + (" and the chosen candidate" if len(bars) > 1 else "") + "; dashed line: the budget.",
                            plots.breakdown_figure(bars, budget=budget)))
    return blocks


def memory_throughput_front(candidates: list[CandidateRow]) -> set[str]:
    """The ids of the measured candidates that fit and that no other fitting one beats on both peak memory (lower)
    and throughput (higher): the front a user chooses along when memory, not speed, is what they are short of."""
    fitting = [(c.id, m.peak_bytes, m.tokens_per_s) for c in candidates
               if (m := c.measured) is not None and m.fits and m.peak_bytes is not None and m.tokens_per_s is not None]
    return {name for name, peak, rate in fitting
            if not any(p <= peak and r >= rate and (p < peak or r > rate) for _, p, r in fitting)}


def _lossy_quality(candidate: CandidateRow, quality: Any) -> str:
    """The quality column: exact for fp32 optimizer state on a full-precision base; each lossy lever's loss check
    (a lower-precision state against fp32 state, an nf4 base against the full-precision base), or "not checked"."""
    state, base = str(candidate.decision["optimizer_state"]), str(candidate.decision["lora_base_precision"])
    parts = []
    if state != "fp32":
        parts.append(_lever_check(quality, "optimizer_state", state, f"{state} state", "fp32 state"))
    if base == "nf4":
        parts.append(_lever_check(quality, "lora_base_precision", base, "nf4 base", None))
    return "; ".join(parts) or "exact"


def _lever_check(quality: Any, lever: str, value: str, name: str, reference: str | None) -> str:
    """One lossy lever's loss check in a few words (``reference``: its reference, default the check's own)."""
    checks = quality.get(lever) if isinstance(quality, dict) else None
    for check in checks if isinstance(checks, list) else []:
        if isinstance(check, dict) and check.get(lever) == value:
            against = reference or f"the {check.get('reference_base', 'full-precision')} base"
            return (f"{name}: {_passed(check.get('passed'))} (loss within "
                    f"{format_number(times(check.get('max_relative_difference'), 100), '.2f')}% of {against})")
    return f"{name}: lossy, not checked"


def _plotted(row: dict[str, Any]) -> dict[str, Any]:
    """A candidate's row for the plots: a peak that is the trusted estimate (no trial ran) is not drawn as a
    measurement."""
    if (row.get("memory") or {}).get("decided_by") == "estimate" and row.get("measured"):
        row = {**row, "measured": {**row["measured"], "peak_bytes": None}}
    return row


def _verdict(fits: bool | None, how: str) -> str:
    return "?" if fits is None else f"{'yes' if fits else 'no'} ({how})"


def _candidate_table(candidates: list[CandidateRow], chosen_id: str | None,
                     quality: Any = None) -> Table | Paragraph:
    if not candidates:
        return Paragraph(text="The plan holds no candidates.")
    front = memory_throughput_front(candidates)
    rows, marked = [], None
    for index, cand in enumerate(candidates):
        measured = cand.measured
        by_estimate = (cand.memory or {}).get("decided_by") == "estimate"
        if measured is not None and by_estimate:  # fits by its estimate, within the margin of its measured error
            fits = _verdict(measured.fits, f"estimate, margin {(cand.memory or {}).get('margin') or 0:.1%}")
        elif measured is not None:
            # Measured on the longest window the data can produce (plan.json's measured_on), or, in a plan made
            # before that, on the epoch's second window.
            how = "measured on the longest window" if measured.measured_on else "measured"
            fits = _verdict(measured.fits, how)
        else:
            fits = _verdict(cand.fits_estimate, "estimate")
        name = cand.id
        if name == chosen_id:
            name, marked = f"**{name} (chosen)**", index
        decision = cand.decision
        state, base = str(decision["optimizer_state"]), str(decision["lora_base_precision"])
        levers = ", ".join(([f"loss chunks {decision['loss_chunk_tokens']}"] if decision["loss_chunk_tokens"] else [])
                           + ([f"{state} state"] if state != "fp32" else [])
                           + ([f"{base} base"] if base != "fp32" else [])) or "-"
        rows.append([name, f"{decision['micro_batch_size']} x {decision['grad_accum_steps']}",
                     str(decision["precision"]), str(decision["activation_checkpointing"]),
                     str(decision["offload"]), levers, format_bytes(cand.estimated_peak_bytes),
                     format_bytes(cand.accumulation_bytes) if cand.accumulation_bytes is not None else "-",
                     format_bytes(measured.peak_bytes if measured and not by_estimate else None), fits,
                     format_number(measured.tokens_per_s if measured else None, ",.0f"),
                     format_hms(measured.seconds_per_epoch if measured else None),
                     format_hms(times(measured.hours_per_billion_tokens if measured else None, 3600)),
                     "yes" if cand.id in front else "", _lossy_quality(cand, quality),
                     cand.status + (f": {measured.error}" if measured and measured.error else "")])
    header = ["candidate", "micro x accum", "precision", "recompute", "offload", "levers", "estimated peak",
              "of it, accumulation", "measured peak", "fits", "tokens/s", "time per epoch", "time per 1B tokens", "front", "quality",
              "status"]
    return Table(header=header, rows=rows, marked_row=marked)


def _decision(root: Path, plan: PlanRecord, chosen: CandidateRow | None, budget: float | None) -> list[Block]:
    """What to train with, why, the command, and the quality check in one line; or why nothing was chosen."""
    choice, quality = plan.choice, plan.quality
    if choice is None:
        return [Paragraph(text=f"**No candidate was chosen.** {_why_none(plan.candidates, budget)}")]
    measured = chosen.measured if chosen is not None else None
    figures = ""
    if measured is not None and measured.tokens_per_s is not None:
        figures = (f"; measured {measured.tokens_per_s:,.0f} tokens/s at a peak of "
                   f"{format_bytes(measured.peak_bytes)}" + (f" of {format_bytes(budget)}" if budget else ""))
    flags = choice.flags
    command = (f"--micro-batch-size {flags['micro_batch_size']} --grad-accum-steps {flags['grad_accum_steps']} "
               f"--precision {flags['precision']} --activation-checkpointing {flags['activation_checkpointing']} "
               f"--offload {flags['offload']}")
    # train's default order is by-length, so a plan's "drawn" must be said (a plan.json without it means drawn).
    command += " " + " ".join(_chosen_cut(choice, plan.seq_len).command_line())
    if flags["loss_chunk_tokens"]:
        command += f" --loss-chunk-tokens {flags['loss_chunk_tokens']}"
    if flags["optimizer_state"] != "fp32":
        command += f" --optimizer-state {flags['optimizer_state']}"
    if flags["lora_base_precision"] != "fp32":
        command += f" --lora-base-precision {flags['lora_base_precision']}"
    reason = (choice.reason or "not given").rstrip(".")
    return [Paragraph(text=f"**Chosen: {choice.id}**: {_config_text(flags)}{_cut_text(choice, plan.seq_len)}"
                           f"{figures}."),
            Paragraph(text=f"**Why:** {reason}."),
            Paragraph(text=f"**Train with it:** `cadence train --plan {root / PLAN_FILE}` with the --data it was "
                           f"planned on, or by flags: `cadence train ... {command}`"),
            Paragraph(text=f"**Quality check: {quality_verdict(quality)}**{_quality_line(quality)}")]


def _chosen_cut(choice: Choice, seq_len: int | None) -> Cut:
    """The chosen configuration's cut, from plan.json's choice (a plan without the cut flags means drawn rows);
    --packing's rows are the sequence length."""
    return Cut.from_flags(choice.flags, micro_batch_size=int(choice.flags["micro_batch_size"] or 1),
                          seq_len=seq_len or 1)


def _cut_text(choice: Choice, seq_len: int | None) -> str:
    """How the chosen configuration cuts each window, when it is not the drawn order (empty otherwise)."""
    described = _chosen_cut(choice, seq_len).describe()
    return f", windows cut: {described}" if described else ""


def _why_none(candidates: list[CandidateRow], budget: float | None) -> str:
    """Why nothing was chosen: the candidates' statuses counted, and the smallest estimate against the budget."""
    if not candidates:
        return "The plan holds no candidates: see the notes."
    counts: dict[str, int] = {}
    for candidate in candidates:
        counts[candidate.status] = counts.get(candidate.status, 0) + 1
    text = f"Of {len(candidates)} candidates: " + "; ".join(f"{n} {status}" for status, n in counts.items()) + "."
    if budget:
        smallest = min(candidates, key=lambda c: c.estimated_peak_bytes)
        text += (f" The smallest estimated peak is {smallest.id}'s {format_bytes(smallest.estimated_peak_bytes)}, "
                 f"against a budget of {format_bytes(budget)}.")
    return text + " See each candidate's status below and the notes."


def quality_verdict(quality: Any) -> str:
    """FAIL when any recorded check failed, PASS when every one passed, "not checked" otherwise (none recorded, or
    one without a verdict)."""
    quality = quality if isinstance(quality, dict) else {}
    passed = [check.get("passed") for check in (quality.get("gradient"), quality.get("loss"))
              if isinstance(check, dict)]
    if any(p is False for p in passed):
        return "FAIL"
    return "PASS" if passed and all(p is True for p in passed) else "not checked"


def _quality_line(quality: Any) -> str:
    """The checks behind the overall verdict, each with its figure, in one line (the details are further down)."""
    quality = quality if isinstance(quality, dict) else {}
    parts = []
    grad, loss = quality.get("gradient"), quality.get("loss")
    if isinstance(grad, dict):
        parts.append(f"gradient {_passed(grad.get('passed'))} (relative error "
                     f"{format_number(grad.get('relative_error'), '.2e')})")
    if isinstance(loss, dict):
        parts.append(f"loss over {loss.get('steps', '?')} steps {_passed(loss.get('passed'))} (largest difference "
                     f"{format_number(times(loss.get('max_relative_difference'), 100), '.2f')}%)")
    return (": " + ", ".join(parts) + ", against the reference; details below.") if parts else "."


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
                 f"{format_number(grad.get('relative_error'), '.2e')} "
                 f"(tolerance {format_number(grad.get('tolerance'), '.0e')}), "
                 f"cosine {format_number(grad.get('cosine'), '.7f')}, "
                 f"against the reference ({grad.get('reference', '?')})."))
    loss = quality.get("loss")
    if isinstance(loss, dict):
        blocks.append(Paragraph(text=_loss_check_text("Loss", loss, "")))
        if loss.get("chosen") and loss.get("reference"):
            blocks.append(plot_block("report-quality.png", "Loss of the chosen configuration and of the reference over "
                                "the same first steps.", plots.quality_figure(loss["chosen"], loss["reference"])))
    for check in quality.get("optimizer_state") or []:
        if isinstance(check, dict):
            blocks.append(Paragraph(text=_loss_check_text(f"{check.get('optimizer_state', '?')} optimizer state",
                                                          check, "loss ")))
    for check in quality.get("lora_base_precision") or []:
        if isinstance(check, dict):
            blocks.append(Paragraph(text=_loss_check_text(
                f"{check.get('lora_base_precision', '?')} LoRA base against the {check.get('reference_base', '?')} "
                f"base", check, "loss ")))
    return blocks or [Paragraph(text="No quality check was recorded.")]


def _loss_check_text(title: str, check: dict[str, Any], what: str) -> str:
    """A loss comparison against its reference in one line: the verdict, the largest relative difference, the
    tolerance, the reference and an error if the comparison could not run."""
    return (f"**{title} over {check.get('steps', '?')} steps: {_passed(check.get('passed'))}**: largest relative "
            f"{what}difference {format_number(times(check.get('max_relative_difference'), 100), '.2f')}% (tolerance "
            f"{format_number(times(check.get('tolerance'), 100), '.2f')}%)"
            + (f", against {check['reference_setup']}" if check.get("reference_setup") else "")
            + (f"; {check['error']}" if check.get("error") else "") + ".")


def _cuts(rows: list[CutRow]) -> list[Block]:
    """The chosen configuration measured with its windows cut four ways (same samples, same gradient)."""
    def number(value: Any, pattern: str) -> str:
        return pattern.format(value) if plots.finite(value) else "-"

    table = Table(
        header=["cut", "real-token share", "tokens/s", "vs drawn", "measured peak", "fits", "chosen"],
        rows=[[row.cut, number(row.real_share, "{:.2f}"), number(row.tokens_per_s, "{:,.0f}"),
               number(row.ratio, "{:.2f}x"), format_bytes(row.peak_bytes), "yes" if row.fits else "no",
               "**yes**" if row.chosen else ""] for row in rows],
        marked_row=next((index for index, row in enumerate(rows) if row.chosen), None),
    )
    return [Paragraph(text="The data's examples differ in length, so the chosen configuration was measured again "
                           "with each window's samples sorted by length before cutting, cut by a token budget "
                           "(micro-batch x sequence length positions) and packed into rows of the sequence "
                           "length. The window's samples, and so the gradient, are the same for every cut; only "
                           "the padding the model computes changes (the real-token share)."), table]


