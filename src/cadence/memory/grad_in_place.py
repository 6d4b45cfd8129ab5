"""Gradient accumulation without a second copy of the largest gradients: the token embedding's and the LM head's
weight gradients are added straight into ``.grad``, the way Megatron's gradient-accumulation fusion writes its weight
gradient GEMM into ``main_grad``.

Why. From a window's second micro-batch on, autograd makes every parameter's new gradient as a tensor of its own and
only then adds it into the accumulated ``.grad`` (``AccumulateGrad``), so each gradient exists twice for a while. For
most parameters that is brief and small; for the embedding and head of a model with a large vocabulary it is the
largest tensor twice, and longer: a tied weight's head gradient waits beside ``.grad`` through the whole backward of
the blocks until the lookup's own dense gradient (zeros + ``index_add_``, a third copy) arrives to be summed with it.
Measured on CPU (a 2-layer width-64 llama with a 32,000-token vocabulary, tied, short rows, fp32 AdamW): micro-batch
1 x accumulation 8 peaked at 55.9 MiB against 48.1 MiB for 8 x 1, the difference one 32,000 x 64 fp32 tensor
(7.8 MiB). With this module both peak at 48.1 MiB (the optimizer step's), and the micro-batches of 1 x 8 at about
40 MiB (tests/engine/test_accumulation_in_place.py).

How. While a micro-batch runs inside :func:`accumulate_in_place`, the model's token embedding and its LM head call
autograd Functions instead of their own ``forward``: the same forward (``F.embedding``, ``F.linear``), and a backward
that adds the weight's gradient into ``weight.grad`` in place (the embedding's rows with ``index_add_``, the head's
``dY^T X`` with ``addmm_``; a ``.grad`` that does not exist yet is created from the first contribution) and gives
autograd no gradient for the weight, so ``AccumulateGrad`` makes nothing. The input's gradient is the usual one.
The math is the same sum in another order: equal to rounding (fp32 round-off of the order of additions), which the
split tests (8 x 1, 2 x 4, 1 x 8 against one batch) and the verify parity check see as equal.

Where it does not apply (the module keeps its own forward, and autograd its usual path; :func:`in_place_problem`
says why):

- a weight that is not trained (LoRA's and nf4's frozen base, a frozen embedding): it has no gradient to accumulate;
- a module that is not exactly ``nn.Embedding`` / ``nn.Linear`` (a subclass may change the forward: Gemma scales its
  embedding; LoRA wraps the head), an embedding with ``max_norm``, ``scale_grad_by_freq`` or ``sparse``, a head with a
  bias (none of cadence's models has one);
- the head under autocast (bf16, fp16): its matmul runs in the compute dtype and its weight gradient reaches the fp32
  ``.grad`` through autocast's cast, whose backward sums a chunked loss's chunks in the compute dtype; writing each
  chunk into fp32 ``.grad`` would round differently from the unchunked path. The embedding runs in fp32 under
  autocast, so its path applies in every precision;
- a backward that synchronises gradients across processes (DDP outside ``no_sync``: the window's last micro-batch,
  or every one with --sync-every-micro-step): DDP all-reduces a parameter from the hook of its ``AccumulateGrad``,
  which a gradient written straight into ``.grad`` never reaches. The no_sync micro-batches do use it, so under DDP
  the window's last micro-batch still makes the head's and the embedding's gradients beside the accumulated ones;
- FSDP2 (a sharded parameter): FSDP2 reduce-scatters the gradient autograd gives its unsharded parameter and owns
  that parameter's ``.grad``;
- a weight with hooks of its own (``register_hook``, ``register_post_accumulate_grad_hook``): they would not run;
- a whole model compiled with ``torch.compile`` (cadence compiles block by block, which is fine): the compiled graph
  was traced with the modules' own forwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cadence.models.heads import UnsupportedHead, forward_replaced, output_head


@dataclass(frozen=True)
class InPlaceModule:
    """A module whose weight gradient is added straight into ``.grad`` while :func:`accumulate_in_place` runs."""

    module: nn.Module
    kind: str
    """``"embedding"`` or ``"head"``."""


def _wrappers(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """The user's module inside DDP (``.module``) or torch.compile (``._orig_mod``) wrappers, and the wrappers."""
    wrappers: list[nn.Module] = []
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model, wrappers
        wrappers.append(model)
        model = inner


def _model_problem(model: nn.Module) -> str | None:
    """Why no weight of ``model`` may take the in-place path in this backward (None: the modules decide)."""
    inner, wrappers = _wrappers(model)
    if any(hasattr(wrapper, "_orig_mod") for wrapper in wrappers):
        return "the whole model is compiled: its graph was traced with the modules' own forwards"
    if any(getattr(wrapper, "require_backward_grad_sync", False) for wrapper in wrappers):
        return ("this backward synchronises gradients across processes (DDP): DDP all-reduces each parameter from the "
                "hook of its AccumulateGrad, which a gradient written straight into .grad never reaches")
    if any(type(module).__name__.startswith("FSDP") for module in inner.modules()):
        return "FSDP2 reduce-scatters the gradient autograd gives each unsharded parameter and owns its .grad"
    return None


def _weight_problem(weight: Any) -> str | None:
    if not isinstance(weight, nn.Parameter) or not weight.requires_grad:
        return "its weight is not trained"
    if type(weight.data) is not torch.Tensor:  # a DTensor (FSDP2's shard) or another tensor subclass
        return f"its weight is a {type(weight.data).__name__}, not a plain tensor"
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return "its weight has gradient hooks of its own, which would not run"
    return None


