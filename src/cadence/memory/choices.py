"""The spellings of the memory levers, in a module without torch.

Why a module of their own: the command line's `--help` lists these choices and must answer without importing torch
(issue 41); offload.py, optimizer_state.py and recompute.py, which need torch, take their names from here.
"""

from __future__ import annotations

from typing import Literal

OffloadMode = Literal["none", "activations", "optimizer"]
OFFLOAD_MODES: tuple[OffloadMode, ...] = ("none", "activations", "optimizer")

OptimizerStateName = Literal["fp32", "bf16", "8bit"]
OPTIMIZER_STATES: tuple[OptimizerStateName, ...] = ("fp32", "bf16", "8bit")

CheckpointingMode = Literal["none", "full", "selective"]
CHECKPOINTING_MODES: tuple[CheckpointingMode, ...] = ("none", "full", "selective")
