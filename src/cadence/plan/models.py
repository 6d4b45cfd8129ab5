"""The model a plan is about, built in or Hugging Face: its memory estimate, size, and fresh seeded copies.

``cadence plan`` estimates every candidate and builds a new model for every trial and for the quality check. A built-in
model is estimated from :data:`cadence.models.MODEL_CONFIGS`; a Hugging Face one (``--model hf:TYPE`` with
``--model-config``, or a model directory) is built once to read its :class:`~cadence.models.hf.ModelShape`, and again,
seeded, whenever a trial needs one, so every trial starts from the same weights, as ``cadence train`` would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from cadence.config import TrainConfig
from cadence.memory.estimate import MemoryEstimate, estimate_step_memory
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.models import MODEL_CONFIGS, MODEL_NAMES, build_model, model_context_length
from cadence.models.hf import HFModel, ModelShape
from cadence.models.lora import LoraShape, planned_nf4
from cadence.optim.choices import OptimizerStateName
from cadence.optim.spec import OptimizerSpec
from cadence.training.prepare import build_run_hf


def is_built_in(config: TrainConfig) -> bool:
    return config.model in MODEL_NAMES


@dataclass(kw_only=True)
class PlanModel:
    """What a plan needs to know about its model."""

    config: TrainConfig
    shape: ModelShape | None  # None: a built-in model
    model_type: str | None
    num_parameters: int
    context_length: int
    tokenizer: Any | None = None
    hf: HFModel | None = None
    """The model built to read the shape (used for loading data with its tokenizer)."""

    def estimate(self, *, micro_batch_size: int, seq_len: int, precision: str, checkpointing: str,
                 offload: str = "none", device_type: str = "cpu", grad_accum_steps: int = 1,
                 loss_chunk_tokens: int = 0, optimizer_state: OptimizerStateName = "fp32",
                 lora_base_precision: str | None = None) -> MemoryEstimate:
        """The estimated step of one candidate; ``optimizer_state``: the state the candidate stores the run's optimizer
        in (the plan's lossy lever; the optimizer itself is the user's); ``lora_base_precision``: the base a
        candidate holds under LoRA (default: the configuration's)."""
        options: dict[str, Any] = {
            "micro_batch_size": micro_batch_size, "seq_len": seq_len, "precision": precision,
            "checkpointing": checkpointing, "offload": offload, "device_type": device_type,
            "grad_accum_steps": grad_accum_steps, "loss_chunk_tokens": loss_chunk_tokens,
            "optimizer": OptimizerSpec.from_flags(self.config).with_state(optimizer_state),
        }
        if self.shape is None:
            return estimate_step_memory(MODEL_CONFIGS[self.config.model], **options)
        # --lora-rank: the frozen base has no gradient and no optimizer state; the adapters have both.
        lora = self.lora(lora_base_precision)
        # --packing: transformers masks attention block by block, which repeats k and v to the query heads.
        return estimate_hf_step_memory(self.shape, model_type=str(self.model_type), lora=lora,
                                       packed=self.config.packing, **options)

    def lora(self, base_precision: str | None = None) -> LoraShape | None:
        """The adapters as the estimate sees them, with the frozen base held in ``base_precision`` (default: as built).
        An nf4 base is counted from the layers quantisation would replace, so a plan estimates it without building
        it; the rest of the base (embeddings, norms, head) then stays fp32, as the nf4 build leaves it."""
        lora = self.hf.lora if self.hf is not None else None
        if lora is None or base_precision != "nf4" or self.config.lora_base_precision == "nf4":
            return lora  # as built
        return dataclasses.replace(planned_nf4(lora, self.hf.model), bf16_base_parameters=0)  # type: ignore[union-attr]

    def nf4_layers(self) -> int:
        """Weight elements an nf4 base would hold in 4 bits (the blocks' linear layers); 0 for a built-in model or one
        whose blocks have none (gpt2's Conv1D)."""
        lora = self.lora("nf4")
        return lora.nf4_base_parameters if lora is not None else 0

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size if self.shape is not None else MODEL_CONFIGS[self.config.model].vocab_size

    @property
    def embedding_bytes(self) -> int:
        """fp32 bytes of the token embedding (vocabulary x width): the largest tensor of a model with a large
        vocabulary, whose gradient accumulation would hold twice if the engine did not add it straight into
        ``.grad`` (cadence.memory.grad_in_place)."""
        width = self.shape.hidden_size if self.shape is not None else MODEL_CONFIGS[self.config.model].n_embd
        return self.vocab_size * width * 4

    def build(self, **changes: Any) -> torch.nn.Module:
        """A fresh model with the seed's initial weights; ``changes``: TrainConfig fields that change the build (a
        candidate's --lora-base-precision and the --precision its nf4 layers compute in)."""
        hf = build_run_hf(dataclasses.replace(self.config, **changes), warn=False)
        if hf is not None:
            return hf.model
        torch.manual_seed(self.config.seed)
        return build_model(self.config.model)


def plan_model(config: TrainConfig, *, hf: HFModel | None = None) -> PlanModel:
    """What the plan needs of ``config``'s model; ``hf``: the Hugging Face model the run already built, if any."""
    if is_built_in(config):
        return PlanModel(config=config, shape=None, model_type=None,
                         num_parameters=MODEL_CONFIGS[config.model].num_parameters(),
                         context_length=model_context_length(config.model))
    hf = hf or build_run_hf(config, warn=False)
    if hf is None:
        raise ValueError(f"{config.model} is neither a built-in model nor a Hugging Face one")
    return PlanModel(config=config, shape=hf.shape, model_type=str(getattr(hf.config, "model_type", "")),
                     num_parameters=hf.shape.num_parameters, context_length=hf.context_length,
                     tokenizer=hf.tokenizer, hf=hf)
