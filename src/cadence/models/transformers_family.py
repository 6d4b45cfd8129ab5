"""transformers' causal LMs as a model family: ``--model hf:TYPE`` (built from its config, random init) or a local
model directory (``save_pretrained``), both built offline (:mod:`cadence.models.hf`).

What such a model is, is read from it built on the meta device (:func:`cadence.models.hf.meta_model`): its shape, its
repeated blocks, how its packed rows attend, its LoRA adapters and the layers an nf4 base quantises, and which memory
estimator knows its blocks. The estimate replays two kinds of decoder block, llama's and gpt2's, recognised by their
layers (:data:`cadence.models.blocks.BLOCK_LAYOUTS`), never by a name; a model whose blocks are neither (Mamba's mixers, a hybrid of attention and recurrent layers, mixture-of-experts MLPs) has no estimate, and
says so, rather than being estimated as something it is not.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from cadence.errors import UsageError
from cadence.models.blocks import BLOCK_LAYOUTS, block_layout, repeated_blocks
from cadence.models.family import BuiltModel, Estimator, ModelFamily, PackingKernel, Resolved, Supports
from cadence.models.hf import (
    HF_PREFIX,
    build_hf_model,
    is_hf_model,
    meta_model,
    model_shape,
    model_tokenizer,
    packed_attention_supported,
    parse_model_overrides,
)
from cadence.models.lora import LoraSettings, apply_lora, hold_base_in_bf16, lora_shape
from cadence.models.packed_attention import runs_packed_attention, use_packed_attention
from cadence.models.quantized import already_quantized, quantizable_linears, quantize_base_nf4
from cadence.models.shape import ModelShape


class Transformers(ModelFamily):
    """transformers' causal LMs (see the module docstring)."""

    key = "transformers"
    offered = "hf:TYPE, or a local model directory"
    refuses: ClassVar[dict[str, str]] = {}
    exports_pretrained = True

    def claims(self, name: str) -> bool:
        # After the built-in names (the registry's order): a directory called gpt-tiny does not shadow the built-in.
        return is_hf_model(name)

    def pretrained(self, name: str) -> bool:
        return not name.startswith(HF_PREFIX)  # hf:TYPE is built from its config; a directory holds trained weights

    def data_tokenizer(self, name: str) -> Any | None:
        return model_tokenizer(name)

    def resolve(self, name: str, overrides: tuple[str, ...], lora: LoraSettings | None) -> Resolved:
        _refuse_quantised(name)
        model, config = meta_model(name, parse_model_overrides(list(overrides)))
        use_packed_attention(model)  # as the build sets it: the attention packed rows will go through
        shape = model_shape(model, config)
        estimator, no_estimate = block_estimator(model, shape)
        supports = _supports(model)
        adapters = bf16 = None
        if lora is not None:
            # The adapters injected on the meta device, as the build injects them (lora_A's init on meta draws from
            # the RNG: the run's seeded draws are kept out of it).
            with torch.random.fork_rng(devices=[]):
                apply_lora(model, lora)
            adapters = lora_shape(model)
            bf16 = hold_base_in_bf16(model)
        matmul = _matmul_weights(model)
        if bf16 is not None:
            supports = dataclasses.replace(supports, bf16_base_elements=bf16)
        return Resolved(architecture=type(model).__name__, shape=shape, supports=supports, estimator=estimator,
                        no_estimate=no_estimate, matmul_weights=matmul, adapters=adapters)

    def build(self, name: str, overrides: tuple[str, ...], lora: LoraSettings | None, *, seed: int, precision: str,
              base_precision: str, shard_later: bool, warn: bool) -> BuiltModel:
        _refuse_quantised(name)
        torch.manual_seed(seed)
        hf = build_hf_model(name, parse_model_overrides(list(overrides)), shard_later=shard_later and lora is None)
        notes = list(hf.notes)
        if lora is not None:
            if base_precision == "nf4":
                # Before the adapters, so that peft wraps the 4-bit layers with its bitsandbytes LoRA layer; the
                # quantisation draws nothing from the RNG, so lora_A's init is the same as on a full-precision base.
                quantize_base_nf4(hf.model, torch.bfloat16 if precision == "bf16" else torch.float32)
            # Right after the build, under the same seeded RNG: lora_A's random init is the same in every build. The
            # base is recorded as an absolute path, so the exported adapter loads with peft from any working directory.
            apply_lora(hf.model, dataclasses.replace(
                lora, base_name_or_path=None if name.startswith(HF_PREFIX) else str(Path(name).resolve())))
            if base_precision == "bf16":
                hold_base_in_bf16(hf.model)
            if name.startswith(HF_PREFIX):
                # Adapters on a base of random weights learn nothing a real model could use (issue 41); a note once
                # the adapters are in place, so that a refused --lora-rank is its one line alone.
                notes.append(f"--lora-rank on {name}: the base is built from its config with random weights, so the "
                             f"adapters are trained on a random model; give a model directory (save_pretrained) for "
                             f"a real fine-tune")
        for note in notes if warn else ():
            warnings.warn(note, stacklevel=4)
        return BuiltModel(module=hf.model, tokenizer=hf.tokenizer, vocab_size=hf.vocab_size, pending=hf.pending,
                          twin=hf.twin, notes=notes)


