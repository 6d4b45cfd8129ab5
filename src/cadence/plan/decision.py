"""The decision: which feasible candidate to train with, and whether a cut by length or an nf4 base beats it.

The contenders are timed in alternating rounds from the start (``cadence.plan.rounds``); each one's throughput is
the median of its rounds, and candidates tied with the fastest within their noise go to the lower measured peak, then the
simpler configuration. The cuts by length and an nf4 base replace the choice only when clearly faster, measured the
same way; a lossy lever is kept only after its loss check (``cadence.plan.quality``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cadence.config import TrainConfig
from cadence.config.commands import PlanOptions
from cadence.config.plan_file import CutRow, Rounds
from cadence.data.text import PackedSequences
from cadence.formatting import format_bytes
from cadence.memory.choices import CHECKPOINTING_MODES, OFFLOAD_MODES
from cadence.models.spec import ModelSpec
from cadence.plan.candidates import NF4_PRECISIONS, Candidate, build_candidates
from cadence.plan.measure import DISAGREE, Deadline, Rates, agree, alternate, ranked_with_ties, tied
from cadence.plan.quality import BASE_TOLERANCE, quality_steps
from cadence.plan.rounds import MAX_CONTENDERS, Races, race
from cadence.plan.search import (
    OFFLOAD_COST,
    RECOMPUTE_COST,
    REPORT_STEPS,
    dominates,
    measure_candidate,
    measuring_cost,
    quality_reserve,
)
from cadence.plan.trials import TrialSetup, timed_round
from cadence.training.prepare import Prepared

Say = Callable[[str], None]

CUT_GAIN = 1.03
"""A cut by length replaces drawn order only when its measured throughput is more than 3% higher: the same
gradient either way, so only a clear, measured gain is worth a different configuration."""
VARIABLE_LENGTHS = 0.95
"""Below this share of real tokens among the computed positions (drawn order), the data is variable-length enough
for cuts by length to be measured."""
NF4_GAIN = 1.1
"""An nf4 base replaces a full-precision base that fits only when its median throughput is more than 10% higher and
outside the rounds' noise: it is lossy (4-bit rounding, kept only after its loss check) and dequantises every weight
in each matmul, so it can be faster only by what its freed memory buys, and only a clear measured gain is worth it."""
NF4_CONTENDERS = 2
"""nf4-base configurations a plan measures against a full-precision choice (the ones its freed memory buys most)."""


def simplicity(candidate: Candidate) -> tuple[int, ...]:
    """Smaller is simpler: fewer levers pulled (an nf4 base, recompute, offload, loss chunks, reduced precision), then
    less accumulation."""
    setup = candidate.setup
    return (int(setup.lora_base_precision == "nf4"), CHECKPOINTING_MODES.index(setup.activation_checkpointing),
            OFFLOAD_MODES.index(setup.offload),
            int(setup.loss_chunk_tokens > 0), ("fp32", "bf16", "fp16").index(setup.precision),
            int(setup.cut.by_length), setup.grad_accum_steps)


def decide(feasible: list[Candidate], prep: Prepared, options: PlanOptions, deadline: Deadline, say: Say,
           notes: list[str], races: Races) -> Candidate:
    """The feasible candidate to train with. The contenders (at most MAX_CONTENDERS, the cheapest by the prior cost)
    are timed in alternating rounds from the start with the stopping rule (``cadence.plan.rounds``); the fastest
    median wins, and candidates tied with it within their noise go to the lowest peak, then the simplest
    configuration. Contenders timed already (a second decision after a lossy lever was refused) are ranked on their
    rounds."""
    open_ = [c for c in feasible if not any(dominates(other, c) for other in feasible)]
    for candidate in feasible:
        if candidate not in open_ and not candidate.timing.rounds and "not timed" not in candidate.status:
            better = next(other for other in feasible if dominates(other, candidate))
            candidate.status += f"; not timed: {better.id} fits with as large a micro-batch and fewer costly levers"
    contenders = interleaved(open_, prep)[:MAX_CONTENDERS]
    left_out = [c for c in open_ if c not in contenders]
    if left_out:
        notes.append(f"{len(left_out)} fitting candidates were not timed ({', '.join(c.id for c in left_out)}): "
                     f"at most {MAX_CONTENDERS} contenders are timed, each precision's cheapest by the prior cost per "
                     f"token")
    if any(not c.timing.rounds for c in contenders):
        if len(contenders) > 1:
            say(f"contenders {', '.join(c.id for c in contenders)}: timing them in up to {options.rounds} "
                f"alternating rounds (stopping when one is clear)")
        race(contenders, races, options, deadline, say, notes, lambda: check_reserve(contenders, races, options))
    # The stopping rule's verdict stands: a contender dropped as clearly behind is out, even where the leader's
    # rounds disagree and the tie rule would otherwise take every overlapping contender (a gpt-tiny plan chose a
    # dropped fp32 full-recompute contender for its lower peak: 0.33x the sweep's best).
    timed = [c for c in contenders if c.timing.rounds and c.id not in races.dropped]
    if not timed:
        raise RuntimeError("no contender could be timed")  # each fits its budget: a bug of the plan, not the input
    return ranked(timed, notes, "contenders")


def interleaved(candidates: list[Candidate], prep: Prepared) -> list[Candidate]:
    """``candidates`` in the order to time them: each precision's cheapest first (by the prior cost), the precisions
    taking turns. The prior orders only within a precision: across precisions it is a guess (fp32 first on a CPU,
    where a CPU with bf16 matrix units runs bf16 several times faster), and a round cut short by the --time-budget
    keeps every precision in it."""
    ranks: dict[str, int] = {}
    keyed = []
    for candidate in sorted(candidates, key=lambda c: measuring_cost(c, prep.device)):
        rank = ranks.get(candidate.setup.precision, 0)
        ranks[candidate.setup.precision] = rank + 1
        keyed.append((rank, measuring_cost(candidate, prep.device), candidate))
    return [candidate for _, _, candidate in sorted(keyed, key=lambda item: item[:2])]


def check_reserve(contenders: list[Candidate], races: Races, options: PlanOptions) -> float:
    """Seconds to keep, while the rounds run, for the quality check (the gradient of one window, then the loss
    windows the rounds' runs have not trained yet: the leader's and its fp32 twin's) and the report, at the leader's
    time per window."""
    # The stopping rule's verdict stands: a contender dropped as clearly behind is out, even where the leader's
    # rounds disagree and the tie rule would otherwise take every overlapping contender (a gpt-tiny plan chose a
    # dropped fp32 full-recompute contender for its lower peak: 0.33x the sweep's best).
    timed = [c for c in contenders if c.timing.rounds and c.id not in races.dropped]
    if not timed:
        return 0.0
    leader = max(timed, key=lambda c: c.timing.median or 0.0)
    steps = quality_steps(options)
    def untrained(candidate: Candidate | None) -> int:
        run = races.runs.get(candidate.id) if candidate is not None else None
        return steps - min(steps, len(run.losses)) if run is not None and run.parts is not None else steps
    twin = None if leader.setup.precision == "fp32" else next(
        (c for c in contenders if c.setup.precision == "fp32" and c.setup.exact == leader.setup.exact), None)
    windows = 2 + untrained(leader) + (untrained(twin) if leader.setup.precision != "fp32" else 0) + REPORT_STEPS
    return windows * (leader.seconds_per_step or 0.0)


def alternate_rounds(items: list[Candidate], prep: Prepared, options: PlanOptions, deadline: Deadline, say: Say,
                     notes: list[str]) -> None:
    """Time ``items`` (the cuts, an nf4 base against the choice) in up to --rounds alternating rounds (another set
    where their rounds disagree), within the --time-budget; each round's rate joins the candidate's rates."""
    def time_one(candidate: Candidate) -> float | None:
        rates = candidate.timing
        candidate.rates = rates
        rate = timed_round(prep, candidate.setup, steps=max(1, options.trial_steps - 2))
        if rate is not None:
            rates.rounds.append(rate)
        say(f"  round {len(rates.rounds) - 1} {candidate.id}: " + (f"{rate:,.0f} tokens/s" if rate else "out of memory"))
        return rate

    done = alternate(items, options.rounds, time_one,
                     should_stop=lambda: deadline.passed(quality_reserve(items, options)))
    noisy = [c for c in items if c.rates is not None and not agree(c.rates)]
    if noisy and done == options.rounds and options.rounds > 1:
        # The rounds disagree (a loaded machine): time another set, so the medians rest on more rounds.
        say(f"  the rounds of {', '.join(c.id for c in noisy)} disagree by more than {DISAGREE:.0%} of their median: "
            f"timing {options.rounds} more rounds")
        extra = alternate(items, options.rounds, time_one,
                          should_stop=lambda: deadline.passed(quality_reserve(items, options)))
        done += extra
        notes.append(f"the rounds of {', '.join(c.id for c in noisy)} disagreed by more than {DISAGREE:.0%} of their "
                     f"median (a busy machine): {extra} more alternating rounds were timed")
    if done < options.rounds:
        notes.append(f"the --time-budget of {deadline.seconds:g} s allowed {done} of {options.rounds} alternating "
                     f"rounds of {', '.join(c.id for c in items)}")


def ranked(items: list[Candidate], notes: list[str], what: str) -> Candidate:
    """The winner of ``items`` by their rounds' medians, ties (within the noise band) said in the notes."""
    winner, tie = ranked_with_ties(items, rates=lambda c: c.timing, simplicity=simplicity, peak=lambda c: c.peak)
    for candidate in items:  # the median of the rounds is the candidate's throughput from here on
        median = candidate.timing.median
        if median is not None and candidate.measured is not None:
            candidate.measured = dataclasses.replace(candidate.measured, tokens_per_s=median)
    leader = max(items, key=lambda c: c.timing.median or 0.0)
    if leader.rates is not None and not agree(leader.rates):
        notes.append(f"{what}: the rounds of {leader.id} still disagree ({min(leader.rates.rounds):,.0f} to "
                     f"{max(leader.rates.rounds):,.0f} tokens/s): its median does not rank it, every candidate whose "
                     f"rounds overlap its rounds is in the tie, and the predicted throughput is uncertain by that much")
    if len(tie) > 1:
        figures = "; ".join(f"{c.id} {c.timing.median or 0:,.0f} +/- {c.timing.band:,.0f} tokens/s, peak "
                            f"{format_bytes(c.peak)}" for c in tie)
        notes.append(f"{what} {', '.join(c.id for c in tie)} were tied within their measured noise ({figures}, "
                     f"over {len(winner.timing.rounds)} rounds): {winner.id} was chosen for its lower peak memory, "
                     f"then the simpler configuration")
    return winner


def time_against(chosen: Candidate, fitting: list[Candidate], prep: Prepared, options: PlanOptions,
                 deadline: Deadline, say: Say, notes: list[str], what: str) -> None:
    """Time ``fitting`` (measured once) in alternating rounds with the ``chosen`` configuration, as the front-runners
    were, so that noise cannot crown one; each one's throughput is then the median of its rounds."""
    for candidate in fitting:
        candidate.rates = Rates(rounds=[candidate.rate])
    if chosen.rates is None:
        chosen.rates = Rates(rounds=[chosen.rate])
    say(f"{what}: timing them again in up to {options.rounds} alternating rounds")
    alternate_rounds([chosen, *fitting], prep, options, deadline, say, notes)
    for candidate in [chosen, *fitting]:
        median = candidate.timing.median
        if median is not None and candidate.measured is not None:
            candidate.measured = dataclasses.replace(candidate.measured, tokens_per_s=median)


# ---------------------------------------------------------------------------------------------- an nf4 base
def nf4_buys_speed(nf4: TrialSetup, chosen: TrialSetup) -> bool:
    """Whether ``nf4`` (an nf4-base setup) pulls no speed lever harder than ``chosen`` and eases at least one: a larger
    micro-batch, less recompute, no offload or no loss chunks where the choice needs them. At the choice's own levers
    an nf4 base is only slower (it dequantises each weight in every matmul), so only these can be faster."""
    levers = [(nf4.micro_batch_size, chosen.micro_batch_size, True),
              (RECOMPUTE_COST[nf4.activation_checkpointing], RECOMPUTE_COST[chosen.activation_checkpointing], False),
              (OFFLOAD_COST[nf4.offload], OFFLOAD_COST[chosen.offload], False),
              (int(nf4.loss_chunk_tokens > 0), int(chosen.loss_chunk_tokens > 0), False)]
    no_worse = all(mine >= theirs if larger_is_faster else mine <= theirs for mine, theirs, larger_is_faster in levers)
    same_cut = dataclasses.replace(nf4.cut, micro_batch_size=chosen.cut.micro_batch_size) == chosen.cut
    return no_worse and any(mine != theirs for mine, theirs, _ in levers) and same_cut


def nf4_clearly_faster(nf4: Rates, chosen: Rates) -> bool:
    """The rule that lets an nf4 base replace a full-precision choice: its median above NF4_GAIN x the choice's and
    the two not tied within their rounds' noise."""
    if nf4.median is None or chosen.median is None:
        return False
    return nf4.median > NF4_GAIN * chosen.median and not tied(nf4, chosen)


def compare_nf4_base(prep: Prepared, chosen: Candidate, config: TrainConfig, constrained: set[str],
                     model: ModelSpec, budget: int, options: PlanOptions, say: Say,
                     notes: list[str], deadline: Deadline, *, first_number: int,
                     longest: int) -> tuple[Candidate, list[Candidate]]:
    """Under LoRA with a full-precision base that fits: the nf4-base configurations whose estimates fit the budget
    and whose freed memory buys the choice a speed lever (:func:`nf4_buys_speed`), at most NF4_CONTENDERS, measured
    and timed in alternating rounds with the choice. The fastest replaces it only when :func:`nf4_clearly_faster`
    (the loss check of the base follows in the planner). Returns the choice and the nf4 candidates measured."""
    setup = chosen.setup
    if setup.precision not in NF4_PRECISIONS:
        return chosen, []
    pool = build_candidates(config, constrained, prep.device, prep.seq_len, [], model,
                            states=[setup.optimizer_state], bases=["nf4"], precisions=[setup.precision],
                            longest=longest)
    buying = sorted((c for c in pool if c.estimate.peak_bytes <= budget and nf4_buys_speed(c.setup, setup)),
                    key=lambda c: (measuring_cost(c, prep.device), -c.setup.micro_batch_size))[:NF4_CONTENDERS]
    if not buying:
        notes.append("an nf4 base was not measured: within the budget the memory it frees buys the choice no larger "
                     "micro-batch and no cheaper recompute, offload or loss chunking, and at the choice's own levers "
                     "an nf4 base is only slower (it dequantises every weight in each matmul)")
        return chosen, []
    contenders: list[Candidate] = []
    say(f"nf4 base: the memory it frees buys {', '.join(c.setup.describe() for c in buying)}; measuring against the "
        f"choice (kept only if more than {NF4_GAIN - 1:.0%} faster and its losses stay within {BASE_TOLERANCE:.0%})")
    for number, candidate in enumerate(buying, start=first_number):
        if deadline.passed(quality_reserve([chosen, *contenders], options) * 2):  # its loss check's runs too
            notes.append(f"the --time-budget of {deadline.seconds:g} s was spent before an nf4 base "
                         f"({candidate.setup.describe()}) was measured")
            break
        candidate.id = f"c{number:02d}"
        measure_candidate(candidate, prep, budget, options, say)
        contenders.append(candidate)
    fitting = [c for c in contenders if c.feasible]
    if not fitting:
        if contenders:
            notes.append(f"an nf4 base was measured ({', '.join(c.id for c in contenders)}) and did not fit the "
                         f"budget: the choice keeps its {setup.lora_base_precision} base")
        return chosen, contenders
    time_against(chosen, fitting, prep, options, deadline, say, notes,
                 f"nf4 base {', '.join(c.id for c in fitting)} against {chosen.id}")
    best = max(fitting, key=lambda c: c.timing.median or 0.0)
    figures = (f"{best.id} {best.setup.describe()} {best.timing.median or 0:,.0f} +/- {best.timing.band:,.0f} "
               f"tokens/s against {chosen.id}'s {chosen.timing.median or 0:,.0f} +/- {chosen.timing.band:,.0f}")
    if nf4_clearly_faster(best.timing, chosen.timing):
        notes.append(f"an nf4 base was clearly faster: {figures} (more than {NF4_GAIN - 1:.0%}, outside the "
                     f"rounds' noise): it replaces the {setup.lora_base_precision} base if its losses pass their check")
        return best, contenders
    notes.append(f"an nf4 base was not clearly faster: {figures} (it must be more than {NF4_GAIN - 1:.0%} faster, "
                 f"outside the rounds' noise): the choice keeps its {setup.lora_base_precision} base")
    return chosen, contenders


# ---------------------------------------------------------------------------------------------- cuts by length
def _cut_variants(prep: Prepared, chosen: Candidate, model: ModelSpec,
                  notes: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The cuts worth measuring for ``chosen`` (name, the Cut fields they change): none for text of full sequences
    or data with little padding; packing only where the model keeps packed examples apart, and only packing where
    each window is one micro-batch."""
    data, seq_len = prep.data, prep.seq_len
    if isinstance(data.train, PackedSequences):
        notes.append("the data is text cut into full sequences of --seq-len: there is no padding, so cuts by length "
                     "and packing were not measured")
        return []
    share = chosen.measured.real_share if chosen.measured is not None else None
    if share is None or share >= VARIABLE_LENGTHS:
        notes.append(f"in drawn order {share or 1:.0%} of the computed positions are real tokens: too little padding "
                     f"for cuts by length or packing to pay, so they were not measured")
        return []
    micro = chosen.setup.micro_batch_size
    variants: list[tuple[str, dict[str, Any]]] = [
        ("by-length", {"order": "by-length"}),
        # The budget is the chosen micro-batch's worst case (micro x seq-len): the same memory bound as the choice.
        ("token budget", {"order": "by-length", "micro_batch_tokens": micro * seq_len}),
        ("packing", {"pack_length": seq_len, "micro_batch_tokens": micro * seq_len}),
    ]
    if prep.objective.name != "sft":  # a preference sample's two sequences are rows of their own
        variants.pop()
        notes.append(f"packing was not measured: --objective {prep.objective.name} does not pack")
    elif model.supports.packing == "none":
        variants.pop()
        notes.append(f"packing was not measured: {model.supports.packing_problem}")
    elif model.supports.packing == "dense-mask":
        notes.append(f"packing on this model ({model.supports.attention} attention) goes through "
                     f"transformers' dense block mask, attention over whole rows: it can be slower than by-length "
                     f"although it computes less padding (the measurement below decides)")
    if chosen.setup.grad_accum_steps == 1:
        # One micro-batch per window: sorting it, or cutting it by its own worst case, leaves it as it is.
        variants = [variant for variant in variants if "pack_length" in variant[1]]
        notes.append("the choice runs each window as one micro-batch, so only packing can change its padding")
    return variants


def compare_cuts(prep: Prepared, chosen: Candidate, budget: int, options: PlanOptions, say: Say, model: ModelSpec,
                 notes: list[str], deadline: Deadline) -> tuple[Candidate, list[CutRow]]:
    """For data of variable lengths, the chosen configuration measured again with its windows cut by length, by a
    token budget and packed: the same samples per window and the same gradient, less padding. The fastest that fits
    replaces drawn order when it is clearly faster. Returns the (possibly re-cut) choice and one row per cut."""
    variants = _cut_variants(prep, chosen, model, notes)
    if not variants:
        return chosen, []
    micro, share = chosen.setup.micro_batch_size, chosen.result.real_share or 0.0
    say(f"cuts: in drawn order {share:.0%} of the computed positions are real tokens; measuring the choice with "
        f"its windows cut {', '.join(name for name, _ in variants)} (a budget is {micro * prep.seq_len} positions; "
        f"same samples, same gradient)")
    names = {chosen.id: "drawn"}
    tried = [chosen]
    for name, fields in variants:
        if deadline.passed(quality_reserve(tried, options)):
            notes.append(f"the --time-budget of {deadline.seconds:g} s was spent before the {name} cut was measured")
            break
        cut = dataclasses.replace(chosen.setup.cut, **fields)
        variant = Candidate(id=f"{chosen.id}-{name.replace(' ', '-')}", estimate=chosen.estimate,
                            snapshot_bytes=chosen.snapshot_bytes,
                            setup=dataclasses.replace(chosen.setup, cut=cut))
        measure_candidate(variant, prep, budget, options, say, label="cut")
        names[variant.id] = name
        tried.append(variant)
    fitting = [c for c in tried[1:] if c.feasible]
    if fitting:
        # The cuts are the same math: only a clear, measured gain is worth another configuration. Timed in
        # alternating rounds with the drawn order, as the front-runners were, so noise cannot crown one.
        time_against(chosen, fitting, prep, options, deadline, say, notes,
                     f"cuts {', '.join(names[c.id] for c in [chosen, *fitting])}")
    winner = _cut_verdict(chosen, fitting, tried, names, [name for name, _ in variants], notes)
    return winner, [cut_row(names[c.id], c, chosen, chosen=c is winner) for c in tried]


def _cut_verdict(chosen: Candidate, fitting: list[Candidate], tried: list[Candidate], names: dict[str, str],
                 variants: list[str], notes: list[str]) -> Candidate:
    """The cut to train with: the fastest that fits when more than CUT_GAIN faster than drawn order outside the
    rounds' noise, else drawn order (the notes say why)."""
    best = max(fitting, key=lambda c: c.rate, default=None)
    faster = best is not None and best.rate > CUT_GAIN * chosen.rate
    if best is not None and faster and not tied(best.timing, chosen.timing):
        return best
    if best is not None and faster:
        notes.append(f"the {names[best.id]} cut measured faster than drawn order, but within the rounds' noise: the "
                     f"choice keeps drawn order")
    elif not fitting:
        # Only what was measured is compared: with no cut measured within the budget, nothing was found slower.
        unmeasured = [name for name in variants if name not in names.values()]
        over = [names[c.id] for c in tried[1:]]
        notes.append("the choice keeps drawn order, the order it was measured in: "
                     + "; ".join(part for part in (
                         f"{', '.join(over)} did not fit the budget on the longest window" if over else "",
                         f"{', '.join(unmeasured)} not measured" if unmeasured else "") if part)
                     + " (so no cut was compared with it on speed)")
    else:
        notes.append(f"no cut by length ({', '.join(names[c.id] for c in fitting)}, measured) was more than 3% faster "
                     f"than drawn order: the choice keeps drawn order")
    return chosen


def cut_row(name: str, candidate: Candidate, drawn: Candidate, *, chosen: bool) -> CutRow:
    result, base = candidate.measured, drawn.measured
    rate = result.tokens_per_s if result else None
    return CutRow(cut=name, id=candidate.id, flags=candidate.setup.cut.flags(),
                  real_share=result.real_share if result else None, tokens_per_s=rate,
                  ratio=rate / base.tokens_per_s if rate and base and base.tokens_per_s else None,
                  peak_bytes=result.peak_bytes if result else None, fits=bool(result and result.fits),
                  error=result.error if result else None, chosen=chosen,
                  rounds=Rounds(**candidate.rates.as_dict()) if candidate.rates else None)
