"""The search: which candidates a plan measures, in which order, until its trials or its --time-budget run out.

Every candidate computes the same effective batch, so a trial's time follows its cost per token: the order uses a
prior of relative costs (only to order, never to decide). While nothing measured fits, the search measures what can
fit first (the most memory saved per second of measuring); once something fits, what can be faster. A group of
levers whose measured peak is over the budget steps down to its next smaller micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from cadence.config.commands import PlanOptions
from cadence.formatting import format_bytes
from cadence.plan.candidates import Candidate, Group, lever_flags, lever_words
from cadence.plan.measure import Deadline
from cadence.plan.quality import quality_steps
from cadence.plan.trials import MIN_TRIAL_STEPS, TrialResult, run_trial
from cadence.plan.trust import Trust, Verdict, distance_words
from cadence.training.prepare import Prepared

ESTIMATE_MARGIN = 1.15
"""Candidates whose estimate is up to 15% over the budget are still worth measuring: the estimate's tolerance."""
RECOMPUTE_COST = {"none": 1.0, "selective": 1.1, "full": 1.35}
OFFLOAD_COST = {"none": 1.0, "activations": 1.3, "optimizer": 1.5}
CHUNK_COST = 1.15
"""Prior relative cost per token, used only to order which candidates to measure first, never to decide."""
NF4_COST = 1.2
"""Prior relative cost per token of an nf4 base (each matmul dequantises its weight in the forward, the recompute and
the backward), only to order what to measure."""
REPORT_STEPS = 4
"""The report's plots and pages, in trial steps of time (about 2 s on a 2-core CPU, where a gpt-tiny step with its
share of a trial's building is 0.5 s), kept beside the quality check."""
UNTRIED_SHOWN = 4
"""Untried lever combinations a failed plan lists (the lowest estimated peaks)."""


def precision_prior(device: torch.device) -> dict[str, float]:
    """CPUs without bf16/fp16 matrix units run fp32 fastest; GPUs with tensor cores run bf16 and fp16 fastest."""
    if device.type == "cuda":
        return {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}
    return {"fp32": 1.0, "bf16": 1.5, "fp16": 2.0}


def measuring_cost(candidate: Candidate, device: torch.device) -> float:
    """The prior relative seconds of measuring ``candidate`` (every candidate computes the same effective batch, so
    a trial's time follows its cost per token): only for ordering, never for deciding."""
    setup = candidate.setup
    return (precision_prior(device)[setup.precision] * RECOMPUTE_COST[setup.activation_checkpointing]
            * OFFLOAD_COST[setup.offload] * (CHUNK_COST if setup.loss_chunk_tokens else 1.0)
            * (NF4_COST if setup.lora_base_precision == "nf4" else 1.0))


def choose_trials(candidates: list[Candidate], budget: int, max_trials: int, device: torch.device, *,
                  fitting_known: bool = True) -> list[Candidate]:
    """Per group, the largest micro-batch the estimate admits, groups in prior order (cheapest first); with
    ``fitting_known`` False (nothing measured fits yet), in :func:`fit_first` order, so that the ``max_trials`` taken
    are the ones most likely to fit."""
    if max_trials == 0:
        return list(candidates)
    leaders: dict[Group, Candidate] = {}
    for candidate in candidates:
        if candidate.estimate.peak_bytes > budget * ESTIMATE_MARGIN:
            continue
        best = leaders.get(candidate.group)
        if best is None or _leads(candidate, best, budget, fitting_known):
            leaders[candidate.group] = candidate
    ordered = sorted(leaders.values(), key=lambda c: measuring_cost(c, device))
    return ordered[:max_trials] if fitting_known else fit_first(ordered, budget, device)[:max_trials]


def _leads(candidate: Candidate, best: Candidate, budget: int, fitting_known: bool) -> bool:
    """Whether ``candidate`` replaces ``best`` as its group's trial: the larger micro-batch (the faster, likely);
    while nothing measured fits, the largest the estimate puts within the budget itself (not only within its
    margin), or, where none is, the smallest."""
    larger = candidate.setup.micro_batch_size > best.setup.micro_batch_size
    if fitting_known:
        return larger
    within, best_within = candidate.estimate.peak_bytes <= budget, best.estimate.peak_bytes <= budget
    if within != best_within:
        return within
    return larger if within else not larger


