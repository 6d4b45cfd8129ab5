"""``cadence plan``: which micro-batch, accumulation, recompute, offload and precision under a memory budget?

diagnose (the analytic estimate of the configuration one would naively try: the whole batch at once, fp32)
-> candidates (every micro-batch that divides the effective batch x precision x recompute [x offload on a GPU],
   each with its estimated peak: ``candidates``)
-> measured trials (per precision/recompute/offload group, the largest micro-batch the estimate admits; when the
   measurement says it does not fit after all, the next smaller one: ``search``)
-> decision (the front-runners timed again in alternating rounds; the highest median throughput whose measured peak
   is within the budget, candidates tied with it within the rounds' noise going to the lower peak: the effective
   batch is the same for every candidate, so the math is too: ``decision``), all within --time-budget
-> quality check (the decision's window gradient against fp32 accumulation of the same window, and a short loss
   comparison against fp32: ``quality``) -> plan.json (``record``) and its report.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from cadence.config import TrainConfig, validate
from cadence.config.commands import PlanOptions
from cadence.config.plan_file import CUT_FLAGS, CutRow, PlanAdaptive
from cadence.engine.adaptive_batch import AdaptiveBatch
from cadence.engine.choices import PRECISIONS, PrecisionName
from cadence.errors import CadenceFailure, Problem, UsageError
from cadence.formatting import format_bytes
from cadence.memory.estimate import MemoryEstimate
from cadence.memory.estimate_for import estimate_for
from cadence.models.spec import ModelSpec
from cadence.optim.choices import OptimizerStateName
from cadence.output_files import timestamped_directory
from cadence.plan.adaptive import RangeThroughput, as_fixed, planned_batch, policy, step_split
from cadence.plan.batch import BatchChoice, choose_effective_batch
from cadence.plan.candidates import (
    Candidate,
    accumulation_diagnosis,
    build_candidates,
    lever_words,
    longest_example,
    lossy_candidates,
    nf4_problem,
)
from cadence.plan.decision import compare_cuts, compare_nf4_base, decide
from cadence.plan.measure import Deadline
from cadence.plan.objective_cost import objective_cost
from cadence.plan.quality import lossy_check, lossy_words, quality_check, unchecked_lossy_lever
from cadence.plan.record import PlanOutcome, plan_record, write
from cadence.plan.report import plan_report
from cadence.plan.rounds import Races, can_keep
from cadence.plan.search import measure_candidate, run_trials, untried_levers
from cadence.plan.trust import Trust
from cadence.report.document import write_report
from cadence.training.prepare import Prepared, prepare

Say = Callable[[str], None]


class PlanFailed(CadenceFailure):
    """No candidate fits the budget (the CLI exits with status 1 and this message)."""

    label = "plan failed"


def validate_plan(config: TrainConfig, options: PlanOptions, constrained: Collection[str] = ()) -> None:
    """Every problem of a plan request, each naming its flag."""
    problems: list[Problem] = []
    auto = config.effective_batch_size == "auto"
    if config.effective_batch_size is None:
        problems.append(Problem(where="--effective-batch-size", message="is required: the batch the plan keeps fixed, "
                                                                        "auto (chosen from the gradient noise "
                                                                        "scale) or adaptive (a range)"))
    problems += _auto_batch_problems(config, options, auto, constrained)
    if config.memory_budget is None:
        problems.append(Problem(where="--memory-budget", message="is required, e.g. 512MiB or 2GiB"))
    if config.micro_batch_size == "auto":
        problems.append(Problem(where="--micro-batch-size", message="auto is what a plan decides; give a number "
                                                                     "to constrain the plan, or leave it out"))
    if "grad_accum_steps" in constrained:
        problems.append(Problem(where="--grad-accum-steps", message="is what a plan decides from "
                                "--effective-batch-size; give --micro-batch-size to constrain the split"))
    for name, minimum in (("trial_steps", 3), ("max_trials", 0), ("quality_steps", 1), ("rounds", 1)):
        if getattr(options, name) < minimum:
            problems.append(Problem(where="--" + name.replace("_", "-"),
                                    message=f"must be at least {minimum}, got {getattr(options, name)}"))
    if not (options.time_budget > 0 and math.isfinite(options.time_budget)):
        problems.append(Problem(where="--time-budget", message=f"must be a positive number of seconds, got "
                                                                f"{options.time_budget}"))
    try:
        validate(_as_validated(config))
    except UsageError as err:
        problems += err.problems
    if problems:
        raise UsageError(problems)


def _as_validated(config: TrainConfig) -> TrainConfig:
    """The configuration as the config's validation sees it: auto is resolved before anything runs at a batch (its
    bounds are the plan's own, checked by :func:`_auto_batch_problems`), so the rest is checked as for any batch;
    under adaptive the branch test's --eval-every is train's flag (checked when train runs the plan)."""
    if config.effective_batch_size == "auto":
        return dataclasses.replace(config, effective_batch_size=None, min_effective_batch_size=None,
                                   max_effective_batch_size=None)
    if config.effective_batch_size == "adaptive" and config.batch_branch_test is not None:
        return dataclasses.replace(config, eval_every=max(config.eval_every, 1))
    return config


AUTO_BOUNDS = (1, 4096)
"""--min-effective-batch-size and --max-effective-batch-size of a plan with --effective-batch-size auto, not given."""


def auto_bounds(config: TrainConfig) -> tuple[int, int]:
    """The range --effective-batch-size auto chooses from."""
    low, high = config.min_effective_batch_size, config.max_effective_batch_size
    return (AUTO_BOUNDS[0] if low is None else low, AUTO_BOUNDS[1] if high is None else high)


def _auto_batch_problems(config: TrainConfig, options: PlanOptions, auto: bool,
                         constrained: Collection[str]) -> list[Problem]:
    """The problems of --effective-batch-size auto's own flags (each is refused without auto; the range's bounds are
    adaptive's too, which the config's validation checks)."""
    problems: list[Problem] = []
    auto_only = ("noise_scale_windows", "noise_scale_training", "lr_reference_batch")
    for name in auto_only if not auto else ():
        if getattr(options, name) != getattr(PlanOptions(), name):
            problems.append(Problem(where="--" + name.replace("_", "-"),
                                    message="is for --effective-batch-size auto, which this plan is not"))
    if not auto:
        return problems
    low, high = auto_bounds(config)
    for name, value in (("noise_scale_windows", options.noise_scale_windows), ("min_effective_batch_size", low),
                        ("max_effective_batch_size", high)):
        if value < 1:
            problems.append(Problem(where="--" + name.replace("_", "-"), message=f"must be at least 1, got {value}"))
    if options.lr_reference_batch is not None and options.lr_reference_batch < 1:
        problems.append(Problem(where="--lr-reference-batch",
                                message=f"must be at least 1, got {options.lr_reference_batch}"))
    if low > high:
        problems.append(Problem(where="--min-effective-batch-size", message=(
            f"{low} is above --max-effective-batch-size {high}")))
    if "micro_batch_size" in constrained:
        problems.append(Problem(where="--micro-batch-size", message=(
            "cannot constrain an effective batch that is not chosen yet (auto); leave it out, or give "
            "--effective-batch-size N")))
    return problems


@dataclass(kw_only=True)
class PlanRun:
    """One plan in progress: the run it is about, what it has found so far, and its clock."""

    config: TrainConfig
    options: PlanOptions
    constrained: set[str]
    prep: Prepared
    model: ModelSpec
    budget: int
    deadline: Deadline
    say: Say
    out: Path
    notes: list[str] = field(default_factory=list)
    batch_choice: BatchChoice | None = None
    candidates: list[Candidate] = field(default_factory=list)
    measured: list[Candidate] = field(default_factory=list)
    kept: list[PrecisionName] = field(default_factory=list)
    """The precisions the matmul probe kept."""
    longest: int = 0
    trust: Trust | None = None
    """The estimate's measured error (``plan.trust``): the shipped figures, then this plan's trials."""
    reach_confirmed: Candidate | None = None
    """Where no estimate was within reach of the budget: the closest candidate, measured to confirm."""
    races: Races | None = None
    """The contenders' runs, kept across rounds and for the quality check's losses."""
    adaptive: AdaptiveBatch | None = None
    """Under --effective-batch-size adaptive: the policy planned for (``config`` keeps it; ``prep`` is its minimum)."""
    throughput: RangeThroughput | None = None
    """Under adaptive: the choice's throughput at both ends of the range."""

    @property
    def feasible(self) -> list[Candidate]:
        return [c for c in self.measured if c.feasible]

    @property
    def nf4_problem(self) -> str | None:
        return nf4_problem(self.config, self.constrained, self.model, self.kept)


