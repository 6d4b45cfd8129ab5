"""The reference model a run's preference objective is scored against (dpo, ipo, kto), chosen from the flags:

- ``--reference-model DIR``: that model directory, loaded once and frozen (one more copy of its weights);
- under ``--lora-rank``: the policy itself with its adapters turned off, which is the base (no second copy);
- otherwise: a frozen copy of the starting weights, made before training (one more copy of the weights).

The other objectives (sft, simpo, orpo) have none.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from cadence.config import TrainConfig
from cadence.engine.objective import Objective
from cadence.engine.reference import AdaptersOffReference, FrozenReference, Reference
from cadence.errors import UsageError
from cadence.models.heads import chunking_problem
from cadence.models.spec import ModelSpec


def reference_problem(config: TrainConfig, policy_vocab: int) -> str | None:
    """Why ``--reference-model`` cannot score this run's data (its vocabulary is not the policy's), found before
    anything is written; None when it can, or when there is none."""
    if config.reference_model is None:
        return None
    try:
        recorded = json.loads((Path(config.reference_model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{config.reference_model}/config.json cannot be read: {error}"
    vocab = recorded.get("vocab_size") if isinstance(recorded, dict) else None
    if vocab != policy_vocab:
        return (f"{config.reference_model} has a vocabulary of {vocab} tokens and {config.model} one of {policy_vocab}: "
                f"the reference must read the same token ids (the same tokenizer)")
    return None


def starting_copy(objective: Objective, config: TrainConfig, model: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen copy of the starting weights the objective needs (taken before recompute, compilation and wrapping
    change the model), or None where the reference is something else."""
    if not objective.needs_reference or config.reference_model is not None or config.lora_rank > 0:
        return None
    frozen = copy.deepcopy(model)
    frozen.requires_grad_(False)
    return frozen.eval()


def build_reference(objective: Objective, config: TrainConfig, *, policy: torch.nn.Module,
                    starting: torch.nn.Module | None, device: torch.device, vocab_size: int) -> Reference | None:
    """The objective's reference (see the module docstring); ``policy``: the model as the engine runs it (wrapped);
    ``starting``: :func:`starting_copy`'s copy."""
    if not objective.needs_reference:
        return None
    if config.reference_model is not None:
        with torch.random.fork_rng(devices=[]):  # its build draws an initialisation the weights then replace
            loaded = ModelSpec.from_flags({"model": str(config.reference_model)}).build(seed=config.seed).module
        loaded = loaded.to(device)
        loaded.requires_grad_(False)
        return FrozenReference(model=loaded.eval(), targets_only=chunking_problem(loaded, vocab_size) is None,
                               description=f"the model {config.reference_model} (frozen)")
    if config.lora_rank > 0:
        return AdaptersOffReference(policy=policy, targets_only=objective.preference is not None and
                                    objective.preference.targets_only)
    if starting is None:
        raise UsageError.single("--objective", f"{objective.name} needs the starting weights as its reference, and "
                                               f"no copy was made")
    return FrozenReference(model=starting, targets_only=chunking_problem(starting, vocab_size) is None)


__all__ = ["build_reference", "reference_problem", "starting_copy"]