def _refuse_quantised(name: str) -> None:
    if not name.startswith(HF_PREFIX) and (quantized := already_quantized(Path(name) / "config.json")):
        # Its weights are packed codes and scales, not the parameters its architecture lists: reading them as such
        # would be garbage, and quantising or de-quantising them again is not what the user has.
        raise UsageError.single("--model", (
            f"{name} holds an already quantised model ({quantized}: its config.json has quantization_config); "
            f"cadence reads full-precision weights only: give the original model directory (with --lora-rank and "
            f"--lora-base-precision nf4 to train LoRA on a 4-bit base)"))


ATTENTION_MODULES = frozenset({"self_attn", "attn", "attention", "self_attention"})
"""What transformers' decoder blocks call their attention: a block without one (a Mamba mixer, a linear-attention or
recurrent layer) would carry one packed example's state into the next."""
RECURRENT = re.compile(r"mamba|mixer|ssm|recurrent|rglru|lightning|linearattention|deltanet|rwkv|lstm", re.IGNORECASE)
"""Layers that carry a state along the sequence (by their class names), which position ids restarting at each packed
example do not reset; a causal convolution (``nn.Conv1d``, Mamba's) carries one too."""


def _keeps_examples_apart(block: nn.Module) -> bool:
    """Whether packed examples stay apart in ``block``: it attends (its attention masked or run example by example),
    and nothing in it carries a state along the sequence."""
    return bool(ATTENTION_MODULES & {name for name, _ in block.named_children()}) and not any(
        isinstance(module, nn.Conv1d) or RECURRENT.search(type(module).__name__) for module in block.modules())


def _supports(model: nn.Module) -> Supports:
    """What the model (on the meta device, its attention set as built, no adapters yet) supports."""
    try:
        blocks, problem = repeated_blocks(model), None
    except ValueError as err:
        blocks, problem = [], str(err)
    packing: PackingKernel = "per-example" if runs_packed_attention(model) else "dense-mask"
    packing_problem = None
    if not packed_attention_supported():
        packing, packing_problem = "none", ("this transformers cannot keep packed examples apart (it needs "
                                            "masking_utils.find_packed_sequence_indices, transformers 4.54 or later)")
    elif not blocks or not all(_keeps_examples_apart(block) for block in blocks):
        packing, packing_problem = "none", (
            f"{type(model).__name__}'s layers are not all attention blocks, so packed examples would not be kept "
            f"apart (a recurrent or state-space layer carries one example's state into the next)")
    linears = list(quantizable_linears(model)) if blocks else []
    return Supports(
        packing=packing, packing_problem=packing_problem,
        attention=str(getattr(model.config, "_attn_implementation", None)), blocks=len(blocks),
        blocks_problem=problem,
        nf4_linears=tuple(layer.weight.numel() for _, layer in linears),
        nf4_bias_elements=sum(layer.bias.numel() for _, layer in linears if layer.bias is not None))


def _matmul_weights(model: nn.Module) -> int:
    """PaLM's N: every module's 2-D weight (each matmul's; an embedding is a lookup and is left out, a tied head is a
    matmul all the same), LoRA's adapters included."""
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) or not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            continue
        total += weight.numel()
    return total


def block_estimator(model: nn.Module, shape: ModelShape) -> tuple[Estimator | None, str | None]:
    """Which replay knows this model's blocks (:data:`cadence.models.blocks.BLOCK_LAYOUTS`), or (None, the one line
    saying why none does)."""
    architecture = type(model).__name__
    try:
        blocks = repeated_blocks(model)
    except ValueError:
        return None, (f"no memory estimate for {architecture}: it keeps no list of repeated blocks the estimate knows "
                      f"(it replays a step block by block)")
    layouts = {block_layout(block) for block in blocks}
    known = [name for name, sets in BLOCK_LAYOUTS.items() if layouts <= set(sets) and len(layouts) == 1]
    if not known:
        held = ", ".join(sorted(set().union(*layouts))) or "no linear layers"
        kinds = " (its blocks are not all alike)" if len(layouts) > 1 else ""
        return None, (f"no memory estimate for {architecture}: its blocks hold {held}{kinds}, not the llama-style "
                      f"q/k/v/o attention and gate/up/down MLP (or gpt2's blocks) that the estimate replays")
    if not shape.num_heads or not shape.head_dim or not shape.intermediate_size:
        return None, (f"no memory estimate for {architecture}: its config gives no attention heads, head size or MLP "
                      f"width to estimate from")
    return known[0], None


__all__ = ["Transformers", "block_estimator"]
