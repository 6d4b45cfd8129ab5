"""The memory estimate for transformers decoder models, from their shape (:class:`cadence.models.shape.ModelShape`)
and the style of their blocks.

The replay of a step is :mod:`cadence.memory.decoder_replay` (the blocks, the head, the model trained whole) and, under
``--lora-rank``, :mod:`cadence.memory.lora_replay` (the frozen base, in fp32, bf16 or nf4, and peft's adapters).
Calibrated against :func:`cadence.memory.measure.measure_step` on tiny llama and gpt2 configs (see
tests/memory/test_memory_estimate_hf.py). Which style a model's blocks are is the model's to say
(:attr:`cadence.models.spec.ModelSpec.estimator`): this module never guesses it from a name.
"""

from __future__ import annotations

from typing import Any

from cadence.memory.decoder_replay import BLOCK_STYLES, BlockStyle, DecoderReplay
from cadence.memory.estimate import ADAMW, MemoryEstimate, estimate_from_replay, input_problems
from cadence.memory.lora_replay import LoraDecoderReplay
from cadence.models.lora import LoraShape
from cadence.models.shape import ModelShape
from cadence.optim.spec import OptimizerSpec


def estimate_hf_step_memory(
    shape: ModelShape,
    *,
    style: BlockStyle,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    checkpointing: str,
    offload: str = "none",
    device_type: str = "cpu",
    grad_accum_steps: int = 1,
    loss_chunk_tokens: int = 0,
    target_tokens: int | None = None,
    optimizer: OptimizerSpec = ADAMW,
    lora: LoraShape | None = None,
    packed: bool = False,
    full_logits: bool = False,
) -> MemoryEstimate:
    """Predict the peak memory of one step of the transformers decoder ``shape`` describes, whose blocks are
    ``style`` (llama or gpt2), trained by the Engine; ``loss_chunk_tokens``, ``target_tokens``, ``optimizer``
    and ``full_logits`` as in :func:`cadence.memory.estimate.estimate_step_memory` (``loss_chunk_tokens`` 0: the
    target positions' logits only, every position counted as a target unless ``target_tokens`` says otherwise).
    ``lora``: the adapters --lora-rank injected (:func:`cadence.models.lora.lora_shape`; ``shape`` stays the base
    model's): the base is frozen (no gradient, no optimizer state, and no saved inputs where only a weight gradient
    needed them), the adapters are trained. ``packed``: rows hold several examples (``--packing``): transformers
    builds a block-diagonal mask for the forward, which cadence's attention
    (:mod:`cadence.models.packed_attention`, one causal SDPA per example) does not keep."""
    problems = input_problems(micro_batch_size=micro_batch_size, seq_len=seq_len, grad_accum_steps=grad_accum_steps,
                              context_length=shape.context_length, precision=precision,
                              checkpointing=checkpointing, offload=offload, loss_chunk_tokens=loss_chunk_tokens,
                              target_tokens=target_tokens, full_logits=full_logits)
    if style not in BLOCK_STYLES:
        problems.append(f"unknown block style {style!r} (one of {', '.join(BLOCK_STYLES)})")
    if not shape.num_heads or not shape.head_dim or not shape.intermediate_size:
        problems.append("the model's config gives no attention heads, head size or MLP width to estimate from")
    if problems:
        raise ValueError("; ".join(problems))
    on_device = device_type != "cpu"
    settings: dict[str, Any] = dict(
        tokens=micro_batch_size * seq_len, seq_len=seq_len, precision=precision, checkpointing=checkpointing,
        offload_activations=on_device and offload == "activations",
        offload_optimizer=on_device and offload == "optimizer", on_device=on_device,
        loss_chunk_tokens=loss_chunk_tokens, target_tokens=target_tokens, optimizer=optimizer,
        packed=packed, full_logits=full_logits,
    )
    replay = (DecoderReplay(shape, style, **settings) if lora is None
              else LoraDecoderReplay(shape, style, lora=lora, **settings))
    return estimate_from_replay(replay, grad_accum_steps=grad_accum_steps, precision=precision, offload=offload,
                                on_device=on_device)


__all__ = ["BLOCK_STYLES", "BlockStyle", "estimate_hf_step_memory"]
