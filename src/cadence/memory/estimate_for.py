"""The memory estimate of one step of any model: the one entry point, chosen by the model's own estimator.

A :class:`cadence.models.spec.ModelSpec` says which replay knows its step (``spec.estimator``): the built-in GPT's
(:mod:`cadence.memory.estimate`) or the decoder replay of llama-style or gpt2-style blocks
(:mod:`cadence.memory.estimate_hf`). A model no replay knows (a Mamba mixer, a hybrid of attention and recurrent
layers, mixture-of-experts MLPs) is refused with one line naming its architecture and why: it is never estimated as
something it is not. Without an estimate a step's memory can still be measured (``cadence train --micro-batch-size
auto --memory-budget SIZE`` measures it), but ``cadence plan``, which ranks its candidates by this estimate, stops.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from cadence.errors import UsageError
from cadence.memory.estimate import ADAMW, MemoryEstimate, estimate_step_memory
from cadence.memory.estimate_hf import BlockStyle, estimate_hf_step_memory
from cadence.models.gpt import GPTConfig
from cadence.models.spec import ModelSpec
from cadence.optim.spec import OptimizerSpec

WITHOUT_AN_ESTIMATE = ("without an estimate a step's memory can only be measured: cadence train --micro-batch-size auto "
                       "--memory-budget SIZE measures it")
"""What the refusal says to do instead."""


def estimate_problem(spec: ModelSpec) -> str | None:
    """Why there is no memory estimate for ``spec``'s model (one line naming its architecture), or None."""
    if spec.estimator is None:
        return f"{spec.no_estimate}; {WITHOUT_AN_ESTIMATE}"
    return None


def _gpt(spec: ModelSpec, *, packed: bool, lora_base_precision: str | None, **options: Any) -> MemoryEstimate:
    # The built-in GPT attends packed rows example by example and holds no more than plain causal attention (its
    # attention's docstring), and takes no LoRA: both options change nothing here.
    shape = spec.shape
    config = GPTConfig(vocab_size=shape.vocab_size, context_length=shape.context_length, n_layer=shape.num_layers,
                       n_head=int(shape.num_heads or 1), n_embd=shape.hidden_size)
    return estimate_step_memory(config, **options)


def _decoder(style: BlockStyle) -> Callable[..., MemoryEstimate]:
    def replay(spec: ModelSpec, *, packed: bool, lora_base_precision: str | None, **options: Any) -> MemoryEstimate:
        lora = spec.adapters_for(lora_base_precision or "fp32", str(options["precision"]))
        return estimate_hf_step_memory(spec.shape, style=style, lora=lora, packed=packed, **options)

    return replay


ESTIMATORS: dict[str, Callable[..., MemoryEstimate]] = {"gpt": _gpt, "llama": _decoder("llama"),
                                                        "gpt2": _decoder("gpt2")}
"""The replays of the estimators cadence ships with, by the name a model gives
(:data:`cadence.models.family.Estimator`). Any other name is a replay module of its own (:func:`replay_for`)."""
REPLAY_MODULE = "cadence.memory.estimate_{}"
"""Where the replay of an estimator named NAME outside :data:`ESTIMATORS` is: that module's ``replay`` function, called
as :func:`estimate_for` calls a replay (the spec, then its keywords). So a new replay is one module in memory/ and
the family naming it; nothing here changes."""


def replay_for(estimator: str) -> Callable[..., MemoryEstimate]:
    """The replay of ``estimator``: one of :data:`ESTIMATORS`, or its own module's (:data:`REPLAY_MODULE`)."""
    known = ESTIMATORS.get(estimator)
    if known is not None:
        return known
    replay: Callable[..., MemoryEstimate] = importlib.import_module(REPLAY_MODULE.format(estimator)).replay
    return replay


def estimate_for(spec: ModelSpec, *, micro_batch_size: int, seq_len: int, precision: str, checkpointing: str,
                 offload: str = "none", device_type: str = "cpu", grad_accum_steps: int = 1,
                 loss_chunk_tokens: int = 0, optimizer: OptimizerSpec = ADAMW, lora_base_precision: str | None = None,
                 packed: bool = False, target_tokens: int | None = None, full_logits: bool = False) -> MemoryEstimate:
    """The estimated peak of one step of ``spec``'s model trained so (the options as in
    :func:`cadence.memory.estimate.estimate_step_memory`; ``optimizer``: the run's optimizer and the state it keeps,
    ``OptimizerSpec.with_state`` for a plan's candidate); ``lora_base_precision``: the base LoRA's adapters sit on
    (fp32, bf16 or nf4; None: fp32), ``packed``: rows hold several examples (--packing). A model without an estimate
    is a UsageError naming --model (:func:`estimate_problem`)."""
    problem = estimate_problem(spec)
    if problem is not None:
        raise UsageError.single("--model", problem)
    replay = replay_for(str(spec.estimator))
    return replay(spec, packed=packed, lora_base_precision=lora_base_precision, micro_batch_size=micro_batch_size,
                  seq_len=seq_len, precision=precision, checkpointing=checkpointing, offload=offload,
                  device_type=device_type, grad_accum_steps=grad_accum_steps, loss_chunk_tokens=loss_chunk_tokens,
                  optimizer=optimizer, target_tokens=target_tokens, full_logits=full_logits)


__all__ = ["ESTIMATORS", "REPLAY_MODULE", "WITHOUT_AN_ESTIMATE", "estimate_for", "estimate_problem", "replay_for"]
