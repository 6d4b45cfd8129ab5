"""--batch-branch-test: the direct measurement of Merrill et al. ("Critical Batch Size Revisited") before a grow is kept.

When the adaptive batch's rule asks to grow, the run is snapshotted in memory (weights, optimizer state and its
param groups' LR and beta2, the LR schedule's clock and scale, the engine's counters, precision state and noise-scale
averages, the random generators). From it, one branch trains the next ``K`` grown windows' examples at the larger
batch; from the same snapshot a second branch trains exactly the same examples, in the same order, at the current
batch (twice the optimizer steps). Each branch is then scored on the probe: the first :data:`PROBE_MICRO_BATCHES`
validation micro-batches (the evaluation's own, always the same ones). The snapshot is restored after each branch,
so the run then continues from exactly where it was, at the batch the comparison chose: it is the run that made that
choice without a branch, bitwise (what the branches did is gone but for their figures).

With several processes every rank does all of this together, in lockstep: each snapshots its own state (its DDP
replica, or its FSDP2 shards: the state dicts hold this rank's DTensor shards, copied and loaded back in place, no
gather), trains both branches on its own part of the read-ahead windows (the real run's split: each rank reads
ahead its own windows), and scores its share of the probe (:func:`probe_share`). The engine's evaluation all-reduces
loss x targets and targets, so every rank reads the same two probe losses and takes the same verdict; each rank then
restores its own generators, noise-scale averages and counters.
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

from cadence.distributed.ranks import ProcessGroupCollective, unwrap
from cadence.engine.step import Engine
from cadence.engine.windows import Window, merge_windows, padding_micro_batch

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
    """Tokens the two branches trained on together, all ranks' (thrown away: the run trains them again)."""
    seconds: float


class BranchTest:
    """Snapshots the run and trains the two branches (see the module docstring)."""

    def __init__(self, engine: Engine, probe: Sequence[Any]) -> None:
        """``probe``: this rank's validation micro-batches (every world-th of the evaluation's, from its rank on, as
        ``training.evaluation.validation_batches`` gives them); the branches are scored on this rank's share of the
        first :data:`PROBE_MICRO_BATCHES` of all ranks' (:func:`probe_share`)."""
        self.engine = engine
        collective = engine.collective
        rank = collective.ranks.rank if isinstance(collective, ProcessGroupCollective) else 0
        self.probe = probe_share(probe, rank=rank, world_size=collective.world_size)

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


def probe_share(mine: Sequence[Any], *, rank: int, world_size: int) -> list[Any]:
    """This rank's part of the probe: of the evaluation's first :data:`PROBE_MICRO_BATCHES` micro-batches (all
    ranks'), those that ``mine`` (this rank's every world-th, from ``rank`` on) holds, padded with target-less
    micro-batches so that every rank runs as many forwards (FSDP2 gathers parameters in each). The engine's
    evaluation sums loss x targets and targets over ranks: the probe loss is one process's on the same micro-batches,
    and every rank reads the same figure, so every rank takes the same verdict."""
    held = len(range(rank, PROBE_MICRO_BATCHES, world_size))
    per_rank = -(-PROBE_MICRO_BATCHES // world_size)
    share = list(mine)[:held]
    return share + [padding_micro_batch() for _ in range(per_rank - len(share))]


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