def make_plan(config: TrainConfig, options: PlanOptions, *, constrained: set[str], stream: IO[str] | None = None,
              log: Callable[[str], None] | None = None, started: float | None = None) -> dict[str, Any]:
    """Diagnose, measure, decide, check; write OUT/plan.json (and its report) and return the plan. ``started``: the
    ``time.perf_counter()`` the command started at (its start-up counts in --time-budget); default now."""
    stream = stream or sys.stderr
    say = log or (lambda text: print(text, file=stream, flush=True))
    if "micro_batch_size" not in constrained:  # the plan decides it; the default 8 must not constrain validation
        config = dataclasses.replace(config, micro_batch_size=1, grad_accum_steps=None)
    validate_plan(config, options, constrained)
    run = _assemble(config, options, constrained, say, time.perf_counter() if started is None else started)
    baseline = _diagnose(run)
    accumulation = _search(run)
    run.races = races = Races(prep=run.prep, keep=can_keep(run.feasible, run.prep.device))
    try:
        with run.deadline.phase("rounds"):
            chosen = decide(run.feasible, run.prep, options, run.deadline, say, run.notes, races)
        chosen = _compare_nf4(run, chosen)
        chosen, lossy_checks = _check_lossy_levers(run, chosen)
        with run.deadline.phase("cuts"):
            chosen, cuts = (compare_cuts(run.prep, chosen, run.budget, options, say, run.model, run.notes,
                                         run.deadline) if not constrained & set(CUT_FLAGS) else (chosen, []))
        say(f"choice: {chosen.id} {chosen.setup.describe()} at {chosen.rate:,.0f} tokens/s, peak "
            f"{format_bytes(chosen.peak)}" + (" (estimated)" if chosen.result.estimated else ""))
        with run.deadline.phase("quality"):
            quality = quality_check(run.prep, chosen, run.budget, options, run.model, races, run.feasible)
    finally:
        races.close_all()
    quality.update(lossy_checks)
    _range_throughput(run, chosen)
    say(f"quality: gradient relative error {quality['gradient']['relative_error']:.2e} "
        f"({'pass' if quality['gradient']['passed'] else 'FAIL'}), loss within "
        f"{quality['loss']['max_relative_difference']:.2%} of fp32 ({'pass' if quality['loss']['passed'] else 'FAIL'})")
    return _finish(run, chosen, baseline, quality, cuts, accumulation)


