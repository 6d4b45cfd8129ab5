"""The step chain against a hand-written PyTorch loop, and one test per rule of DESIGN.md section 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_optimizer, prompt_completion_dataset, reference_loop, tiny_model

from cadence import Engine, iter_windows, make_window
from cadence.data import TokenDataset, collate, epoch_order, iterate_micro_batches
from cadence.engine.schedules import build_lr_scheduler, lr_factor

EFFECTIVE = 8
STEPS = 4  # 4 windows of 8 = 32 samples; the datasets hold more, so no epoch boundary inside the test


def engine_run(dataset: TokenDataset, *, micro: int, steps: int, max_grad_norm: float, precision: str = "fp32",
               seed: int = 0, warmup: int = 2) -> tuple[list[float], torch.nn.Module, Engine]:
    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=warmup, max_steps=steps)
    engine = Engine(model, optimizer, scheduler=scheduler, precision=precision, max_grad_norm=max_grad_norm)
    losses = []
    windows = iter_windows(iterate_micro_batches(dataset, micro, seed, 0), EFFECTIVE // micro, micro_batch_size=micro)
    for window, _ in zip(windows, range(steps)):
        result = engine.step(window)
        assert not result.skipped
        losses.append(result.loss)
    return losses, model, engine


def relative_l2(a: torch.nn.Module, b: torch.nn.Module) -> float:
    flat_a = torch.cat([p.detach().flatten() for p in a.parameters()])
    flat_b = torch.cat([p.detach().flatten() for p in b.parameters()])
    return float((flat_a - flat_b).norm() / flat_b.norm())


def assert_losses_close(actual: list[float], expected: list[float], rel: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rel * abs(e), f"step {step}: {a} vs {e}"


# -------------------------------------------------------------------------------------------- parity and splits
@pytest.mark.parametrize("data", ["packed", "prompt_completion"])
@pytest.mark.parametrize("micro", [8, 2, 1])
@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_split_matches_hand_written_one_big_batch_loop(data, micro, max_grad_norm, packed_dataset, variable_dataset):
    dataset = packed_dataset if data == "packed" else variable_dataset
    expected_losses, expected_model = reference_loop(dataset, steps=STEPS, max_grad_norm=max_grad_norm)
    losses, model, engine = engine_run(dataset, micro=micro, steps=STEPS, max_grad_norm=max_grad_norm)
    assert_losses_close(losses, expected_losses)
    assert relative_l2(model, expected_model) < 1e-4
    assert engine.steps == STEPS and engine.skipped_steps == 0


def test_variable_length_data_really_has_10x_target_spread(variable_dataset):
    counts = [example.num_targets for example in variable_dataset]
    assert max(counts) >= 10 * min(counts)


def test_per_micro_batch_mean_would_be_caught(variable_dataset):
    """Sanity of the parity test: averaging per micro-batch (the 2024 bug) changes the weights beyond tolerance."""
    _, expected_model = reference_loop(variable_dataset, steps=STEPS, max_grad_norm=0.0)
    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=2, max_steps=STEPS)
    for window, _ in zip(iter_windows(iterate_micro_batches(variable_dataset, 2, 0, 0), 4), range(STEPS)):
        for batch in window.micro_batches:
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100) / 4
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert relative_l2(model, expected_model) > 1e-3


# -------------------------------------------------------------------------------------------- clipping
def test_clipping_once_per_window_not_per_micro_batch(packed_dataset):
    """With active clipping, clipping each micro-batch's partial gradient gives a different model than the engine."""
    _, engine_model, _ = engine_run(packed_dataset, micro=2, steps=STEPS, max_grad_norm=0.05)
    _, reference = reference_loop(packed_dataset, steps=STEPS, max_grad_norm=0.05)
    assert relative_l2(engine_model, reference) < 1e-4

    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=2, max_steps=STEPS)
    for window, _ in zip(iter_windows(iterate_micro_batches(packed_dataset, 2, 0, 0), 4), range(STEPS)):
        for batch in window.micro_batches:
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            (loss / window.targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # the bug: clipping inside the micro loop
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert relative_l2(model, reference) > 1e-3


def fp16_reference(dataset: TokenDataset, *, micro: int, steps: int, max_grad_norm: float,
                   unscale_first: bool = True) -> torch.nn.Module:
    """A hand-written fp16 loop with GradScaler; ``unscale_first=False`` is the clip-before-unscale bug."""
    model = tiny_model()
    optimizer = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu")
    windows = iter_windows(iterate_micro_batches(dataset, micro, 0, 0), EFFECTIVE // micro)
    for window, _ in zip(windows, range(steps)):
        for batch in window.micro_batches:
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="sum")
            scaler.scale(loss / window.targets).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model


def test_fp16_unscales_before_clipping(packed_dataset):
    model = tiny_model()
    optimizer = make_optimizer(model)
    # Compared bit for bit with a hand-written loop that sums gradients the way autograd does: fp16's forward rounds
    # so coarsely that any other fp32 summation order (1e-7, the in-place embedding gradient's: its own test is
    # tests/engine/test_accumulation_in_place.py) grows to 4e-4 in 4 steps, as a 1e-7 change of the weights grows to
    # 2e-3. This test is about the clipping order, so it keeps autograd's order.
    engine = Engine(model, optimizer, precision="fp16", max_grad_norm=0.5, gradients_in_place=False)
    for window, _ in zip(iter_windows(iterate_micro_batches(packed_dataset, 2, 0, 0), 4), range(STEPS)):
        result = engine.step(window)
        assert not result.skipped and result.loss_scale == 2.0**16
        assert result.grad_norm is not None and result.grad_norm < 100, "grad_norm must be reported unscaled"
    right = fp16_reference(packed_dataset, micro=2, steps=STEPS, max_grad_norm=0.5)
    wrong = fp16_reference(packed_dataset, micro=2, steps=STEPS, max_grad_norm=0.5, unscale_first=False)
    assert relative_l2(model, right) < 1e-4
    assert relative_l2(model, wrong) > 1e-3


# -------------------------------------------------------------------------------------------- schedule and skips
def test_scheduler_advances_once_per_optimizer_step_not_per_micro_batch(packed_dataset):
    _, _, engine = engine_run(packed_dataset, micro=1, steps=3, max_grad_norm=1.0, warmup=0)
    assert engine.scheduler.last_epoch == 3  # 3 optimizer steps, 24 micro-batches
    expected = 1e-2 * lr_factor(3, schedule="cosine", warmup_steps=0, max_steps=3)
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def overflow_on(window_number: int):
    """A loss function whose loss is huge in one window: its fp16-scaled gradients overflow to inf."""
    from cadence.engine.step import token_cross_entropy_sum

    calls = {"window": 0}

    def loss_fn(model, batch):
        loss = token_cross_entropy_sum(model, batch)
        return loss * 1e38 if calls["window"] == window_number else loss

    return loss_fn, calls


def test_fp16_overflow_skips_step_keeps_lr_and_counts_it(packed_dataset):
    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule="linear", warmup_steps=0, max_steps=10)
    loss_fn, calls = overflow_on(window_number=2)
    engine = Engine(model, optimizer, scheduler=scheduler, precision="fp16", max_grad_norm=1.0, loss_fn=loss_fn)
    results = []
    for number, window in enumerate(iter_windows(iterate_micro_batches(packed_dataset, 4, 0, 0), 2)):
        calls["window"] = number
        before = [p.detach().clone() for p in model.parameters()]
        results.append(engine.step(window))
        if number == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "skipped step changed weights"
        if number == 4:
            break
    skipped = results[2]
    assert skipped.skipped and skipped.skip_reason == "fp16 overflow"
    assert skipped.step == 2  # the step counter did not count it
    assert skipped.lr == results[3].lr  # the LR did not advance past the skipped step
    assert results[3].loss_scale == skipped.loss_scale / 2  # the next step runs with a lower scale
    assert [r.step for r in results] == [1, 2, 2, 3, 4]
    assert engine.skipped_steps == 1 and engine.steps == 4 and scheduler.last_epoch == 4


