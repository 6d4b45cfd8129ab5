"""The sizes of a model, whatever its family: what a memory estimate, a FLOP count and a plan read.

A frozen value without torch: the built-in GPT reports its config's sizes in it, a transformers model the sizes its
config declares (read from a model built on the meta device, so nothing is allocated), and
:class:`cadence.models.spec.ModelSpec` carries it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes a memory estimate needs (None where the model's config has no such idea)."""

    num_layers: int
    """Repeated blocks."""
    hidden_size: int
    """Width of the residual stream."""
    num_heads: int | None
    """Attention heads per block."""
    num_kv_heads: int | None
    """Key/value heads (grouped-query attention); equal to num_heads for plain multi-head attention."""
    head_dim: int | None
    """Width of one attention head."""
    intermediate_size: int | None
    """Width of the MLP's hidden layer."""
    vocab_size: int
    """Token ids the embedding and the head hold."""
    context_length: int
    """Longest sequence the model accepts."""
    num_parameters: int
    """Distinct parameters of the built model (a tied LM head counted once; LoRA adapters not counted)."""
    tied_embeddings: bool
    """The LM head shares the token embedding's weight."""

    @property
    def embedding_bytes(self) -> int:
        """fp32 bytes of the token embedding (vocabulary x width): the largest tensor of a model with a large
        vocabulary, whose gradient accumulation would hold twice if the engine did not add it straight into
        ``.grad`` (cadence.memory.grad_in_place)."""
        return self.vocab_size * self.hidden_size * 4


__all__ = ["ModelShape"]