def _assemble(config: TrainConfig, options: PlanOptions, constrained: set[str], say: Say, started: float) -> PlanRun:
    """The run the plan is about, assembled as train assembles it (the model, its checks, the data through the token
    store; every trial is a variant of it), with the effective batch chosen first under auto."""
    out = config.out or timestamped_directory(Path("plans"), datetime.now())
    auto = config.effective_batch_size == "auto"
    # The run the trials vary is a fixed batch: auto's is chosen below; adaptive's candidates compute its minimum.
    prep = prepare(as_fixed(config, 1 if auto else planned_batch(config), val_fraction=0.0), out=out)
    model = prep.model
    # One deadline from the plan's start: the noise-scale measurement spends part of it, the trials the rest.
    run = PlanRun(config=config, options=options, constrained=constrained, prep=prep, model=model,
                  budget=int(config.memory_budget_bytes() or 0), deadline=Deadline(options.time_budget,
                                                                                  started=started),
                  say=say, out=out, adaptive=policy(config))
    if run.adaptive is not None:
        fewest = "at least two per window" if run.adaptive.mode == "adaptive" else "one per window or more: a ramp measures nothing"
        run.notes.append(f"{run.adaptive.describe()}: every candidate was timed at the minimum's accumulation, and only "
                         f"micro-batches that divide the minimum ({fewest}) were candidates (the batch grows the "
                         f"accumulation, never the micro-batch, so a candidate's memory is the same at every batch of "
                         f"the range)")
    if auto:
        with run.deadline.phase("noise scale"):
            choice = choose_effective_batch(
                prep, model, budget=run.budget, windows=options.noise_scale_windows,
                bounds=auto_bounds(config),
                lr_reference=options.lr_reference_batch, constrained=constrained, say=say, deadline=run.deadline,
                training=options.noise_scale_training)
        run.batch_choice = choice
        run.config = as_fixed(config, choice.effective_batch_size)  # auto's bounds are its choice's, not a range
        run.prep = prep.variant(effective_batch_size=choice.effective_batch_size)
        run.notes.append(f"effective batch {choice.effective_batch_size}: {choice.reason}. {choice.lr_advice}")
        if choice.time_note is not None:
            run.notes.append(choice.time_note)
    return run


