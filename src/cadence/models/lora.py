"""LoRA adapters on a transformers model, with peft (``--lora-rank R``).

peft's LoRA layers are injected into the model in place (``peft.inject_adapter_in_model``): the model stays the
transformers model it was (the same class, its blocks where recompute, ``--compile`` and FSDP2 find them, its head
where the chunked loss finds it); each targeted linear layer becomes a peft ``lora.Linear`` holding the original
layer (``base_layer``, frozen) and two small matrices ``lora_A`` (rank x in) and ``lora_B`` (out x rank, zero at
the start, so the adapted model starts as the base model). peft marks every other parameter frozen
(``requires_grad=False``), so only the adapters get gradients and optimizer state (``build_optimizer`` takes the
trained parameters only). Parameter names are the model's with peft's inserted (``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``): checkpoints and model.safetensors hold the base and the adapters together.

``--save-hf DIR`` writes the adapter as ``PeftModel.save_pretrained`` does (adapter_config.json and
adapter_model.safetensors, keys ``base_model.model.<name>`` without the adapter name), so that
``peft.PeftModel.from_pretrained(base, DIR)`` loads it unchanged onto the same base model.

peft is an optional dependency (``cadence[hf]``), imported only when LoRA is asked for.
"""

from __future__ import annotations

import contextlib
import copy
import math
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.errors import UsageError
from cadence.models.quantized import (
    bitsandbytes_installed,
    bitsandbytes_problem,
    logical_numel,
    nf4_bytes,
    quantized_layers,
    quiet_bitsandbytes,
)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PeftModel puts before the wrapped model's parameter names in a saved adapter."""


@dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """What ``--lora-rank``, ``--lora-alpha``, ``--lora-targets`` and ``--lora-dropout`` ask for."""

    rank: int
    alpha: float | None = None
    """None: the rank (adapter output scaled by alpha / rank = 1)."""
    targets: tuple[str, ...] | None = None
    """Module names (the last part, e.g. q_proj) or peft's ``all-linear``; None: peft's default for the type."""
    dropout: float = 0.0
    base_name_or_path: str | None = None
    """Recorded in adapter_config.json as the base model (a model directory; None for hf:TYPE)."""


@dataclass(frozen=True, kw_only=True)
class LoraShape:
    """The adapters of a model, as the memory estimate needs them."""

    rank: int
    adapted: tuple[tuple[str, int, int], ...]
    """(module name, in features, out features) of every adapted layer."""
    adapter_parameters: int
    trainable_parameters: int
    frozen_parameters: int
    dropout: float
    bf16_base_parameters: int = 0
    """Frozen linear-layer elements held in bf16 (--lora-base-precision bf16)."""
    nf4_base_parameters: int = 0
    """Frozen linear-layer elements held in 4-bit NormalFloat (--lora-base-precision nf4), unpacked."""
    nf4_base_bytes: int = 0
    """What those elements take: packed codes, absmaxes, scales and codes (:func:`cadence.models.quantized.nf4_bytes`)."""


