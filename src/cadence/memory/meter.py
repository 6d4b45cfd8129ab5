"""Measured peak memory of one optimizer step.

CUDA: the caching allocator's own high-water mark, reset before the step (cheap, so every step is measured).
CPU: PyTorch keeps no allocator statistics, so the profiler's allocation events are replayed instead: the bytes live
when a segment starts (parameters, gradients, optimizer state) plus the highest running sum of allocations minus frees
during it. The profiler costs about as much as the step itself, so on CPU only the steps the caller asks for are
measured (every step when a memory budget is enforced); the others report None rather than a guess.
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
        if hasattr(t, "to_local"):  # an FSDP2 DTensor: this process holds (and pays for) its shard only
            t = t.to_local()
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
def quiet_native_stderr() -> Iterator[None]:
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


class MemoryBudgetExceeded(torch.OutOfMemoryError):
    """A measured peak above ``--memory-budget`` on a device without an allocator cap (the CPU).

    A subclass of torch.OutOfMemoryError, so the code that recovers from a real CUDA out-of-memory error recovers
    from this one too: that is what makes out-of-memory handling testable without a GPU.
    """


class StepMemoryMeter:
    """Measures the peak tensor memory of a step; ``peak_bytes`` is None when it was not measured.

    CUDA: ``measure`` resets the allocator's high-water mark and reads it back. CPU: the step is measured in
    segments (each micro-batch's forward and backward, then the optimizer phase), each a profiler session whose
    peak is the bytes live at its start plus the highest running sum of its allocations. Segments let the budget be
    checked after every micro-batch, as close to a real allocation failure as a measurement can get.
    """

    def __init__(self, device: torch.device, *, budget_bytes: int | None = None, resident_bytes: int = 0) -> None:
        self.device = device
        self.budget_bytes = budget_bytes
        self.resident_bytes = resident_bytes
        """CPU: bytes the step keeps live besides the model and optimizer (a preference objective's frozen reference
        model), added to every segment's baseline; CUDA's allocator counts them by itself."""
        self.peak_bytes: int | None = None
        self._active = False
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @contextlib.contextmanager
    def measure(
        self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, enabled: bool, segmented: bool = False
    ) -> Iterator[None]:
        """The whole step. On CPU, ``enabled`` (or a budget) turns measurement on: as one profiler session, or, when
        ``segmented``, as the ``segment()`` blocks inside it (the engine's micro-batches and optimizer phase)."""
        self.peak_bytes = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        if self.device.type != "cpu" or not (enabled or (segmented and self.budget_bytes is not None)):
            yield
            return
        self._model, self._optimizer = model, optimizer
        try:
            if segmented:
                self._active = True
                yield
            else:
                with self._profiled(guarded=False):
                    yield
        finally:
            self._active = False
            self._model = self._optimizer = None

    @contextlib.contextmanager
    def segment(self, *, guarded: bool = False) -> Iterator[None]:
        """One part of a segmented step. ``guarded``: raise MemoryBudgetExceeded when its peak is above the budget."""
        if not self._active:  # always on CUDA (the allocator's high-water mark needs no segments): no work, no sync
            yield
            return
        with self._profiled(guarded=guarded):
            yield

    @contextlib.contextmanager
    def _profiled(self, *, guarded: bool) -> Iterator[None]:
        assert self._model is not None and self._optimizer is not None  # set by measure()
        baseline = live_training_bytes(self._model, self._optimizer) + self.resident_bytes
        from torch.profiler import ProfilerActivity, profile

        with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        peak = baseline + peak_of_allocation_events(prof)
        self.peak_bytes = max(self.peak_bytes or 0, peak)
        if guarded and self.budget_bytes is not None and peak > self.budget_bytes:
            raise MemoryBudgetExceeded(
                f"measured peak {peak:,} bytes is above the memory budget of {self.budget_bytes:,} bytes"
            )


def peak_of_allocation_events(prof: Any) -> int:
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
