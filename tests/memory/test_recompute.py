"""Activation checkpointing: identical fp32 gradients, unchanged state_dict names, less activation memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, tiny_model

from cadence.memory.recompute import apply_activation_checkpointing, checkpoint_blocks


def grads_after_backward(mode: str, precision_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    model = tiny_model()
    apply_activation_checkpointing(model, mode)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, TINY.context_length))
    if precision_dtype is None:
        logits = model(ids)
    else:
        with torch.autocast("cpu", dtype=precision_dtype):
            logits = model(ids)
    F.cross_entropy(logits.float().flatten(0, 1), ids.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_fp32_gradients_identical_to_no_checkpointing(mode):
    reference = grads_after_backward("none")
    for got, want in zip(grads_after_backward(mode), reference):
        assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_bf16_autocast_works_with_recompute(mode):
    reference = grads_after_backward("none", torch.bfloat16)
    for got, want in zip(grads_after_backward(mode, torch.bfloat16), reference):
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-4)


def test_state_dict_names_unchanged_and_eval_skips_recompute():
    plain = tiny_model()
    model = tiny_model()
    assert apply_activation_checkpointing(model, "full") == TINY.n_layer
    assert list(model.state_dict()) == list(plain.state_dict())
    with torch.no_grad():
        ids = torch.randint(0, 256, (2, 8))
        assert torch.equal(model(ids), plain(ids))


def test_measured_peak_shrinks():
    """Full keeps only block inputs; selective keeps matmul outputs and recomputes the cheap ops."""
    from cadence.memory.meter import StepMemoryMeter

    def peak(mode: str) -> int:
        model = tiny_model()
        apply_activation_checkpointing(model, mode)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        meter = StepMemoryMeter(torch.device("cpu"))
        ids = torch.randint(0, 256, (16, TINY.context_length))
        with meter.measure(model=model, optimizer=optimizer, enabled=True):
            model(ids).float().logsumexp(-1).sum().backward()
        assert meter.peak_bytes is not None
        return meter.peak_bytes

    none, selective, full = peak("none"), peak("selective"), peak("full")
    assert full < selective < none


def test_bad_mode_and_double_application():
    model = tiny_model()
    with pytest.raises(ValueError):
        apply_activation_checkpointing(model, "most")  # type: ignore[arg-type]
    apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError):
        apply_activation_checkpointing(model, "selective")
    with pytest.raises(ValueError):
        checkpoint_blocks(torch.nn.Linear(2, 2))
