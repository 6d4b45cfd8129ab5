"""Optimizer offload (``--offload optimizer``): the optimizer's state and update live on the CPU, for parameters that
live on an accelerator.

An fp32 master copy of every trained parameter, the optimizer state (AdamW: two more parameter-sized tensors) and the
update itself live on the CPU (``OffloadedOptimizer``), around any inner optimizer class. The accelerator keeps only
the parameters and their gradients; each step moves the gradients to the host and the updated parameters back.

Sync points of ``OffloadedOptimizer.step`` (the only ones this module adds): the device->host gradient copies are
asynchronous into pinned buffers, so the host waits once, on each parameter device's current stream, before the CPU
update reads them. The host->device copies of the updated parameters are asynchronous and need no wait: the stream
orders them before the next forward, and the host writes those pinned masters again only after the next step's wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from cadence.optim.stepping import closure_loss


@dataclass(eq=False)
class _Slot:
    """One device parameter and its host-side companions."""

    param: torch.Tensor
    """The model's parameter, on its device (what ``param_groups`` holds)."""
    master: torch.Tensor
    """The host copy the inner optimizer updates: fp32 (or wider), pinned when ``param`` is on CUDA."""
    grad: torch.Tensor
    """Persistent host buffer for ``param.grad``: pinned memory is slow to allocate, so it is allocated once."""
    version: int
    """``param._version`` when ``master`` last equalled ``param``; a different value means someone wrote ``param``."""

    @property
    def asynchronous(self) -> bool:
        # Only CUDA <-> pinned-host copies are truly asynchronous; for other devices non_blocking would buy nothing.
        return self.param.device.type == "cuda"


