"""Where a step's memory goes and how to spend less: the measured peak, the analytic estimate, recompute, offload."""

from cadence.memory.estimate import MemoryEstimate, estimate_step_memory
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.memory.measure import MeasuredMemory, measure_step
from cadence.memory.meter import StepMemoryMeter
from cadence.memory.offload import OFFLOAD_MODES, OffloadedOptimizer
from cadence.memory.recompute import CHECKPOINTING_MODES, apply_activation_checkpointing

__all__ = [
    "CHECKPOINTING_MODES", "OFFLOAD_MODES", "MeasuredMemory", "MemoryEstimate", "OffloadedOptimizer",
    "StepMemoryMeter", "apply_activation_checkpointing", "estimate_hf_step_memory", "estimate_step_memory",
    "measure_step",
]
