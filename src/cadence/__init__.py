"""cadence: training with a big batch on a small accelerator, with the step chain exactly right.

The engine is usable from your own loop::

    from cadence import Engine, iter_windows
"""

from __future__ import annotations

__version__ = "0.1.0"

from cadence.engine import Engine, SingleProcess, StepResult, token_cross_entropy_sum  # noqa: E402
from cadence.errors import Problem, UsageError  # noqa: E402
from cadence.precision import Precision  # noqa: E402
from cadence.schedules import build_lr_scheduler, lr_factor  # noqa: E402
from cadence.windows import Window, count_targets, iter_windows, make_window  # noqa: E402

__all__ = [
    "Engine",
    "Precision",
    "Problem",
    "SingleProcess",
    "StepResult",
    "UsageError",
    "Window",
    "__version__",
    "build_lr_scheduler",
    "count_targets",
    "iter_windows",
    "lr_factor",
    "make_window",
    "token_cross_entropy_sum",
]
