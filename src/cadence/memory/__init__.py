"""Where a step's memory goes and how to spend less: the measured peak, the analytic estimate, recompute, offload."""

from __future__ import annotations

from cadence.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.memory.choices": ("CHECKPOINTING_MODES", "OFFLOAD_MODES"),
    "cadence.memory.estimate": ("MemoryEstimate", "estimate_step_memory"),
    "cadence.memory.estimate_for": ("estimate_for",),
    "cadence.memory.estimate_hf": ("estimate_hf_step_memory",),
    "cadence.memory.measure": ("MeasuredMemory", "measure_step"),
    "cadence.memory.meter": ("StepMemoryMeter",),
    "cadence.memory.recompute": ("apply_activation_checkpointing",),
})
