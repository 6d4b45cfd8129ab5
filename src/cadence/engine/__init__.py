"""The step chain (``Engine.step``) and what it is made of: precision, windows of micro-batches, LR schedules, and
the gradient noise scale it can measure on the way.

Usable from a user's own loop: ``from cadence.engine import Engine, iter_windows, prefetch``.
"""

from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
from cadence.engine.cut import Cut
from cadence.engine.noise_scale import GradientNoiseScale, NoiseScale
from cadence.engine.precision import PRECISIONS, Precision, PrecisionName
from cadence.engine.prefetch import Prefetcher, prefetch
from cadence.engine.schedules import LR_SCHEDULES, build_lr_scheduler, lr_factor
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

__all__ = [
    "IGNORE_INDEX", "LR_SCHEDULES", "PRECISIONS", "Batch", "ChunkedCrossEntropy", "Cut", "Engine", "GradientNoiseScale",
    "LossFn", "NoiseScale", "PartialWindow", "Precision", "PrecisionName", "Prefetcher", "SingleProcess", "StepResult",
    "TargetsOnlyCrossEntropy", "Window", "build_lr_scheduler", "count_targets", "count_tokens", "epoch_windows",
    "iter_windows", "lr_factor", "make_window", "prefetch", "recut", "shift_hf_labels", "token_cross_entropy_sum",
]