def _range_throughput(run: PlanRun, chosen: Candidate) -> None:
    """Under adaptive: the choice's throughput at both ends of its range (the optimizer step's share of a window
    measured phase by phase; the maximum's figure derived from it), said on the console."""
    if run.adaptive is None:
        return
    with run.deadline.phase("range throughput"):
        split = step_split(run.prep, chosen.setup)
    run.throughput = RangeThroughput.of(run.adaptive, chosen.rate or None, split)
    run.say(f"adaptive batch: {run.throughput.words()}")
    if chosen.snapshot_bytes:
        run.say(f"adaptive batch: the branch test's snapshot ({format_bytes(chosen.snapshot_bytes)}: the weights and "
                f"the optimizer state) is counted in the peak {format_bytes(chosen.peak)}")


def _diagnose(run: PlanRun) -> MemoryEstimate:
    """The naive configuration's estimate (the whole batch at once in fp32), said on the console."""
    prep, config = run.prep, run.config
    effective = planned_batch(config)
    run.longest = longest_example(prep.data, prep.seq_len)
    baseline = estimate_for(run.model, micro_batch_size=effective, seq_len=run.longest, precision="fp32",
                            checkpointing="none", device_type=prep.device.type, packed=config.packing,
                            lora_base_precision=config.lora_base_precision, objective=objective_cost(config, run.model))
    run.say(f"plan: {config.model}, effective batch {effective} x {prep.seq_len} tokens, budget "
            f"{format_bytes(run.budget)} on {prep.device}\ndiagnosis: the whole batch at once in fp32 needs about "
            f"{format_bytes(baseline.peak_bytes)}: {baseline.dominant}")
    if run.longest < prep.seq_len:
        run.notes.append(f"the data's longest example has {run.longest} positions (--seq-len {prep.seq_len}): every "
                         f"candidate is estimated at micro-batches of rows that long, and measured on the longest "
                         f"window the data can produce")
    return baseline


def _search(run: PlanRun) -> dict[str, Any]:
    """The candidates estimated and measured until something fits (the lossy levers where nothing exact does);
    returns the accumulation diagnosis. Nothing fitting is a PlanFailed naming what was not measured."""
    config, constrained, prep = run.config, run.constrained, run.prep
    states: list[OptimizerStateName] = [config.optimizer_state] if "optimizer_state" in constrained else ["fp32"]
    run.trust = Trust.of(run.model, enabled=run.options.max_trials != 0)
    with run.deadline.phase("probe"):  # and the candidates' estimates
        run.candidates = build_candidates(config, constrained, prep.device, prep.seq_len, run.notes, run.model,
                                          states=states, longest=run.longest)
    run.kept = sorted({c.setup.precision for c in run.candidates}, key=PRECISIONS.index)
    accumulation = accumulation_diagnosis(run.candidates, run.model)
    if accumulation["raises_peak"]:
        run.say(f"diagnosis: {accumulation['explanation']}")
    with run.deadline.phase("memory"):
        run_trials(run.candidates, run.candidates, run.measured, prep, run.budget, run.options, run.deadline,
                   run.say, run.notes, trust=run.trust,
                   defer_over_estimate="optimizer_state" not in constrained or run.nf4_problem is None)
    if not run.feasible:
        # Only where no exact configuration fits (measured, not estimated: the estimate may be optimistic) does the
        # plan reach for the lossy levers, lower-precision optimizer state and an nf4 base; the loss checks then
        # gate them.
        more = lossy_candidates(config, constrained, prep.device, prep.seq_len, run.model, longest=run.longest,
                                precisions=run.kept, first_number=len(run.candidates) + 1, notes=run.notes,
                                say=run.say)
        run.candidates += more
        with run.deadline.phase("memory"):
            run_trials(more, run.candidates, run.measured, prep, run.budget, run.options, run.deadline, run.say,
                       run.notes, trust=run.trust)
    if not run.feasible and not run.measured:
        with run.deadline.phase("memory"):
            _confirm_out_of_reach(run)
    if not run.feasible:
        raise _nothing_fits(run)
    return accumulation