def test_nonfinite_gradient_in_fp32_skips_instead_of_corrupting_weights(packed_dataset):
    loss_fn, calls = overflow_on(window_number=0)
    model = tiny_model()
    engine = Engine(model, make_optimizer(model), loss_fn=lambda m, b: loss_fn(m, b) * math.inf)
    result = engine.step(next(iter_windows(iterate_micro_batches(packed_dataset, 4, 0, 0), 2)))
    assert result.skipped and result.skip_reason == "non-finite gradients" and result.grad_norm is None
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -------------------------------------------------------------------------------------------- targets and windows
def test_window_without_targets_is_skipped_with_warning_not_divided_by_zero(packed_dataset):
    model = tiny_model()
    engine = Engine(model, make_optimizer(model))
    batch = collate([packed_dataset[0], packed_dataset[1]])
    masked = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], -100)}
    with pytest.warns(UserWarning, match="no loss-bearing targets"):
        result = engine.step([masked, masked])
    assert result.skipped and result.skip_reason == "no targets" and result.loss is None
    assert engine.steps == 0 and engine.skipped_steps == 1


def test_fully_masked_micro_batch_contributes_zero_targets(packed_dataset):
    batch = collate([packed_dataset[i] for i in range(4)])
    masked = {"input_ids": batch["input_ids"], "labels": torch.full_like(batch["labels"], -100)}
    with_masked = tiny_model()
    result = Engine(with_masked, make_optimizer(with_masked)).step([batch, masked])
    alone = tiny_model()
    expected = Engine(alone, make_optimizer(alone)).step([batch])
    assert result.targets == expected.targets == 4 * 16
    assert result.loss == pytest.approx(expected.loss, rel=1e-6)
    assert relative_l2(with_masked, alone) < 1e-6


