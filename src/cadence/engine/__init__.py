"""The step chain (``Engine.step``) and what it is made of: precision, windows of micro-batches, LR schedules, and
the gradient noise scale it can measure on the way.

Usable from a user's own loop: ``from cadence.engine import Engine, iter_windows, prefetch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.engine.choices import LR_SCHEDULES, PRECISIONS, PrecisionName
    from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
    from cadence.engine.cut import Cut
    from cadence.engine.noise_scale import GradientNoiseScale, NoiseScale
    from cadence.engine.objective import MicroBatchLoss, Objective
    from cadence.engine.precision import Precision
    from cadence.engine.prefetch import Prefetcher, prefetch
    from cadence.engine.schedules import build_lr_scheduler, lr_factor
    from cadence.engine.step import Engine, LossFn, PartialWindow, SingleProcess, StepResult, token_cross_entropy_sum
    from cadence.engine.windows import (
        IGNORE_INDEX,
        Batch,
        Window,
        count_targets,
        count_tokens,
        epoch_windows,
        iter_windows,
        make_window,
        recut,
        shift_hf_labels,
    )

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.engine.choices": ("LR_SCHEDULES", "PRECISIONS", "PrecisionName"),
    "cadence.engine.chunked_loss": ("ChunkedCrossEntropy", "TargetsOnlyCrossEntropy"),
    "cadence.engine.cut": ("Cut",),
    "cadence.engine.noise_scale": ("GradientNoiseScale", "NoiseScale"),
    "cadence.engine.objective": ("MicroBatchLoss", "Objective"),
    "cadence.engine.precision": ("Precision",),
    "cadence.engine.prefetch": ("Prefetcher", "prefetch"),
    "cadence.engine.schedules": ("build_lr_scheduler", "lr_factor"),
    "cadence.engine.step": (
        "Engine", "LossFn", "PartialWindow", "SingleProcess", "StepResult", "token_cross_entropy_sum"),
    "cadence.engine.windows": (
        "IGNORE_INDEX", "Batch", "Window", "count_targets", "count_tokens", "epoch_windows", "iter_windows",
        "make_window", "recut", "shift_hf_labels"),
})
