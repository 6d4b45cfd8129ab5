"""``cadence plan --effective-batch-size adaptive``: one set of levers for a whole range of effective batches.

The adaptive batch (``engine.adaptive_batch``) grows the accumulation, never the micro-batch, so a candidate's memory
does not depend on the batch the run is at; what the range asks of the plan is:

- a micro-batch that serves every batch of the range: it divides the minimum (every batch is a whole number of the
  minimum's windows), and on one process the minimum holds at least two micro-batches (the noise scale the rule
  decides from needs two batch sizes: the first micro-batch's and the window's). The plan times its candidates at
  the minimum's accumulation (:func:`planned_batch`, :func:`fewest_micro_batches`);
- with ``--batch-branch-test``, the snapshot the branch test keeps (a second copy of the weights and the optimizer
  state on their device, ``training.branch_test``) counted in every candidate's memory (:func:`snapshot_bytes`): its
  estimate, and its measured peak (the trial runs without the snapshot; its bytes are added: a copy of tensors whose
  sizes are known);
- the throughput at both ends of the range (:class:`RangeThroughput`): at the minimum measured (the rounds), at the
  maximum derived from the share of a window's time the optimizer step takes (measured, :func:`step_split`), which a
  larger window amortises over more micro-batches.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from cadence.config import TrainConfig
from cadence.engine.adaptive_batch import BATCH_MODES, LORA_MAX_BATCH, AdaptiveBatch
from cadence.engine.prefetch import prefetch
from cadence.memory.estimate import MemoryEstimate
from cadence.memory.estimate_for import estimate_for
from cadence.models.spec import ModelSpec
from cadence.optim.spec import OptimizerSpec
from cadence.plan.trials import TrialSetup, trial_run
from cadence.profiling.profiler import PhaseTimer
from cadence.training.components import build_components
from cadence.training.prepare import Prepared

SNAPSHOT = "branch_snapshot"
"""The estimate's category of the branch test's snapshot (``MemoryEstimate.by_category``)."""
OPTIMIZER_PHASES = ("unscale_clip", "optimizer_step", "zero_grad_scheduler")
"""The engine's phases that run once per window whatever its micro-batches (``Engine.apply_gradients``): what a
larger window amortises."""
SPLIT_STEPS = 3
"""Windows timed phase by phase for the optimizer step's share (after one warm-up window)."""


def policy(config: TrainConfig) -> AdaptiveBatch | None:
    """The adaptive (or ramp) policy the plan's run asks for (its LR scaling the optimizer's default unless given; a
    LoRA run's maximum :data:`LORA_MAX_BATCH` unless given), None for a fixed batch."""
    if config.effective_batch_size not in BATCH_MODES:
        return None
    return AdaptiveBatch.from_flags(config, lr_scaling=OptimizerSpec.from_flags(config).batch_lr_scaling,
                                    maximum=LORA_MAX_BATCH if config.lora_rank else None)


def planned_batch(config: TrainConfig) -> int:
    """The effective batch every candidate computes: the given one, or under adaptive the minimum (the batch its
    windows are made of; a larger batch is several of them in one optimizer step; a ramp's too)."""
    if config.effective_batch_size in BATCH_MODES:
        return int(config.min_effective_batch_size or 0)
    return int(config.effective_batch_size or 0)


def as_fixed(config: TrainConfig, batch: int, **changes: Any) -> TrainConfig:
    """``config`` as a run at the fixed effective ``batch`` (what a plan's trials vary): the adaptive flags (and
    auto's bounds, which share their names) left out."""
    return dataclasses.replace(config, effective_batch_size=batch, min_effective_batch_size=None,
                               max_effective_batch_size=None, batch_lr_scaling=None, batch_branch_test=None,
                               batch_branch_tolerance=None, **changes)


def fewest_micro_batches(config: TrainConfig) -> int:
    """Micro-batches a window of the planned batch must hold: 2 under adaptive (the noise scale needs two batch
    sizes; a plan is one process), else 1 (a ramp measures nothing)."""
    return 2 if config.effective_batch_size == "adaptive" else 1