def peft_problem() -> str | None:
    """Why LoRA cannot run here (peft missing, or a broken bitsandbytes that peft would import), or None."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return "needs peft (pip install 'cadence[hf]', or pip install peft)"
    # peft reaches for bitsandbytes' 8-bit linear layer whenever bitsandbytes is installed (to tell its layers
    # apart while injecting the adapters), so a bitsandbytes without it fails every LoRA run.
    broken = bitsandbytes_problem(needs=("nn.Linear8bitLt",)) if bitsandbytes_installed() else None
    if broken is None:
        try:
            _import_peft()
        except UsageError:
            return "needs peft, which fails to import (pip install --force-reinstall peft)"
        except Exception as err:  # noqa: BLE001 - peft or what it imports, failing as installed
            frames = traceback.extract_tb(err.__traceback__)
            if "bitsandbytes" not in str(err) and not any("bitsandbytes" in frame.filename for frame in frames):
                reason = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
                return f"needs peft, which is installed but fails to import ({reason}): pip install --force-reinstall peft"
            broken = bitsandbytes_problem(failure=err)
    if broken is not None:
        return (f"needs peft, which imports bitsandbytes when it is installed; it {broken} (or, if you do not use "
                f"--optimizer-state 8bit, uninstall it: pip uninstall bitsandbytes)")
    return None


def split_targets(items: list[str] | tuple[str, ...] | None) -> tuple[str, ...] | None:
    """``--lora-targets q_proj,v_proj`` or the flag repeated: the module names, in order, once each."""
    if not items:
        return None
    names = [name.strip() for item in items for name in str(item).split(",") if name.strip()]
    return tuple(dict.fromkeys(names)) or None


def _import_peft() -> Any:
    try:
        with quiet_bitsandbytes():  # peft imports bitsandbytes when it is installed
            import peft
    except ImportError:
        raise UsageError.single("--lora-rank", "LoRA needs peft: pip install 'cadence[hf]'") from None
    return peft


def _imported_peft() -> Any:
    """peft for apply_lora: a failure of its own imports (validate() has said which package) as one line."""
    try:
        return _import_peft()
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - peft's own imports failing (a broken bitsandbytes): said by peft_problem
        raise UsageError.single("--lora-rank", f"LoRA {peft_problem() or 'needs peft, which fails to import'}") \
            from None


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (and return it): the base frozen, the adapters trained.

    Seed the global RNG first: ``lora_A`` is initialised randomly (``lora_B`` with zeros). Bad targets are a
    UsageError naming ``--lora-targets``."""
    widest = max((min(module.in_features, module.out_features) for module in model.modules()
                  if isinstance(module, nn.Linear)), default=0)
    if settings.rank > widest:
        # Checked before peft allocates anything: a rank of 10**9 asked for terabytes (a traceback from the
        # allocator), 2**63 overflowed; and a rank above a layer's smaller side adds nothing that side allows.
        raise UsageError.single("--lora-rank", (
            f"{settings.rank} is more than the layer's width: the widest linear layer of this model has {widest} on "
            f"its smaller side, and a rank above that adds nothing (give at most {widest}; 8 to 64 is usual)"))
    peft = _imported_peft()
    targets: Any = list(settings.targets) if settings.targets else None
    if targets == ["all-linear"]:
        targets = "all-linear"  # peft's own word: every linear layer but the output head
    config = peft.LoraConfig(
        r=settings.rank, lora_alpha=settings.rank if settings.alpha is None else settings.alpha,
        target_modules=targets, lora_dropout=settings.dropout, bias="none", task_type="CAUSAL_LM",
        base_model_name_or_path=settings.base_name_or_path,
    )
    model_type = getattr(getattr(model, "config", None), "model_type", "?")
    try:
        peft.inject_adapter_in_model(config, model)
    except ValueError as err:
        text = " ".join(str(err).split())
        names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                        if isinstance(module, nn.Linear) and name})
        if "specify `target_modules`" in text:
            message = f"peft knows no default layers to adapt for {model_type} models; name them"
        else:
            message = f"{text[:200]}"
        raise UsageError.single("--lora-targets", (
            f"{message} (this model's linear layers: {', '.join(names)}; e.g. --lora-targets "
            f"{','.join(n for n in names if 'proj' in n)[:60] or 'NAME'})")) from None
    return model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s LoRA layers compute their base layer alone (peft's ``enable_adapters(False)``
    on each): the model is the base it was built from, with no copy of it. A preference objective's reference."""
    # peft's LoRA layers, found by what they have (peft is optional, and untyped): their enable_adapters method.
    switches: list[Callable[[bool], None]] = [
        getattr(module, "enable_adapters") for module in model.modules()
        if callable(getattr(module, "enable_adapters", None)) and hasattr(module, "base_layer")]
    for switch in switches:
        switch(False)
    try:
        yield
    finally:
        for switch in switches:
            switch(True)


