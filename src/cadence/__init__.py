"""cadence: training with a big batch on a small accelerator, with the step chain exactly right.

The engine is usable from your own loop::

    from cadence import Engine, iter_windows
"""

from __future__ import annotations

__version__ = "0.1.0"

from cadence.engine import (  # noqa: E402
    ChunkedCrossEntropy,
    Cut,
    Engine,
    GradientNoiseScale,
    Precision,
    SingleProcess,
    StepResult,
    Window,
    build_lr_scheduler,
    count_targets,
    epoch_windows,
    iter_windows,
    lr_factor,
    make_window,
    prefetch,
    shift_hf_labels,
    token_cross_entropy_sum,
)
from cadence.errors import Problem, UsageError  # noqa: E402

__all__ = [
    "ChunkedCrossEntropy",
    "Cut",
    "Engine",
    "GradientNoiseScale",
    "Precision",
    "Problem",
    "SingleProcess",
    "StepResult",
    "UsageError",
    "Window",
    "__version__",
    "build_lr_scheduler",
    "count_targets",
    "epoch_windows",
    "iter_windows",
    "lr_factor",
    "make_window",
    "prefetch",
    "shift_hf_labels",
    "token_cross_entropy_sum",
]
