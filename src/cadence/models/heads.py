"""A causal LM split at its output head, for a loss that applies the head itself (``--loss-chunk-tokens``).

The chunked loss (:mod:`cadence.engine.chunked_loss`) runs the model's own forward with the head bypassed (it returns
its input, so the [tokens x vocabulary] logits are never made), takes the hidden states the head was given, and then
calls the head module on a few target positions at a time. Everything goes through the model's own ``forward`` and
the head's own module call, so DDP's and FSDP2's hooks see what they always see, and tied embeddings need nothing:
the head IS the module whose weight is the embedding's.

The head is the built-in GPT's ``lm_head`` or a transformers model's ``get_output_embeddings()``. Some transformers
families change the logits after the head; cadence must do exactly what they do, or refuse:

- handled (:data:`LOGIT_TRANSFORMS`): final soft-capping (``final_logit_softcapping``: Gemma 2 and 3, and others),
  Cohere's ``logit_scale`` and Granite's ``logits_scaling``, each applied to a chunk's fp32 logits;
- refused: anything else a forward does to the logits (``recurrent_gemma``'s ``logits_soft_cap``, a vocabulary
  trimmed after the head, a head called twice, ...), found by :func:`chunking_problem`'s probe of the real model, so a
  family nobody has listed is refused rather than trained on the wrong loss.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cadence.models.gpt import GPT

LogitTransform = Callable[[torch.Tensor], torch.Tensor]
"""What a model's forward does to the logits after its head (fp32 logits in, fp32 logits out)."""


def _softcap(cap: float) -> LogitTransform:
    # As transformers writes it (logits / cap, tanh, * cap), in fp32: the same function, computed on the fp32 logits
    # the loss reads instead of on the head's bf16 output (closer to the exact value, never further).
    return lambda logits: torch.tanh(logits / cap) * cap


def _scale(factor: float) -> LogitTransform:
    return lambda logits: logits * factor


LOGIT_TRANSFORMS: dict[str, tuple[Callable[[float], LogitTransform], str]] = {
    "final_logit_softcapping": (_softcap, "soft-caps the logits, cap x tanh(logits / cap) (Gemma 2 and 3)"),
    "logit_scale": (_scale, "multiplies the logits by logit_scale (Cohere)"),
    "logits_scaling": (lambda value: _scale(1.0 / value), "divides the logits by logits_scaling (Granite)"),
}
"""Config keys whose post-processing of the logits cadence reproduces, chunk by chunk: key -> (the transform made
from the key's value, what the family does). A key set to None (null) does nothing, as in transformers."""

REFUSED_CONFIG_KEYS: dict[str, str] = {
    "logits_soft_cap": "soft-caps the logits in its own way (recurrent Gemma)",
    "unpadded_vocab_size": "trims its padded vocabulary after the head",
}
"""Config keys of families whose post-processing of the logits cadence does not reproduce: key -> why. Anything else
a forward does after the head is found by the probe in :func:`chunking_problem`."""


@dataclass(frozen=True)
class OutputHead:
    """Where a model's logits come from: the head module, and what the forward then does to its output."""

    module: nn.Module
    """Called by the chunked loss on each chunk of hidden states (through the module: hooks and tied weights)."""
    transform: LogitTransform | None = None
    """Applied to each chunk's fp32 logits (:data:`LOGIT_TRANSFORMS`); None: the logits are the head's output."""
    described: str = ""
    """What the transform is, for messages."""


class UnsupportedHead(ValueError):
    """The model cannot be split at its head exactly; the message says why (for a line naming the flag)."""


