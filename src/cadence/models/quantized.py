"""A 4-bit NormalFloat base under LoRA (``--lora-base-precision nf4``, QLoRA), with bitsandbytes.

Every ``nn.Linear`` inside the model's repeated blocks (attention's q/k/v/o projections and the MLP's, whether peft
adapts them or not) is replaced in place by :class:`NF4Linear`, a bitsandbytes ``Linear4bit`` holding its weight as
4-bit NormalFloat codes: block-wise (one absmax per :data:`NF4_BLOCK` elements), and the absmaxes themselves
quantised to 8 bits with one fp32 scale per :data:`NESTED_BLOCK` of them (QLoRA's double quantisation). The
embeddings, the norms and the LM head stay as they are: they are a small share of a large model, the head's
precision matters most to the loss, and peft's LoRA never adapts them by default.

The weight is quantised from its value in the compute dtype (``--precision`` bf16: the bf16 rounding of the fp32
weight, what autocast would have multiplied; fp32: the fp32 weight), so bitsandbytes dequantises it back to the
compute dtype in the forward and again in the backward (the input's gradient), one layer at a time; it never keeps
a dequantised copy. Quantisation is deterministic: the same weights give the same codes on every build, so the
frozen base is reproducible from the model (its seed, or its directory) alone.

``model.safetensors`` and checkpoints hold the state dict as the model has it: each quantised weight's packed codes
(``...weight``, uint8) and its quantisation state (``...weight.absmax``, ``.quant_map``, ``.nested_absmax``,
``.nested_quant_map``, ``.quant_state.bitsandbytes__nf4``), which bitsandbytes writes; loading them back (a resume,
``cadence sample``) restores both exactly (:func:`_load_quantized`), since torch alone would refuse the quantisation
state's keys.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from cadence.errors import UsageError
from cadence.models.blocks import repeated_blocks

NF4_BLOCK = 64
"""Weight elements per absmax (QLoRA's block size)."""
NESTED_BLOCK = 256
"""Absmaxes per fp32 scale of the double quantisation (bitsandbytes' only nested block size)."""
NF4_CODE_BYTES = 16 * 4 + 256 * 4 + 4
"""Per quantised layer: the 16-entry NF4 code, the 256-entry 8-bit code of the absmaxes (both fp32) and the
absmaxes' fp32 offset."""
INSTALL = "pip install 'cadence[8bit]', or pip install bitsandbytes"


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes is installed (found by the import system; not imported)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def bitsandbytes_problem(*, needs: tuple[str, ...] = (), failure: BaseException | None = None) -> str | None:
    """Why bitsandbytes cannot be used here, in words that follow what needs it ("8bit ", "nf4 "), or None when it
    can: not installed (the install line), or installed but failing to import or lacking one of ``needs`` (dotted
    names such as ``optim.AdamW8bit``), or ``failure``: what using it raised elsewhere (peft importing it).

    An installed package can still fail at import: its native library missing or built for another CUDA (an
    OSError), a symbol a newer torch lacks (an AttributeError). Found here, before any run directory exists, it is
    one line naming the package and its repair; found when the optimizer, the nf4 layers or peft are built, it was a
    traceback."""
    if not bitsandbytes_installed():
        return f"needs bitsandbytes ({INSTALL})"
    verb = "to be used"
    if failure is None:
        verb = "to import"
        try:
            with quiet_bitsandbytes():
                import bitsandbytes

            for name in needs:
                target: Any = bitsandbytes
                for part in name.split("."):
                    target = getattr(target, part)
        except Exception as err:  # noqa: BLE001 - whatever its import raises, the package is unusable as installed
            failure = err
    if failure is None:
        return None
    reason = f"{type(failure).__name__}: {(str(failure).splitlines() or [''])[0][:160]}"
    return (f"needs bitsandbytes, and bitsandbytes is installed but fails {verb} ({reason}): repair it with pip "
            f"install --force-reinstall bitsandbytes")


def nf4_bytes(layer_elements: Iterable[int]) -> int:
    """Bytes of weights held in NF4, given each quantised layer's element count: half a byte each, one 8-bit absmax
    per block of 64, one fp32 scale per 256 absmaxes, and each layer's two codes and offset."""
    total = 0
    for elements in layer_elements:
        blocks = -(-elements // NF4_BLOCK)
        total += -(-elements // 2) + blocks + 4 * -(-blocks // NESTED_BLOCK) + NF4_CODE_BYTES
    return total


@contextlib.contextmanager
def quiet_bitsandbytes() -> Iterator[None]:
    """Around an import of bitsandbytes (or of peft, which imports it): its CPU backend logs a warning about optional
    kernels it could not load (a 4-bit matmul kernel among them) that cadence never uses, which would read as a
    problem with the run. Errors still show; the logger's level is restored."""
    logger = logging.getLogger("bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _import_bnb() -> Any:
    try:
        with quiet_bitsandbytes():
            import bitsandbytes
    except ImportError:
        raise UsageError.single("--lora-base-precision", f"nf4 needs bitsandbytes ({INSTALL})") from None
    return bitsandbytes


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The plain ``nn.Linear`` layers inside the model's repeated blocks, by their full name: what nf4 quantises
    (peft's adapters, also ``nn.Linear``, excepted; a peft-wrapped base layer is listed)."""
    blocks = {id(block) for block in repeated_blocks(model)}
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in blocks:
            inside.update(id(m) for m in module.modules())
        if id(module) in inside and type(module) is nn.Linear and ".lora_" not in name:
            yield name, module


def quantized_layers(model: nn.Module) -> list[tuple[str, Any]]:
    """The model's NF4 layers (peft's wrappers excluded: their base layers are listed), by name (bitsandbytes'
    layers: their weights carry a quantisation state, which nn.Module's type does not know)."""
    return [(name, module) for name, module in model.named_modules() if getattr(module, "is_cadence_nf4", False)]


def quantize_base_nf4(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Replace every ``nn.Linear`` of the model's blocks by an :class:`NF4Linear` in place (before peft injects its
    adapters, which then wrap them); returns the weight elements quantised. The replaced weights are frozen."""
    bnb = _import_bnb()
    layer_class = _nf4_linear_class(bnb)
    try:
        found = list(quantizable_linears(model))
    except ValueError as err:
        raise UsageError.single("--lora-base-precision", f"nf4: {err}") from None
    if not found:
        kinds = sorted({type(m).__name__ for block in repeated_blocks(model) for m in block.modules()
                        if "Conv1D" in type(m).__name__})
        raise UsageError.single("--lora-base-precision", (
            "nf4 quantises the nn.Linear layers of the model's blocks, and this model's blocks have none"
            + (f" (they use {', '.join(kinds)}, as gpt2 does); use --lora-base-precision fp32 or bf16" if kinds
               else "; use --lora-base-precision fp32 or bf16")))
    elements = 0
    for name, linear in found:
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        replacement = layer_class.from_linear(linear, compute_dtype)
        setattr(parent, name.rsplit(".", 1)[-1], replacement)
        elements += linear.weight.numel()
    # peft puts its bitsandbytes LoRA layer (lora.Linear4bit) on a Linear4bit only when the model says it is loaded
    # in 4 bits; transformers' quantised loading sets the same attribute.
    setattr(model, "is_loaded_in_4bit", True)  # a flag, not a tensor or module (all nn.Module's type takes)
    return elements


_CLASS: list[type[Any]] = []


def _nf4_linear_class(bnb: Any) -> type[Any]:
    """:class:`NF4Linear`, defined once bitsandbytes is imported (it subclasses bitsandbytes' Linear4bit)."""
    if _CLASS:
        return _CLASS[0]

    class NF4Linear(bnb.nn.Linear4bit):
        """bitsandbytes' ``Linear4bit`` (NF4, double quantisation) whose output stays in the compute dtype.

        bitsandbytes' own forward casts its output back to its input's dtype: under bf16 autocast a projection fed
        an fp32 norm output would return fp32, doubling every projection output that autocast keeps in bf16 for an
        ``nn.Linear``. This forward returns what ``nn.Linear`` under autocast returns (the compute dtype), and never
        repacks the weight for bitsandbytes' CPU inference kernel (which would bypass autograd, silently, after an
        evaluation in eval mode on CPUs with AVX512-BF16)."""

        is_cadence_nf4 = True

        @classmethod
        def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype) -> NF4Linear:
            with torch.device("meta"):  # no random init: the weight is the linear layer's
                layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                            compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4")
            # Quantised from the compute dtype's value of the weight, so the dequantised weight comes back in it.
            source = linear.weight.detach().to(compute_dtype)
            layer.weight = bnb.nn.Params4bit(source, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", blocksize=NF4_BLOCK, module=layer
                                             ).to(linear.weight.device)
            if linear.bias is not None:
                # Frozen; bitsandbytes adds it in the compute dtype (and would cast it in place on first use).
                layer.bias = nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False)
            layer.support_avx512bf16_for_cpu = False
            layer.register_load_state_dict_pre_hook(_load_quantized)
            return layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bnb.nn.modules.fix_4bit_weight_quant_state_from_module(self)
            # autocast's cast of an fp32 input (a norm's output), made here since bitsandbytes' op has no autocast
            # rule; not saved: the frozen weight needs no input for its gradient.
            x = x.to(self.compute_dtype)
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            return bnb.matmul_4bit(x, self.weight, bias=bias, quant_state=self.weight.quant_state)

    _CLASS.append(NF4Linear)
    return NF4Linear


def _load_quantized(module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Before torch loads an NF4 layer: take its quantisation state out of the state dict (torch does not know those
    keys) and install it, so that the packed codes torch then copies in are read with the scales they were saved
    with: a reload is the saved layer bit for bit."""
    from bitsandbytes.functional import QuantState

    keys = [key for key in state_dict if key.startswith(prefix + "weight.")]
    if not keys:
        return  # torch reports the missing keys; the layer keeps its own state
    parts = {key[len(prefix + "weight."):]: state_dict.pop(key) for key in keys}
    try:
        state = QuantState.from_dict(parts, device=module.weight.device)
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as err:
        error_msgs.append(f"{prefix}weight: its quantisation state does not load ({err})")
        return
    if tuple(state.shape) != (module.out_features, module.in_features) or state.blocksize != NF4_BLOCK:
        error_msgs.append(f"{prefix}weight: quantised as {list(state.shape)} in blocks of {state.blocksize}, the "
                          f"model's layer is [{module.out_features}, {module.in_features}] in blocks of {NF4_BLOCK}")
        return
    module.weight.quant_state = state
    module.quant_state = state


def logical_numel(param: torch.Tensor) -> int:
    """A parameter's element count as the model means it: a quantised weight's unpacked size."""
    state = getattr(param, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return math.prod(state.shape)
    return param.numel()


def already_quantized(config_file: Any) -> str | None:
    """What a model directory's config.json says of its quantisation (``quantization_config``), or None."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # unreadable or absent: the model's build says so
    found = config.get("quantization_config") if isinstance(config, dict) else None
    if not found:
        return None
    if isinstance(found, dict):
        method = found.get("quant_method") or "?"
        bits = "4-bit" if found.get("load_in_4bit") else "8-bit" if found.get("load_in_8bit") else None
        return f"{method}{' ' + bits if bits else ''}"
    return "quantised"


__all__ = ["INSTALL", "NESTED_BLOCK", "NF4_CODE_BYTES", "NF4_BLOCK", "already_quantized", "bitsandbytes_installed",
           "bitsandbytes_problem", "logical_numel", "nf4_bytes", "quantizable_linears", "quantize_base_nf4",
           "quantized_layers"]
