"""cadence: training with a big batch on a small accelerator, with the step chain exactly right.

The engine is usable from your own loop::

    from cadence import Engine, iter_windows

``Example`` (one training example: ``input_ids`` and next-token ``labels``) is what a dataset given to
``epoch_windows`` holds.
"""

from __future__ import annotations

__version__ = "0.1.0"

from cadence.data import Example  # noqa: E402
from cadence.engine import (  # noqa: E402
    ChunkedCrossEntropy,
    Cut,
    Engine,
    GradientNoiseScale,
    Precision,
    SingleProcess,
    StepResult,
    TargetsOnlyCrossEntropy,
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
    "Example",
    "GradientNoiseScale",
    "Precision",
    "Problem",
    "SingleProcess",
    "StepResult",
    "TargetsOnlyCrossEntropy",
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