def fit_first(queue: list[Candidate], budget: int, device: torch.device) -> list[Candidate]:
    """The order to measure ``queue`` in while nothing measured fits: a search that fits before it ranks.

    Candidates the estimate puts within the budget come first; among them, and among the rest, the most memory
    saved (below the largest estimate of the queue) per relative second of measuring. So the levers that change the
    fit (lower-precision optimizer state, an nf4 base, loss chunks, recompute) are measured before precisions that change only
    the speed (bf16 autocast keeps fp32 weights, gradients and state: its estimate is about fp32's, its saving about
    none), and a plan that runs out of time has measured what could fit."""
    if not queue:
        return []
    top = max(c.estimate.peak_bytes for c in queue)
    def key(candidate: Candidate) -> tuple[bool, float]:
        saved = top - candidate.estimate.peak_bytes
        return (candidate.estimate.peak_bytes > budget, -saved / measuring_cost(candidate, device))
    return sorted(queue, key=key)


def speed_first(queue: list[Candidate], device: torch.device) -> list[Candidate]:
    """The order to measure ``queue`` in once something fits: the cheapest prior cost first (the likely fastest)."""
    return sorted(queue, key=lambda c: measuring_cost(c, device))


def run_trials(pool: list[Candidate], candidates: list[Candidate], measured: list[Candidate], prep: Prepared,
               budget: int, options: PlanOptions, deadline: Deadline, say: Callable[[str], None],
               notes: list[str], *, trust: Trust, defer_over_estimate: bool = False) -> None:
    """Settle which candidates of ``pool`` fit, per lever group the largest micro-batch that does: by the estimate
    where its measured error decides (``cadence.plan.trust``: clearly over is not run, clearly under fits by the
    estimate), else by a memory trial (adding each to ``measured``), stepping down to the next smaller micro-batch
    of a group that does not fit, until the trials or the time run out. ``defer_over_estimate``: while nothing
    fits, stop at the first candidate whose estimate is over the budget (the lossy levers, whose estimates fit, come
    before it)."""
    reach = []
    for candidate in pool:
        if trust.verdict(candidate, budget) == "over":
            _settle_by_estimate(candidate, trust, budget)
        else:
            reach.append(candidate)
    queue = choose_trials(reach, budget, options.max_trials, prep.device,
                          fitting_known=any(c.feasible for c in measured))
    trials_left = len(pool) if options.max_trials == 0 else options.max_trials
    while queue and trials_left > 0:
        fits = any(c.feasible for c in measured)
        # Nothing fits yet: settle what can fit first; something fits: what can be faster. Either way the
        # --time-budget bounds the search (with nothing that fits, no quality check is left to keep time for), once
        # one trial has run: a plan always measures the candidate most likely to fit, so it has a decision to give.
        queue = speed_first(queue, prep.device) if fits else fit_first(queue, budget, prep.device)
        candidate = queue.pop(0)
        verdict = _settle_by_estimate(candidate, trust, budget)
        if verdict == "under":
            measured.append(candidate)
        elif verdict == "measure":
            better = next((c for c in measured if c.feasible and dominates(c, candidate)), None) \
                if options.max_trials else None  # an exhaustive sweep measures every candidate
            if better is not None:
                # It cannot be faster than what fits already: its memory would decide nothing.
                candidate.status = (f"not measured: {better.id} fits with as large a micro-batch and no costlier "
                                    f"levers")
                continue
            if measured and deadline.passed(quality_reserve(measured, options) if fits else 0.0):
                out_of_time([candidate, *queue], deadline, notes, "trials")
                break
            if defer_over_estimate and not fits and candidate.estimate.peak_bytes > budget:
                for left in [candidate, *queue]:
                    left.status = "not measured: its estimate is over the budget (lower-precision state first)"
                break
            trials_left -= 1
            measure_candidate(candidate, prep, budget, options, say, memory_only=options.max_trials != 0)
            trust.learn(candidate)
            measured.append(candidate)
        if candidate.feasible and not fits:
            # The first fit: from here the search ranks, so each group's largest micro-batch within the estimate's
            # reach (passed over while fitting came first) is worth settling too.
            queue += [c for c in choose_trials(reach, budget, len(pool), prep.device)
                      if c.measured is None and c not in queue and c is not candidate]
        if options.max_trials and not candidate.feasible:
            smaller = next_smaller(candidates, candidate)  # over the budget: step down in this group
            if smaller is not None and smaller.measured is None and smaller not in queue:
                queue.insert(0, smaller)


