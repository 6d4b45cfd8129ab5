"""Activation checkpointing (recompute): trade compute for activation memory, block by block.

Modes:
- ``none``: every block keeps what autograd saves for backward.
- ``full``: each transformer block keeps only its input; its whole forward runs again during backward.
- ``selective``: each block keeps the outputs of its expensive ops (matrix multiplies and attention) and recomputes
  only the cheap ones (layer norms, GELU, residual adds, reshapes). Those cheap ops' saved tensors are as large as the
  matmul outputs but cost almost nothing to recompute, so this saves memory at a few percent of extra time, where
  ``full`` saves most activation memory at about one extra forward per step.

Recomputation uses ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: it works with autocast, with inputs
that do not require grad and with keyword arguments, and gives gradients identical to no checkpointing in fp32.
The blocks' ``forward`` is replaced on the instance (not wrapped in a new module), so parameter names and
``state_dict`` keys stay exactly as the model has them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cadence.memory.choices import CHECKPOINTING_MODES, CheckpointingMode
from cadence.models.blocks import repeated_blocks


def _expensive_ops() -> frozenset[Any]:
    """ATen ops whose outputs selective checkpointing keeps: matmuls and every attention kernel variant."""
    names = [
        "mm", "addmm", "bmm", "baddbmm", "linear",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "scaled_dot_product_attention",
    ]
    ops = [getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)]
    return frozenset(ops)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _EXPENSIVE else CheckpointPolicy.PREFER_RECOMPUTE


_EXPENSIVE = _expensive_ops()


checkpoint_blocks = repeated_blocks
"""The blocks checkpointing wraps: ``model.blocks`` (built-in GPT) or a Hugging Face layer list (the finder lives in
:mod:`cadence.models.blocks`, shared with torch.compile; this name stays for its callers)."""


def apply_activation_checkpointing(model: nn.Module, mode: CheckpointingMode) -> int:
    """Make each block of ``model`` recompute its activations in backward; returns the number of blocks changed."""
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}; expected one of {CHECKPOINTING_MODES}")
    if mode == "none":
        return 0
    blocks = checkpoint_blocks(model)
    for block in blocks:
        if getattr(block, "_cadence_checkpointing", None) is not None:
            raise ValueError("activation checkpointing is already applied to this model")
        block.forward = _checkpointed(block.forward, mode)
        setattr(block, "_cadence_checkpointing", mode)  # a mark, not a tensor or module (all nn.Module's type takes)
    return len(blocks)


def _checkpointed(forward: Callable[..., Any], mode: CheckpointingMode) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward, nothing to recompute
            return forward(*args, **kwargs)
        if mode == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
