"""The next-token loss of a causal LM over its whole logits, and the inputs a padded batch gives the model.

``token_cross_entropy_sum`` is the ``Engine``'s own default way of computing the ``sft`` objective's loss sum
(:mod:`cadence.engine.objective`); the targets-only and chunked ways (:mod:`cadence.engine.chunked_loss`) run the same
forward through :func:`attention_inputs`. A module of its own so that the objective, the chunked loss and the step
chain all read these without importing each other.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cadence.engine.windows import IGNORE_INDEX, Batch

LossFn = Callable[[torch.nn.Module, Batch], torch.Tensor]
"""``loss_fn(model, micro_batch)`` returns the SUM of per-target losses of the micro-batch (a scalar tensor)."""


def token_cross_entropy_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over targets (labels != -100) of a causal LM that returns logits [B, T, V].

    cadence's convention: ``labels[t]`` is the target of position t (the token after ``input_ids[t]``); for Hugging
    Face style labels (equal to ``input_ids``) build the windows with ``hf_labels=True``. When the batch has an
    ``attention_mask`` it is passed to the model, with ``position_ids`` counted from each row's first real token
    (as ``transformers`` does when generating), so that left padding gives every example the positions it has
    alone; ``position_ids`` in the batch are passed as they are."""
    logits = model(batch["input_ids"], **attention_inputs(model, batch))
    if not isinstance(logits, torch.Tensor):  # Hugging Face style outputs
        logits = logits.logits
    # The loss is computed in fp32 even under autocast: a sum over thousands of targets in bf16 loses digits.
    return F.cross_entropy(
        logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def reads_next_token_labels(loss_fn: LossFn) -> bool:
    """Whether ``loss_fn`` is one of cadence's next-token losses (``labels[t]`` is the target of position t):
    ``token_cross_entropy_sum``, or a loss marked with ``next_token_labels = True`` (the chunked loss)."""
    return loss_fn is token_cross_entropy_sum or bool(getattr(loss_fn, "next_token_labels", False))


def attention_inputs(model: torch.nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """The keyword inputs a padded batch needs beyond ``input_ids``, for a model whose forward takes them: none for
    cadence's right-padded batches, nor for a model that only takes ``input_ids`` (the built-in GPT, which a right-
    padded causal batch needs no mask for)."""
    if "attention_mask" not in batch and "position_ids" not in batch:
        return {}
    accepted = _keyword_inputs(type(_innermost(model)).forward)
    mask = batch.get("attention_mask") if "attention_mask" in accepted else None
    if mask is None:
        return {key: batch[key] for key in ("position_ids",) if key in batch and key in accepted}
    positions = batch.get("position_ids")
    if positions is None:
        # Left padding: without this, an absolute-position model (gpt2) would see a padded row's tokens at the
        # positions after its pads, not at 0, 1, 2... (padded positions get 1: they are masked out anyway).
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return {"attention_mask": mask, "position_ids": positions}


def _innermost(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP (``.module``) or torch.compile (``._orig_mod``) wrappers, whose forward
    passes every keyword on."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


@functools.lru_cache(maxsize=64)
def _keyword_inputs(forward: Callable[..., object]) -> frozenset[str]:
    """The keyword inputs a module class's ``forward`` takes (``attention_mask``, ``position_ids`` when it takes
    ``**kwargs``). Cached per class's forward: the signature does not change, and this runs for every micro-batch."""
    wanted = ("attention_mask", "position_ids")
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset(wanted)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset(wanted)
    return frozenset(p.name for p in parameters if p.name in wanted)


__all__ = ["LossFn", "attention_inputs", "reads_next_token_labels", "token_cross_entropy_sum"]
