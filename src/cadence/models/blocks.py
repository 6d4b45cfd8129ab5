"""The repeated transformer blocks of a model: the unit that recompute, torch.compile and FSDP2 each work on, and
the kinds of block the memory estimate replays (:data:`BLOCK_LAYOUTS`)."""

from __future__ import annotations

from typing import Any

from torch import nn

BLOCK_LISTS: tuple[str, ...] = ("blocks", "model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers")
"""Where models keep their blocks, first match wins: the built-in GPT (``blocks``), then the Hugging Face layouts
(Llama/Qwen/Mistral and most decoders, GPT-2 and its kin, OPT, GPT-NeoX)."""


BLOCK_LAYOUTS: dict[str, tuple[frozenset[str], ...]] = {
    "llama": (frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),),
    "gpt2": (frozenset({"c_attn", "c_proj", "c_fc"}),  # gpt2 (Conv1D), gpt_bigcode
             frozenset({"q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"}),  # gpt_neo
             frozenset({"q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"})),  # gptj
}
"""The blocks a memory estimator replays (its name: the key), by the names of their linear layers: a model is
replayed by an estimator when every block holds exactly one of its sets, and by none otherwise. llama's: q/k/v/o
attention and a SwiGLU MLP (llama, qwen2, mistral, gemma, ...); gpt2's: LayerNorm blocks with a GELU MLP (the gpt2
family, estimated as gpt2's)."""


def block_layout(block: nn.Module) -> frozenset[str]:
    """The names of a block's linear layers (``nn.Linear`` and transformers' ``Conv1D``), the last part of each."""
    return frozenset(name.rsplit(".", 1)[-1] for name, module in block.named_modules()
                     if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D")


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
