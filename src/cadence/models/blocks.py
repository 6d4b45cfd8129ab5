"""The repeated transformer blocks of a model: the unit that recompute, torch.compile and FSDP2 each work on."""

from __future__ import annotations

from typing import Any

from torch import nn

BLOCK_LISTS: tuple[str, ...] = ("blocks", "model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")
"""Where models keep their blocks, first match wins: the built-in GPT (``blocks``), then the Hugging Face layouts
(Llama/Qwen/Mistral and most decoders, GPT-2 and its kin, OPT, GPT-NeoX)."""


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of ``module`` (an ``nn.ModuleList`` found at one of :data:`BLOCK_LISTS`), in order.

    Raises ValueError when the model keeps no such list: callers that got the model from a user turn that into a
    message naming their flag."""
    for path in BLOCK_LISTS:
        found: Any = module
        for part in path.split("."):
            found = getattr(found, part, None)
            if found is None:
                break
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return list(found)
    raise ValueError(f"{type(module).__name__} has no list of repeated blocks (looked for "
                     f"{', '.join(BLOCK_LISTS)})")