def _confirm_out_of_reach(run: PlanRun) -> None:
    """No candidate's estimate is within reach of the budget (each clearly over by its measured error): the plan
    says so at once, measuring only the candidate closest to fitting to confirm it."""
    closest = min(run.candidates, key=lambda c: c.estimate.peak_bytes)
    over = closest.estimate.peak_bytes / run.budget - 1
    run.say(f"no estimate is within reach of the budget: the smallest is {closest.id}'s "
            f"{format_bytes(closest.estimate.peak_bytes)} ({lever_words(closest)}), {over:.0%} over; measuring it "
            f"alone to confirm")
    measure_candidate(closest, run.prep, run.budget, run.options, run.say, memory_only=True)
    run.measured.append(closest)
    run.reach_confirmed = closest
    if not closest.feasible:
        run.notes.append(f"no candidate's estimate was within reach of the budget (each over it by more than its "
                         f"measured error); the closest, {closest.id} ({closest.setup.describe()}), estimated "
                         f"{format_bytes(closest.estimate.peak_bytes)}, measured "
                         f"{format_bytes(closest.peak)}: the others were not measured")


def _nothing_fits(run: PlanRun) -> PlanFailed:
    """The failure of a plan where nothing measured fits: the smallest measured peak, what was not measured."""
    peaks = [c for c in run.measured if c.peak]
    smallest = min(peaks, default=None, key=lambda c: c.peak)
    detail = (f"; the smallest measured peak was {format_bytes(smallest.peak)} ({smallest.setup.describe()})"
              if smallest else "")
    why_not_nf4 = run.nf4_problem
    if run.reach_confirmed is not None:
        closest = run.reach_confirmed
        return PlanFailed(
            f"no configuration fits in {format_bytes(run.budget)}: no candidate's estimate is within reach (each is "
            f"over the budget by more than the estimate's measured error); the smallest, {closest.id} "
            f"({closest.setup.describe()}), is estimated at {format_bytes(closest.estimate.peak_bytes)} and measured "
            f"{format_bytes(closest.peak)} to confirm. To close the gap: --memory-budget "
            f"{format_bytes(closest.estimate.peak_bytes)} or more, a smaller --seq-len or a smaller model"
            + (", or --lora-rank (train adapters only)" if run.model.lora is None else "")
            + (f". An nf4 base (--lora-base-precision nf4) was not a candidate: it {why_not_nf4}."
               if why_not_nf4 is not None else "."))
    return PlanFailed(f"no configuration fits in {format_bytes(run.budget)}{detail}."
                      + untried_levers(run.candidates, run.budget, run.deadline, run.constrained)
                      + (f" An nf4 base (--lora-base-precision nf4) was not a candidate: it {why_not_nf4}."
                         if why_not_nf4 is not None else ""))


def _compare_nf4(run: PlanRun, chosen: Candidate) -> Candidate:
    """A full-precision base fits: an nf4 base is worth a measurement only where the memory it frees buys the choice
    a larger micro-batch or less recompute, and it replaces the choice only when clearly faster."""
    if run.nf4_problem is not None or any(c.setup.lora_base_precision == "nf4" for c in run.candidates):
        return chosen
    with run.deadline.phase("nf4 comparison"):
        chosen, contenders = compare_nf4_base(run.prep, chosen, run.config, run.constrained, run.model, run.budget,
                                              run.options, run.say, run.notes, run.deadline,
                                              first_number=len(run.candidates) + 1, longest=run.longest)
    run.candidates += contenders
    run.measured += [c for c in contenders if c not in run.measured]
    return chosen


