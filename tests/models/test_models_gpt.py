"""Tests of the built-in GPT: parameter counts, weight tying, causality, padding independence, errors."""

from __future__ import annotations

import math

import pytest
import torch

from cadence.errors import UsageError
from cadence.models import (
    GPT,
    MODEL_CONFIGS,
    MODEL_NAMES,
    Block,
    GPTConfig,
    build_model,
    model_context_length,
)

TINY = GPTConfig(context_length=16, n_layer=2, n_head=2, n_embd=16)
"""Much smaller than gpt-tiny, for behaviour tests that do not depend on the size."""


def count(model: torch.nn.Module) -> int:
    """Distinct parameters (``parameters()`` already yields a tied tensor once)."""
    return sum(p.numel() for p in model.parameters())


def make(config: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).eval()


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("gpt-tiny", 0.8e6, 1.3e6), ("gpt-small", 8e6, 13e6), ("gpt-base", 75e6, 95e6)],
)
def test_builtin_parameter_counts(name: str, low: float, high: float) -> None:
    # gpt-base is 86M parameters: instantiated here and nowhere else in the suite.
    model = build_model(name)
    real = count(model)
    print(f"{name}: {real:,} parameters")
    assert real == MODEL_CONFIGS[name].num_parameters()
    assert low <= real <= high


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        GPTConfig(vocab_size=100, context_length=7, n_layer=3, n_head=3, n_embd=24),
        GPTConfig(context_length=1, n_layer=1, n_head=1, n_embd=8),
    ],
)
def test_analytic_count_matches_module(config: GPTConfig) -> None:
    assert count(GPT(config)) == config.num_parameters()


def test_names_and_context_lengths() -> None:
    assert MODEL_NAMES == ("gpt-tiny", "gpt-small", "gpt-base")
    assert [model_context_length(n) for n in MODEL_NAMES] == [256, 512, 1024]


@pytest.mark.parametrize("call", [build_model, model_context_length])
def test_unknown_model_is_a_usage_error(call: object) -> None:
    with pytest.raises(UsageError) as caught:
        call("gpt-huge")  # type: ignore[operator]
    (problem,) = caught.value.problems
    assert problem.where == "--model"
    assert "'gpt-huge'" in problem.message and "gpt-tiny, gpt-small, gpt-base" in problem.message


def test_lm_head_is_tied_to_token_embedding() -> None:
    model = make()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    # Tied parameters appear once, and a step on one is a step on the other.
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names
    with torch.no_grad():
        model.tok_emb.weight[3, 0] = 42.0
    assert model.lm_head.weight[3, 0].item() == 42.0


def test_blocks_structure_and_init() -> None:
    config = GPTConfig(context_length=8, n_layer=8, n_head=4, n_embd=256)
    model = make(config)
    assert isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 8 and all(isinstance(b, Block) for b in model.blocks)
    block = model.blocks[0]
    assert block.attn.qkv.bias is not None and block.ln1.bias is not None
    assert torch.all(block.attn.qkv.bias == 0)
    # GPT-2 init: 0.02 everywhere, residual projections scaled by 1/sqrt(2 * n_layer) = 1/4 here.
    assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * config.n_layer)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert block.mlp.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_forward_shape_and_determinism() -> None:
    ids = torch.randint(0, 256, (3, 10))
    logits = make(seed=1)(ids)
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    # Same seed, same weights, same logits: there is no dropout or other randomness.
    assert torch.equal(logits, make(seed=1)(ids))


def test_causality() -> None:
    model = make()
    ids = torch.randint(0, 256, (1, TINY.context_length))
    t = 9
    changed = ids.clone()
    changed[0, t] = (ids[0, t] + 1) % 256
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_right_padding_does_not_change_real_logits() -> None:
    model = make()
    short = torch.randint(1, 256, (1, 5))
    long = torch.randint(1, 256, (1, 12))
    padded = torch.cat([short, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    with torch.no_grad():
        alone = model(short)
        batched = model(torch.cat([padded, long], dim=0))
        long_alone = model(long)
    torch.testing.assert_close(batched[0, :5], alone[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batched[1], long_alone[0], atol=1e-5, rtol=0)


def test_sequence_longer_than_context_is_an_error() -> None:
    model = make()
    model(torch.zeros(1, TINY.context_length, dtype=torch.long))  # exactly the context length is fine
    with pytest.raises(ValueError, match="context length 16"):
        model(torch.zeros(1, TINY.context_length + 1, dtype=torch.long))


def test_backward_reaches_every_parameter() -> None:
    model = make()
    ids = torch.randint(0, 256, (2, 8))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, dims=1).flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(context_length=8, n_layer=1, n_head=3, n_embd=16),  # 16 not divisible by 3
        dict(context_length=0, n_layer=1, n_head=1, n_embd=8),
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        GPTConfig(**kwargs)
