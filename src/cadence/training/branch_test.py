"""--batch-branch-test: the direct measurement of Merrill et al. ("Critical Batch Size Revisited") before a grow is kept.

When the adaptive batch's rule asks to grow, the run is snapshotted in memory (weights, optimizer state and its
param groups' LR and beta2, the LR schedule's clock and scale, the engine's counters, precision state and noise-scale
averages, the random generators). From it, one branch trains the next ``K`` grown windows' examples at the larger
batch; from the same snapshot a second branch trains exactly the same examples, in the same order, at the current
batch (twice the optimizer steps). Each branch is then scored on the probe: the first :data:`PROBE_MICRO_BATCHES`
validation micro-batches (the evaluation's own, always the same ones). The snapshot is restored after each branch,
so the run then continues from exactly where it was, at the batch the comparison chose: it is the run that made that
choice without a branch, bitwise (what the branches did is gone but for their figures).

One process only (validation refuses it with several): the branches would need their comparison all-reduced and
every rank's snapshot taken together.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.distributed.ranks import unwrap
from cadence.engine.step import Engine
from cadence.engine.windows import Window, merge_windows

PROBE_MICRO_BATCHES = 4
"""Validation micro-batches each branch is scored on (the first ones, the same every time): enough to see a
difference of a percent on gpt-tiny, few enough to cost less than one training window."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Everything an optimizer step changes, copied into memory."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    engine: dict[str, Any]
    rng: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class BranchOutcome:
    """What the two branches measured, and what they cost."""

    larger: float
    current: float
    tokens: int
    """Tokens the two branches trained on together (thrown away: the run trains them again)."""
    seconds: float


class BranchTest:
    """Snapshots the run and trains the two branches (see the module docstring)."""

    def __init__(self, engine: Engine, probe: Sequence[Any]) -> None:
        """``probe``: the validation micro-batches the branches are scored on (the first
        :data:`PROBE_MICRO_BATCHES` are used)."""
        self.engine = engine
        self.probe = list(probe)[:PROBE_MICRO_BATCHES]

    def snapshot(self) -> Snapshot:
        engine = self.engine
        scheduler = engine.scheduler
        return Snapshot(
            weights={name: tensor.detach().clone() for name, tensor in unwrap(engine.model).state_dict().items()},
            optimizer=copy.deepcopy(engine.optimizer.state_dict()),
            scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else {},
            engine=copy.deepcopy(engine.state_dict()),
            rng=_rng_state(),
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Back to ``snapshot``; copies again, because ``Optimizer.load_state_dict`` keeps the tensors it is given
        (and the next branch would step them in place)."""
        engine = self.engine
        unwrap(engine.model).load_state_dict(snapshot.weights)
        engine.optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
        if engine.scheduler is not None:
            engine.scheduler.load_state_dict(copy.deepcopy(snapshot.scheduler))
        engine.load_state_dict(copy.deepcopy(snapshot.engine))
        _restore_rng(snapshot.rng)
        engine.optimizer.zero_grad(set_to_none=True)

    def compare(self, windows: Sequence[Window], *, current: int, larger: int,
                set_multiple: Callable[[int], None], set_advance: Callable[[int], None]) -> BranchOutcome:
        """Train ``windows`` (windows of the minimum batch) grouped ``larger`` at a time, then from the same
        snapshot ``current`` at a time, score each on the probe, and leave the run as it was. ``set_multiple``
        applies a batch's LR scale and beta2; ``set_advance`` sets how far the schedule moves in a step."""
        started = time.perf_counter()
        snapshot = self.snapshot()
        losses, tokens = [], 0
        try:
            for multiple in (larger, current):
                set_multiple(multiple)
                for start in range(0, len(windows), multiple):
                    group = list(windows[start:start + multiple])
                    set_advance(len(group))
                    tokens += self.engine.step(merge_windows(group)).tokens
                loss = self.engine.evaluate(self.probe)
                losses.append(float("inf") if loss is None else loss)
                self.restore(snapshot)
        finally:
            self.restore(snapshot)
        return BranchOutcome(larger=losses[0], current=losses[1], tokens=tokens,
                             seconds=time.perf_counter() - started)


# The checkpoint's own (training.checkpoint.layout), which this module cannot import: the checkpoint package imports
# the components, which hold the controller that holds this.
def _rng_state() -> dict[str, Any]:
    """Every random generator a training step can touch."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
