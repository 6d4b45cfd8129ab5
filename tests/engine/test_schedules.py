"""LR schedules are counted in optimizer steps: warmup, then constant, linear or cosine down to the floor."""

from __future__ import annotations

import math

import pytest
import torch

from cadence.engine.schedules import build_lr_scheduler, lr_factor


def test_warmup_starts_above_zero_and_reaches_peak():
    factors = [lr_factor(s, schedule="constant", warmup_steps=4, max_steps=10) for s in range(6)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_goes_from_peak_to_floor(schedule):
    first = lr_factor(2, schedule=schedule, warmup_steps=2, max_steps=12, min_lr_ratio=0.1)
    middle = lr_factor(7, schedule=schedule, warmup_steps=2, max_steps=12, min_lr_ratio=0.1)
    end = lr_factor(12, schedule=schedule, warmup_steps=2, max_steps=12, min_lr_ratio=0.1)
    assert first == pytest.approx(1.0)
    assert middle == pytest.approx(0.55)  # halfway: linear and cosine agree at the midpoint
    assert end == pytest.approx(0.1)


def test_cosine_shape():
    value = lr_factor(1, schedule="cosine", warmup_steps=0, max_steps=4, min_lr_ratio=0.0)
    assert value == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_the_library_s_floor_is_the_command_line_s():
    """Issue 30: build_lr_scheduler decayed to 0.0 by default, cadence train to --min-lr-ratio 0.1."""
    import inspect

    from cadence.config import TrainConfig
    from cadence.engine.schedules import build_lr_scheduler

    for function in (lr_factor, build_lr_scheduler):
        assert inspect.signature(function).parameters["min_lr_ratio"].default == TrainConfig().min_lr_ratio == 0.1
    assert lr_factor(10, schedule="cosine", warmup_steps=0, max_steps=10) == pytest.approx(0.1)


def test_scheduler_object_follows_factor():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=2.0)
    scheduler = build_lr_scheduler(optimizer, schedule="linear", warmup_steps=1, max_steps=5)
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [2.0 * lr_factor(s, schedule="linear", warmup_steps=1, max_steps=5) for s in range(5)]
    assert seen == pytest.approx(expected)


def test_unknown_schedule():
    with pytest.raises(ValueError):
        lr_factor(3, schedule="step", warmup_steps=0, max_steps=5)  # type: ignore[arg-type]


def test_batch_scaled_lr_is_the_step_schedule_at_one_window_and_counts_windows_of_the_minimum():
    """--effective-batch-size adaptive's schedule: with one window of the minimum per step it is the ordinary one;
    a step over 2 windows moves it by 2 (warm-up and decay follow the examples), times the batch's LR scale."""
    from cadence.engine.schedules import BatchScaledLR, build_lr_scheduler, lr_factor

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)

    plain_opt, scaled_opt = optimizer(), optimizer()
    plain = build_lr_scheduler(plain_opt, schedule="cosine", warmup_steps=3, max_steps=10)
    scaled = BatchScaledLR(scaled_opt, schedule="cosine", warmup_steps=3, max_steps=10)
    for _ in range(5):
        assert plain_opt.param_groups[0]["lr"] == scaled_opt.param_groups[0]["lr"]
        plain_opt.step(), scaled_opt.step()
        plain.step(), scaled.step()
    scaled.advance = 2
    scaled.rescale(2 ** 0.5)
    assert scaled_opt.param_groups[0]["lr"] == pytest.approx(2 ** 0.5 * lr_factor(5, schedule="cosine",
                                                                                   warmup_steps=3, max_steps=10))
    scaled_opt.step()
    scaled.step()
    assert scaled.clock == 7
    assert scaled_opt.param_groups[0]["lr"] == pytest.approx(2 ** 0.5 * lr_factor(7, schedule="cosine",
                                                                                   warmup_steps=3, max_steps=10))
    state = scaled.state_dict()
    again = BatchScaledLR(optimizer(), schedule="cosine", warmup_steps=3, max_steps=10)
    again.load_state_dict(state)
    assert (again.clock, again.advance, again.scale) == (7, 2, 2 ** 0.5)