class OffloadedOptimizer(torch.optim.Optimizer):
    """An optimizer whose state and update live on the CPU, for parameters that live on an accelerator.

    ``param_groups`` holds the DEVICE parameters, so everything that walks it (``GradScaler.unscale_``,
    ``clip_grad_norm_`` over the model, LR schedulers setting ``group["lr"]``) sees an ordinary optimizer. An inner
    ``optimizer_class`` (AdamW by default) updates host master copies; every non-``params`` key of each group is
    copied to the inner group at ``step()`` and ``state_dict()``, so a scheduler's changes take effect.

    ``state`` is the INNER optimizer's state, keyed by the host masters (not by the device parameters): its tensors
    are the optimizer memory that lives on the host. ``host_bytes()`` adds the masters and gradient buffers.
    ``state_dict()`` is the inner optimizer's, in the standard format: a plain ``optimizer_class`` over the same
    parameters can load it, and vice versa. Sparse gradients and sharded (DTensor) parameters are not supported.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        **optimizer_kwargs: Any,
    ) -> None:
        self._inner: torch.optim.Optimizer | None = None
        self._slots: list[list[_Slot]] = []  # aligned with param_groups and the inner optimizer's param_groups
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = dict(optimizer_kwargs)
        super().__init__(params, dict(optimizer_kwargs))  # calls add_param_group for each group
        assert self._inner is not None
        # From now on new groups get every default of the inner optimizer, as a plain one would give them.
        self.defaults = dict(self._inner.defaults)

    # -------------------------------------------------------------------------------------------------- structure
    @property
    def state(self) -> Any:
        """The inner optimizer's state (keyed by host masters); ``load_state_dict`` replaces it, so it is looked up."""
        return self._inner.state if self._inner is not None else {}

    @state.setter
    def state(self, value: Any) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty dict here; the real state belongs to the inner optimizer.
        if self._inner is not None:
            raise AttributeError("OffloadedOptimizer.state is the inner optimizer's state; load_state_dict sets it")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # validation (leaf tensors, no duplicates) and defaults, as usual
        group = self.param_groups[-1]
        slots = [_make_slot(p) for p in group["params"]]
        inner_group = {key: value for key, value in group.items() if key != "params"}
        inner_group["params"] = [slot.master for slot in slots]
        if self._inner is None:
            self._inner = self._optimizer_class([inner_group], **self._optimizer_kwargs)
        else:
            self._inner.add_param_group(inner_group)
        self._slots.append(slots)
        # Mirror the inner optimizer's filled-in defaults (betas, eps, ...) so param_groups shows every option.
        self._pull_hyperparameters()

    def __getstate__(self) -> dict[str, Any]:
        # The base class pickles (and deep-copies) only defaults, state and param_groups; the inner optimizer and
        # the slots ARE this optimizer's state, so they travel too (``state`` is the inner one's, not stored twice).
        state = super().__getstate__()
        del state["state"]
        keep = ("_inner", "_slots", "_optimizer_class", "_optimizer_kwargs")
        return state | {key: self.__dict__[key] for key in keep}

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer over the host masters (read-only use: stepping it directly would skip the copies)."""
        assert self._inner is not None
        return self._inner

    @property
    def masters(self) -> list[torch.Tensor]:
        """The host master copies, in ``param_groups`` order."""
        return [slot.master for slots in self._slots for slot in slots]

    # ------------------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Gradients to the host, the inner optimizer's update there, updated parameters back to their devices."""
        loss = closure_loss(closure)
        self._push_hyperparameters()
        stepped: list[_Slot] = []
        wait_on: set[torch.device] = set()
        for slots in self._slots:
            for slot in slots:
                grad = slot.param.grad
                if grad is None:  # like torch optimizers: no gradient, no update (and no weight decay)
                    slot.master.grad = None
                    continue
                if grad.is_sparse:
                    raise RuntimeError("OffloadedOptimizer does not support sparse gradients")
                if slot.param._version != slot.version:
                    # The parameter was written since our last copy (model.load_state_dict after building the
                    # optimizer, a user's in-place edit): the device value is the truth, the master is stale.
                    slot.master.copy_(slot.param, non_blocking=slot.asynchronous)
                # fp32 on the host whatever the gradient dtype: copy_ converts (on the device, before the transfer).
                slot.grad.copy_(grad, non_blocking=slot.asynchronous)
                slot.master.grad = slot.grad
                stepped.append(slot)
                if slot.asynchronous:
                    wait_on.add(slot.param.device)
        for device in wait_on:
            # THE sync point: the copies above were only queued. The CPU update must not read the pinned buffers
            # before the DMA has filled them. One wait per device, after all copies are queued, so they overlap.
            torch.cuda.current_stream(device).synchronize()
        self.inner.step()
        for slot in stepped:
            # Asynchronous from pinned memory: safe without a wait, because the device stream runs this copy before
            # any later kernel reads the parameter, and the host rewrites the master only after the next step's wait.
            slot.param.copy_(slot.master, non_blocking=slot.asynchronous)
            slot.version = slot.param._version
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device gradients (as any optimizer does) and detach the masters from their gradient buffers."""
        super().zero_grad(set_to_none)
        for slots in self._slots:
            for slot in slots:
                slot.master.grad = None  # the buffer itself is kept: reallocating pinned memory each step is slow

    # ----------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict (host tensors), with the hyper-parameters as ``param_groups`` has them."""
        # A scheduler may have changed group["lr"] since the last step(): push it so the checkpoint holds it.
        self._push_hyperparameters()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the inner optimizer (state lands on the host), then show its hyper-parameters in param_groups."""
        self.inner.load_state_dict(state_dict)
        self._pull_hyperparameters()

    def host_bytes(self) -> int:
        """Bytes this optimizer holds in host memory: masters, their gradient buffers and the inner state."""
        tensors = [t for slots in self._slots for slot in slots for t in (slot.master, slot.grad)]
        for per_param in self.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        return _distinct_bytes(tensors)

    # ---------------------------------------------------------------------------------------------------- helpers
    def _push_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value

    def _pull_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            outer.update({key: value for key, value in inner.items() if key != "params"})


def offloaded_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer memory kept on the host instead of the accelerator (0 for an ordinary optimizer)."""
    return optimizer.host_bytes() if isinstance(optimizer, OffloadedOptimizer) else 0


def _make_slot(param: torch.Tensor) -> _Slot:
    # At least fp32: a bf16/fp16 model still gets fp32 masters and fp32 optimizer math (fp64 stays fp64).
    dtype = torch.promote_types(param.dtype, torch.float32)
    pin = param.device.type == "cuda"  # pinned memory makes the per-step copies asynchronous and faster
    master = torch.empty(param.shape, dtype=dtype, pin_memory=pin)
    master.copy_(param.detach())  # blocking: construction is not a hot path, and the master must be complete
    grad = torch.zeros(param.shape, dtype=dtype, pin_memory=pin)
    return _Slot(param=param, master=master, grad=grad, version=param._version)


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages among ``tensors`` (a storage shared by two tensors counts once)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