def _settle_by_estimate(candidate: Candidate, trust: Trust, budget: int) -> Verdict:
    """The estimate's verdict on ``candidate`` (``cadence.plan.trust``), recorded where it decides: clearly over is
    not measured, clearly under fits by the estimate (its peak the estimate, marked as such)."""
    verdict = trust.verdict(candidate, budget)
    peak = candidate.estimate.peak_bytes
    if verdict == "over":
        candidate.status = f"{distance_words(peak, budget)}: not measured ({trust.words(candidate)})"
    elif verdict == "under":
        candidate.status = f"fits by estimate: {distance_words(peak, budget)} ({trust.words(candidate)})"
        candidate.measured = TrialResult(peak_bytes=peak, fits=True, tokens_per_s=None, step_time_s=None, losses=[],
                                         measured_on="the estimate (not measured)", estimated=True)
    return verdict


def measure_candidate(candidate: Candidate, prep: Prepared, budget: int, options: PlanOptions,
                      say: Callable[[str], None], label: str = "trial", *, memory_only: bool = False) -> TrialResult:
    """Run ``candidate``'s trial, record it on the candidate and say it; returns the trial. ``memory_only``: its
    peak alone (the rounds time it)."""
    started = time.perf_counter()
    # The branch test's snapshot (under --batch-branch-test) is live while its branches train: the trial runs without
    # it, so the budget left to the step is the budget less the snapshot, and the peak reported is the step's plus it.
    snapshot = candidate.snapshot_bytes
    result = run_trial(prep, candidate.setup, steps=options.trial_steps, budget_bytes=budget - snapshot,
                       timed=not memory_only)
    if snapshot and result.peak_bytes is not None:
        result.peak_bytes += snapshot
        result.measured_on = f"{result.measured_on}, plus the branch test's snapshot ({format_bytes(snapshot)}, counted)"
    candidate.seconds_per_step = (time.perf_counter() - started) / (2 if memory_only else
                                                                      max(options.trial_steps, MIN_TRIAL_STEPS))
    candidate.measured = result
    candidate.status = "measured" if result.error is None else f"measured: {result.error}"
    rate = f", {result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s else ""
    say(f"  {label} {candidate.id} {candidate.setup.describe()}: peak {format_bytes(result.peak_bytes)} "
        f"(estimate {format_bytes(candidate.estimate.peak_bytes)}){rate}, {'fits' if result.fits else 'DOES NOT FIT'}")
    return result


def dominates(better: Candidate, worse: Candidate) -> bool:
    """Whether ``better`` is faster than ``worse`` without a measurement: the same precision, optimizer state, base
    and cut order, a micro-batch at least as large, and no costlier recompute, offload or loss chunking (each of
    which only adds work to the same micro-batch), one of them cheaper or the micro-batch larger."""
    a, b = better.setup, worse.setup
    same = (a.precision == b.precision and a.optimizer_state == b.optimizer_state
            and a.lora_base_precision == b.lora_base_precision and a.cut.by_length == b.cut.by_length)
    costs = [(RECOMPUTE_COST[a.activation_checkpointing], RECOMPUTE_COST[b.activation_checkpointing]),
             (OFFLOAD_COST[a.offload], OFFLOAD_COST[b.offload]), (int(a.loss_chunk_tokens > 0), int(b.loss_chunk_tokens > 0))]
    no_costlier = all(mine <= theirs for mine, theirs in costs)
    return (same and no_costlier and a.micro_batch_size >= b.micro_batch_size
            and (a.micro_batch_size > b.micro_batch_size or any(mine < theirs for mine, theirs in costs)))