def _check_lossy_levers(run: PlanRun, chosen: Candidate) -> tuple[Candidate, dict[str, list[dict[str, Any]]]]:
    """A lossy lever is kept only when its losses stay near the exact configuration's. The split, recompute, offload
    and chunking are exact levers, so the check of one lossy value holds for every candidate with it; a value that
    fails is refused everywhere and the decision is made again among the rest."""
    checks: dict[str, list[dict[str, Any]]] = {"optimizer_state": [], "lora_base_precision": []}
    feasible = run.feasible
    while (lever := unchecked_lossy_lever(chosen.setup, checks)) is not None:
        with run.deadline.phase("lossy-lever checks"):
            check = lossy_check(lever, run.prep, chosen.setup, run.budget, run.options)
        checks[lever].append(check)
        label, value, reference, tolerance = lossy_words(lever, check)
        run.say(f"{label}: losses within {check['max_relative_difference']:.2%} of {reference} over {check['steps']} "
                f"steps ({'pass' if check['passed'] else 'FAIL'}, tolerance {tolerance:.0%})")
        if check["passed"]:
            continue
        refused = getattr(chosen.setup, lever)
        for candidate in feasible:
            if getattr(candidate.setup, lever) == refused:
                candidate.status = f"refused: {value}'s losses left the tolerance against {reference}"
        feasible = [c for c in feasible if getattr(c.setup, lever) != refused]
        run.notes.append(f"{value} was refused: over {check['steps']} steps its losses differed up to "
                         f"{check['max_relative_difference']:.2%} from {reference} "
                         f"({check.get('error') or 'tolerance'} {tolerance:.0%})")
        if not feasible:
            what = ("an optimizer state whose losses stay within {:.0%} of fp32 state's" if lever == "optimizer_state"
                    else "a base whose losses stay within {:.0%} of the full-precision base's").format(tolerance)
            anyway = ("give --optimizer-state to train with one anyway" if lever == "optimizer_state"
                      else "give --lora-base-precision nf4 to train with it anyway")
            raise PlanFailed(f"no configuration fits in {format_bytes(run.budget)} with {what}. Try a larger "
                             f"--memory-budget, a smaller --seq-len or a smaller model (or {anyway}).")
        with run.deadline.phase("rounds"):
            chosen = decide(feasible, run.prep, run.options, run.deadline, run.say, run.notes, run.races or Races(
                prep=run.prep, keep=False))
    return chosen, checks


def _finish(run: PlanRun, chosen: Candidate, baseline: MemoryEstimate, quality: dict[str, Any], cuts: list[CutRow],
            accumulation: dict[str, Any]) -> dict[str, Any]:
    """plan.json and its report, written; the plan returned as plan.json holds it."""
    duration = time.perf_counter() - run.deadline.started
    over = time_over_budget(run.deadline, duration)
    if over is not None:
        run.notes.append(over)
        run.say(f"time: {over}")
    batch = run.batch_choice
    effective = planned_batch(run.config)
    adaptive, given = None, dict[str, Any](given=effective, chosen=effective)
    if run.adaptive is not None:
        given = {"given": run.adaptive.mode, "chosen": effective}
        adaptive = PlanAdaptive(flags=run.adaptive.flags(), snapshot_bytes=chosen.snapshot_bytes,
                                throughput=run.throughput.as_dict() if run.throughput is not None else None)
    record = plan_record(PlanOutcome(
        config=run.config, data=run.prep.data, source=run.prep.source, device=run.prep.device, seq_len=run.prep.seq_len, budget=run.budget,
        baseline=baseline, model=run.model, candidates=run.candidates, chosen=chosen, quality=quality,
        notes=run.notes, cuts=cuts, diagnosis_extra={"accumulation": accumulation},
        effective_batch=batch.as_dict() if batch is not None else given,
        adaptive=adaptive,
        time_budget=run.options.time_budget, duration=duration,
        time_spent={name: round(seconds, 3) for name, seconds in run.deadline.spent.items() if seconds > 0},
        trust=run.trust))
    path = write(run.out, record)
    for written in write_report(plan_report(run.out), run.out):
        if written.suffix == ".html":
            run.say(f"report: {written}")
    run.say(f"plan written to {path}; train with: cadence train --plan {path}")
    return record.as_json()


TIME_OVER = 1.1
"""A plan that takes longer than this share of its --time-budget says where the time went."""


def time_over_budget(deadline: Deadline, duration: float) -> str | None:
    """The note of a plan that ran past its --time-budget (by more than :data:`TIME_OVER`): where its time went. A
    plan always times every contender once and checks the one it chooses, so the start-up, the first round and the
    quality check are spent whatever the budget, and on a busy machine each takes several times its quiet time."""
    if duration <= deadline.seconds * TIME_OVER:
        return None
    spent = sorted(((name, seconds) for name, seconds in deadline.spent.items() if seconds >= 0.5),
                   key=lambda item: -item[1])
    return (f"the plan took {duration:.0f} s against its --time-budget of {deadline.seconds:g} s: "
            + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in spent)
            + ". The start-up, the first round and the quality check run whatever the budget (a plan times every "
              "contender once and checks the one it chooses); on a busy machine each takes several times its quiet "
              "time: a larger --time-budget, or planning on a quieter machine, keeps the plan within it")
