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
def head_bypassed(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """While active, calling ``head`` returns its input unchanged (no logits are made); yields the list of the inputs
    it was called with. The module's own hooks still run around the call (only its ``forward`` is replaced, on the
    instance), and the class's ``forward`` is back afterwards, however the block ends."""
    captured: list[torch.Tensor] = []

    def bypass(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        captured.append(hidden)
        return hidden

    had_own = "forward" in head.__dict__
    saved = head.__dict__.get("forward")
    head.forward = bypass  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        if had_own:
            head.forward = saved  # type: ignore[method-assign]
        else:
            del head.forward


def chunking_problem(model: nn.Module, vocab_size: int) -> str | None:
    """Why the chunked loss cannot reproduce ``model``'s logits, or None when it can.

    Beyond :func:`output_head`'s config checks, a probe on 6 tokens (eval mode, no gradients, a generator of its
    own) runs the model once whole and once with the head bypassed: the head must be called exactly once, on hidden
    states of every position, and the head (with the known transform) applied to them must give the model's logits.
    Without a known transform the model must return the head's output itself: a forward that makes new logits out
    of it post-processes them in some way cadence has not been taught."""
    try:
        head = output_head(model)
    except UnsupportedHead as err:
        return str(err)
    inner = innermost(model)
    ids = torch.randint(0, vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(inner.parameters()).device)
    was_training = inner.training
    inner.eval()
    try:
        with torch.no_grad():
            whole = _logits(inner(ids))
            with head_bypassed(head.module) as captured:
                bypassed = _logits(inner(ids))
            if len(captured) != 1 or captured[0].shape[:2] != ids.shape:
                return (f"its forward calls the output head {len(captured)} times, or not on every position: cadence "
                        f"cannot apply the head chunk by chunk in its place")
            if head.transform is None and bypassed is not captured[0]:
                return ("its forward changes the logits after the output head (as logit soft-capping or scaling "
                        "do), in a way cadence does not reproduce chunk by chunk")
            rebuilt = head.module(captured[0]).float()
            if head.transform is not None:
                rebuilt = head.transform(rebuilt)
            if whole.shape != rebuilt.shape or not torch.allclose(whole.float(), rebuilt, rtol=1e-4, atol=1e-5):
                what = f" ({head.described})" if head.described else ""
                return (f"the output head applied by cadence{what} does not give the model's own logits: its forward "
                        f"computes them in some other way")
    finally:
        inner.train(was_training)
    return None


def _logits(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


__all__ = [
    "LOGIT_TRANSFORMS", "LogitTransform", "OutputHead", "REFUSED_CONFIG_KEYS", "UnsupportedHead", "chunking_problem",
    "head_bypassed", "innermost", "output_head",
]
