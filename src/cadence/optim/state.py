"""What an optimizer holds as state, for every optimizer: its tensors and their bytes, and the kinds a saved state's
fields are read as (``records.Kind``) before a resume loads them."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cadence.optim.stepping import local
from cadence.records import Kind, tensor_kind

FLOATING = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MOMENT = tensor_kind(dtypes=FLOATING, words="a floating-point tensor (a moment)")
"""A moment, momentum buffer or second-moment estimate: a floating-point tensor (its shape is checked after
loading, against its parameter)."""


def _step_tensor(value: Any) -> Any:
    """torch's optimizers keep the step as a one-element float tensor; a vector or a negative, fractional or infinite
    count would fail (or silently skew a bias correction) at the first step."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise ValueError
    count = float(value.reshape(()).item())
    if not (math.isfinite(count) and count >= 0 and count == int(count)):
        raise ValueError
    return value


STEP_TENSOR = Kind("a step count (a tensor of one element)", _step_tensor)


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor the optimizer holds as state (moments, scales, code books, step counters); a DTensor's local
    shard."""
    for per_parameter in optimizer.state.values():
        for value in per_parameter.values():
            if isinstance(value, torch.Tensor):
                yield local(value)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this process, a storage shared by several (a code book) once."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in state_tensors(optimizer):
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def check_state_shapes(optimizer: Any, expected: Callable[[str, torch.Tensor], tuple[int, ...] | None]) -> None:
    """torch's load_state_dict takes state tensors of any shape; one that does not fit its parameter would fail at
    the first step, mid-run. ``expected(name, parameter)``: the shape state ``name`` must have (None: any, a step
    counter or a code book). Raises ValueError naming the first misfit. Offloaded and FSDP2-sharded optimizers keep
    their own layout (state keyed by host masters, DTensor shards) and are left to themselves."""
    for group in getattr(optimizer, "param_groups", []):
        for parameter in group["params"]:
            if type(parameter).__name__ == "DTensor":
                continue
            for name, value in optimizer.state.get(parameter, {}).items():
                shape = expected(name, parameter)
                if shape is None or not hasattr(value, "shape"):
                    continue
                if tuple(value.shape) != shape:
                    raise ValueError(f"optimizer state {name} of shape {tuple(value.shape)} for a parameter of shape "
                                     f"{tuple(parameter.shape)}")
