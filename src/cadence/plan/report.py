"""The report of a plan (``cadence report PLAN_DIR``): the decision first (the choice, why, how to train with it,
its quality check in one line), then the setup, diagnosis, candidates, cuts, quality details and notes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cadence.engine.cut import Cut
from cadence.formatting import format_bytes, format_hms, format_number
from cadence.report import render as plots
from cadence.report.document import plot_block, read_json_object, times
from cadence.report.render import Block, Bullets, Heading, Paragraph, Report, Table

PLAN_FILE = "plan.json"


def plan_report(root: Path) -> Report:
    """The report of a plan, the decision first: what to train with, why, and whether its quality check passed;
    then the setup, the diagnosis, the candidates (estimated and measured), the cuts, the quality details, the notes.
    """
    plan = read_json_object(root / PLAN_FILE)
    candidates = [c for c in plan.get("candidates") or [] if isinstance(c, dict)]
    choice = plan.get("choice") if isinstance(plan.get("choice"), dict) else None
    if choice is not None and isinstance(plan.get("seq_len"), int):
        choice = {**choice, "seq_len": plan["seq_len"]}  # --packing's row length, for the chosen cut in words
    chosen_id = choice.get("id") if choice else None
    chosen = next((c for c in candidates if c.get("id") == chosen_id), None)
    budget = plan.get("memory_budget_bytes") if plots.finite(plan.get("memory_budget_bytes")) else None
    blocks: list[Block] = [Heading(text="Decision"), *_decision(root, choice, chosen, candidates, budget,
                                                                 plan.get("quality"))]
    blocks += [Heading(text="Setup"), Bullets(items=_plan_setup(plan))]
    batch = plan.get("effective_batch")
    if isinstance(batch, dict) and batch.get("given") == "auto":
        blocks += [Heading(text="The effective batch, from the gradient noise scale"), *_effective_batch(batch)]
    blocks += _diagnosis(plan.get("diagnosis") or {}, chosen, budget)
    blocks += [Heading(text="Candidates"), _candidate_table(candidates, chosen_id, plan.get("quality"))]
    if candidates:
        blocks.append(plot_block("report-memory.png", "Peak memory per candidate, one row each: estimated (blue; "
                                 "faint when not measured) and measured (green); hatched: over the budget; dashed "
                                 "line: the budget; the chosen row is shaded and starred.",
                                 plots.memory_figure(candidates, budget=budget, chosen=chosen_id)))
    if any(plots.finite((c.get("measured") or {}).get("tokens_per_s")) for c in candidates):
        blocks.append(plot_block("report-throughput.png", "Measured throughput of each measured candidate; the "
                                 "chosen one in purple, over-budget ones hatched.",
                                 plots.throughput_plan_figure(candidates, chosen=chosen_id)))
    cuts = [row for row in plan.get("cuts") or [] if isinstance(row, dict)]
    if cuts:
        blocks += [Heading(text="Cutting the windows by length"), *_cuts(cuts)]
    blocks += [Heading(text="Quality check"), *_quality(plan.get("quality"))]
    notes = [str(note) for note in plan.get("notes") or []]
    blocks += [Heading(text="Notes"), Bullets(items=notes) if notes else Paragraph(text="None.")]
    title = f"Plan report: {plan.get('model', '?')}" + (f" within {format_bytes(budget)}" if budget else "")
    return Report(title=title, blocks=blocks)


def _effective_batch(batch: dict[str, Any]) -> list[Block]:
    """--effective-batch-size auto: what was measured, the choice and its reason, and the advice on --lr."""
    measured = batch.get("noise_scale") if isinstance(batch.get("noise_scale"), dict) else {}
    probe = batch.get("probe") if isinstance(batch.get("probe"), dict) else {}
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


def _plan_setup(plan: dict[str, Any]) -> list[str]:
    get = plan.get
    params = get("parameters")
    items = [
        f"**Model:** {get('model', '?')}" + (f", {params:,} parameters" if isinstance(params, int) else ""),
        f"**Device:** {get('device', '?')}, {get('world_size', 1)} process(es); **sequence length:** "
        f"{get('seq_len', '?')} tokens",
        f"**Effective batch:** {get('effective_batch_size', '?')} sequences; **memory budget:** "
        f"{format_bytes(get('memory_budget_bytes'))} per process",
        f"**Data:** {get('data') or 'built-in corpus'}"
        + (f" ({get('tokens_per_epoch'):,} tokens per epoch)" if isinstance(get("tokens_per_epoch"), int) else ""),
        f"**Planned:** {get('created', '?')}, in {format_hms(get('duration_s'))}"
        + (f" of a {get('time_budget_s'):g} s --time-budget" if isinstance(get("time_budget_s"), (int, float)) else "")
        + _time_spent(get("time_spent_s")),
    ]
    if get("version") not in (None, 1):
        items.append(f"**Note:** plan.json version {get('version')}; this report reads version 1 and may miss fields")
    return items


def _time_spent(spent: Any) -> str:
    """Where the plan's time went (plan.json ``time_spent_s``), largest first; empty for a plan without it."""
    if not isinstance(spent, dict):
        return ""
    phases = sorted(((str(name), float(seconds)) for name, seconds in spent.items()
                     if isinstance(seconds, (int, float)) and seconds >= 0.05), key=lambda item: -item[1])
    return f" ({', '.join(f'{name} {seconds:.1f} s' for name, seconds in phases)})" if phases else ""


