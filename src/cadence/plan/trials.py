"""Short measured trials of a training configuration: peak memory and throughput of real steps.

A trial builds the real model, optimizer and engine for one configuration and runs a few windows of the real data:
the first allocates the optimizer state (warm-up, not timed), the second is measured for memory (on CPU by the
profiler, which slows it, so it is not timed either), and the rest are timed. Throughput is the median over the timed
steps, so one slow step (another process, a page fault) does not decide a plan.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cadence.config import TrainConfig
from cadence.data import DataSplits
from cadence.engine.windows import epoch_windows
from cadence.plan.models import fresh_hf
from cadence.training.components import build_components
from cadence.training.prepare import Prepared
from cadence.verify.equivalence import Setup

MIN_TRIAL_STEPS = 3
"""Warm-up, memory and at least one timed step."""


DECISION_FIELDS = ("micro_batch_size", "grad_accum_steps", "precision", "activation_checkpointing", "offload")
"""What a plan decides, in plan.json's order: a verify Setup and the accumulation that makes the effective batch."""

CUT_DEFAULTS: dict[str, Any] = {"micro_batch_order": "drawn", "micro_batch_tokens": None, "packing": False}
"""How the chosen configuration cuts each window (train's flags of those names, with their defaults), decided after
it for data of variable lengths; a plan.json without them (before issue 15) means these defaults."""


@dataclass(kw_only=True, frozen=True)
class TrialSetup(Setup):
    """The decision variables of a plan: how a window is cut and computed (the verify Setup, so that the quality
    check compares exactly this) plus how many micro-batches make the effective batch."""

    grad_accum_steps: int

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DECISION_FIELDS}

    def cut_dict(self) -> dict[str, Any]:
        """The cut as train's flags (``packing`` is a switch; its row length is the sequence length)."""
        return {"micro_batch_order": self.micro_batch_order, "micro_batch_tokens": self.micro_batch_tokens,
                "packing": self.pack_length is not None}

    def describe(self) -> str:
        return (f"micro {self.micro_batch_size} x accum {self.grad_accum_steps}, {self.precision}, "
                f"recompute {self.activation_checkpointing}, offload {self.offload}{self.describe_cut()}")


@dataclass(kw_only=True)
class TrialResult:
    peak_bytes: int | None
    """Measured peak of the memory step (None when the trial could not run)."""
    fits: bool
    """Measured peak within the budget and no out-of-memory error."""
    tokens_per_s: float | None
    """Median over the timed steps."""
    step_time_s: float | None
    """Median optimizer-step wall time."""
    losses: list[float | None]
    error: str | None = None
    real_share: float | None = None
    """Real tokens over computed positions (padding included) over the trial's windows."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def trial_prepared(base: TrainConfig, setup: TrialSetup, *, device: torch.device, seq_len: int, data: DataSplits,
                   max_steps: int) -> Prepared:
    """A Prepared for ``setup`` without re-validating or re-loading the data (the plan did both once); a Hugging
    Face model is built afresh (seeded) for every trial."""
    config = dataclasses.replace(
        base, micro_batch_size=setup.micro_batch_size, grad_accum_steps=setup.grad_accum_steps,
        effective_batch_size=None, precision=setup.precision, activation_checkpointing=setup.activation_checkpointing,
        offload=setup.offload, max_steps=max_steps, memory_budget=None, **setup.cut_dict(),
    )
    return Prepared(
        config=config, device=device, seq_len=seq_len, micro_batch_size=setup.micro_batch_size,
        grad_accum_steps=setup.grad_accum_steps, effective_batch_size=setup.micro_batch_size * setup.grad_accum_steps,
        world_size=1, data=data, out=Path("-"), memory_budget_bytes=None,  # trials write nothing
        hf=fresh_hf(config),
    )


def run_trial(base: TrainConfig, setup: TrialSetup, *, device: torch.device, seq_len: int, data: DataSplits,
              steps: int, budget_bytes: int) -> TrialResult:
    """Run ``steps`` windows of ``setup`` and measure them; out-of-memory is a result (fits False), not an error."""
    steps = max(steps, MIN_TRIAL_STEPS)
    prep = trial_prepared(base, setup, device=device, seq_len=seq_len, data=data, max_steps=steps)
    parts = build_components(prep)
    # The windows train would run: the epoch's permutation, cut as the setup says.
    windows = epoch_windows(data.train, micro_batch_size=setup.micro_batch_size,
                            grad_accum_steps=setup.grad_accum_steps, seed=base.seed, epoch=0,
                            order=setup.micro_batch_order, micro_batch_tokens=setup.micro_batch_tokens,
                            pack_length=setup.pack_length)
    peak: int | None = None
    tokens = positions = 0
    rates: list[float] = []
    times: list[float] = []
    losses: list[float | None] = []
    try:
        for number, window in zip(range(steps), windows):
            result = parts.engine.step(window, measure_memory=number == 1)
            losses.append(result.loss)
            tokens, positions = tokens + result.tokens, positions + result.tokens + result.padded_positions
            if number == 1 or device.type == "cuda":
                peak = max(peak or 0, result.peak_memory_bytes or 0)
            if number >= 2:
                rates.append(result.tokens_per_s)
                times.append(result.step_time_s)
    except torch.OutOfMemoryError as err:
        return TrialResult(peak_bytes=peak, fits=False, tokens_per_s=None, step_time_s=None, losses=losses,
                           error=f"out of memory: {str(err).splitlines()[0]}")
    finally:
        del parts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(losses) < steps:
        return TrialResult(peak_bytes=peak, fits=False, tokens_per_s=None, step_time_s=None, losses=losses,
                           error=f"the training split has fewer than {steps} windows for a trial")
    return TrialResult(
        peak_bytes=peak, fits=peak is not None and peak <= budget_bytes, tokens_per_s=statistics.median(rates),
        step_time_s=statistics.median(times), losses=losses, real_share=tokens / positions if positions else None,
    )