def _embedding_problem(module: nn.Module | None) -> str | None:
    if module is None:
        return "the model has no input embedding module"
    if type(module) is not nn.Embedding:
        return f"the input embedding is a {type(module).__name__}, not exactly nn.Embedding (its forward may differ)"
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return "the embedding renormalises, scales by frequency or is sparse"
    return _weight_problem(module.weight)


def _head_problem(module: nn.Module | None) -> str | None:
    if module is None:
        return "the model has no output head module"
    if type(module) is not nn.Linear:
        return f"the head is a {type(module).__name__}, not exactly nn.Linear (LoRA, quantised, or its own forward)"
    if module.bias is not None:
        return "the head has a bias"
    return _weight_problem(module.weight)


def _input_embedding(model: nn.Module) -> nn.Module | None:
    inner, _ = _wrappers(model)
    own = getattr(inner, "tok_emb", None)  # the built-in GPT
    if isinstance(own, nn.Module):
        return own
    get = getattr(inner, "get_input_embeddings", None)
    try:
        found = get() if callable(get) else None
    except NotImplementedError:
        return None
    return found if isinstance(found, nn.Module) else None


def _output_head(model: nn.Module) -> nn.Module | None:
    try:
        return output_head(model).module
    except UnsupportedHead:
        return None


def in_place_modules(model: nn.Module) -> tuple[list[InPlaceModule], dict[str, str]]:
    """The modules of ``model`` whose weight gradients go straight into ``.grad`` in its next backward, and, for the
    embedding and the head that do not, why not (``{"embedding": why, "head": why}``)."""
    problem = _model_problem(model)
    found: list[InPlaceModule] = []
    why: dict[str, str] = {}
    for kind, module, check in (("embedding", _input_embedding(model), _embedding_problem),
                                ("head", _output_head(model), _head_problem)):
        reason = problem or check(module)
        if reason is None and module is not None:
            found.append(InPlaceModule(module=module, kind=kind))
        else:
            why[kind] = reason or "not found"
    return found, why


def in_place_problem(model: nn.Module) -> dict[str, str]:
    """Why the embedding and the head of ``model`` do not take the in-place path (empty: both do)."""
    return in_place_modules(model)[1]


@contextlib.contextmanager
def accumulate_in_place(model: nn.Module) -> Iterator[list[InPlaceModule]]:
    """Around one micro-batch's forward AND backward: the embedding's and the head's weight gradients are added
    straight into ``.grad`` (see the module docstring); everything else is autograd's usual path. Enter it inside
    the gradient-sync context (DDP's ``no_sync`` decides whether this backward synchronises). Yields the modules
    that take the path; their own ``forward`` is back afterwards, however the block ends."""
    modules, _ = in_place_modules(model)
    with contextlib.ExitStack() as stack:
        for item in modules:
            forward = _embedding_forward(item.module) if item.kind == "embedding" else _head_forward(item.module)
            stack.enter_context(forward_replaced(item.module, forward))
        yield modules


def _embedding_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        return _EmbeddingIntoGrad.apply(ids, module.weight, module.padding_idx)

    return forward


def _head_forward(module: nn.Module) -> Callable[..., torch.Tensor]:
    own = type(module).forward

    def forward(rows: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(rows.device.type):
            return own(module, rows)  # see the module docstring: the compute-dtype head keeps autograd's path
        return _LinearIntoGrad.apply(rows, module.weight)

    return forward


def _add_into_grad(parameter: torch.Tensor, add: Callable[[torch.Tensor], object],
                   make: Callable[[], torch.Tensor]) -> None:
    """``add(parameter.grad)`` in place, or ``parameter.grad = make()`` when it has none yet (the first
    contribution: nothing to add to, so nothing is made twice)."""
    if parameter.grad is None:
        parameter.grad = make()
    else:
        add(parameter.grad)


class _EmbeddingIntoGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)``; its backward adds the rows' gradients into ``weight.grad`` (index_add_)."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        # The parameter itself, not a saved copy: activation offload would give backward a host copy, with no .grad.
        ctx.parameter, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        parameter = ctx.parameter
        ids = ids.reshape(-1)
        rows = grad_out.reshape(ids.numel(), -1).to(parameter.dtype)
        if ctx.padding_idx is not None:
            # nn.Embedding gives the padding row no gradient: add zeros there (a mask, no host sync as indexing needs)
            rows = rows.masked_fill((ids == ctx.padding_idx).unsqueeze(1), 0.0)
        _add_into_grad(parameter, lambda grad: grad.index_add_(0, ids, rows),
                       lambda: torch.zeros_like(parameter).index_add_(0, ids, rows))
        return None, None, None


class _LinearIntoGrad(torch.autograd.Function):
    """``F.linear(rows, weight)`` (no bias); its backward adds ``dY^T X`` into ``weight.grad`` (addmm_)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.parameter = weight  # see _EmbeddingIntoGrad
        return F.linear(rows, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        rows, weight = ctx.saved_tensors
        parameter = ctx.parameter
        grad_rows = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        out_rows = grad_out.reshape(-1, grad_out.shape[-1]).t()
        in_rows = rows.reshape(-1, rows.shape[-1])
        _add_into_grad(parameter, lambda grad: grad.addmm_(out_rows, in_rows), lambda: out_rows.mm(in_rows))
        return grad_rows, None


__all__ = ["InPlaceModule", "accumulate_in_place", "in_place_modules", "in_place_problem"]