def _diagnosis(diagnosis: dict[str, Any], chosen: dict[str, Any] | None, budget: float | None) -> list[Block]:
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
    if chosen and chosen.get("estimated_by_category"):
        bars.append((f"chosen ({chosen.get('id')})", chosen["estimated_by_category"]))
    if categories:
        blocks.append(plot_block("report-diagnosis.png", "Estimated peak memory by category: the baseline"
                            + (" and the chosen candidate" if len(bars) > 1 else "") + "; dashed line: the budget.",
                            plots.breakdown_figure(bars, budget=budget)))
    return blocks


def memory_throughput_front(candidates: list[dict[str, Any]]) -> set[str]:
    """The ids of the measured candidates that fit and that no other fitting one beats on both peak memory (lower)
    and throughput (higher): the front a user chooses along when memory, not speed, is what they are short of."""
    fitting = [(c.get("id"), m["peak_bytes"], m["tokens_per_s"]) for c in candidates
               if isinstance(m := c.get("measured"), dict) and m.get("fits") and plots.finite(m.get("peak_bytes"))
               and plots.finite(m.get("tokens_per_s"))]
    return {str(name) for name, peak, rate in fitting
            if not any(p <= peak and r >= rate and (p < peak or r > rate) for _, p, r in fitting)}


def _lossy_quality(candidate: dict[str, Any], quality: Any) -> str:
    """The quality column: exact for fp32 optimizer state on a full-precision base; each lossy lever's loss check
    (a lower-precision state against fp32 state, an nf4 base against the full-precision base), or "not checked"."""
    state, base = str(candidate.get("optimizer_state", "fp32")), str(candidate.get("lora_base_precision", "fp32"))
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


def _candidate_table(candidates: list[dict[str, Any]], chosen_id: str | None,
                     quality: Any = None) -> Table | Paragraph:
    if not candidates:
        return Paragraph(text="The plan holds no candidates.")
    front = memory_throughput_front(candidates)
    rows, marked = [], None
    for index, cand in enumerate(candidates):
        measured = cand.get("measured") or {}
        if measured:
            # Measured on the longest window the data can produce (plan.json's measured_on), or, in a plan made
            # before that, on the epoch's second window.
            how = "measured on the longest window" if measured.get("measured_on") else "measured"
            fits = {True: f"yes ({how})", False: f"no ({how})"}.get(measured.get("fits"), "?")
        else:
            fits = {True: "yes (estimate)", False: "no (estimate)"}.get(cand.get("fits_estimate"), "?")
        name = str(cand.get("id", "?"))
        if name == chosen_id:
            name, marked = f"**{name} (chosen)**", index
        state, base = str(cand.get("optimizer_state", "fp32")), str(cand.get("lora_base_precision", "fp32"))
        levers = ", ".join(([f"loss chunks {cand['loss_chunk_tokens']}"] if cand.get("loss_chunk_tokens") else [])
                           + ([f"{state} state"] if state != "fp32" else [])
                           + ([f"{base} base"] if base != "fp32" else [])) or "-"
        rows.append([name, f"{cand.get('micro_batch_size', '?')} x {cand.get('grad_accum_steps', '?')}",
                     str(cand.get("precision", "?")), str(cand.get("activation_checkpointing", "none")),
                     str(cand.get("offload", "none")), levers, format_bytes(cand.get("estimated_peak_bytes")),
                     format_bytes(cand["accumulation_bytes"]) if plots.finite(cand.get("accumulation_bytes")) else "-",
                     format_bytes(measured.get("peak_bytes")), fits,
                     format_number(measured.get("tokens_per_s"), ",.0f"),
                     format_hms(measured.get("seconds_per_epoch")),
                     format_hms(times(measured.get("hours_per_billion_tokens"), 3600)),
                     "yes" if str(cand.get("id")) in front else "", _lossy_quality(cand, quality),
                     str(cand.get("status", "?")) + (f": {measured['error']}" if measured.get("error") else "")])
    header = ["candidate", "micro x accum", "precision", "recompute", "offload", "levers", "estimated peak",
              "of it, accumulation", "measured peak", "fits", "tokens/s", "time per epoch", "time per 1B tokens", "front", "quality",
              "status"]
    return Table(header=header, rows=rows, marked_row=marked)


