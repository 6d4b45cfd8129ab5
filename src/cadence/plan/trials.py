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
from typing import Any

import torch

from cadence.engine.precision import fp32_matmul
from cadence.engine.prefetch import prefetch
from cadence.memory.choices import OptimizerStateName
from cadence.training.components import build_components
from cadence.training.prepare import Prepared
from cadence.verify.equivalence import Setup

MIN_TRIAL_STEPS = 3
"""Warm-up, memory and at least one timed step."""


@dataclass(kw_only=True, frozen=True)
class TrialSetup(Setup):
    """The decision variables of a plan: how a window is cut and computed (the verify Setup, so that the quality
    check compares exactly this) plus how many micro-batches make the effective batch and how the optimizer keeps
    its state."""

    grad_accum_steps: int
    optimizer_state: OptimizerStateName = "fp32"
    """``--optimizer-state``: the only lossy lever a plan may pull (the window's gradient is the same, the update is
    not), so a decision that pulls it has passed a loss comparison against fp32 state (plan.json's quality)."""

    def lever_text(self) -> str:
        state = f", {self.optimizer_state} optimizer state" if self.optimizer_state != "fp32" else ""
        return super().lever_text() + state

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DECISION_FIELDS}

    def train_flags(self) -> dict[str, Any]:
        """The setup as train's flags (TrainConfig fields): the decision and the cut."""
        return {**self.as_dict(), **self.cut.flags()}

    @property
    def exact(self) -> bool:
        """Whether the setup gives the update of fp32 accumulation (every lever but the optimizer state's is exact)."""
        return self.optimizer_state == "fp32"

    def describe(self) -> str:
        cut = self.cut.describe()
        return (f"micro {self.micro_batch_size} x accum {self.grad_accum_steps}, {self.precision}, "
                f"recompute {self.activation_checkpointing}, offload {self.offload}" + self.lever_text()
                + (f", {cut}" if cut else ""))


# targets_only is how verify computes the loss of a model whose head splits (derived from the model, not a flag).
_SETUP_FIELDS = [f for f in dataclasses.fields(TrialSetup) if f.name not in ("cut", "grad_accum_steps", "targets_only")]
DECISION_FIELDS: tuple[str, ...] = ("micro_batch_size", "grad_accum_steps", *(f.name for f in _SETUP_FIELDS))
"""What a plan decides, in plan.json's order: the split of the effective batch, then how the setup computes a
window and updates (each of its fields, so a new one is decided and recorded too). plan.json records the setup's
cut next to them, as train's cut flags."""
DECISION_DEFAULTS: dict[str, Any] = {f.name: f.default for f in _SETUP_FIELDS if f.default is not dataclasses.MISSING}
"""What a decision field is when a plan.json has no key for it (a lever added after the plan was made)."""


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


def trial_run(prep: Prepared, setup: TrialSetup, *, steps: int) -> Prepared:
    """The plan's run (``prep``: its data loaded and checked once) with ``setup``'s decision and cut, for ``steps``
    optimizer steps; no budget guard (the trial measures the peak itself) and nothing written."""
    return prep.variant(**setup.train_flags(), effective_batch_size=None, max_steps=steps, memory_budget=None)


def run_trial(prep: Prepared, setup: TrialSetup, *, steps: int, budget_bytes: int) -> TrialResult:
    """Run ``steps`` windows of ``setup`` and measure them; out-of-memory is a result (fits False), not an error."""
    steps = max(steps, MIN_TRIAL_STEPS)
    trial = trial_run(prep, setup, steps=steps)
    device = trial.device
    parts = build_components(trial)
    # The windows train would run (the epoch's permutation, cut as the setup says), prepared ahead in a thread as
    # train prepares them: cut and collated in the measuring thread instead, the same steps ran 10-20x slower on a
    # loaded 2-core CPU (measured: 165 against 3,458 tokens/s for gpt-tiny), and the plan predicted 1/6 of the run.
    windows = prefetch(trial.windows(0), depth=trial.config.prefetch_windows, pin_memory=device.type == "cuda")
    peak: int | None = None
    tokens = positions = 0
    rates: list[float] = []
    times: list[float] = []
    losses: list[float | None] = []
    try:
        # fp32 matmuls as the run will set them (tf32 on CUDA by default): they change the speed being measured.
        with windows, fp32_matmul(trial.config.fp32_matmul):
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


def timed_round(prep: Prepared, setup: TrialSetup, *, steps: int) -> float | None:
    """One round of timing ``setup``: one warm-up window (untimed: it allocates the optimizer state), then ``steps``
    windows timed as training times them, throughput over the round (tokens / step time, no profiler, no memory
    measurement). The same first windows of the epoch for every candidate, so every round sees the same samples.
    None when it runs out of memory."""
    trial = trial_run(prep, setup, steps=steps + 1)
    parts = build_components(trial)
    tokens, seconds = 0, 0.0
    windows = prefetch(trial.windows(0), depth=trial.config.prefetch_windows,
                       pin_memory=trial.device.type == "cuda")  # as training prepares them (see run_trial)
    try:
        with windows, fp32_matmul(trial.config.fp32_matmul):
            for number, window in zip(range(steps + 1), windows):
                result = parts.engine.step(window)
                if number >= 1:
                    tokens, seconds = tokens + result.tokens, seconds + result.step_time_s
    except torch.OutOfMemoryError:
        return None
    finally:
        del parts
        if trial.device.type == "cuda":
            torch.cuda.empty_cache()
    return tokens / seconds if seconds > 0 else None

