"""cadence: training with a big batch on a small accelerator, with the step chain exactly right.

The engine is usable from your own loop::

    from cadence import Engine, iter_windows

``Example`` (one training example: ``input_ids`` and next-token ``labels``) is what a dataset given to
``epoch_windows`` holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.data import Example
    from cadence.engine import (
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
    from cadence.errors import Problem, UsageError

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.data": ("Example",),
    "cadence.engine": (
        "ChunkedCrossEntropy", "Cut", "Engine", "GradientNoiseScale", "Precision", "SingleProcess", "StepResult",
        "TargetsOnlyCrossEntropy", "Window", "build_lr_scheduler", "count_targets", "epoch_windows", "iter_windows",
        "lr_factor", "make_window", "prefetch", "shift_hf_labels", "token_cross_entropy_sum"),
    "cadence.errors": ("Problem", "UsageError"),
})

__version__ = "0.1.0"
__all__ = [*__all__, "__version__"]