def _decision(root: Path, choice: dict[str, Any] | None, chosen: dict[str, Any] | None,
              candidates: list[dict[str, Any]], budget: float | None, quality: Any) -> list[Block]:
    """What to train with, why, the command, and the quality check in one line; or why nothing was chosen."""
    if not choice:
        return [Paragraph(text=f"**No candidate was chosen.** {_why_none(candidates, budget)}")]
    measured = (chosen or {}).get("measured") or {}
    figures = ""
    if plots.finite(measured.get("tokens_per_s")):
        figures = (f"; measured {measured['tokens_per_s']:,.0f} tokens/s at a peak of "
                   f"{format_bytes(measured.get('peak_bytes'))}" + (f" of {format_bytes(budget)}" if budget else ""))
    flags = (f"--micro-batch-size {choice.get('micro_batch_size')} --grad-accum-steps {choice.get('grad_accum_steps')} "
             f"--precision {choice.get('precision')} --activation-checkpointing "
             f"{choice.get('activation_checkpointing', 'none')} --offload {choice.get('offload', 'none')}")
    # train's default order is by-length, so a plan's "drawn" must be said (a plan.json without it means drawn).
    flags += " " + " ".join(_chosen_cut(choice).command_line())
    if choice.get("loss_chunk_tokens"):
        flags += f" --loss-chunk-tokens {choice['loss_chunk_tokens']}"
    if choice.get("optimizer_state", "fp32") != "fp32":
        flags += f" --optimizer-state {choice['optimizer_state']}"
    if choice.get("lora_base_precision", "fp32") != "fp32":
        flags += f" --lora-base-precision {choice['lora_base_precision']}"
    reason = str(choice.get("reason") or "not given").rstrip(".")
    return [Paragraph(text=f"**Chosen: {choice.get('id', '?')}**: {_config_text(choice)}{_cut_text(choice)}{figures}."),
            Paragraph(text=f"**Why:** {reason}."),
            Paragraph(text=f"**Train with it:** `cadence train --plan {root / PLAN_FILE}` with the --data it was "
                           f"planned on, or by flags: `cadence train ... {flags}`"),
            Paragraph(text=f"**Quality check: {quality_verdict(quality)}**{_quality_line(quality)}")]


def _chosen_cut(choice: dict[str, Any]) -> Cut:
    """The chosen configuration's cut, from plan.json's choice (a plan without the cut flags means drawn rows)."""
    return Cut.from_flags(choice, micro_batch_size=int(choice.get("micro_batch_size") or 1),
                          seq_len=int(choice.get("seq_len") or 1))


def _cut_text(choice: dict[str, Any]) -> str:
    """How the chosen configuration cuts each window, when it is not the drawn order (empty otherwise)."""
    described = _chosen_cut(choice).describe()
    return f", windows cut: {described}" if described else ""


def _why_none(candidates: list[dict[str, Any]], budget: float | None) -> str:
    """Why nothing was chosen: the candidates' statuses counted, and the smallest estimate against the budget."""
    if not candidates:
        return "The plan holds no candidates: see the notes."
    counts: dict[str, int] = {}
    for candidate in candidates:
        status = str(candidate.get("status", "no status"))
        counts[status] = counts.get(status, 0) + 1
    text = f"Of {len(candidates)} candidates: " + "; ".join(f"{n} {status}" for status, n in counts.items()) + "."
    estimated = [c for c in candidates if plots.finite(c.get("estimated_peak_bytes"))]
    if estimated and budget:
        smallest = min(estimated, key=lambda c: c["estimated_peak_bytes"])
        text += (f" The smallest estimated peak is {smallest.get('id', '?')}'s "
                 f"{format_bytes(smallest['estimated_peak_bytes'])}, against a budget of {format_bytes(budget)}.")
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


def _cuts(rows: list[dict[str, Any]]) -> list[Block]:
    """The chosen configuration measured with its windows cut four ways (same samples, same gradient)."""
    def number(value: Any, pattern: str) -> str:
        return pattern.format(value) if plots.finite(value) else "-"

    table = Table(
        header=["cut", "real-token share", "tokens/s", "vs drawn", "measured peak", "fits", "chosen"],
        rows=[[str(row.get("cut", "?")), number(row.get("real_share"), "{:.2f}"),
               number(row.get("tokens_per_s"), "{:,.0f}"), number(row.get("ratio"), "{:.2f}x"),
               format_bytes(row.get("peak_bytes")), "yes" if row.get("fits") else "no",
               "**yes**" if row.get("chosen") else ""] for row in rows],
        marked_row=next((index for index, row in enumerate(rows) if row.get("chosen")), None),
    )
    return [Paragraph(text="The data's examples differ in length, so the chosen configuration was measured again "
                           "with each window's samples sorted by length before cutting, cut by a token budget "
                           "(micro-batch x sequence length positions) and packed into rows of the sequence "
                           "length. The window's samples, and so the gradient, are the same for every cut; only "
                           "the padding the model computes changes (the real-token share)."), table]
