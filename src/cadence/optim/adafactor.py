"""Adafactor (``--optimizer adafactor``): torch's Adafactor, whose second moment of a matrix is factored into a row
and a column estimate (rows + columns values instead of rows x columns), and which keeps no first moment: the
smallest state of the optimizers here besides SGD without momentum.

Its step size is relative: ``min(lr, 1/sqrt(t)) x max(1e-3, RMS(parameter))`` (t: the optimizer steps done, counted
by the optimizer itself), so --lr caps a step relative to the parameter's scale; the LR schedule scales it as for the
others. Weight decay is decoupled (the parameter times 1 - lr x decay), on matrices and embeddings only. Its second
moment's decay, 1 - t^-0.8, is a function of the step count: a resumed run continues it from the saved step."""

from __future__ import annotations

from typing import Any

import torch

from cadence.errors import Problem
from cadence.optim.spec import OptimizerRule, OptimizerSpec, ParamGroup, TrainedTensor, decay_groups
from cadence.optim.state import MOMENT, STEP_TENSOR, check_state_shapes
from cadence.records import Record

FP32_BYTES = 4


class AdafactorRule(OptimizerRule):
    """Adafactor: see the module docstring."""

    title = "Adafactor"
    options = frozenset({"weight_decay"})
    offloadable = True

    def param_groups(self, spec: OptimizerSpec, model: torch.nn.Module) -> list[ParamGroup]:
        return decay_groups(model, spec.weight_decay)

    def constructor(self, spec: OptimizerSpec, *, device_type: str) -> tuple[type[torch.optim.Optimizer],
                                                                              dict[str, Any]]:
        # The per-tensor loop: the foreach path groups tensors by shape class and is not faster on CPU; on CUDA it
        # is, and computes the same update.
        return torch.optim.Adafactor, {"lr": spec.lr, "foreach": device_type == "cuda"}

    def describe(self, spec: OptimizerSpec) -> str:
        return (f"Adafactor (factored second moment, no first moment; relative step capped by --lr; weight decay "
                f"{spec.weight_decay:g} on matrices and embeddings)")

    def problems(self, spec: OptimizerSpec, *, sharded: bool) -> list[Problem]:
        if sharded:
            return [Problem(where="--optimizer", message=(
                "adafactor with --strategy fsdp is not supported: its column statistics are means over a matrix's "
                "rows, which FSDP2 shards over the ranks, so each rank would factor its own shard and the update "
                "would change with the number of ranks; use --strategy ddp"))]
        return []

    def state_bytes(self, spec: OptimizerSpec, tensors: list[TrainedTensor], *, on_device: bool
                    ) -> tuple[int, int | None]:
        """A matrix: its row and column estimates (rows + columns fp32 values); a vector: its own estimate (one fp32
        value per element); and a one-element fp32 step per tensor. The step's scratch (per tensor, CPU and the
        per-tensor loop alike): the estimate rebuilt at full size (row x column) and turned into the update in
        place, the previous tensor's still bound to the loop; a vector's square and its copy."""
        state = 0
        sizes = []
        for tensor in tensors:
            factored = len(tensor.shape) >= 2
            state += FP32_BYTES * ((tensor.shape[-2] + tensor.shape[-1]) if factored else tensor.numel) + FP32_BYTES
            sizes.append(tensor.numel * (1 if factored else 2))
        if on_device:  # foreach: a whole group's estimates at once
            return state, FP32_BYTES * sum(sizes)
        worst = max((cur + prev for prev, cur in zip([0, *sizes[:-1]], sizes, strict=True)), default=0)
        return state, FP32_BYTES * worst

    def check_saved(self, spec: OptimizerSpec, optimizer: Record) -> None:
        states = optimizer.record("state")
        for key in states.data:
            entry = states.record(key)
            entry.take("step", STEP_TENSOR)
            names = ("row_var", "col_var") if entry.get("variance") is None else ("variance",)
            for name in names:
                entry.take(name, MOMENT)

    def check_loaded(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> None:
        check_state_shapes(optimizer, _expected_shape)


def _expected_shape(name: str, parameter: torch.Tensor) -> tuple[int, ...] | None:
    shape = tuple(parameter.shape)
    return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1]) if len(shape) >= 2 else None,
            "variance": shape}.get(name)


RULE = AdafactorRule()
