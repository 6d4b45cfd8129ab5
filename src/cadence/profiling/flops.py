"""FLOPs: what a model needs per token, and what the device can do (measured, not looked up)."""

from __future__ import annotations

import time

import torch

from cadence.engine.choices import PrecisionName
from cadence.engine.precision import Precision
from cadence.models import GPTConfig
from cadence.models.spec import ModelSpec


def model_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token by PaLM's appendix B: 6N + 12 L H Q T.

    N counts the weights every token multiplies through: the blocks and the LM head (tied to the token embedding,
    so the embedding matrix counts once, as the head's matmul); the position embedding is a lookup, not a matmul,
    and is left out. 12 L H Q T is attention's score and value matmuls (forward and backward) at context T.
    Recompute adds hardware FLOPs, not model FLOPs: MFU stays comparable across recompute modes.
    """
    c = config
    per_block = 12 * c.n_embd * c.n_embd + 13 * c.n_embd  # qkv + proj + 2 x mlp (4x) weights, biases, 2 norms
    weights = c.n_layer * per_block + c.vocab_size * c.n_embd + 2 * c.n_embd
    attention = 12 * c.n_layer * c.n_head * c.head_dim * seq_len
    return 6.0 * weights + attention


def matmul_speed(precision: PrecisionName, device: torch.device, size: int = 384, repeats: int = 8,
                 round_seconds: float | None = None) -> float:
    """Multiply-adds per second of a square matmul under ``precision``'s autocast: best of three timed rounds.

    ``round_seconds``: each round runs at most as many of the ``repeats`` multiplies as fit in it (at least one), as
    one timed multiply after the warm-up predicts. An emulated precision (bf16 or fp16 on a CPU without their
    instructions) multiplies 30-50x slower than fp32, so a fixed count would spend seconds learning only that it is
    slow (measured: 9.9 s of a 37 s plan)."""

    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device)
    b = torch.randn(size, size, generator=generator).to(device)
    autocast = Precision(precision, device).autocast

    def timed(count: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        with autocast():
            for _ in range(count):
                a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    timed(1)  # warm-up: kernel selection, autocast's weight cast
    if round_seconds is not None:
        one = timed(1)
        repeats = max(1, min(repeats, int(round_seconds / max(one, 1e-9))))
    best = min(timed(repeats) for _ in range(3))
    return repeats * size**3 / best


def spec_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """The same count for any model, from its spec: 6 x the weights every token multiplies through
    (``spec.matmul_weights``: for the built-in GPT exactly :func:`model_flops_per_token`'s; for a transformers model
    each matmul's 2-D weight, the LM head's included, an embedding being a lookup) + 12 L H Q T for attention."""
    shape = spec.shape
    attention_width = (shape.num_heads or 0) * (shape.head_dim or 0) or shape.hidden_size
    return 6.0 * spec.matmul_weights + 12.0 * shape.num_layers * attention_width * seq_len


def measured_peak_flops(precision: PrecisionName, device: torch.device) -> tuple[float, str]:
    """Peak FLOP/s of this device in ``precision``: a short large-matmul benchmark (2 FLOPs per multiply-add)."""
    size = 4096 if device.type == "cuda" else 1024
    repeats = 20 if device.type == "cuda" else 4
    flops = 2.0 * matmul_speed(precision, device, size=size, repeats=repeats, round_seconds=0.25)
    return flops, f"measured: {precision} matmul {size}x{size} on {device.type}, best of 3 rounds"
