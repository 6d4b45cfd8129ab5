"""What a model family is to cadence, and what one built model of it is.

A family (the built-in GPT, transformers' causal LMs, ...) is a :class:`ModelFamily`: how ``--model`` names its
models, the flags it does not take, what a named model is without its weights (:class:`Resolved`: its shape, what it
supports, which memory estimator replays its step) and how it is built (:class:`BuiltModel`).
:class:`cadence.models.spec.ModelSpec` is the one value the rest of cadence holds; the registry of families is
:data:`cadence.models.spec.FAMILIES`. Nothing outside ``models/`` asks which family a model is: it asks the spec what
the model is and supports (``tests/test_architecture.py`` keeps it so).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from torch import nn

from cadence.models.lora import LoraSettings, LoraShape
from cadence.models.pretrained import PretrainedFiles
from cadence.models.shape import ModelShape

PackingKernel = Literal["per-example", "dense-mask", "none"]
"""How packed rows (``--packing``) attend: each example on its own (``per-example``), through transformers' dense
block mask over whole rows (``dense-mask``: right, but it can be slower than by-length rows), or not kept apart at all
(``none``: --packing is refused)."""

Estimator = str
"""The name of a memory estimator (``gpt``, the built-in GPT's replay; ``llama`` and ``gpt2``, the decoder replay of
those blocks: ``cadence.memory.estimate_for.ESTIMATORS``; any other NAME: the module ``cadence.memory.estimate_NAME``).
A name, not a closed list here: a new estimator is its replay in memory/ and the family that names it, nothing in
between."""


@dataclass(frozen=True, kw_only=True)
class Supports:
    """The cadence features that depend on a model's code, and what the model offers each."""

    packing: PackingKernel
    """How packed rows attend (:data:`PackingKernel`)."""
    packing_problem: str | None = None
    """Why packed examples would not be kept apart (``packing`` none), in words that follow --packing."""
    attention: str
    """The attention the model runs, in words (for a note on how packed rows go)."""
    blocks: int
    """Repeated blocks: the units of recompute (--activation-checkpointing), of --compile and of FSDP2's sharding;
    0 when the model keeps none cadence can find (``blocks_problem`` says why)."""
    blocks_problem: str | None = None
    nf4_linears: tuple[int, ...] = ()
    """Weight elements of each layer an nf4 base (--lora-base-precision nf4) holds in 4 bits: the ``nn.Linear``
    layers of the blocks; () where there are none (gpt2's Conv1D) or the family takes no LoRA."""
    nf4_bias_elements: int = 0
    """Bias elements of those layers, held in the compute dtype (bf16 under --precision bf16)."""
    bf16_base_elements: int = 0
    """Frozen linear-layer elements a bf16 base (--lora-base-precision bf16) holds in bf16."""


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What a named model is, known without its weights (a transformers model is built on the meta device)."""

    architecture: str
    """The model's class: GPT, LlamaForCausalLM, MambaForCausalLM, ..."""
    shape: ModelShape
    supports: Supports
    estimator: Estimator | None
    """The memory estimator that replays this model's step; None: none does (``no_estimate`` says why)."""
    no_estimate: str | None
    """Why there is no memory estimate, in one line naming the architecture; None when there is one."""
    matmul_weights: int
    """Weights every token multiplies through (the blocks' matmuls and the head; for the built-in GPT its norms and
    biases too, as the FLOP count has always counted them): MFU's 6N."""
    adapters: LoraShape | None
    """The LoRA adapters --lora-rank injects, on a full-precision base; None without LoRA."""


@dataclass(kw_only=True)
class BuiltModel:
    """One built model with its initial weights, and what the run needs beside it."""

    module: nn.Module
    """What the engine trains: the built-in GPT, or a transformers ``PreTrainedModel`` (LoRA adapters injected in
    place); fp32 parameters on the CPU. Called with ``input_ids``; its output is the logits, or has ``.logits``."""
    tokenizer: Any | None
    """The tokenizer the data is read with (a transformers tokenizer found next to a model directory), or None: bytes."""
    vocab_size: int
    pending: PretrainedFiles | None = None
    """Set when the parameters are still on the meta device (FSDP2: each rank reads its own shard of these files
    once the model is sharded, :func:`cadence.models.pretrained.load_shards`)."""
    twin: nn.Module | None = None
    """A pending model's small stand-in for the checks that run a forward (:attr:`probe`)."""
    notes: list[str] = field(default_factory=list)
    """Things worth telling the user (dropout left on, weights a checkpoint lacked)."""

    @property
    def probe(self) -> tuple[nn.Module, int]:
        """What a check that runs a forward runs (the output-head probe of
        :func:`cadence.models.heads.chunking_problem`), with its vocabulary size: the model itself, or a pending
        model's twin of one layer and a small vocabulary. The verdicts depend on the family's code and settings, not
        on the weights or the depth."""
        if self.twin is not None:
            return self.twin, int(getattr(self.twin, "config").vocab_size)  # a transformers model's config
        return self.module, self.vocab_size


class ModelFamily(ABC):
    """One family of models (see the module docstring). Subclasses are the registry's entries; each is stateless."""

    key: ClassVar[str]
    """The family's name in a :class:`~cadence.models.spec.ModelSpec` (``spec.family``), in words."""
    offered: ClassVar[str]
    """How the message for an unknown --model names this family's models ("built-in models are ...")."""
    refuses: ClassVar[Mapping[str, str]] = {}
    """The features (:data:`cadence.models.spec.FEATURES`) this family does not take, each with the message that
    refuses its flag (``{model}``: the --model given)."""
    exports_pretrained: ClassVar[bool] = False
    """Whether a run of it can be written as a ``save_pretrained`` directory (--save-hf, ``cadence export``)."""

    @abstractmethod
    def claims(self, name: str) -> bool:
        """Whether --model ``name`` names one of this family's models."""

    def pretrained(self, name: str) -> bool:
        """Whether the model starts from trained weights read from files (not a random initialisation)."""
        return False

    def context_length(self, name: str) -> int | None:
        """The longest sequence the model accepts when it is known from its name alone (None: once resolved)."""
        return None

    def data_tokenizer(self, name: str) -> Any | None:
        """The tokenizer the model reads its data with, without building the model (None: bytes)."""
        return None

    @abstractmethod
    def resolve(self, name: str, overrides: tuple[str, ...], lora: LoraSettings | None) -> Resolved:
        """What the model is without its weights; bad --model, --model-config or LoRA flags are a UsageError."""

    @abstractmethod
    def build(self, name: str, overrides: tuple[str, ...], lora: LoraSettings | None, *, seed: int, precision: str,
              base_precision: str, shard_later: bool, warn: bool) -> BuiltModel:
        """The model with the seed's initial weights (LoRA adapters injected, the base held in ``base_precision``,
        an nf4 base computing in ``precision``); ``shard_later``: a model whose weights FSDP2 reads shard by shard is
        left on the meta device; ``warn``: its notes said as warnings."""


__all__ = ["BuiltModel", "Estimator", "ModelFamily", "PackingKernel", "Resolved", "Supports"]
