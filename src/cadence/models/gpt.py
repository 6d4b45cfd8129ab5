"""A small byte-level GPT decoder: the built-in model that every cadence feature is tested on.

The model is deliberately plain (pre-norm blocks, fused qkv, tied LM head, no dropout) so that runs are deterministic
and the analytic parameter count in :meth:`GPTConfig.num_parameters` can be checked against the real module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. Frozen, so one config can be shared by many models safely."""

    vocab_size: int = 256
    """Number of token ids; 256 because tokens are raw bytes."""
    context_length: int
    """Longest sequence the model accepts (size of the learned position table)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int
    """Width of the residual stream."""

    def __post_init__(self) -> None:
        # These are programming errors (configs are built-in, not typed by users), hence ValueError.
        for name in ("vocab_size", "context_length", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    def num_parameters(self) -> int:
        """Number of distinct parameters of ``GPT(self)``, computed without building it.

        The LM head is tied to the token embedding, so it adds nothing.
        """
        e = self.n_embd
        layer_norm = 2 * e  # weight + bias
        attention = (e * 3 * e + 3 * e) + (e * e + e)  # fused qkv + output projection
        mlp = (e * 4 * e + 4 * e) + (4 * e * e + e)  # up + down projection
        block = 2 * layer_norm + attention + mlp
        embeddings = self.vocab_size * e + self.context_length * e
        return embeddings + self.n_layer * block + layer_norm


DocumentSpans = list[list[tuple[int, int]]]
"""Per row of a packed batch, the ``(start, end)`` positions of each example, in order, covering the row."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=True)
        # Named ``proj`` like the MLP's: GPT._init_weights finds the residual-stream projections by that name.
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=True)

    def forward(self, x: torch.Tensor, documents: DocumentSpans | None = None) -> torch.Tensor:
        """``x``: [B, T, C] -> [B, T, C]. ``documents``: for packed rows, where each row's examples lie (see
        :func:`document_spans`); None is plain causal attention over the whole row."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, H, T, D], the layout scaled_dot_product_attention expects.
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        if documents is not None:
            return _document_attention(q, k, v, documents, self.proj)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


def _document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentSpans,
                        proj: nn.Module) -> torch.Tensor:
    """``proj`` of block-diagonal causal attention over packed rows: [B, H, T, D] x 3 -> [B, T, C]. Each example of
    a row attends causally within itself only.

    Computed example by example with the causal kernel rather than once over the row with a [T, T] mask: a mask
    forces SDPA onto a kernel that computes (and for the backward keeps) every one of the T x T scores, most of
    them masked out, where the examples' own causal blocks are a fraction of that. Measured on this machine for
    gpt-small's heads at T=1024 and a typical packing (forward + backward): fp32 0.31 s against the mask's 0.49 s,
    bf16 1.27 s against 2.56 s. The loop costs one small kernel call per example, nothing next to the matmuls.

    Memory, measured the same way: this holds what plain causal attention holds, no more. The inputs are split,
    not sliced (a slice's backward allocates a zero tensor of the whole input per slice). Each example's output is
    projected on its own: SDPA already lays it out as [L, H * D] rows, so the projection saves a view of what SDPA
    saves anyway, and only the projected pieces (which nothing saves) are concatenated. Concatenating the attention
    outputs first would keep a second copy of them, for the projection's backward, in every block (+10.5 MiB per
    block for gpt-small at 7 x 1024).
    """
    pieces = []
    for row, (q_row, k_row, v_row) in enumerate(zip(q.unbind(0), k.unbind(0), v.unbind(0), strict=True)):
        lengths = [end - start for start, end in documents[row]]
        for q_doc, k_doc, v_doc in zip(q_row.split(lengths, dim=1), k_row.split(lengths, dim=1),
                                       v_row.split(lengths, dim=1), strict=True):
            out = F.scaled_dot_product_attention(q_doc[None], k_doc[None], v_doc[None], is_causal=True)  # [1,H,L,D]
            pieces.append(proj(out[0].transpose(0, 1).flatten(1)))  # [L, H * D] -> [L, C]
    b, _, t, _ = q.shape
    return torch.cat(pieces, dim=0).view(b, t, -1)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=True)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [B, T, C] -> [B, T, C]."""
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Public because activation checkpointing wraps each block of :attr:`GPT.blocks`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=True)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=True)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, documents: DocumentSpans | None = None) -> torch.Tensor:
        """``x``: [B, T, C] -> [B, T, C]; ``documents`` as in :class:`CausalSelfAttention`."""
        x = x + self.attn(self.ln1(x), documents)
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """Byte-level GPT decoder: ``input_ids`` [B, T] -> logits [B, T, vocab_size]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.context_length, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=True)
        # No bias on the head: a tied head is a read-out of the embedding table (as in GPT-2), and a bias would be
        # the only untied output parameter.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).

        The scaling keeps the residual stream's variance from growing with depth (two residual adds per block).
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head:
                    continue  # tied: initialised as the embedding below
                # attn.proj and mlp.proj are the two layers per block that write into the residual stream.
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``: int64 [B, T] with T <= context_length -> logits [B, T, vocab_size].

        ``position_ids`` [B, T] (optional): packed rows, several examples one after another, each counting its
        positions from 0. A position 0 starts a new example, and attention never crosses into the example before
        it (block-diagonal causal attention), so each example's logits are those it has alone."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.context_length:
            # Internal error: the config layer validates --seq-len against the model before we get here.
            raise ValueError(f"sequence length {t} exceeds the model's context length {self.config.context_length}")
        if position_ids is None:
            x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(t, device=input_ids.device))
            documents = None
        else:
            x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
            documents = document_spans(position_ids)
        for block in self.blocks:
            x = block(x, documents) if documents is not None else block(x)
        return self.lm_head(self.ln_f(x))


def document_spans(position_ids: torch.Tensor) -> DocumentSpans:
    """Where each example of each packed row lies: per row, ``(start, end)`` of every run of positions that starts
    at position id 0 (how packed rows are laid out, as in transformers). Computed once per forward, on the host:
    every block's attention uses the same spans."""
    starts = position_ids == 0
    starts[:, 0] = True  # a row that does not begin at position id 0 still begins an example there
    width = position_ids.shape[1]
    spans: DocumentSpans = [[] for _ in range(position_ids.shape[0])]
    for row, columns in enumerate(starts.cpu().tolist()):
        begins = [at for at, first in enumerate(columns) if first]
        spans[row] = list(zip(begins, [*begins[1:], width]))
    return spans


MODEL_CONFIGS: dict[str, GPTConfig] = {
    # about 1.06M parameters
    "gpt-tiny": GPTConfig(context_length=256, n_layer=5, n_head=4, n_embd=128),
    # about 10.9M parameters
    "gpt-small": GPTConfig(context_length=512, n_layer=6, n_head=6, n_embd=384),
    # about 86.0M parameters
    "gpt-base": GPTConfig(context_length=1024, n_layer=12, n_head=12, n_embd=768),
}
"""Built-in model sizes, by the name given to ``--model``."""
