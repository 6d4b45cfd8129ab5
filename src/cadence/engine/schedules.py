"""Learning-rate schedules counted in optimizer steps (never micro-batches, never skipped steps)."""

from __future__ import annotations

import math

import torch

from cadence.engine.choices import DEFAULT_MIN_LR_RATIO, LR_SCHEDULES, LRScheduleName


def lr_factor(
    steps_done: int, *, schedule: LRScheduleName, warmup_steps: int, max_steps: int,
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO,
) -> float:
    """Multiplier of the peak LR for the optimizer step that follows ``steps_done`` completed steps.

    Warmup is linear and starts at 1/warmup (not 0: a step at LR 0 is a wasted window). After warmup the LR decays
    from 1 to ``min_lr_ratio`` over the remaining steps (linear or half-cosine), or stays at 1 (constant).
    """
    if warmup_steps > 0 and steps_done < warmup_steps:
        return (steps_done + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, max(0.0, (steps_done - warmup_steps) / decay_steps))
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown LR schedule {schedule!r}; expected one of {LR_SCHEDULES}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    schedule: LRScheduleName,
    warmup_steps: int,
    max_steps: int,
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose ``step()`` the engine calls once per optimizer step that really happened (see
    :func:`lr_factor`; ``min_lr_ratio`` defaults to ``--min-lr-ratio``'s :data:`DEFAULT_MIN_LR_RATIO`)."""

    def factor(steps_done: int) -> float:
        return lr_factor(
            steps_done, schedule=schedule, warmup_steps=warmup_steps, max_steps=max_steps, min_lr_ratio=min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class BatchScaledLR(torch.optim.lr_scheduler.LRScheduler):
    """The schedule of :func:`lr_factor` counted in windows of the minimum batch rather than optimizer steps, times a
    batch multiplier (``--effective-batch-size adaptive``).

    ``clock`` counts the windows of the minimum batch that optimizer steps have consumed (a step over a window of
    ``advance`` of them moves it by ``advance``), so warm-up and decay follow the examples seen, and a grown batch
    does not shorten them; ``scale`` is the LR multiplier of the current batch (``--batch-lr-scaling``). With both at
    1 it is exactly :func:`build_lr_scheduler`'s schedule. Its state dict holds all four (a resume continues them)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, schedule: LRScheduleName, warmup_steps: int,
                 max_steps: int, min_lr_ratio: float = DEFAULT_MIN_LR_RATIO) -> None:
        self.schedule, self.warmup_steps, self.max_steps, self.min_lr_ratio = (schedule, warmup_steps, max_steps,
                                                                                min_lr_ratio)
        self.clock = 0
        """Windows of the minimum batch consumed by the optimizer steps so far."""
        self.advance = 1
        """Windows of the minimum batch in the window the next optimizer step runs."""
        self.scale = 1.0
        super().__init__(optimizer)

    def _rates(self) -> list[float | torch.Tensor]:
        factor = self.scale * lr_factor(self.clock, schedule=self.schedule, warmup_steps=self.warmup_steps,
                                        max_steps=self.max_steps, min_lr_ratio=self.min_lr_ratio)
        return [float(base) * factor for base in self.base_lrs]

    def get_lr(self) -> list[float | torch.Tensor]:
        return self._rates()

    def step(self, epoch: int | None = None) -> None:
        if getattr(self, "_step_count", 0) > 0:  # not the constructor's initial step
            self.clock += self.advance
        super().step(epoch)

    def rescale(self, scale: float) -> None:
        """The batch changed: the LR of the next step (and after) is the schedule's times ``scale``."""
        self.scale = scale
        rates = self._rates()
        for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        self._last_lr = rates