def test_short_last_window_is_normalised_by_its_own_targets():
    dataset = prompt_completion_dataset(count=20)  # windows of 8, 8 and a short one of 4
    order = epoch_order(len(dataset), 0, 0).tolist()
    reference = tiny_model()
    optimizer = make_optimizer(reference)
    for start in (0, 8, 16):
        batch = collate([dataset[i] for i in order[start:start + 8]])
        F.cross_entropy(reference(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    for micro in (8, 2, 1):
        model = tiny_model()
        engine = Engine(model, make_optimizer(model))
        windows = list(iter_windows(iterate_micro_batches(dataset, micro, 0, 0), 8 // micro, micro_batch_size=micro))
        assert [w.samples for w in windows] == [8, 8, 4] and windows[-1].short
        for window in windows:
            engine.step(window)
        assert relative_l2(model, reference) < 1e-4, f"micro {micro}"


def test_drop_last_window(variable_dataset):
    dataset = prompt_completion_dataset(count=20)
    for micro in (8, 2, 1):
        kept = list(iter_windows(iterate_micro_batches(dataset, micro, 0, 0), 8 // micro, micro_batch_size=micro,
                                 last_window="drop"))
        assert [w.samples for w in kept] == [8, 8]


def test_plain_list_of_micro_batches_is_a_window(packed_dataset):
    batches = [collate([packed_dataset[i]]) for i in range(3)]
    window = make_window(batches)
    assert (window.targets, window.tokens, window.samples) == (48, 48, 3)


def test_reported_counts_and_memory(packed_dataset):
    model = tiny_model()
    engine = Engine(model, make_optimizer(model))
    windows = iter_windows(iterate_micro_batches(packed_dataset, 2, 0, 0), 4)
    first = engine.step(next(windows))
    second = engine.step(next(windows), measure_memory=True)
    assert (first.micro_steps, first.samples, first.tokens, first.targets) == (4, 8, 128, 128)
    assert first.peak_memory_bytes is None  # not measured: never a guess
    params = sum(p.numel() * 4 for p in model.parameters())
    # parameters + AdamW's two moments + gradients at least; activations on top
    assert second.peak_memory_bytes is not None and second.peak_memory_bytes > 4 * params
    assert second.tokens_per_s > 0 and second.step_time_s > 0


def test_nan_in_one_micro_batch_skips_that_step_and_training_continues(packed_dataset):
    from cadence.engine.step import token_cross_entropy_sum

    calls = {"micro": 0}

    def loss_fn(model, batch):
        calls["micro"] += 1
        loss = token_cross_entropy_sum(model, batch)
        return loss * float("nan") if calls["micro"] == 6 else loss  # window 3, second micro-batch

    model = tiny_model()
    engine = Engine(model, make_optimizer(model), loss_fn=loss_fn, max_grad_norm=1.0)
    results = [engine.step(w) for w, _ in zip(iter_windows(iterate_micro_batches(packed_dataset, 2, 0, 0), 2),
                                                range(5))]
    assert [r.skipped for r in results] == [False, False, True, False, False]
    assert results[2].skip_reason == "non-finite gradients" and engine.skipped_steps == 1 and engine.steps == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert results[3].loss is not None and math.isfinite(results[3].loss)
