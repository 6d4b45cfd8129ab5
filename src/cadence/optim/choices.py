"""The optimizers cadence trains with, and how their state may be stored, in a module without torch.

Why a module of their own: the command line's `--help` lists these choices and must answer without importing torch
(issue 41). The registry is here too, as module names: adding an optimizer is one module under ``cadence.optim``
that defines ``RULE`` (a :class:`cadence.optim.spec.OptimizerRule`) and one entry in ``OPTIMIZER_MODULES`` and
``OptimizerName`` below.
"""

from __future__ import annotations

from typing import Literal

OptimizerName = Literal["adamw", "muon", "schedule-free", "adafactor", "sgd"]
OPTIMIZER_MODULES: dict[OptimizerName, str] = {
    "adamw": "cadence.optim.adamw",
    "muon": "cadence.optim.muon",
    "schedule-free": "cadence.optim.schedule_free",
    "adafactor": "cadence.optim.adafactor",
    "sgd": "cadence.optim.sgd",
}
"""Each optimizer's module, whose ``RULE`` says everything cadence needs to know about it."""
OPTIMIZERS: tuple[OptimizerName, ...] = tuple(OPTIMIZER_MODULES)

OptimizerStateName = Literal["fp32", "bf16", "8bit"]
OPTIMIZER_STATES: tuple[OptimizerStateName, ...] = ("fp32", "bf16", "8bit")
