"""Models: the built-in byte-level GPT and transformers' causal LMs, each a family behind one value, the
:class:`ModelSpec` (``models/spec.py``) that the rest of cadence holds."""

from __future__ import annotations

from cadence.models.blocks import repeated_blocks
from cadence.models.builtin import MODEL_NAMES, gpt_config
from cadence.models.compile import CompileClock, CompileStats, compile_blocks, compile_problem, compile_stats
from cadence.models.family import BuiltModel, Supports
from cadence.models.gpt import GPT, MODEL_CONFIGS, Block, GPTConfig
from cadence.models.shape import ModelShape
from cadence.models.spec import ModelSpec


def build_model(name: str) -> GPT:
    """Build a freshly initialised built-in GPT (seed the global RNG first for reproducible weights)."""
    return GPT(gpt_config(name))


def model_context_length(name: str) -> int:
    """Longest sequence the built-in model ``name`` accepts, without building it."""
    return gpt_config(name).context_length


__all__ = [
    "GPT", "GPTConfig", "Block", "BuiltModel", "MODEL_CONFIGS", "MODEL_NAMES", "CompileClock", "CompileStats",
    "ModelShape", "ModelSpec", "Supports", "build_model", "compile_blocks", "compile_problem", "compile_stats",
    "model_context_length", "repeated_blocks",
]
