"""Speed measured once: the contenders timed in alternating rounds from the start, with a sequential stopping rule.

Every contender (per lever group, the largest micro-batch that fits: by its trusted estimate or its memory trial) is
built once and kept: round 0 builds it and runs one warm-up window (untimed: it allocates the optimizer state), then
each round times windows of its own run until ROUND_SECONDS have passed (at least one window), A B C A B C ..., so a
slow spell of the machine falls on every contender alike. Each contender's throughput is the median of its rounds
and its noise band half their spread (``cadence.plan.measure``).

The stopping rule, after every round from MIN_ROUNDS on: a contender whose *best* round is behind the leader's median
by more than the measured noise (the two bands put together, at least MIN_NOISE of the leader's median) is dropped:
no later round can bring it level. The rounds stop when one contender is left, at --rounds rounds (twice that while
the rounds of those left disagree: a busy machine), or when the --time-budget is spent; the decision then ranks them
(ties within the noise go to the lower peak, then the simpler configuration).

Each contender trains on from window to window, from the same initial weights over the same windows of the epoch,
so its losses over its windows are what the quality check's loss comparison needs: the check reuses them
(``cadence.plan.quality``) instead of training again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cadence.config.commands import PlanOptions
from cadence.engine.precision import fp32_matmul
from cadence.engine.prefetch import prefetch
from cadence.engine.windows import Window
from cadence.plan.candidates import Candidate
from cadence.plan.measure import DISAGREE, Deadline, Rates, agree
from cadence.plan.trials import TrialSetup, trial_run
from cadence.training.components import Components, build_components
from cadence.training.prepare import Prepared

Say = Callable[[str], None]

ROUND_SECONDS = 1.0
"""A round times a contender's windows until this long has passed (at least one window): long enough that a step's
jitter is a small part of it, short enough that several rounds fit the plan's time."""
MIN_ROUNDS = 2
"""Rounds before the stopping rule may drop a contender: one round has no noise band."""
MIN_NOISE = 0.03
"""The noise the stopping rule assumes at least (of the leader's median): two or three rounds can agree by chance."""
MAX_CONTENDERS = 9
"""Contenders timed at most (the cheapest by the prior cost, ``cadence.plan.search``): every precision a CPU keeps
(fp32, bf16, fp16 where its matrix units run it) x the three recompute modes; a GPU's offload groups would otherwise
multiply them. Six left out gpt-tiny's fastest (bf16 full recompute at micro-batch 16, whose prior cost per token
ranked it last: the plan chose 0.78x the sweep's best without timing it)."""
HORIZON = 64
"""Optimizer steps every round run is built for (its LR schedule's length): the same for every run, so runs of
different contenders, and the quality check's reference, follow the same schedule over the same windows."""


def behind(rates: Rates, leader: Rates) -> bool:
    """The stopping rule: ``rates``' best round is below the leader's median by more than the measured noise."""
    if not rates.rounds or leader.median is None:
        return False
    noise = max(rates.band + leader.band, MIN_NOISE * leader.median)
    return max(rates.rounds) < leader.median - noise


@dataclass(kw_only=True)
class Run:
    """One contender's run, kept across rounds: its model, optimizer and engine, its windows, its losses."""

    setup: TrialSetup
    parts: Components | None
    """None once closed (its memory given back)."""
    windows: Iterator[Window]
    stack: contextlib.ExitStack
    losses: list[float | None] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time spent in this run (building included)."""
    tokens: int = 0
    positions: int = 0
    """Real tokens, and positions computed (padding included), over the run's windows."""

    def step(self) -> tuple[int, float]:
        """One window: (tokens, step seconds)."""
        began = time.perf_counter()
        if self.parts is None:
            raise RuntimeError("a closed round run was stepped")  # a bug of the plan, not the user's input
        window = next(self.windows)
        result = self.parts.engine.step(window)
        self.losses.append(result.loss)
        self.tokens, self.positions = self.tokens + result.tokens, self.positions + result.tokens + \
            result.padded_positions
        self.seconds += time.perf_counter() - began
        return result.tokens, result.step_time_s

    def close(self) -> None:
        self.stack.close()
        self.parts = None


def _epochs(prep: Prepared) -> Iterator[Window]:
    epoch = 0
    while True:
        empty = True
        for window in prep.windows(epoch):
            empty = False
            yield window
        if empty:
            return
        epoch += 1


def start_run(prep: Prepared, setup: TrialSetup) -> Run:
    """``setup``'s run from the plan's initial weights over the epoch's windows (epochs chained)."""
    began = time.perf_counter()
    trial = trial_run(prep, setup, steps=HORIZON)
    parts = build_components(trial)
    stack = contextlib.ExitStack()
    windows = stack.enter_context(prefetch(_epochs(trial), depth=trial.config.prefetch_windows,
                                           pin_memory=trial.device.type == "cuda"))
    stack.enter_context(fp32_matmul(trial.config.fp32_matmul))
    run = Run(setup=setup, parts=parts, windows=windows, stack=stack)
    run.seconds = time.perf_counter() - began
    return run


