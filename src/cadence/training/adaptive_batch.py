"""The adaptive effective batch in a run (``--effective-batch-size adaptive``): the controller that groups the data
order's windows and, after each optimizer step, asks the rule whether to grow, hold or shrink the batch.

The rule is :func:`cadence.engine.adaptive_batch.decide` (pure). What this adds is where it acts:

- the data order is the minimum batch's windows (``Prepared.windows``); a batch of ``k`` times the minimum is ``k``
  of them in a row, merged (:func:`cadence.engine.windows.merge_windows`): the same examples in the same order, the
  micro-batch and its memory unchanged, the step chain's divisor their targets summed before the first backward;
- the decision is taken at a window boundary from the engine's gradient noise scale, whose terms are all-reduced
  over ranks, so every rank decides the same;
- at a switch the LR becomes the schedule's times ``--batch-lr-scaling`` of the ratio to the minimum, AdamW's beta2
  ``beta2 ** ratio`` (its half-life in examples kept, floored), and the schedule itself counts windows of the
  minimum (:class:`cadence.engine.schedules.BatchScaledLR`), so --max-steps and --warm-up follow the examples seen;
- with --batch-branch-test a grow is kept only when a branch at the larger batch does not lose to one at the
  current batch on the same examples (:mod:`cadence.training.branch_test`); the windows the branches train are read
  ahead from the data order and then run for real;
- its state (the multiple, the streaks, the switches so far) goes into every checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar, cast

import torch

from cadence.engine.adaptive_batch import AdaptiveBatch, BatchMeasurement, BatchState, decide, decide_ramp
from cadence.engine.noise_scale import GradientNoiseScale
from cadence.engine.schedules import BatchScaledLR
from cadence.engine.step import StepResult
from cadence.engine.windows import Window, merge_windows
from cadence.training.branch_test import BranchTest


class Place(Protocol):
    """A window of the data order and where it sits (the loop's ``EpochWindow``)."""

    @property
    def epoch(self) -> int: ...
    @property
    def window_in_epoch(self) -> int: ...
    @property
    def window(self) -> Window: ...


P = TypeVar("P", bound=Place)


class BatchController:
    """The run's adaptive batch: see the module docstring. Every rank holds one and makes the same decisions."""

    def __init__(self, policy: AdaptiveBatch, *, scheduler: BatchScaledLR, optimizer: torch.optim.Optimizer,
                 noise_scale: GradientNoiseScale | None, beta2: float | None, budget: int,
                 branch: BranchTest | None = None) -> None:
        """``beta2``: the optimizer's --adam-beta2 (its groups with ``betas`` follow the batch), None: none;
        ``noise_scale``: the engine's (None: --noise-scale-ema 0, which only a preset ramp allows);
        ``budget``: --max-steps, the windows of the minimum the run consumes (the last group stops there);
        ``branch``: --batch-branch-test's branches (None: grows are kept as the rule says)."""
        self.policy = policy
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.noise_scale = noise_scale
        self.beta2 = beta2
        self.budget = budget
        self.state = BatchState()
        self.switches: list[dict[str, Any]] = []
        """Each grow and shrink: the step after which it happened, the batches and the reason (summary.json)."""
        self.branch = branch
        self.branch_tests: list[dict[str, Any]] = []
        """Each branch test: its step, the two probe losses, whether the grow was kept, its tokens and seconds."""
        self._places: Iterator[Any] = iter(())
        self.last_group = 1
        """Windows of the minimum the step being taken consumes (the evaluation's clock moves by them)."""
        self._ahead: deque[Any] = deque()
        """Windows read ahead for a branch test, not yet grouped (the real run takes them first)."""

    # ------------------------------------------------------------------------------------------------ the windows
    def group(self, places: Iterator[P]) -> Iterator[P]:
        """The data order's windows grouped ``multiple`` at a time (as the state says when each group is taken: after
        the previous step's decision), never across an epoch's end; a group is the position of its last window."""
        self._places, self._ahead = places, deque()
        pending: P | None = None
        while True:
            group = [pending] if pending is not None else []
            pending = None
            # Never past the budget: the run's last window may be smaller than the batch, as an epoch's last may.
            while len(group) < min(self.state.multiple, max(1, self.budget - self.clock)):
                place = self._next_place()
                if place is None:
                    break
                if group and place.epoch != group[0].epoch:
                    pending = place  # the next epoch's first window starts the next group
                    break
                group.append(place)
            if not group:
                return
            self.scheduler.advance = len(group)  # the schedule moves by the minimum's windows this step consumes
            self.last_group = len(group)
            # A NamedTuple's copy with the merged window (the position stays its last window's).
            yield cast(Any, group[-1])._replace(window=merge_windows([place.window for place in group]))

    def _next_place(self) -> Any:
        return self._ahead.popleft() if self._ahead else next(self._places, None)

    def _read_ahead(self, count: int) -> list[Window]:
        """Up to ``count`` of the next windows of the minimum, in the next group's epoch, read ahead and kept for
        the real run."""
        while len(self._ahead) < count:
            place = next(self._places, None)
            if place is None:
                break
            self._ahead.append(place)
        windows: list[Window] = []
        for place in itertools.islice(self._ahead, count):
            if place.epoch != self._ahead[0].epoch:
                break  # a group never crosses an epoch's end
            windows.append(place.window)
        return windows

    # ------------------------------------------------------------------------------------------------ the decision
    def after_step(self, result: StepResult, step: int) -> dict[str, Any]:
        """Decide after the optimizer step ``step`` (whose window ``result`` is); apply a switch to the LR and beta2;
        the metrics row's fields."""
        before = self.state.effective(self.policy)
        scale = self.scheduler.scale
        earlier = self.state
        if self.policy.ramp_tokens:  # a preset: the clock decides, nothing measured
            self.state, decision, reason = decide_ramp(self.policy, self.state, self.clock)
        else:
            self.state, decision, reason = decide(self.policy, self.state, self._measured(result))
        if decision == "grow" and self.branch is not None:
            decision, reason = self._branch_test(earlier, step, reason)
        after = self.state.effective(self.policy)
        if after != before:
            self._apply()
            self.switches.append({"step": step, "decision": decision, "from": before, "to": after,
                                  "reason": reason})
        return {"effective_batch": result.samples, "batch_decision": decision, "batch_reason": reason,
                "next_effective_batch": after, "lr_batch_scale": scale, "minimum_windows": self.clock}

    def _measured(self, result: StepResult) -> BatchMeasurement:
        """The rule's measurement after this step: the noise scale in sequences; None before any estimate, after a
        skipped step, or while either average is not positive (unresolved: see the rule's module docstring)."""
        noise = self.noise_scale
        estimate = None if noise is None or result.skipped else noise.estimate()
        if estimate is None:
            return BatchMeasurement(critical=None)
        return BatchMeasurement(critical=estimate.sequences, windows=estimate.windows)

    def _branch_test(self, earlier: BatchState, step: int, reason: str) -> tuple[Any, str]:
        """The rule asked to grow from ``earlier``: keep the grow (the state as decided) or roll it back to
        ``earlier`` with the hold-off; the decision and its reason."""
        branch, grown_windows = self.branch, self.policy.branch_windows
        if branch is None or grown_windows is None:
            return "grow", reason
        larger, current = self.state.multiple, earlier.multiple
        # The examples of K grown windows, within the budget and the epoch; whole grown windows only.
        room = min(grown_windows * larger, max(0, self.budget - self.clock))
        windows = self._read_ahead(room)
        windows = windows[:len(windows) // larger * larger]
        if not windows:
            return "grow", f"{reason}; no branch test (less than one grown window left in the epoch or budget)"
        kept_state = self.state

        def set_multiple(multiple: int) -> None:
            self.state = dataclasses.replace(kept_state, multiple=multiple)
            self._apply()

        def set_advance(windows: int) -> None:
            self.scheduler.advance = windows

        outcome = branch.compare(windows, current=current, larger=larger, set_multiple=set_multiple,
                                      set_advance=set_advance)
        kept, verdict = self.policy.branch_verdict(outcome.larger, outcome.current)
        self.branch_tests.append({"step": step, "from": earlier.effective(self.policy),
                                  "to": kept_state.effective(self.policy), "windows": len(windows) // larger,
                                  "larger_probe_loss": outcome.larger, "current_probe_loss": outcome.current,
                                  "kept": kept, "tokens": outcome.tokens, "time_s": round(outcome.seconds, 3)})
        # The snapshot restored the LR scale and beta2 of ``earlier``; a kept grow sets its own below.
        if kept:
            self.state = kept_state
            return "grow", f"{reason}; {verdict}"
        self.state = dataclasses.replace(earlier, grow_streak=0, shrink_streak=0, hold_off=self.policy.branch_hold_off)
        return "hold", f"{verdict}; no grow for {self.policy.branch_hold_off} windows"

    def _apply(self) -> None:
        """The LR multiplier and beta2 of the current multiple, from the next step on."""
        multiple = self.state.multiple
        self.scheduler.rescale(self.policy.lr_scale(multiple))
        if self.beta2 is not None:
            beta2 = self.policy.beta2(self.beta2, multiple)
            for group in self.optimizer.param_groups:
                if "betas" in group:
                    group["betas"] = (group["betas"][0], beta2)

    @property
    def clock(self) -> int:
        """Windows of the minimum batch the optimizer steps have consumed (what --max-steps counts here)."""
        return self.scheduler.clock

    def describe(self) -> str:
        return self.policy.describe()

    def summary(self) -> dict[str, Any]:
        """summary.json's fields: the policy, the batch at the end, every switch."""
        fields: dict[str, Any] = {**self.policy.flags(), "final_effective_batch": self.state.effective(self.policy),
                                  "switches": list(self.switches)}
        if self.branch is not None:  # what the branches cost: trained, scored, thrown away
            fields.update(branch_tests=list(self.branch_tests),
                          branch_tokens=sum(int(test["tokens"]) for test in self.branch_tests),
                          branch_time_s=round(sum(float(test["time_s"]) for test in self.branch_tests), 3))
        return {"adaptive_batch": fields}

    # ------------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.state_dict(), "switches": list(self.switches),
                "branch_tests": list(self.branch_tests)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The controller's state as saved (the LR scale and beta2 come back with the scheduler and optimizer)."""
        self.state = BatchState.from_state_dict(dict(state["state"]))
        self.switches = [dict(switch) for switch in state["switches"]]
        self.branch_tests = [dict(test) for test in state.get("branch_tests", [])]
