"""The spellings of the memory levers, in a module without torch.

Why a module of their own: the command line's `--help` lists these choices and must answer without importing torch
(issue 41); offload.py and recompute.py, which need torch, take their names from here (the optimizer's are in
cadence.optim.choices).
"""

from __future__ import annotations

from typing import Literal

OffloadMode = Literal["none", "activations", "optimizer"]
OFFLOAD_MODES: tuple[OffloadMode, ...] = ("none", "activations", "optimizer")

CheckpointingMode = Literal["none", "full", "selective"]
CHECKPOINTING_MODES: tuple[CheckpointingMode, ...] = ("none", "full", "selective")
