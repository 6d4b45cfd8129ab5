"""Built-in models: a byte-level GPT in three sizes, selected by ``--model``."""

from __future__ import annotations

from cadence.errors import UsageError
from cadence.models.blocks import repeated_blocks
from cadence.models.compile import CompileClock, CompileStats, compile_blocks, compile_problem, compile_stats
from cadence.models.gpt import GPT, MODEL_CONFIGS, Block, GPTConfig

MODEL_NAMES: tuple[str, ...] = tuple(MODEL_CONFIGS)
"""Names accepted by ``--model`` for the built-in GPT, smallest first."""


def _config(name: str) -> GPTConfig:
    """Look up a built-in config, naming ``--model`` when the name is unknown."""
    try:
        return MODEL_CONFIGS[name]
    except KeyError:
        raise UsageError.single(
            "--model", f"unknown model {name!r}; built-in models are {', '.join(MODEL_NAMES)}"
        ) from None


def build_model(name: str) -> GPT:
    """Build a freshly initialised built-in GPT (seed the global RNG first for reproducible weights)."""
    return GPT(_config(name))


def model_context_length(name: str) -> int:
    """Longest sequence the built-in model ``name`` accepts, without building it."""
    return _config(name).context_length


__all__ = [
    "GPT", "GPTConfig", "Block", "MODEL_CONFIGS", "MODEL_NAMES", "CompileClock", "CompileStats", "build_model",
    "compile_blocks", "compile_problem", "compile_stats", "model_context_length", "repeated_blocks",
]
