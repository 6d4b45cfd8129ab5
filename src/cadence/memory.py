"""Measured peak memory of one optimizer step.

CUDA: the caching allocator's own high-water mark, reset before the step (cheap, so every step is measured).
CPU: PyTorch keeps no allocator statistics, so the profiler's allocation events are replayed instead: the bytes live
when the step starts (parameters, optimizer state, anything the user holds in the model and optimizer) plus the highest
running sum of allocations minus frees during the step. The profiler costs about as much as the step itself, so on CPU
only the steps the caller asks for are measured; the others report None rather than a guess.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch


def tensor_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Bytes of distinct storages among ``tensors`` (tied weights count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or key == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def live_training_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held between steps by the model's parameters, buffers and gradients and the optimizer's state."""
    tensors: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(tensors)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Kineto writes 'profiler_start/stop' lines straight to file descriptor 2; keep them off the user's terminal."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (embedded interpreter): nothing to protect
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class StepMemoryMeter:
    """Measures the peak tensor memory of a block of work; ``peak_bytes`` is None when it was not measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes: int | None = None

    @contextlib.contextmanager
    def measure(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, enabled: bool) -> Iterator[None]:
        self.peak_bytes = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        if not enabled or self.device.type != "cpu":
            yield
            return
        baseline = live_training_bytes(model, optimizer)
        from torch.profiler import ProfilerActivity, profile

        with _quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        self.peak_bytes = baseline + _peak_of_allocation_events(prof)


def _peak_of_allocation_events(prof: Any) -> int:
    """Highest running total of CPU allocations minus frees, in event time order (0 if nothing was allocated).

    The profiler reports allocations and frees as instant events with a signed ``cpu_memory_usage``; events that
    merely contain allocations (operator ranges) carry the same bytes again, so only the instant events count.
    """
    deltas: list[tuple[int, int]] = []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CPU:
            continue
        if event.name() != "[memory]":
            continue
        deltas.append((event.start_ns(), int(event.nbytes())))
    deltas.sort(key=lambda item: item[0])
    running = peak = 0
    for _, nbytes in deltas:
        running += nbytes
        peak = max(peak, running)
    return peak