def innermost(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (``.module``) or torch.compile (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def output_head(model: nn.Module) -> OutputHead:
    """The head of the built-in GPT or of a transformers causal LM (inside any DDP or compile wrapper), with the
    logit transform its config asks for. Raises :class:`UnsupportedHead` when there is no head module or the config
    asks for a post-processing cadence does not reproduce."""
    inner = innermost(model)
    if isinstance(inner, GPT):
        return OutputHead(module=inner.lm_head)
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        raise UnsupportedHead(f"{type(inner).__name__} has no output head module (get_output_embeddings() is None) "
                              f"for cadence to apply chunk by chunk")
    config = getattr(inner, "config", None)
    for key, why in REFUSED_CONFIG_KEYS.items():
        if getattr(config, key, None) is not None:
            raise UnsupportedHead(f"{getattr(config, 'model_type', type(inner).__name__)} {why} ({key}="
                                  f"{getattr(config, key)!r}), which cadence does not reproduce chunk by chunk")
    transforms = [(key, value) for key in LOGIT_TRANSFORMS if (value := getattr(config, key, None)) is not None]
    if not transforms:
        return OutputHead(module=head)
    if len(transforms) > 1:
        raise UnsupportedHead(f"the config sets {' and '.join(key for key, _ in transforms)}: more than one "
                              f"post-processing of the logits, which cadence does not combine")
    key, value = transforms[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
        raise UnsupportedHead(f"{key}={value!r} is not a finite non-zero number")
    make, why = LOGIT_TRANSFORMS[key]
    return OutputHead(module=head, transform=make(float(value)), described=f"{why}, {key}={value:g}")


@contextlib.contextmanager
def forward_replaced(head: nn.Module, forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    """While active, calling ``head`` (an output head, or any module: the in-place accumulation replaces the
    embedding's too) runs ``forward`` instead of the module's own. The module's hooks still run
    around the call (only ``forward`` is replaced, on the instance), and the class's ``forward`` is back afterwards,
    however the block ends."""
    had_own = "forward" in head.__dict__
    saved = head.__dict__.get("forward", head.forward)  # the instance's own forward, when it has one
    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = saved
        else:
            del head.forward


@contextlib.contextmanager
def head_bypassed(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While active, calling ``head`` returns its input unchanged (no logits are made); yields the list of the inputs
    it was called with (see :func:`forward_replaced`)."""
    captured: list[torch.Tensor] = []

    def bypass(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured.append(hidden)
        return hidden

    with forward_replaced(head, bypass):
        yield captured


PROBE_LOGIT_RANGE = 60.0
"""The probe's stand-in logits are uniform in +-60: far outside the range where soft-capping (cap 20 or 30) or a scale
would look like the identity, so that a post-processing the transform does not reproduce cannot pass unnoticed."""


def chunking_problem(model: nn.Module, vocab_size: int) -> str | None:
    """Why the chunked loss cannot reproduce ``model``'s logits, or None when it can.

    Beyond :func:`output_head`'s config checks, a probe on 6 tokens (eval mode, no gradients, a generator of its
    own) runs the model with its head replaced by one that records its input and returns large random stand-in
    logits: the head must be called exactly once, on hidden states of every position, and the model must return the
    stand-in logits as they are, or exactly as the known transform changes them. A forward that does anything else
    to the logits (scales, caps, trims or adds to them in a way cadence has not been taught) is refused. Last, the
    head applied to the recorded hidden states must give the model's own logits."""
    try:
        head = output_head(model)
    except UnsupportedHead as err:
        return str(err)
    inner = innermost(model)
    device = next(inner.parameters()).device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (1, 6), generator=generator).to(device)
    standin = ((torch.rand(1, 6, vocab_size, generator=generator) * 2 - 1) * PROBE_LOGIT_RANGE).to(device)
    captured: list[torch.Tensor] = []

    def record(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured.append(hidden)
        return standin.to(hidden.dtype) if hidden.is_floating_point() else standin

    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad(), _as_trained(inner, device):
            whole = _logits(inner(ids)).float()
            with forward_replaced(head.module, record):
                returned = _logits(inner(ids)).float()
            if len(captured) != 1 or captured[0].shape[:2] != ids.shape:
                return (f"its forward calls the output head {len(captured)} times, or not on every position: cadence "
                        f"cannot apply the head chunk by chunk in its place")
            expected = standin.float() if head.transform is None else head.transform(standin.float())
            if returned.shape != expected.shape or not torch.allclose(returned, expected, rtol=1e-5, atol=1e-4):
                known = f" beyond what cadence reproduces ({head.described})" if head.described else ""
                return (f"its forward changes the logits after the output head{known}, as logit soft-capping, "
                        f"scaling or trimming do; cadence cannot compute that loss chunk by chunk")
            rebuilt = head.module(captured[0]).float()
            if head.transform is not None:
                rebuilt = head.transform(rebuilt)
            if whole.shape != rebuilt.shape or not torch.allclose(whole, rebuilt, rtol=1e-4, atol=1e-5):
                return ("the output head applied to the hidden states it is given does not give the model's own "
                        "logits: its forward computes them in some other way")
    finally:
        inner.train(was_training)
    return None


def _as_trained(model: nn.Module, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """What the probe's forwards run under: nothing for fp32 weights; autocast to their dtype for a model holding
    weights in a lower precision (a LoRA base in bf16, --lora-base-precision bf16, runs only under autocast, as
    --precision bf16 trains it: a bf16 weight times an fp32 activation is an error outside it). The head applied to
    the recorded hidden states runs under it too, so both sides of the comparison round alike."""
    lower = {param.dtype for param in model.parameters() if param.is_floating_point() and param.dtype != torch.float32}
    if not lower:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if torch.bfloat16 in lower else lower.pop()
    return torch.autocast(device.type, dtype=dtype)


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


__all__ = [
    "LOGIT_TRANSFORMS", "LogitTransform", "OutputHead", "REFUSED_CONFIG_KEYS", "UnsupportedHead", "chunking_problem",
    "PROBE_LOGIT_RANGE", "head_bypassed", "forward_replaced", "innermost", "output_head",
]
