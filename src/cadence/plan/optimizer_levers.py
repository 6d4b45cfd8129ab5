"""The optimizers a plan lists but never tries (issue 51): another optimizer whose state would be smaller.

The optimizer changes the update itself (Muon's orthogonalised steps, Adafactor's factored second moment, SGD's
missing one), so it is the user's choice: a plan estimates and measures every candidate with the user's
``--optimizer`` and never switches it, whatever the memory it would save. What it may do is say, with the estimate,
which other optimizer would keep less state on this model: plan.json's ``optimizer_levers`` (typed,
``config.plan_file.OptimizerLever``) and a line each in the plan's report (``plan.report``), marked as not tried.
"""

from __future__ import annotations

from dataclasses import replace

from cadence.config import TrainConfig
from cadence.config.plan_file import OptimizerLever
from cadence.memory.estimate_for import estimate_for
from cadence.models.spec import ModelSpec
from cadence.optim.choices import OPTIMIZERS, OptimizerStateName
from cadence.optim.spec import OptimizerSpec


def state_bytes(model: ModelSpec, optimizer: OptimizerSpec, *, seq_len: int) -> int:
    """``optimizer``'s estimated state on ``model`` (the memory estimate's optimizer_state; it does not depend on the
    batch, so one sequence of one row stands for any)."""
    estimate = estimate_for(model, micro_batch_size=1, seq_len=seq_len, precision="fp32", checkpointing="none",
                            optimizer=replace(optimizer, offload=False))
    return int(estimate.by_category["optimizer_state"])


def optimizer_levers(config: TrainConfig, model: ModelSpec, *, seq_len: int,
                     chosen_state: OptimizerStateName = "fp32") -> list[OptimizerLever]:
    """Every other optimizer whose estimated state on ``model`` is below the user's (as the chosen configuration keeps
    it: ``chosen_state``), smallest first; an optimizer that could not train this run as configured (its own problems
    with the run's schedule) is left out."""
    user = OptimizerSpec.from_flags(config)
    chosen = state_bytes(model, user.with_state(chosen_state), seq_len=seq_len)
    levers = []
    for name in OPTIMIZERS:
        if name == user.name:
            continue
        other = OptimizerSpec(name=name, lr=user.lr)
        if other.problems(lr_schedule=config.lr_schedule):
            continue
        bytes_ = state_bytes(model, other, seq_len=seq_len)
        if bytes_ < chosen:
            levers.append(OptimizerLever(optimizer=name, state_bytes=bytes_, chosen_state_bytes=chosen))
    return sorted(levers, key=lambda lever: lever.state_bytes)


__all__ = ["optimizer_levers", "state_bytes"]
