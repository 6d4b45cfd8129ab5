"""Attention for packed rows of transformers models: each example's own causal attention, not a dense mask.

Under ``--packing`` a row holds several examples one after another, their ``position_ids`` restarting at 0 at each.
transformers keeps them apart by turning those restarts into a block-diagonal mask of (row, query, key) booleans,
which SDPA then applies: attention is computed over the whole row (the causal kernel's skipping of the upper
triangle lost to the explicit mask), and, since SDPA's grouped-query path takes no mask, k and v are first repeated
to the query heads. Measured on a transformers llama on CPU (issue 30): packing ran at 1,392 tokens/s against
by-length's 2,464, with more memory, although it computed 8% padding against 43%.

``cadence_sdpa`` is transformers' SDPA attention with one difference: for a packed batch (no cache, ``position_ids``
made of whole runs 0, 1, 2, ... from each row's first position) it runs SDPA once per example, with ``is_causal``
and grouped-query attention, and concatenates the outputs; the mask transformers built is not needed. Everything
else (unpacked rows, padding masks, generation with a cache, blocks compiled by ``--compile``) goes to
transformers' own SDPA function unchanged. The result is the same attention (to rounding: the kernels sum in
different blocks).

The name is registered in transformers' attention registries (its documented extension point, a class-wide mapping:
registering twice is harmless) and set on the models cadence builds; a saved model says ``sdpa`` again
(:func:`transformers_attention`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_NAME = "cadence_sdpa"
"""The attention implementation cadence sets on transformers models whose config asks for ``sdpa``."""


def example_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the (start, end) of each example of a packed batch: runs of ``position_ids`` 0, 1, 2, ... that start
    at the row's first position. None when the positions are not that (a left-padded row's positions, one run per
    row: nothing packed, or a shape other than [rows, length]), so the caller keeps transformers' own attention."""
    if position_ids.dim() != 2 or position_ids.shape[1] == 0:
        return None
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    whole_runs = bool((position_ids[:, 0] == 0).all()) and bool(((steps == 1) | (position_ids[:, 1:] == 0)).all())
    if not whole_runs:
        return None
    # One transfer to the host per layer call: the spans decide Python-level slicing. On a GPU it is a sync point,
    # but a small one (the starts of the examples) next to the layer's matmuls.
    length = position_ids.shape[1]
    starts: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
    for row, column in (position_ids == 0).nonzero().tolist():
        starts[row].append(column)
    spans = [list(zip(row, [*row[1:], length], strict=True)) for row in starts]
    if all(len(row) == 1 for row in spans):
        return None  # nothing packed: the causal kernel over whole rows is already right
    return spans


def packed_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [rows, heads, length, head size], key and value [rows, kv heads,
    length, head size]; returns the output as [rows, length, heads, head size] and no attention weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions = kwargs.get("position_ids")
    spans = None
    # Under --compile the spans would be Python-level slicing of data-dependent sizes: a graph break and a new
    # compile for every new set of lengths. Compiled blocks keep transformers' masked attention (same result).
    plain_causal = (kwargs.get("position_bias") is None and kwargs.get("softcap") is None
                    and not kwargs.get("output_attentions", False) and getattr(module, "is_causal", True)
                    and is_causal is not False)
    if (plain_causal and not torch.compiler.is_compiling() and positions is not None
            and query.shape[2] == key.shape[2] and positions.shape[0] == query.shape[0]):
        # Per layer: a few integers to the host, next to the mask transformers still builds once per forward for
        # the fallback (measured within the 1.12x of BENCHMARKS.md).
        spans = example_spans(positions)
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    grouped = key.shape[1] != query.shape[1]
    rows = []
    # unbind and split, not indexing: their backward is one stack / cat of the pieces' gradients, where a slice's
    # backward would fill a zero tensor of the whole input for every piece (measured: a third of the packed step).
    for q_row, k_row, v_row, row_spans in zip(query.unbind(0), key.unbind(0), value.unbind(0), spans, strict=True):
        sizes = [end - start for start, end in row_spans]
        pieces = [
            F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), dropout_p=dropout,
                                           scale=scaling, is_causal=True, enable_gqa=grouped)
            for q, k, v in zip(q_row.split(sizes, dim=1), k_row.split(sizes, dim=1), v_row.split(sizes, dim=1),
                               strict=True)
        ]
        rows.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    output = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return output.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, packed_sdpa_attention)
    # The mask transformers makes for sdpa: still made (a padding mask, generation, and the fallback need it).
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_packed_attention(model: nn.Module) -> bool:
    """Set ``cadence_sdpa`` on ``model`` when it runs transformers' SDPA attention through the attention interface;
    returns whether it did (other implementations, eager or flash, are left as they are)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        return False  # a model family that calls SDPA itself, outside the interface
    _register()
    getattr(model, "set_attn_implementation")(ATTENTION_NAME)  # a transformers model's method (checked above)
    return getattr(config, "_attn_implementation", None) == ATTENTION_NAME


def runs_packed_attention(model: nn.Module) -> bool:
    """Whether ``model`` (a transformers model, or a peft one around it) attends packed rows example by example."""
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION_NAME


@contextlib.contextmanager
def transformers_attention(model: nn.Module) -> Iterator[None]:
    """While saving: the model's config says ``sdpa`` (what anyone loading it has), then cadence's again. ``model``
    may be a peft model (--lora-rank): its base model is the transformers one."""
    get_base = getattr(model, "get_base_model", None)
    # a transformers model (its methods are not nn.Module's)
    transformers_model: Any = get_base() if callable(get_base) else model
    config = getattr(transformers_model, "config", None)
    ours = getattr(config, "_attn_implementation", None) == ATTENTION_NAME
    if ours:
        transformers_model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        if ours:
            transformers_model.set_attn_implementation(ATTENTION_NAME)


__all__ = ["ATTENTION_NAME", "example_spans", "packed_sdpa_attention", "runs_packed_attention",
           "transformers_attention", "use_packed_attention"]
