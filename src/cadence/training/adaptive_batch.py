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
- its state (the multiple, the streaks, the switches so far) goes into every checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, TypeVar, cast

import torch

from cadence.engine.adaptive_batch import AdaptiveBatch, BatchMeasurement, BatchState, decide
from cadence.engine.noise_scale import GradientNoiseScale
from cadence.engine.schedules import BatchScaledLR
from cadence.engine.step import StepResult
from cadence.engine.windows import Window, merge_windows


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
                 noise_scale: GradientNoiseScale, beta2: float | None, budget: int) -> None:
        """``beta2``: the optimizer's --adam-beta2 (its groups with ``betas`` follow the batch), None: none;
        ``budget``: --max-steps, the windows of the minimum the run consumes (the last group stops there)."""
        self.policy = policy
        self.scheduler = scheduler
        self.optimizer = optimizer
        self.noise_scale = noise_scale
        self.beta2 = beta2
        self.budget = budget
        self.state = BatchState()
        self.switches: list[dict[str, Any]] = []
        """Each grow and shrink: the step after which it happened, the batches and the reason (summary.json)."""

    # ------------------------------------------------------------------------------------------------ the windows
    def group(self, places: Iterator[P]) -> Iterator[P]:
        """The data order's windows grouped ``multiple`` at a time (as the state says when each group is taken: after
        the previous step's decision), never across an epoch's end; a group is the position of its last window."""
        pending: P | None = None
        while True:
            group = [pending] if pending is not None else []
            pending = None
            # Never past the budget: the run's last window may be smaller than the batch, as an epoch's last may.
            while len(group) < min(self.state.multiple, max(1, self.budget - self.clock)):
                place = next(places, None)
                if place is None:
                    break
                if group and place.epoch != group[0].epoch:
                    pending = place  # the next epoch's first window starts the next group
                    break
                group.append(place)
            if not group:
                return
            self.scheduler.advance = len(group)  # the schedule moves by the minimum's windows this step consumes
            # A NamedTuple's copy with the merged window (the position stays its last window's).
            yield cast(Any, group[-1])._replace(window=merge_windows([place.window for place in group]))

    # ------------------------------------------------------------------------------------------------ the decision
    def after_step(self, result: StepResult, step: int) -> dict[str, Any]:
        """Decide after the optimizer step ``step`` (whose window ``result`` is); apply a switch to the LR and beta2;
        the metrics row's fields."""
        estimate = self.noise_scale.estimate()
        measured = BatchMeasurement(critical=None if result.skipped or estimate is None else estimate.sequences,
                                    windows=estimate.windows if estimate is not None else 0)
        before = self.state.effective(self.policy)
        scale = self.scheduler.scale
        self.state, decision, reason = decide(self.policy, self.state, measured)
        after = self.state.effective(self.policy)
        if after != before:
            self._apply()
            self.switches.append({"step": step, "decision": decision, "from": before, "to": after,
                                  "reason": reason})
        return {"effective_batch": result.samples, "batch_decision": decision, "batch_reason": reason,
                "next_effective_batch": after, "lr_batch_scale": scale}

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
        return {"adaptive_batch": {**self.policy.flags(), "final_effective_batch": self.state.effective(self.policy),
                                   "switches": list(self.switches)}}

    # ------------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"state": self.state.state_dict(), "switches": list(self.switches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The controller's state as saved (the LR scale and beta2 come back with the scheduler and optimizer)."""
        self.state = BatchState.from_state_dict(dict(state["state"]))
        self.switches = [dict(switch) for switch in state["switches"]]
