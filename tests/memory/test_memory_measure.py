"""The measured memory of a real step: the categories add up, gradients and AdamW state have their exact sizes, the
totals agree with the engine's own meter, accumulation does not grow the peak, and recompute cuts activation memory
without changing a single gradient bit."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model

from cadence.config import TrainConfig
from cadence.engine.step import Engine, token_cross_entropy_sum
from cadence.memory.measure import CATEGORIES, MeasuredMemory, measure_step
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models import build_model
from cadence.training.components import build_optimizer

MiB = 2**20


pytestmark = pytest.mark.usefixtures("one_thread")


def make_window(batch: int, seq: int, accum: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``accum`` micro-batches of random bytes (every label a target)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, 256, (batch, seq), generator=generator),
            "labels": torch.randint(0, 256, (batch, seq), generator=generator),
        }
        for _ in range(accum)
    ]


def steady_engine(
    model: torch.nn.Module, precision: str = "fp32", checkpointing: str = "none", warm_up: bool = True
) -> Engine:
    """An engine as the trainer builds it; ``warm_up`` runs one step first, so AdamW's state exists."""
    apply_activation_checkpointing(model, checkpointing)  # type: ignore[arg-type]
    engine = Engine(model, build_optimizer(model, TrainConfig()), precision=precision, max_grad_norm=1.0)
    if warm_up:
        engine.step(make_window(2, 16, 1, seed=0))
    return engine


def measure(engine: Engine, window: list[dict[str, torch.Tensor]]) -> MeasuredMemory:
    return measure_step(engine.model, engine.optimizer, lambda: engine.step(window), "cpu")


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight is yielded once


@pytest.fixture(scope="module")
def tiny_fp32() -> tuple[Engine, MeasuredMemory]:
    torch.manual_seed(0)
    engine = steady_engine(build_model("gpt-tiny"))
    return engine, measure(engine, make_window(4, 64, 1))


def test_categories_add_up_to_the_peak(tiny_fp32: tuple[Engine, MeasuredMemory]) -> None:
    _, measured = tiny_fp32
    assert measured.source == "profiler memory timeline (cpu)"
    assert set(measured.by_category_at_peak) == set(CATEGORIES) == set(measured.peak_by_category)
    assert sum(measured.by_category_at_peak.values()) == measured.peak_bytes
    for name in CATEGORIES:
        assert 0 <= measured.by_category_at_peak[name] <= measured.peak_by_category[name] <= measured.peak_bytes
    assert measured.activation_peak_bytes == measured.peak_by_category["activation"] > 0
    assert "peak" in measured.summary()


def test_gradients_and_adamw_state_have_their_exact_sizes(tiny_fp32: tuple[Engine, MeasuredMemory]) -> None:
    engine, measured = tiny_fp32
    n = numel(engine.model)
    # fp32 gradients, all alive after the backward; AdamW's two fp32 moments (plus a scalar step per tensor).
    assert measured.peak_by_category["gradient"] == pytest.approx(4 * n, rel=1e-3)
    assert measured.peak_by_category["optimizer_state"] == pytest.approx(8 * n, rel=1e-3)
    assert measured.peak_by_category["parameter"] == pytest.approx(4 * n, rel=1e-3)  # fp32: no autocast copies
    assert measured.baseline_bytes == pytest.approx(12 * n, rel=1e-3)  # what existed before the step


def test_the_first_step_creates_the_optimizer_state() -> None:
    """AdamW allocates its state inside the first step(), before the tracer could tag it; it is still recognised."""
    engine = steady_engine(tiny_model(), warm_up=False)
    measured = measure(engine, make_window(4, 32, 1))
    assert measured.baseline_bytes == pytest.approx(4 * numel(engine.model), rel=1e-3)  # parameters only
    assert measured.peak_by_category["optimizer_state"] == pytest.approx(8 * numel(engine.model), rel=0.01)


