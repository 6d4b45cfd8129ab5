"""SGD with momentum (``--optimizer sgd``): torch's SGD, momentum 0.9 unless --momentum says otherwise, Nesterov with
--nesterov. Its weight decay is torch's (added to the gradient, an L2 penalty), on matrices and embeddings only; one
momentum buffer per trained parameter (4 bytes), none without momentum."""

from __future__ import annotations

from typing import Any

import torch

from cadence.errors import Problem
from cadence.optim.spec import OptimizerRule, OptimizerSpec, ParamGroup, TrainedTensor, decay_groups
from cadence.optim.state import MOMENT, check_state_shapes
from cadence.records import Record

FP32_BYTES = 4


class SGDRule(OptimizerRule):
    """SGD: see the module docstring."""

    title = "SGD"
    options = frozenset({"weight_decay", "momentum", "nesterov"})
    offloadable = True
    default_momentum = 0.9
    batch_lr_scaling = "linear"

    def param_groups(self, spec: OptimizerSpec, model: torch.nn.Module) -> list[ParamGroup]:
        return decay_groups(model, spec.weight_decay)

    def constructor(self, spec: OptimizerSpec, *, device_type: str) -> tuple[type[torch.optim.Optimizer],
                                                                              dict[str, Any]]:
        return torch.optim.SGD, {"lr": spec.lr, "momentum": spec.momentum_value, "nesterov": spec.nesterov}

    def describe(self, spec: OptimizerSpec) -> str:
        nesterov = ", Nesterov" if spec.nesterov else ""
        return (f"SGD (momentum {spec.momentum_value:g}{nesterov}; weight decay {spec.weight_decay:g} as an L2 term on "
                f"matrices and embeddings)")

    def problems(self, spec: OptimizerSpec, *, sharded: bool) -> list[Problem]:
        if spec.nesterov and spec.momentum_value == 0:
            return [Problem(where="--nesterov", message="needs momentum: give --momentum above 0")]
        return []

    def state_bytes(self, spec: OptimizerSpec, tensors: list[TrainedTensor], *, on_device: bool
                    ) -> tuple[int, int | None]:
        """One fp32 momentum buffer per element (none without momentum). The step's scratch: torch's per-tensor loop
        (CPU) makes the gradient plus the weight-decay term (a decayed tensor's copy) and, with Nesterov, the gradient
        plus the momentum (another, while the first is held); the loop variable lets go of both before the next
        tensor. The foreach kernels (CUDA) make them for a whole group at once."""
        numels = [tensor.numel for tensor in tensors]
        state = FP32_BYTES * sum(numels) if spec.momentum_value else 0
        copies = [(1 if spec.weight_decay and len(t.shape) >= 2 else 0) + (1 if spec.nesterov else 0) for t in tensors]
        if on_device:
            decayed = sum(t.numel for t in tensors if len(t.shape) >= 2) if spec.weight_decay else 0
            return state, FP32_BYTES * (decayed + (sum(numels) if spec.nesterov else 0))
        return state, FP32_BYTES * max((n * c for n, c in zip(numels, copies, strict=True)), default=0)

    def check_saved(self, spec: OptimizerSpec, optimizer: Record) -> None:
        states = optimizer.record("state")
        for key in states.data:
            entry = states.record(key)
            if entry.get("momentum_buffer") is not None:
                entry.take("momentum_buffer", MOMENT)

    def check_loaded(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> None:
        check_state_shapes(optimizer, lambda name, parameter: tuple(parameter.shape))


RULE = SGDRule()