def next_smaller(candidates: list[Candidate], candidate: Candidate) -> Candidate | None:
    smaller = [c for c in candidates if c.group == candidate.group
               and c.setup.micro_batch_size < candidate.setup.micro_batch_size]
    return max(smaller, key=lambda c: c.setup.micro_batch_size, default=None)


def quality_reserve(measured: list[Candidate], options: PlanOptions) -> float:
    """Seconds to keep for the quality check (its two short runs and the gradient comparison) and the report, at the
    slowest feasible candidate's time per trial step, its trial's building included. The step time alone left the
    building out: under a load of 9 on 2 cores the quality check took 2.5x what it predicted (45 s against 18)."""
    step = max((c.seconds_per_step or c.result.step_time_s or 0.0 for c in measured if c.feasible), default=0.0)
    # The quality check's runs: the choice and, unless it computes in fp32, its fp32 reference; a lossy lever's
    # loss check runs two more.
    runs = 1 + int(any(c.feasible and c.setup.precision != "fp32" for c in measured))
    runs += 2 if any(c.feasible and not c.setup.exact for c in measured) else 0
    return (runs * (quality_steps(options) + 1) + 2 + REPORT_STEPS) * step


def out_of_time(left: list[Candidate], deadline: Deadline, notes: list[str], what: str) -> None:
    for candidate in left:
        candidate.status = "not measured: --time-budget spent"
    if left:
        notes.append(f"the --time-budget of {deadline.seconds:g} s was spent after {deadline.elapsed:.0f} s: "
                     f"{len(left)} {what if len(left) > 1 else what.rstrip('s')} "
                     f"{'were' if len(left) > 1 else 'was'} not measured ({', '.join(c.id for c in left)}); a larger "
                     f"--time-budget measures them")


def untried_levers(candidates: list[Candidate], budget: int, deadline: Deadline, constrained: set[str]) -> str:
    """What a plan that found nothing to fit did not measure: each untried combination of levers at its smallest
    estimated peak (lowest first), and the one most likely to fit with the flags that plan it alone; or, when every
    combination was measured, what else to try."""
    groups: dict[Group, Candidate] = {}
    for candidate in candidates:
        if candidate.measured is not None:
            continue
        best = groups.get(candidate.group)
        if best is None or candidate.estimate.peak_bytes < best.estimate.peak_bytes:
            groups[candidate.group] = candidate
    tried = {c.group for c in candidates if c.measured is not None}
    untried = sorted((c for group, c in groups.items() if group not in tried), key=lambda c: c.estimate.peak_bytes)
    if not untried:
        return " Every combination of levers was measured: try a larger --memory-budget, a smaller --seq-len or a " \
               "smaller model."
    spent = deadline.passed()
    listed = "; ".join(f"{c.id} {lever_words(c)}: estimated {format_bytes(c.estimate.peak_bytes)}"
                       for c in untried[:UNTRIED_SHOWN])
    more = f" (and {len(untried) - UNTRIED_SHOWN} more)" if len(untried) > UNTRIED_SHOWN else ""
    head = f"The --time-budget of {deadline.seconds:g} s ran out before these were measured" if spent \
        else "Not measured"
    text = f" {head}: {listed}{more}."
    likely = untried[0]
    verdict = ("within the budget" if likely.estimate.peak_bytes <= budget
               else f"{likely.estimate.peak_bytes / budget:.2f}x the budget")
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in lever_flags(likely).items()
                     if name not in constrained)
    return text + (f" Most likely to fit: {likely.id} ({lever_words(likely)}, estimated "
            f"{format_bytes(likely.estimate.peak_bytes)}, {verdict}); plan it with "
            + (f"{flags}, or " if flags else "") + "a larger --time-budget.")