def test_autocast_weight_copies_count_as_parameters() -> None:
    torch.manual_seed(0)
    engine = steady_engine(build_model("gpt-tiny"), precision="bf16")
    measured = measure(engine, make_window(4, 64, 1))
    n = numel(engine.model)
    # fp32 masters plus bf16 copies of the weights the matmuls use (all of them, but not the position table).
    assert 4.25 * n < measured.peak_by_category["parameter"] <= 6 * n
    assert measured.peak_by_category["gradient"] == pytest.approx(4 * n, rel=1e-3)  # still fp32


# bf16 + full recompute: emulated bf16 on CPUs without bf16 instructions makes it one of the longest tests.
@pytest.mark.parametrize(("precision", "checkpointing"), [("fp32", "none"),
                                                          pytest.param("bf16", "full", marks=pytest.mark.slow)])
def test_agrees_with_the_engines_step_memory_meter(precision: str, checkpointing: str) -> None:
    """Two steps on the same window: the engine's meter (allocation events) and the timeline agree on the total."""
    torch.manual_seed(0)
    engine = steady_engine(build_model("gpt-tiny"), precision=precision, checkpointing=checkpointing)
    window = make_window(8, 64, 2)
    metered = engine.step(window, measure_memory=True).peak_memory_bytes
    measured = measure(engine, window)
    assert metered is not None
    assert measured.peak_bytes == pytest.approx(metered, rel=0.03)


@pytest.mark.slow
def test_peak_does_not_grow_with_accumulation() -> None:
    """Same micro-batch, 8 micro-batches per step instead of 1: the step's peak stays within 5%.

    What does change is named exactly: from 1 to 2 micro-batches the fp32 gradients are alive during the second
    forward (one gradient buffer, never more); the window's token ids are the caller's data, all of them held for
    the whole step (the engine counts the window's targets before the first backward), so they are reported as
    ``input`` and grow with the window by construction.
    """
    torch.manual_seed(0)
    engine = steady_engine(build_model("gpt-tiny"))
    batch, seq = 8, 256
    runs = {accum: measure(engine, make_window(batch, seq, accum)) for accum in (1, 2, 8)}
    step_peak = {accum: m.peak_bytes - m.by_category_at_peak["input"] for accum, m in runs.items()}
    for accum, m in runs.items():
        print(f"\naccum {accum:2}: peak {m.peak_bytes / MiB:.1f} MiB, without the window's inputs "
              f"{step_peak[accum] / MiB:.1f} MiB ({m.summary()})", end="")
    assert step_peak[8] == pytest.approx(step_peak[1], rel=0.05)
    assert step_peak[8] == pytest.approx(step_peak[2], rel=0.005)
    assert step_peak[2] - step_peak[1] == pytest.approx(4 * numel(engine.model), rel=0.05)
    assert runs[8].by_category_at_peak["input"] >= 8 * 2 * batch * seq * 8


@pytest.mark.slow
def test_full_checkpointing_halves_activation_memory_with_identical_gradients() -> None:
    torch.manual_seed(0)
    reference = build_model("gpt-small")
    recomputed = copy.deepcopy(reference)
    window = make_window(2, 256, 1)

    # Bitwise the same fp32 gradients: recompute re-runs the same kernels on the same inputs.
    apply_activation_checkpointing(recomputed, "full")
    for model in (reference, recomputed):
        token_cross_entropy_sum(model, window[0]).backward()
    for (name, p), q in zip(reference.named_parameters(), recomputed.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
        p.grad = q.grad = None

    measured = {}
    for mode, model in (("none", reference), ("full", recomputed)):
        engine = Engine(model, build_optimizer(model, TrainConfig()), precision="fp32", max_grad_norm=1.0)
        engine.step(window)
        measured[mode] = measure(engine, window)
        print(f"\n{mode}: {measured[mode].summary()}", end="")
    assert measured["full"].activation_peak_bytes <= 0.5 * measured["none"].activation_peak_bytes
    assert measured["full"].peak_bytes < measured["none"].peak_bytes
