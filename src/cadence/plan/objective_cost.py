"""What the training objective adds to a plan's estimates, and the preference reference's memory lever.

A preference objective runs two sequences per sample (a pair's chosen and rejected with gradients; a KTO example's
completion with gradients and its mismatched sequence in the window's no-gradient pass) and, for dpo, ipo and kto,
scores against a reference, whose cost depends on what it is (:class:`cadence.memory.estimate_for.ObjectiveCost`):

- under --lora-rank, the base with the adapters off: nothing;
- --reference-logprobs live (full fine-tuning): a frozen copy of the weights (the starting ones, or
  --reference-model's) held through every step;
- --reference-logprobs precomputed: the log-probabilities scored before training, kept in host memory (a key and a
  float per sequence): nothing on the device.

The plan lists the two modes of full fine-tuning as a lever: a candidate keeps the frozen copy (live) where its
estimate fits the budget, and takes the precomputed log-probabilities where only they make it fit (unless
--reference-logprobs was given). Both give the same losses (tests/engine/test_preference.py).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from cadence.config import TrainConfig
from cadence.engine.choices import ReferenceLogprobs
from cadence.engine.objective import Objective
from cadence.memory.estimate_for import SFT_COST, ObjectiveCost
from cadence.models.spec import ModelSpec

FP32_BYTES = 4


def reference_weight_bytes(config: TrainConfig, model: ModelSpec) -> int:
    """A frozen reference's weights: --reference-model's parameters, else the policy's (fp32, a tied head once)."""
    reference = config.reference_model
    shape = model.shape if reference is None else ModelSpec.from_flags({"model": str(Path(reference))}).shape
    return shape.num_parameters * FP32_BYTES


def objective_cost(config: TrainConfig, model: ModelSpec, mode: ReferenceLogprobs | None = None) -> ObjectiveCost:
    """The objective's cost for ``config`` (``mode``: the reference's, default the config's)."""
    objective = Objective.from_flags(config)
    if objective.name == "sft":
        return SFT_COST
    graph_rows = 1 if objective.name == "kto" else 2
    if not objective.needs_reference or config.lora_rank > 0:
        what = "" if not objective.needs_reference else "the base with the LoRA adapters off: no copy"
        return ObjectiveCost(graph_rows=graph_rows, input_rows=2, held_what=what)
    if (mode or config.reference_logprobs) == "precomputed":
        return ObjectiveCost(graph_rows=graph_rows, input_rows=2,
                             held_what="precomputed log-probabilities, in host memory")
    return ObjectiveCost(graph_rows=graph_rows, input_rows=2, held_bytes=reference_weight_bytes(config, model),
                         held_what="a frozen copy of the reference's weights")


def reference_modes(config: TrainConfig, constrained: Collection[str]) -> list[ReferenceLogprobs]:
    """The reference modes a plan may choose between: live then precomputed for a reference objective in full
    fine-tuning where --reference-logprobs was not given; else the config's alone."""
    objective = Objective.from_flags(config)
    if "reference_logprobs" in constrained or not objective.needs_reference or config.lora_rank > 0:
        return [config.reference_logprobs]
    return ["live", "precomputed"]


__all__ = ["objective_cost", "reference_modes", "reference_weight_bytes"]