@dataclass(kw_only=True)
class Races:
    """The plan's kept runs, by candidate id: the rounds' contenders, and the quality check's reference."""

    prep: Prepared
    keep: bool
    """Whether runs are kept between rounds (host memory allows it; on a GPU each would hold device memory while
    another is timed, so there a round starts its contender again from its initial weights)."""
    runs: dict[str, Run] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    """Contenders the stopping rule dropped: out of the decision, whatever a tie rule would say of their rounds."""

    def run(self, candidate: Candidate) -> Run:
        run = self.runs.get(candidate.id)
        if run is None or run.parts is None:
            run = start_run(self.prep, candidate.setup)
            self.runs[candidate.id] = run
            run.step()  # warm-up: allocates the optimizer state; never timed
        return run

    def time_round(self, candidate: Candidate) -> float | None:
        """One round of ``candidate``: windows of its run until ROUND_SECONDS (at least one); tokens/s."""
        try:
            run = self.run(candidate)
            tokens, seconds = 0, 0.0
            while seconds < ROUND_SECONDS or tokens == 0:
                done, spent = run.step()
                tokens, seconds = tokens + done, seconds + spent
        except (torch.OutOfMemoryError, StopIteration):
            self.close(candidate.id)
            return None
        candidate.seconds_per_step = run.seconds / max(1, len(run.losses))
        if candidate.measured is not None and run.positions:  # the share of real tokens: the cuts' comparison
            candidate.measured = dataclasses.replace(candidate.measured, real_share=run.tokens / run.positions)
        if not self.keep:
            self.close(candidate.id, keep_losses=True)
        return tokens / seconds if seconds > 0 else None

    def losses(self, key: str, setup: TrialSetup, steps: int) -> list[float | None] | None:
        """The first ``steps`` losses of the run of candidate ``key`` with ``setup``, training it on where it has
        fewer and is still kept; None where it has no such run with them."""
        run = self.runs.get(key)
        if run is None or run.setup != setup:
            return None
        while len(run.losses) < steps and run.parts is not None:
            run.step()
        return run.losses[:steps] if len(run.losses) >= steps else None

    def close(self, key: str, *, keep_losses: bool = False) -> None:
        run = self.runs.get(key)
        if run is not None:
            run.close()
            if not keep_losses:
                del self.runs[key]

    def close_all(self) -> None:
        for run in self.runs.values():
            run.close()


def can_keep(contenders: list[Candidate], device: torch.device) -> bool:
    """Runs are kept on a CPU where their estimated peaks together take at most half the memory available now."""
    if device.type != "cpu":
        return False
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # no such figure on this system: rebuild every round, the safe way
        return False
    return sum(c.estimate.peak_bytes for c in contenders) <= available / 2


def race(contenders: list[Candidate], races: Races, options: PlanOptions, deadline: Deadline, say: Say,
         notes: list[str], reserve: Callable[[], float]) -> None:
    """Time ``contenders`` in alternating rounds with the stopping rule (module docstring); each one's ``rates``
    hold its rounds. ``reserve()``: seconds to keep for what follows (the quality check, the report)."""
    alive = list(contenders)
    for candidate in alive:
        candidate.rates = Rates()
    # The memory trials' profiler leaves many objects behind (a collection took 1.3 s after one gpt-tiny trial on
    # this loaded 2-core CPU): collected inside a timed window, they would slow whichever contender ran then.
    gc.collect()
    limit = options.rounds
    done = 0
    while alive and done < limit:
        if done and deadline.passed(reserve()):
            notes.append(f"the --time-budget of {deadline.seconds:g} s allowed {done} alternating rounds of "
                         f"{', '.join(c.id for c in alive)}")
            break
        for candidate in list(alive):
            rate = races.time_round(candidate)
            say(f"  round {done} {candidate.id}: " + (f"{rate:,.0f} tokens/s" if rate else "out of memory"))
            if rate is None:
                alive.remove(candidate)
                candidate.status = "measured: out of memory in its rounds"
                continue
            candidate.timing.rounds.append(rate)
        done += 1
        if done >= MIN_ROUNDS and len(alive) > 1:
            kept = _drop_behind(alive, done, say)
            races.dropped |= {c.id for c in alive if c not in kept}
            alive = kept
        if done == limit and limit == options.rounds and len(alive) > 1 and limit > 1 \
                and not all(agree(c.timing) for c in alive):
            limit = 2 * options.rounds  # a busy machine: the medians rest on more rounds
            notes.append(f"the rounds of {', '.join(c.id for c in alive if not agree(c.timing))} disagreed by more "
                         f"than {DISAGREE:.0%} of their median (a busy machine): up to {options.rounds} more "
                         f"alternating rounds were timed")
        if len(alive) == 1:
            break


def _drop_behind(alive: list[Candidate], done: int, say: Say) -> list[Candidate]:
    leader = max(alive, key=lambda c: c.timing.median or 0.0)
    kept = []
    for candidate in alive:
        if candidate is not leader and behind(candidate.timing, leader.timing):
            candidate.status = (f"measured: behind {leader.id} after {done} rounds (best "
                                f"{max(candidate.timing.rounds):,.0f} against its median "
                                f"{leader.timing.median or 0:,.0f} tokens/s, beyond the noise)")
            say(f"  {candidate.id} dropped: {candidate.status[len('measured: '):]}")
        else:
            kept.append(candidate)
    return kept


__all__ = ["HORIZON", "MAX_CONTENDERS", "MIN_NOISE", "MIN_ROUNDS", "ROUND_SECONDS", "Races", "Run", "behind",
           "can_keep", "race", "start_run"]
