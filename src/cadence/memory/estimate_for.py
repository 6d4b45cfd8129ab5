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
from dataclasses import dataclass, replace
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


@dataclass(frozen=True, kw_only=True)
class ObjectiveCost:
    """What the training objective adds to a step's memory (the model's replay knows the sft step only).

    A preference objective runs two sequences per sample: a pair's chosen and rejected through the policy with
    gradients (``graph_rows`` 2); a KTO example's completion with gradients and its mismatched sequence only in the
    window's no-gradient pass (``graph_rows`` 1, ``input_rows`` 2). The reference scores each micro-batch before the
    policy's forward, so its activations are gone before the policy's graph exists: what it adds to the peak is what
    it holds through the step, ``held_bytes``: a frozen copy's weights (full fine-tuning, or --reference-model), 0 for
    the base with the LoRA adapters off, a key and a float per row for precomputed log-probabilities."""

    graph_rows: int = 1
    """Rows per sample that run through the policy with gradients."""
    input_rows: int = 1
    """Rows per sample in a micro-batch's token ids and labels."""
    held_bytes: int = 0
    """Bytes the objective holds through the step besides the model (the reference)."""
    held_what: str = ""
    """What they are, in words (the estimate's note)."""


SFT_COST = ObjectiveCost()
"""Next-token cross-entropy: one row per sample, nothing held."""


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
                 packed: bool = False, target_tokens: int | None = None, full_logits: bool = False,
                 objective: ObjectiveCost = SFT_COST) -> MemoryEstimate:
    """The estimated peak of one step of ``spec``'s model trained so (the options as in
    :func:`cadence.memory.estimate.estimate_step_memory`; ``optimizer``: the run's optimizer and the state it keeps,
    ``OptimizerSpec.with_state`` for a plan's candidate); ``lora_base_precision``: the base LoRA's adapters sit on
    (fp32, bf16 or nf4; None: fp32), ``packed``: rows hold several examples (--packing). A model without an estimate
    is a UsageError naming --model (:func:`estimate_problem`). ``objective``: what the training objective adds
    (:class:`ObjectiveCost`; ``micro_batch_size`` counts samples, a preference pair one)."""
    problem = estimate_problem(spec)
    if problem is not None:
        raise UsageError.single("--model", problem)
    replay = replay_for(str(spec.estimator))
    estimate = replay(spec, packed=packed, lora_base_precision=lora_base_precision,
                      micro_batch_size=micro_batch_size * objective.graph_rows, seq_len=seq_len, precision=precision,
                      checkpointing=checkpointing, offload=offload, device_type=device_type,
                      grad_accum_steps=grad_accum_steps, loss_chunk_tokens=loss_chunk_tokens, optimizer=optimizer,
                      target_tokens=None if target_tokens is None else target_tokens * objective.graph_rows,
                      full_logits=full_logits)
    return with_objective(estimate, objective, micro_batch_size=micro_batch_size, seq_len=seq_len,
                          grad_accum_steps=grad_accum_steps, on_device=device_type != "cpu")


def with_objective(estimate: MemoryEstimate, objective: ObjectiveCost, *, micro_batch_size: int, seq_len: int,
                   grad_accum_steps: int, on_device: bool) -> MemoryEstimate:
    """``estimate`` (of ``graph_rows`` rows per sample) with what else the objective holds: the rows that run without
    gradients only (int64 ids and labels: the window's on cpu, where it sits whole in memory; the micro-batch's on a
    device) and the reference's bytes, counted as parameters."""
    extra_rows = (objective.input_rows - objective.graph_rows) * micro_batch_size
    inputs = extra_rows * seq_len * 2 * 8 * (1 if on_device else grad_accum_steps)
    if not inputs and not objective.held_bytes:
        return estimate
    by_category = dict(estimate.by_category)
    by_category["inputs"] = by_category.get("inputs", 0) + inputs
    by_category["parameters"] = by_category.get("parameters", 0) + objective.held_bytes
    notes = list(estimate.notes)
    if objective.held_bytes:
        notes.append(f"the reference holds {objective.held_bytes:,} bytes through the step ({objective.held_what}), "
                     f"counted with the parameters")
    return replace(estimate, peak_bytes=estimate.peak_bytes + inputs + objective.held_bytes, by_category=by_category,
                   notes=notes)


__all__ = ["ESTIMATORS", "REPLAY_MODULE", "SFT_COST", "ObjectiveCost", "with_objective", "WITHOUT_AN_ESTIMATE", "estimate_for", "estimate_problem", "replay_for"]
