"""The spellings of the step chain's options, and their defaults that flags share, in a module without torch.

Why a module of their own: the command line's `--help` lists these choices and must answer without importing torch
(issue 41); precision.py, schedules.py and windows.py, which need torch, take their names from here.
"""

from __future__ import annotations

from typing import Literal

PrecisionName = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[PrecisionName, ...] = ("fp32", "bf16", "fp16")

LRScheduleName = Literal["constant", "linear", "cosine"]
LR_SCHEDULES: tuple[LRScheduleName, ...] = ("constant", "linear", "cosine")

DEFAULT_MIN_LR_RATIO = 0.1
"""The floor of a decaying schedule, as a fraction of the peak LR: the library's default and ``--min-lr-ratio``'s, so a
loop built from the library decays as ``cadence train`` does (a tenth of the peak, the usual choice for fine-tuning
and pretraining alike; 0.0 decays to nothing, which leaves the last steps with almost no update)."""

LastWindow = Literal["step", "drop"]
LAST_WINDOW_CHOICES: tuple[LastWindow, ...] = ("step", "drop")

ObjectiveName = Literal["sft", "dpo", "ipo", "simpo", "orpo", "kto"]
OBJECTIVES: tuple[ObjectiveName, ...] = ("sft", "dpo", "ipo", "simpo", "orpo", "kto")
"""What the step chain minimises (cadence.engine.objective): sft, next-token cross-entropy over the targets; dpo, ipo,
simpo and orpo on preference pairs; kto on unpaired rows with a desirable/undesirable label."""

ReferenceLogprobs = Literal["live", "precomputed"]
REFERENCE_LOGPROBS: tuple[ReferenceLogprobs, ...] = ("live", "precomputed")
"""How a full fine-tuning's reference is scored (cadence.engine.reference): live, a frozen model in memory through
training; precomputed, its log-probabilities computed once before training and kept beside the token store."""

BatchLRScaling = Literal["sqrt", "linear", "none"]
BATCH_LR_SCALINGS: tuple[BatchLRScaling, ...] = ("sqrt", "linear", "none")
"""How --effective-batch-size adaptive scales the LR when the batch changes by a ratio r: by sqrt(r) (Adam-type
optimizers), by r (SGD), or not at all."""
