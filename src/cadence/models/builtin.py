"""The built-in byte-level GPT as a model family: ``--model gpt-tiny`` (or ``gpt-small``, ``gpt-base``).

Everything about it is known from its name (:data:`cadence.models.gpt.MODEL_CONFIGS`): its shape, its context, that
its blocks are the ``blocks`` list and its packed rows attend example by example. It trains whole, with its own
weights file: no --model-config, no LoRA or nf4 base, no transformers export.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from cadence.errors import UsageError
from cadence.models.family import BuiltModel, ModelFamily, Resolved, Supports
from cadence.models.gpt import GPT, MODEL_CONFIGS, GPTConfig
from cadence.models.lora import LoraSettings
from cadence.models.shape import ModelShape

MODEL_NAMES: tuple[str, ...] = tuple(MODEL_CONFIGS)
"""Names accepted by ``--model`` for the built-in GPT, smallest first."""


def gpt_config(name: str) -> GPTConfig:
    """A built-in model's config, naming ``--model`` when the name is unknown."""
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise UsageError.single(
            "--model", f"unknown model {name!r}; built-in models are {', '.join(MODEL_NAMES)}"
        ) from None


def gpt_shape(config: GPTConfig) -> ModelShape:
    """The built-in GPT's sizes as every family reports them."""
    return ModelShape(num_layers=config.n_layer, hidden_size=config.n_embd, num_heads=config.n_head,
                      num_kv_heads=config.n_head, head_dim=config.head_dim, intermediate_size=4 * config.n_embd,
                      vocab_size=config.vocab_size, context_length=config.context_length,
                      num_parameters=config.num_parameters(), tied_embeddings=True)


def gpt_matmul_weights(config: GPTConfig) -> int:
    """What PaLM's 6N counts for the built-in GPT (:func:`cadence.profiling.flops.model_flops_per_token`): each
    block's qkv, projection and 4x MLP weights with their biases and both norms, the tied head, the final norm."""
    per_block = 12 * config.n_embd * config.n_embd + 13 * config.n_embd
    return config.n_layer * per_block + config.vocab_size * config.n_embd + 2 * config.n_embd


class BuiltInGPT(ModelFamily):
    """The built-in GPT (see the module docstring)."""

    key = "built-in"
    offered = f"built-in models are {', '.join(MODEL_NAMES)}"
    refuses: ClassVar[dict[str, str]] = {
        "model_config": "overrides a Hugging Face model's config; {model} is built in",
        "save_hf": "saves Hugging Face models; {model} is built in (its weights are in model.safetensors)",
        "lora": ("LoRA adapts Hugging Face models (hf:TYPE or a model directory, with peft); {model} is built in and "
                 "trains whole (drop --lora-rank)"),
        "nf4": "nf4 quantises a Hugging Face model's linear layers; {model} is built in",
        # Its block-diagonal attention splits each row at its examples in Python: dynamo guards on those lengths, so
        # every new packing is a new graph (about a minute each for gpt-tiny on a CPU) until it gives up after 8 and
        # runs eagerly.
        "compiled_packing": ("does not work with --packing on a built-in model: its attention splits each row at the "
                             "packed examples' lengths, so every new packing would compile again; use "
                             "--micro-batch-order by-length instead of --packing, or drop --compile"),
    }

    def claims(self, name: str) -> bool:
        return name in MODEL_CONFIGS

    def context_length(self, name: str) -> int | None:
        return gpt_config(name).context_length

    def resolve(self, name: str, overrides: tuple[str, ...], lora: LoraSettings | None) -> Resolved:
        config = gpt_config(name)
        return Resolved(
            architecture=GPT.__name__, shape=gpt_shape(config),
            supports=Supports(packing="per-example", attention="its own per-example attention",
                              blocks=config.n_layer),
            estimator="gpt", no_estimate=None, matmul_weights=gpt_matmul_weights(config), adapters=None)

    def build(self, name: str, overrides: tuple[str, ...], lora: LoraSettings | None, *, seed: int, precision: str,
              base_precision: str, shard_later: bool, warn: bool) -> BuiltModel:
        config = gpt_config(name)
        torch.manual_seed(seed)
        return BuiltModel(module=GPT(config), tokenizer=None, vocab_size=config.vocab_size)


__all__ = ["BuiltInGPT", "MODEL_NAMES", "gpt_config", "gpt_matmul_weights", "gpt_shape"]
