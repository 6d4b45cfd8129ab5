"""The reference model of a preference objective (DPO, IPO, KTO) and the per-sequence log-probabilities both it and
the policy are scored by.

A reference only ever answers one question, without gradients: the summed log-probability of each row's targets
(:func:`row_logps`). Where it comes from costs very different memory, so it is one of two values:

- :class:`FrozenReference`: a model of its own, frozen (the policy's starting weights copied before training, or
  ``--reference-model DIR``): one more copy of the weights;
- :class:`AdaptersOffReference`: under LoRA, the policy itself with its adapters turned off (peft's
  ``enable_adapters(False)`` around the forward): the base the adapters were added to, no copy at all;
- :class:`PrecomputedReference`: for full fine-tuning, the log-probabilities a reference computed once before
  training (``--reference-logprobs precomputed``, :mod:`cadence.data.reference_logps`), looked up by each row's key:
  no model at all, a key and a float per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cadence.data.reference_logps import ReferenceLogps, row_keys
from cadence.engine.chunked_loss import target_losses
from cadence.engine.token_loss import attention_inputs
from cadence.engine.windows import IGNORE_INDEX, Batch
from cadence.memory.meter import tensor_bytes
from cadence.models.lora import adapters_disabled


def row_logps(model: torch.nn.Module, batch: Batch, *, targets_only: bool, chunk_tokens: int | None = None
              ) -> torch.Tensor:
    """Each row's summed next-token log-probability over its targets (labels != -100), fp32 ([rows]).

    ``targets_only``: the head on the target positions only (:func:`cadence.engine.chunked_loss.target_losses`,
    ``chunk_tokens`` at a time; the model can be split at its head), else every position's logits. A row without a
    target scores 0."""
    labels = batch["labels"]
    rows, width = labels.shape
    if targets_only:
        losses, positions = target_losses(model, batch, chunk_tokens)
        # Each target's loss added into its row: the rows' sums in one scatter (no host sync, any number of rows).
        return torch.zeros(rows, dtype=torch.float32, device=losses.device).index_add(
            0, torch.div(positions, width, rounding_mode="floor"), -losses)
    logits = model(batch["input_ids"], **attention_inputs(model, batch))
    if not isinstance(logits, torch.Tensor):  # Hugging Face style outputs
        logits = logits.logits
    # fp32, as the token loss: a sum of log-probabilities over hundreds of tokens in bf16 loses digits.
    per_position = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="none")
    return -per_position.view(rows, width).sum(1)


def inference_module(model: torch.nn.Module) -> torch.nn.Module:
    """What a no-gradient forward runs: the module inside DDP (whose forward would broadcast buffers, a collective
    the ranks need not agree on here); FSDP2's sharded model as it is (its forward gathers the shards)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class Reference(Protocol):
    """The reference model's summed log-probabilities of a micro-batch's rows."""

    @property
    def description(self) -> str:
        """In words, for the console and the reports (read-only: the references are frozen values)."""

    @property
    def held_bytes(self) -> int:
        """The memory the reference holds of its own (a frozen model's weights; 0 for the policy's adapters off)."""

    def row_logps(self, batch: Batch) -> torch.Tensor:
        """[rows] fp32, without gradients."""


@dataclass(frozen=True)
class FrozenReference:
    """A model of its own, frozen: the starting weights copied before training, or another model's."""

    model: torch.nn.Module
    targets_only: bool
    description: str = "a frozen copy of the starting weights"

    @property
    def held_bytes(self) -> int:
        return tensor_bytes([*self.model.parameters(), *self.model.buffers()])

    def row_logps(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            return row_logps(self.model, batch, targets_only=self.targets_only)


@dataclass(frozen=True)
class AdaptersOffReference:
    """Under LoRA: the policy with its adapters turned off, which is the base model (no second copy in memory)."""

    policy: torch.nn.Module
    targets_only: bool
    description: str = "the base model (the LoRA adapters turned off; no copy)"
    held_bytes: int = 0

    def row_logps(self, batch: Batch) -> torch.Tensor:
        with torch.no_grad(), adapters_disabled(self.policy):
            return row_logps(inference_module(self.policy), batch, targets_only=self.targets_only)


@dataclass(frozen=True)
class PrecomputedReference:
    """The reference's log-probabilities computed before training, looked up by row key (no model in memory)."""

    record: ReferenceLogps
    description: str = "the starting weights' log-probabilities, computed before training (no model in memory)"

    @property
    def held_bytes(self) -> int:
        return self.record.held_bytes

    def row_logps(self, batch: Batch) -> torch.Tensor:
        keys = row_keys(batch["input_ids"], batch["labels"])
        missing = self.record.missing(keys)
        if missing:  # the pass before training scored every row of the splits: a row from elsewhere
            raise RuntimeError(f"{len(missing)} rows of this micro-batch have no precomputed reference "
                               f"log-probability (they are not rows of the run's splits)")
        values = [0.0 if key is None else self.record.logps[key] for key in keys]
        return torch.tensor(values, dtype=torch.float32, device=batch["labels"].device)


__all__ = ["AdaptersOffReference", "FrozenReference", "PrecomputedReference", "Reference", "inference_module",
           "row_logps"]
