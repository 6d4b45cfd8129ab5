"""Where a step's memory goes and how to spend less: the measured peak, the analytic estimate, recompute, offload."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.memory.choices import CHECKPOINTING_MODES, OFFLOAD_MODES
    from cadence.memory.estimate import MemoryEstimate, estimate_step_memory
    from cadence.memory.estimate_for import estimate_for
    from cadence.memory.estimate_hf import estimate_hf_step_memory
    from cadence.memory.measure import MeasuredMemory, measure_step
    from cadence.memory.meter import StepMemoryMeter
    from cadence.memory.recompute import apply_activation_checkpointing

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.memory.choices": ("CHECKPOINTING_MODES", "OFFLOAD_MODES"),
    "cadence.memory.estimate": ("MemoryEstimate", "estimate_step_memory"),
    "cadence.memory.estimate_for": ("estimate_for",),
    "cadence.memory.estimate_hf": ("estimate_hf_step_memory",),
    "cadence.memory.measure": ("MeasuredMemory", "measure_step"),
    "cadence.memory.meter": ("StepMemoryMeter",),
    "cadence.memory.recompute": ("apply_activation_checkpointing",),
})
