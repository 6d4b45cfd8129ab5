"""The optimizer seam: one frozen :class:`OptimizerSpec` per run (which optimizer, its groups, its state precision,
its offload, its state bytes and checkpoint checks), one module per optimizer behind it, and cadence's own optimizer
classes (the bf16-state AdamW, the offload wrapper)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.optim.choices import OPTIMIZER_STATES, OPTIMIZERS, OptimizerName, OptimizerStateName
    from cadence.optim.low_precision import BF16StateAdamW
    from cadence.optim.offload import OffloadedOptimizer
    from cadence.optim.spec import OptimizerSpec, ParamGroup
    from cadence.optim.state import optimizer_state_bytes

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.optim.choices": ("OPTIMIZERS", "OPTIMIZER_STATES", "OptimizerName", "OptimizerStateName"),
    "cadence.optim.low_precision": ("BF16StateAdamW",),
    "cadence.optim.offload": ("OffloadedOptimizer",),
    "cadence.optim.spec": ("OptimizerSpec", "ParamGroup"),
    "cadence.optim.state": ("optimizer_state_bytes",),
})
