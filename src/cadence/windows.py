"""The import path cadence 0.1 documented for windows (``from cadence.windows import epoch_windows``); the windows
live in :mod:`cadence.engine.windows` now, and :mod:`cadence.engine` re-exports them."""

from cadence.engine.windows import (
    IGNORE_INDEX,
    Batch,
    Window,
    count_targets,
    count_tokens,
    epoch_windows,
    iter_windows,
    make_window,
)

__all__ = ["IGNORE_INDEX", "Batch", "Window", "count_targets", "count_tokens", "epoch_windows", "iter_windows",
           "make_window"]
