"""Where the memory of one training step goes, measured: the peak, and what it was made of at that moment.

CPU (and CUDA where the profiler can see it): PyTorch's profiler memory timeline (``profile_memory=True`` with shapes
and stacks, then ``torch.profiler._memory_profiler``) replays every allocation and free of the step and labels each
tensor. Its labels are turned into the categories people reason in:

- ``parameter``: the fp32 parameters, plus the low-precision copies autocast makes of them (a bf16/fp16 weight copy
  is the parameter in compute dtype; the profiler calls it an activation because an activation flows into the op);
- ``gradient``: the parameters' ``.grad`` (fp32: they accumulate in the parameters' dtype);
- ``optimizer_state``: the optimizer's state (AdamW's two moments and its step counters);
- ``activation``: tensors made by the forward (saved for backward or not yet freed), including the ones activation
  checkpointing recomputes during backward (the profiler files those under "autograd detail");
- ``temporary``: working memory: gradients of activations flowing through backward, the optimizer step's scratch;
- ``input``: the micro-batches; ``other``: whatever the profiler could not attribute to a tensor.

The API is private and has changed between releases, so any failure of it falls back to the total alone (the same
replay of allocation events that :class:`cadence.memory.meter.StepMemoryMeter` uses, or ``torch.cuda.max_memory_allocated``),
and ``source`` says which one answered.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence.formatting import format_mib
from cadence.memory.meter import peak_of_allocation_events, quiet_native_stderr

CATEGORIES: tuple[str, ...] = (
    "parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "other",
)
"""The measured categories, in the order reports print them."""


@dataclass(kw_only=True)
class MeasuredMemory:
    """The measured memory of one step. Bytes are tensor bytes (allocator rounding and fragmentation excluded)."""

    peak_bytes: int
    """Total live tensor bytes at the step's peak, tensors alive before the step (parameters, state) included."""
    by_category_at_peak: dict[str, int]
    """Category -> bytes at the moment of the peak; sums to ``peak_bytes``."""
    peak_by_category: dict[str, int]
    """Each category's own maximum over the step (they need not happen at the same moment)."""
    activation_peak_bytes: int
    """Most activation bytes alive at once: what "activation memory" refers to (recomputed ones included)."""
    source: str
    """How it was measured, e.g. ``"profiler memory timeline (cpu)"``."""
    baseline_bytes: int = 0
    """Bytes the model and optimizer held when the step started."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the peak and its largest parts."""
        parts = sorted(self.by_category_at_peak.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {format_mib(value)}" for name, value in parts if value > 0)
        return (f"peak {format_mib(self.peak_bytes)} ({shown}); "
                f"activations peak {format_mib(self.activation_peak_bytes)}")


def measure_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    run_step: Callable[[], object],
    device: torch.device | str,
) -> MeasuredMemory:
    """Run ``run_step()`` (one full step: every micro-batch of a window, the optimizer step and ``zero_grad``) under
    the profiler and return its measured peak by category.

    Measure a step after the first: AdamW allocates its state lazily inside the first ``step()``.
    """
    device = _normalised(torch.device(device))
    from torch.profiler import ProfilerActivity, profile

    before = _owned_storages(model, optimizer, device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with quiet_native_stderr(), profile(
        activities=activities, profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    after = _owned_storages(model, optimizer, device)
    baseline = sum(size for size, _ in before.values())
    try:
        measured = _from_timeline(prof, device, before, after)
    except Exception as err:  # noqa: BLE001 - a private API must never break the step it measures
        return _fallback(prof, device, before, baseline, f"{type(err).__name__}: {err}")
    measured.baseline_bytes = baseline
    if device.type == "cuda":
        # The caching allocator's own high-water mark is the ground truth for the total on a GPU.
        allocator_peak = int(torch.cuda.max_memory_allocated(device))
        measured.notes.append(f"torch.cuda.max_memory_allocated: {format_mib(allocator_peak)}")
    return measured


# --------------------------------------------------------------------------------------------------- what we own
def _normalised(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:N`` (the profiler keys tensors by the full device)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _owned_storages(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[int, tuple[int, str]]:
    """Storage pointer -> (bytes, category) of what the model and optimizer hold on ``device`` right now."""
    owned: dict[int, tuple[int, str]] = {}

    def add(tensors: Iterable[Any], category: str) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor) or _normalised(t.device) != device:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() != 0:
                owned.setdefault(storage.data_ptr(), (storage.nbytes(), category))  # tied weights count once

    add(model.parameters(), "parameter")
    add((p.grad for p in model.parameters()), "gradient")
    add(model.buffers(), "other")
    for state in optimizer.state.values():
        add(state.values(), "optimizer_state")
    return owned


# --------------------------------------------------------------------------------------------------- the timeline
def _from_timeline(
    prof: Any, device: torch.device, before: dict[int, tuple[int, str]], after: dict[int, tuple[int, str]]
) -> MeasuredMemory:
    from torch.profiler import _memory_profiler as mp

    memory_profile = prof._memory_profile()
    events = [e for e in memory_profile.timeline if _normalised(e[2][0].device) == device]
    # What the model and optimizer hold after the step, keyed by the profiler's tensor keys still alive at the end
    # (a freed tensor's address may have been reused by one they hold now).
    destroyed = {e[2][0] for e in events if e[1] == mp.Action.DESTROY}
    held_after = {
        e[2][0]: after[e[2][0].storage.ptr][1]
        for e in events
        if isinstance(e[2][0], mp.TensorKey) and e[2][0] not in destroyed and e[2][0].storage.ptr in after
    }
    parameter_ptrs = {ptr for ptr, (_, category) in before.items() if category == "parameter"}
    labeller = _Labeller(memory_profile, parameter_ptrs, held_after)

    # Tensors alive before the step appear as PREEXISTING only if some op touched them; add the rest (an unused
    # buffer, a frozen parameter) once, as a constant, so that nothing is counted twice or missed.
    seen = {key.storage.ptr for _, action, (key, _), _ in events
            if action == mp.Action.PREEXISTING and isinstance(key, mp.TensorKey)}
    unseen: collections.Counter[str] = collections.Counter()
    for ptr, (size, category) in before.items():
        if ptr not in seen:
            unseen[category] += size

    live: collections.Counter[str] = collections.Counter(unseen)
    peak_by_category: dict[str, int] = {name: live[name] for name in CATEGORIES}
    peak, at_peak = sum(live.values()), dict(live)
    index = 0
    while index < len(events):
        # Apply every event of one timestamp before looking at the total: the timeline orders simultaneous events
        # as create-before-free, which would show a peak that never existed.
        time_ns = events[index][0]
        while index < len(events) and events[index][0] == time_ns:
            _, action, (key, version), size = events[index]
            if action in (mp.Action.PREEXISTING, mp.Action.CREATE):
                live[labeller(key, version)] += size
            elif action == mp.Action.INCREMENT_VERSION:  # an in-place op may move a tensor to another category
                live[labeller(key, version)] -= size
                live[labeller(key, version + 1)] += size
            elif action == mp.Action.DESTROY:
                live[labeller(key, version)] -= size
            index += 1
        total = sum(live.values())
        for name in CATEGORIES:
            peak_by_category[name] = max(peak_by_category[name], live[name])
        if total > peak:
            peak, at_peak = total, dict(live)
    by_category = {name: int(at_peak.get(name, 0)) for name in CATEGORIES}
    return MeasuredMemory(
        peak_bytes=sum(by_category.values()),
        by_category_at_peak=by_category,
        peak_by_category={name: int(value) for name, value in peak_by_category.items()},
        activation_peak_bytes=int(peak_by_category["activation"]),
        source=f"profiler memory timeline ({device})",
    )


class _Labeller:
    """Maps a profiler (tensor key, version) to one of :data:`CATEGORIES`.

    The profiler's own categories come first where they are unambiguous (parameter, gradient, optimizer state,
    input); three mechanisms it does not know about are recognised from the op tree:
    - autocast's low-precision parameter copies: allocations inside an ``aten::_to_copy`` of a parameter;
    - recomputation: allocations inside a backward function with a Python frame in between (checkpointing re-runs
      the block's Python forward from a saved-tensor unpack hook; native backward formulas call no Python);
    - optimizer scratch: allocations inside ``Optimizer.step`` (AdamW's per-tensor ``sqrt`` and quotient).
    """

    def __init__(self, memory_profile: Any, parameter_ptrs: set[int], held_after: dict[Any, str]) -> None:
        from torch._C._profiler import RecordScope, _EventType
        from torch.profiler import _memory_profiler as mp

        self._mp = mp
        self._categories = memory_profile._categories
        self._held_after = held_after
        self._direct = {
            mp.Category.PARAMETER: "parameter",
            mp.Category.GRADIENT: "gradient",
            mp.Category.OPTIMIZER_STATE: "optimizer_state",
            mp.Category.INPUT: "input",
        }
        self.parameter_copies: set[Any] = set()
        self.recomputed: set[Any] = set()
        self.optimizer_scratch: set[Any] = set()
        tree = memory_profile._op_tree
        # Optimizer.step calls a marker function the Python tracer tags with the optimizer; its caller spans the step.
        steps = [
            (event.parent.start_time_ns, event.parent.end_time_ns)
            for event in tree.dfs()
            if event.typed[0] == _EventType.PyCall and event.typed[1].optimizer is not None and event.parent
        ]
        for event in tree.dfs():
            if event.typed[0] != _EventType.Allocation or event.typed[1].alloc_size <= 0:
                continue
            key = mp.TensorKey.from_allocation(event.typed[1])
            if key is None:
                continue
            if any(start <= event.start_time_ns <= end for start, end in steps):
                self.optimizer_scratch.add(key)
            python_frame = False
            ancestor = event.parent
            while ancestor is not None:
                kind = ancestor.typed[0]
                if kind == _EventType.TorchOp and ancestor.name == "aten::_to_copy":
                    source = ancestor.typed[1].inputs[0] if ancestor.typed[1].inputs else None
                    source_key = mp.TensorKey.from_tensor(source) if hasattr(source, "storage_data_ptr") else None
                    if source_key is not None and source_key.storage.ptr in parameter_ptrs:
                        self.parameter_copies.add(key)
                elif kind in (_EventType.PyCall, _EventType.PyCCall):
                    python_frame = True
                elif kind == _EventType.TorchOp and ancestor.typed[1].scope == RecordScope.BACKWARD_FUNCTION:
                    if python_frame:
                        self.recomputed.add(key)
                    break
                ancestor = ancestor.parent

    def __call__(self, key: Any, version: int) -> str:
        mp = self._mp
        if not isinstance(key, mp.TensorKey):
            return "other"  # an allocation with no tensor behind it (a kernel's private buffer)
        category = self._categories.get(key, version)
        if category in self._direct:
            return self._direct[category]
        if key in self.parameter_copies:
            return "parameter"
        if key in self.recomputed:
            return "activation"
        if category == mp.Category.ACTIVATION:
            return "activation"
        if category in (mp.Category.AUTOGRAD_DETAIL, mp.Category.TEMPORARY):
            return "temporary"
        if key in self.optimizer_scratch:
            # The first step creates AdamW's state inside step(), before the tracer could tag it: a tensor the
            # optimizer still holds afterwards is state, anything else it made is scratch.
            return self._held_after.get(key, "temporary")
        return "other"


def _fallback(
    prof: Any, device: torch.device, before: dict[int, tuple[int, str]], baseline: int, reason: str
) -> MeasuredMemory:
    """The total alone, when the timeline could not be built: the step's growth is reported as ``other``."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        source = "torch.cuda.max_memory_allocated"
    else:
        peak = baseline + peak_of_allocation_events(prof)
        source = "profiler allocation events (cpu)"
    by_category = dict.fromkeys(CATEGORIES, 0)
    for size, category in before.values():
        by_category[category] += size
    by_category["other"] += max(0, peak - baseline)
    return MeasuredMemory(
        peak_bytes=sum(by_category.values()),
        by_category_at_peak=by_category,
        peak_by_category=dict(by_category),
        activation_peak_bytes=0,
        source=source,
        baseline_bytes=baseline,
        notes=[f"no category breakdown: the profiler memory timeline failed ({reason})"],
    )
