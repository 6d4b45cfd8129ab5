"""Activation offload: the tensors autograd saves for backward kept in host memory, so a bigger batch fits the
accelerator.

Modes (``--offload``):
- ``none``: everything stays on the accelerator.
- ``activations``: the tensors autograd saves in the forward pass for the backward pass are copied to host memory as
  they are saved and brought back when backward needs them (``activation_offload``). Gradients are unchanged; the
  price is one host round trip per saved tensor over PCIe, weights that a matmul saves included.
- ``optimizer``: the optimizer's state and update on the host; the optimizer's own concern
  (:class:`cadence.optim.offload.OffloadedOptimizer`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def activation_offload(device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """The context to wrap one micro-batch's FORWARD (and loss) in: tensors saved for backward live in host memory.

    Like ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, except that the copy to the host is asynchronous
    too: save_on_cpu's device-to-host ``copy_`` blocks the host at every saved tensor (one synchronisation per saved
    activation, so the forward's kernels are never queued ahead). Here each saved tensor is copied into pinned host
    memory with ``non_blocking=True``: the copy is ordered after the kernel that produced the tensor on the same
    stream, the device tensor's memory is only reused by kernels queued after the copy, the pinned buffer is held by
    PyTorch's host allocator until its copy has finished, and the host never reads the buffer (backward copies it
    back, asynchronously, on the same stream). On a CPU device the same hooks run (so this path is exercised by the
    CPU tests), but a CPU tensor already is host memory: it is kept as it is, and no memory is saved. Only the
    forward needs to be inside the context; backward may run after it has exited."""
    return _HostActivations(pin_memory=torch.device(device).type == "cuda")


class _HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """saved_tensors_hooks that keep every saved device tensor in (pinned) host memory; see activation_offload."""

    def __init__(self, *, pin_memory: bool) -> None:
        def pack(tensor: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
            if tensor.device.type == "cpu":
                return None, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
            host.copy_(tensor, non_blocking=pin_memory)
            return tensor.device, host

        def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
            device, tensor = packed
            return tensor if device is None else tensor.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)
