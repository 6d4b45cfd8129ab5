"""Evaluation during training (--eval-every): the validation micro-batches every evaluation runs, the best evaluation
so far (--keep-best keeps its weights), and the early stop it decides (--early-stop-after)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cadence.data import iterate_micro_batches
from cadence.engine.step import Engine
from cadence.engine.windows import collate_samples, padding_micro_batch
from cadence.training.prepare import Prepared

PERPLEXITY_CAP = 700.0
"""Perplexity is exp of the per-token validation loss, capped there: a diverged model's would overflow."""


@dataclass
class BestEvaluation:
    """The lowest validation loss of the run so far, its step, and the evaluations since it."""

    loss: float | None = None
    step: int | None = None
    since: int = 0

    def evaluated(self, step: int, loss: float) -> bool:
        """Count an evaluation; True when it is a new best (strictly lower)."""
        if self.loss is None or loss < self.loss:
            self.loss, self.step, self.since = loss, step, 0
            return True
        self.since += 1
        return False

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]]) -> BestEvaluation:
        best = cls()
        for row in rows:
            if row.get("val_loss") is not None:
                best.evaluated(int(row["step"]), float(row["val_loss"]))
        return best


class Evaluation:
    """A run's evaluations: when they are due, running them into a metrics row, the best one, and the early stop.

    ``kept_rows``: a resumed run's metrics rows, whose evaluations count (the best so far, the evaluations since it);
    a resumed run that had already stopped early stays stopped (it trains no further step, as it would not have had
    it run on)."""

    def __init__(self, prep: Prepared, kept_rows: list[dict[str, Any]], *, resumed: bool) -> None:
        config = prep.config
        self.every, self.patience = config.eval_every, config.early_stop_after
        self.batches, self.examples = validation_batches(prep)
        """The micro-batches every evaluation runs (this rank's share), and how many validation examples all ranks
        hold together: the figure --keep-best and --early-stop-after decide on, and the console states."""
        self.best = BestEvaluation.from_rows(kept_rows)
        self.early_stopped = bool(resumed and self.patience and self.best.since >= self.patience)
        """True once --early-stop-after stopped the run."""

    def due(self, steps: int, *, done: bool, skipped: bool, advanced: int = 1) -> bool:
        """Whether the step just taken (``steps`` so far; ``done``: the last) is evaluated: every --eval-every
        steps and at the end, never after a skipped step (the weights did not change). ``advanced``: how far this
        step moved ``steps``; an adaptive batch counts windows of the minimum (a step of k of them crosses at most
        one multiple of --eval-every when k <= it), so that evaluations fall at the same examples whatever the batch
        did."""
        if not self.batches or skipped:
            return False
        return done or steps // self.every > (steps - advanced) // self.every

    def run(self, engine: Engine, row: dict[str, Any]) -> bool:
        """Evaluate the model now into ``row`` (``val_loss``, ``val_perplexity``) and count it; True when it is the
        best so far. The engine sums over ranks: every rank calls it."""
        row["val_loss"] = engine.evaluate(self.batches)
        row.update({f"val_{name}": value for name, value in engine.last_eval_metrics.items()})  # val_rewards/...
        row["val_perplexity"] = math.exp(min(row["val_loss"], PERPLEXITY_CAP))
        return self.best.evaluated(engine.steps, row["val_loss"])

    def stops(self, *, done: bool) -> bool:
        """Whether the run stops after this evaluation (--early-stop-after evaluations without a new best), unless
        it ends anyway (``done``); remembered in :attr:`early_stopped`."""
        if self.patience and self.best.since >= self.patience and not done:
            self.early_stopped = True
        return self.early_stopped

    def stopped_by(self) -> str | None:
        """Why the run stopped early, for summary.json (None when it did not)."""
        if not self.early_stopped:
            return None
        return (f"early stop: {self.best.since} evaluations without a lower validation loss than step "
                f"{self.best.step}'s {self.best.loss:.4f} (--early-stop-after {self.patience})")

    def announcement(self, prep: Prepared) -> str | None:
        """The console's evaluation line (None without evaluation)."""
        if not self.batches:
            return None
        whole = len(prep.data.val) if prep.data.val is not None else 0
        unit = ("windows of the minimum batch" if prep.config.effective_batch_size in ("adaptive", "ramp")
                else "steps")
        return (f"evaluation: every {self.every} {unit} on {self.examples:,} validation examples"
                + (f" (the first {prep.config.eval_batches} micro-batches of {whole:,}: --eval-batches)"
                   if self.examples < whole else " (all of them)"))

    @staticmethod
    def best_record(row: dict[str, Any]) -> dict[str, Any]:
        """best/best.json: the step and validation loss of the weights beside it."""
        return {"step": int(row["step"]), "val_loss": row["val_loss"], "val_perplexity": row["val_perplexity"]}

    def summary_fields(self) -> dict[str, Any]:
        return {"best_val_loss": self.best.loss, "best_val_step": self.best.step}


def validation_batches(prep: Prepared) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The validation micro-batches every evaluation runs (the whole validation set, or its first --eval-batches),
    always the same ones, so evaluations are comparable; and how many examples they hold.

    With several processes each rank evaluates every world-th of them (the engine sums over ranks), padded so that
    all ranks run the same number of forwards (FSDP2 gathers parameters in each)."""
    config = prep.config
    if config.eval_every <= 0 or prep.data.val is None:
        return [], 0
    batches = []
    for batch in iterate_micro_batches(prep.data.val, prep.micro_batch_size, config.seed, 0, shuffle=False,
                                       collate_fn=collate_samples):  # preference samples: their two sequences
        batches.append(batch)
        if len(batches) == config.eval_batches:
            break
    examples = sum(prep.objective.counter().samples(batch) for batch in batches)  # a preference sample: 2 rows
    world, rank = prep.ranks.world_size, prep.ranks.rank
    per_rank = -(-len(batches) // world)
    mine = batches[rank::world]
    return mine + [padding_micro_batch() for _ in range(per_rank - len(mine))], examples