def hold_base_in_bf16(model: nn.Module) -> int:
    """Cast the frozen linear layers' weights and biases to bf16 in place (--lora-base-precision bf16); returns the
    elements cast.

    Under bf16 autocast this is the same math: autocast rounds every fp32 weight of a matmul to bf16 (to nearest),
    the very values stored here, and a frozen weight never changes. Only linear layers (nn.Linear and transformers'
    Conv1D, both matmuls autocast runs in bf16) are cast: norms and embeddings compute in their own dtype, and a
    head whose weight is the embedding's (tied) is left alone, as are the adapters (trained, fp32)."""
    others = {id(param) for module in model.modules() if not _is_linear(module)
              for param in module.parameters(recurse=False)}
    cast = 0
    for module in model.modules():
        if not _is_linear(module):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad or id(param) in others or param.dtype == torch.bfloat16:
                continue
            param.data = param.data.to(torch.bfloat16)
            cast += param.numel()
    return cast


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def is_lora(model: nn.Module) -> bool:
    """Whether peft's LoRA layers were injected into ``model`` (:func:`apply_lora`)."""
    return bool(getattr(model, "peft_config", None))


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trained, frozen) parameter counts; a tied weight once; a sharded parameter at its full size."""
    trained = frozen = 0
    for param in model.parameters():  # each distinct parameter once
        if param.requires_grad:
            trained += param.numel()
        else:
            frozen += logical_numel(param)  # an nf4 weight at its unpacked size (its packed tensor holds two a byte)
    return trained, frozen


def lora_shape(model: nn.Module) -> LoraShape | None:
    """The adapters injected into ``model`` (None without LoRA), for the memory estimate."""
    if not is_lora(model):
        return None
    config = getattr(model, "peft_config")["default"]  # peft's attribute, which nn.Module's type does not know
    adapted = []
    adapter_parameters = 0
    module: Any  # peft's layers: their adapters are attributes nn.Module's type does not know
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        base = getattr(module, "base_layer", None)
        if isinstance(lora_a, nn.ModuleDict) and "default" in lora_a and base is not None:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            adapted.append((name, int(a.shape[1]), int(b.shape[0])))
            adapter_parameters += a.numel() + b.numel()
    trained, frozen = parameter_counts(model)
    nf4 = [math.prod(module.weight.quant_state.shape) for _, module in quantized_layers(model)]
    quantized = {id(module.weight) for _, module in quantized_layers(model)}
    bf16 = sum(p.numel() for p in model.parameters()
               if not p.requires_grad and p.dtype == torch.bfloat16 and id(p) not in quantized)
    return LoraShape(rank=int(config.r), adapted=tuple(adapted), adapter_parameters=adapter_parameters,
                     trainable_parameters=trained, frozen_parameters=frozen, dropout=float(config.lora_dropout),
                     bf16_base_parameters=bf16, nf4_base_parameters=sum(nf4), nf4_base_bytes=nf4_bytes(nf4))


def adapter_weights(model: nn.Module, weights: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors as a saved adapter holds them: ``base_model.model.<name>`` without the adapter name
    (peft's ``get_peft_model_state_dict``, then PeftModel's prefix). ``weights``: the model's full state dict, when
    the caller gathered it (FSDP2)."""
    peft = _import_peft()
    found = peft.get_peft_model_state_dict(model, state_dict=None if weights is None else dict(weights))
    return {PEFT_PREFIX + name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in found.items()}


def write_adapter(model: nn.Module, directory: Path, weights: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write ``model``'s adapter into ``directory`` (existing, empty) as ``PeftModel.save_pretrained`` would."""
    from safetensors.torch import save_file

    config = copy.deepcopy(getattr(model, "peft_config")["default"])  # peft's (nn.Module's type does not know it)
    save_file(adapter_weights(model, weights), str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config.inference_mode = True  # as PeftModel.save_pretrained records it: a loaded adapter is frozen unless asked
    config.save_pretrained(str(directory))  # peft's own adapter_config.json


__all__ = ["LoraSettings", "LoraShape", "adapters_disabled", "apply_lora", "hold_base_in_bf16", "is_lora", "lora_shape",
           "parameter_counts", "peft_problem", "split_targets", "write_adapter"]
