"""Measurement that survives a busy machine: alternating rounds, medians, a noise band, ties, and a time budget.

One timing of a candidate decides nothing on a shared node: another process takes a core for a few seconds and the
candidate measured then looks 2x slower. So the front-runners are timed again in alternating rounds (A B C A B C ...,
as ``benchmarks/overhead.py`` pairs its implementations), each candidate's throughput is the median of its rounds,
and the spread of its rounds is its noise band. Two candidates whose medians differ by less than their bands put
together are a tie: the measurement cannot tell them apart, so the tie is decided by what the measurement CAN tell
(the lower measured peak memory), then by the simpler configuration, and the plan says so. The matmul probe that
decides which precisions are worth measuring is repeated the same way, and a precision is left out only when even
its best round is far below the slowest round of the fastest precision.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cadence.engine.choices import PrecisionName
from cadence.profiling.flops import matmul_speed

T = TypeVar("T")


@dataclass(kw_only=True)
class Rates:
    """The throughputs (tokens/s) one candidate measured, round by round."""

    rounds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.rounds) if self.rounds else None

    @property
    def band(self) -> float:
        """Half the spread of the rounds (tokens/s): how far one round may fall from the median by noise alone."""
        return (max(self.rounds) - min(self.rounds)) / 2 if len(self.rounds) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"rounds": list(self.rounds), "median": self.median, "band": self.band}


DISAGREE = 0.25
"""A candidate's rounds agree when their band (half their spread) is within this share of their median. Rounds that
disagree more (a loaded machine: one candidate's rounds ran 1,212 and 236 tokens/s in issue 43) do not rank it on
their median: the plan times another set of rounds if its --time-budget allows, and otherwise the candidates whose
rounds overlap the leader's are a tie, decided by peak memory and simplicity."""


def agree(rates: Rates) -> bool:
    """Whether ``rates``' rounds agree within :data:`DISAGREE` of their median (one round always does)."""
    median = rates.median
    return median is None or rates.band <= DISAGREE * median


def overlap(a: Rates, b: Rates) -> bool:
    """Whether the ranges of ``a``'s and ``b``'s rounds overlap."""
    if not a.rounds or not b.rounds:
        return False
    return max(a.rounds) >= min(b.rounds) and min(a.rounds) <= max(b.rounds)


def tied(a: Rates, b: Rates) -> bool:
    """Whether the measurement cannot tell ``a`` and ``b`` apart: their medians differ by less than their bands put
    together (a candidate measured once has no band: it ties only with an equal figure)."""
    if a.median is None or b.median is None:
        return False
    return abs(a.median - b.median) <= a.band + b.band


def alternate(items: Sequence[T], rounds: int, time_one: Callable[[T], float | None],
              should_stop: Callable[[], bool] | None = None) -> int:
    """Time every item of ``items`` once per round, in the same order every round (A B C A B C ...), so that a slow
    spell of the machine falls on every candidate alike instead of on whichever was measured then. ``time_one``
    returns a throughput or None (the item failed: it is not timed again). Stops early when ``should_stop()`` (the
    time budget), checked before each round, so every item keeps the same number of rounds. Returns the rounds
    done."""
    alive = list(items)
    done = 0
    for _ in range(rounds):
        if should_stop is not None and should_stop():
            break
        alive = [item for item in alive if time_one(item) is not None]
        done += 1
    return done


def ranked_with_ties(items: Sequence[T], rates: Callable[[T], Rates], peak: Callable[[T], int],
                     simplicity: Callable[[T], tuple[Any, ...]]) -> tuple[T, list[T]]:
    """The winner among ``items`` and the items tied with the fastest (the winner among them).

    The fastest median leads; every item the measurement cannot tell from it (:func:`tied`) is in the tie, and the
    tie goes to the lowest measured peak memory, then to the simplest configuration (``simplicity``: smaller is
    simpler)."""
    fastest = max(items, key=lambda item: rates(item).median or 0.0)
    # Rounds that disagree rank nothing by their median: every candidate whose rounds overlap the leader's ties.
    same = tied if agree(rates(fastest)) else (lambda a, b: tied(a, b) or overlap(a, b))
    tie = [item for item in items if item is fastest or same(rates(item), rates(fastest))]
    winner = min(tie, key=lambda item: (peak(item), simplicity(item), -(rates(item).median or 0.0)))
    return winner, tie


class Deadline:
    """``--time-budget``: the measuring a plan may do, in seconds from its start, and where the time went (the
    seconds before the deadline was made, the command's start-up, and each :meth:`phase`)."""

    def __init__(self, seconds: float, *, started: float | None = None) -> None:
        self.seconds = seconds
        self.started = time.perf_counter() if started is None else started
        self.spent: dict[str, float] = {"start-up": self.elapsed}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time of the ``with`` block to ``name`` in :attr:`spent` (added up over several blocks)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - began

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def passed(self, reserve: float = 0.0) -> bool:
        """Whether the budget is spent, keeping ``reserve`` seconds for what must still run (the quality check)."""
        return self.elapsed + reserve > self.seconds


PROBE_ROUNDS = 3
"""Rounds of the matmul probe, alternating the precisions."""
PROBE_ROUND_SECONDS = 0.02
"""The longest a probe round may multiply for (``matmul_speed``'s ``round_seconds``): eight 384-wide fp32 multiplies
take about 10 ms on a 2-core CPU; an emulated precision then runs one multiply a round, enough to show it is slow."""
SLOW_PRECISION = 0.2
"""A precision whose best matmul round runs below a fifth of the slowest round of the fastest precision is not a
candidate: that is an emulated precision (fp16 on most CPUs runs at ~1% of bf16), not a close call. Closer calls are
measured: a model is more than matmuls (fp32 matmuls at a third of bf16's AMX speed still train at 0.7x of bf16 on
gpt-tiny)."""


@dataclass(kw_only=True)
class PrecisionProbe:
    """The matmul probe's rounds per precision (multiply-adds per second) and the precisions worth measuring."""

    speeds: dict[str, list[float]]
    kept: list[PrecisionName]
    notes: list[str]


def probe_precisions(names: Sequence[PrecisionName], device: torch.device,
                     speed: Callable[[PrecisionName, torch.device], float] | None = None) -> PrecisionProbe:
    """Which of ``names`` can win on throughput: each probed in :data:`PROBE_ROUNDS` alternating rounds; one is left
    out only when it is slower beyond doubt (its best round below :data:`SLOW_PRECISION` of the fastest precision's
    worst round), and the notes give the figures either way."""
    speed = speed or (lambda name, on: matmul_speed(name, on, round_seconds=PROBE_ROUND_SECONDS))
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(PROBE_ROUNDS):
        for name in names:
            speeds[name].append(speed(name, device))
    fastest = max(names, key=lambda name: max(speeds[name]))
    floor = min(speeds[fastest])
    kept = [name for name in names if max(speeds[name]) >= SLOW_PRECISION * floor]
    notes = []
    for name in sorted(set(names) - set(kept)):
        notes.append(f"{name} was left out: its matrix multiplies ran at {_gmacs(speeds[name])} against "
                     f"{fastest}'s {_gmacs(speeds[fastest])} on this {device.type} ({PROBE_ROUNDS} alternating rounds; "
                     f"even its best round is below {SLOW_PRECISION:.0%} of {fastest}'s slowest), so it cannot win on "
                     f"throughput")
    return PrecisionProbe(speeds=speeds, kept=kept, notes=notes)


def _gmacs(rounds: Sequence[float]) -> str:
    low, high = min(rounds) / 1e9, max(rounds) / 1e9
    return f"{low:.3g}-{high:.3g} GMAC/s" if len(rounds) > 1 else f"{high:.3g} GMAC/s"


__all__ = ["DISAGREE", "PROBE_ROUNDS", "PROBE_ROUND_SECONDS", "SLOW_PRECISION", "Deadline", "PrecisionProbe", "Rates",
           "agree", "alternate", "overlap", "probe_precisions", "ranked_with_ties", "tied"]