def serving_micro_batches(config: TrainConfig, sizes: list[int]) -> list[int]:
    """The micro-batch sizes of ``sizes`` that serve the plan's whole range (see :func:`fewest_micro_batches`)."""
    batch, fewest = planned_batch(config), fewest_micro_batches(config)
    return [size for size in sizes if batch % size == 0 and batch // size >= fewest]


def snapshot_bytes(model: ModelSpec, config: TrainConfig, *, optimizer: OptimizerSpec, offload: str,
                   lora_base_precision: str, device_type: str) -> int:
    """Device bytes of the branch test's snapshot for a candidate: its weights (the model's whole state dict, a LoRA
    base included, as the base keeps it) and the optimizer state on the device (offloaded state is copied in host
    memory, where it lives); 0 without ``--batch-branch-test``. From the estimate of one fp32 micro-batch of one
    row, where the parameters category holds the weights alone (no autocast copies) and no reference is counted."""
    if config.effective_batch_size != "adaptive" or config.batch_branch_test is None:
        return 0
    alone = estimate_for(model, micro_batch_size=1, seq_len=1, precision="fp32", checkpointing="none",
                         offload=offload, device_type=device_type, optimizer=optimizer,
                         lora_base_precision=lora_base_precision, packed=config.packing)
    # The snapshot clones every state-dict entry: a head tied to the embedding is an entry of its own, cloned again.
    tied = model.shape.embedding_bytes if model.shape.tied_embeddings else 0
    return int(alone.by_category.get("parameters", 0) + alone.by_category.get("optimizer_state", 0) + tied)


def with_snapshot(estimate: MemoryEstimate, snapshot: int) -> MemoryEstimate:
    """``estimate`` with the branch test's snapshot held through the step (the branches train with it live)."""
    if not snapshot:
        return estimate
    return dataclasses.replace(
        estimate, peak_bytes=estimate.peak_bytes + snapshot, by_category={**estimate.by_category, SNAPSHOT: snapshot},
        notes=[*estimate.notes, f"--batch-branch-test holds a snapshot of the weights and the optimizer state "
                                f"({snapshot:,} bytes) while its branches train: counted in the peak"])


@dataclass(frozen=True, kw_only=True)
class StepSplit:
    """Where a window's time goes, measured phase by phase (device synchronised at each phase boundary)."""

    window_s: float
    """Median wall time of a window (its micro-batches and its optimizer step)."""
    optimizer_s: float
    """Median time of the window's optimizer step (:data:`OPTIMIZER_PHASES`)."""
    windows: int
    """Windows timed."""

    @property
    def optimizer_share(self) -> float:
        return min(1.0, self.optimizer_s / self.window_s) if self.window_s > 0 else 0.0


def step_split(prep: Prepared, setup: TrialSetup, *, steps: int = SPLIT_STEPS) -> StepSplit | None:
    """Time ``steps`` windows of ``setup`` phase by phase (after a warm-up window that allocates the optimizer
    state); None when none ran."""
    trial = trial_run(prep, setup, steps=steps + 1)
    parts = build_components(trial)
    timer = PhaseTimer(trial.device)
    parts.engine.phases = timer
    windows = prefetch(trial.windows(0), depth=trial.config.prefetch_windows,
                       pin_memory=trial.device.type == "cuda")
    try:
        with windows:
            for number, window in zip(range(steps + 1), windows):
                timer.end_step(keep=False)
                parts.engine.step(window)
                timer.end_step(keep=number >= 1)
    finally:
        parts.engine.phases = None
        del parts
    if not timer.steps:
        return None
    optimizer = [sum(step.get(name, 0.0) for name in OPTIMIZER_PHASES) for step in timer.steps]
    return StepSplit(window_s=statistics.median(timer.step_times), optimizer_s=statistics.median(optimizer),
                     windows=len(timer.steps))


@dataclass(frozen=True, kw_only=True)
class RangeThroughput:
    """The chosen configuration's throughput at both ends of the adaptive range: measured at the minimum, derived at
    the maximum."""

    minimum: int
    maximum: int
    at_minimum: float | None
    """Tokens/s at the minimum: measured (the median of the plan's alternating rounds)."""
    optimizer_share: float | None
    """The share of a minimum window's time its optimizer step takes: measured (:func:`step_split`)."""
    at_maximum: float | None
    """Tokens/s at the maximum: derived. A window of ``k = maximum / minimum`` minimum windows runs their
    micro-batches and one optimizer step, so per minimum window's tokens it takes ``(1 - s) + s / k`` of a minimum
    window's time (``s``: the optimizer share): ``at_minimum / ((1 - s) + s / k)``."""
    windows: int = 0
    """Windows the optimizer share was timed over."""

    @classmethod
    def of(cls, adaptive: AdaptiveBatch, at_minimum: float | None, split: StepSplit | None) -> RangeThroughput:
        share = split.optimizer_share if split is not None else None
        at_maximum = None
        if at_minimum is not None and share is not None:
            at_maximum = at_minimum / ((1 - share) + share / adaptive.most_windows)
        return cls(minimum=adaptive.minimum, maximum=adaptive.maximum, at_minimum=at_minimum, optimizer_share=share,
                   at_maximum=at_maximum, windows=split.windows if split is not None else 0)

    def as_dict(self) -> dict[str, Any]:
        return {"minimum": self.minimum, "maximum": self.maximum, "tokens_per_s_at_minimum": self.at_minimum,
                "tokens_per_s_at_minimum_from": "measured: the median of the plan's alternating rounds",
                "optimizer_step_share": self.optimizer_share,
                "optimizer_step_share_from": f"measured: {self.windows} windows of the minimum timed phase by phase",
                "tokens_per_s_at_maximum": self.at_maximum,
                "tokens_per_s_at_maximum_from": (
                    "derived, not measured: at_minimum / ((1 - share) + share / (maximum / minimum)), the optimizer "
                    "step run once per window of the maximum instead of once per window of the minimum")}

    def words(self) -> str:
        if self.at_minimum is None:
            return f"throughput over the range {self.minimum}-{self.maximum}: not measured"
        text = f"throughput {self.at_minimum:,.0f} tokens/s at batch {self.minimum} (measured)"
        if self.at_maximum is None or self.optimizer_share is None:
            return text + f"; at {self.maximum} not derived (the optimizer step's share was not measured)"
        return (text + f", about {self.at_maximum:,.0f} tokens/s at {self.maximum} (derived: the optimizer step is "
                f"{self.optimizer_share:.1%} of a window of {self.minimum}, measured, and runs once per window)")


__all__ = ["OPTIMIZER_PHASES", "SNAPSHOT", "RangeThroughput", "StepSplit", "as_fixed", "fewest_micro_batches", "planned_batch",
           "policy", "serving_micro_batches", "snapshot_bytes", "step_split", "with_snapshot"]
