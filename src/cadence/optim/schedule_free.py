"""Schedule-Free AdamW (``--optimizer schedule-free``): AdamW without a decaying LR schedule, whose weights to evaluate
and save are an average of its iterates (Defazio et al., "The Road Less Scheduled", 2024; the ``schedulefree``
package's ``AdamWScheduleFree``, written here in cadence's own terms: no dependency).

Three sequences: ``z`` (the plain AdamW-preconditioned SGD iterate, in the state), ``x`` (the weighted average of the
z's: the weights to evaluate, save and export) and ``y = (1 - beta1) z + beta1 x`` (where the gradient is taken: the
parameters while training). A step: ``v <- beta2 v + (1 - beta2) g^2``; ``u = g / (sqrt(v) + eps) + decay x y``;
``y <- lerp(y, z, c) + lr (beta1 (1 - c) - 1) u``; ``z <- z - lr u``, with ``lr`` the scheduled LR times
``sqrt(1 - beta2^(k+1))`` and ``c = w_k / sum w`` the average's weight of this step (``w_k = lr_max^2``, lr_max the
largest LR so far: warm-up steps weigh less). ``k`` counts optimizer steps (the engine steps once per window, and an
fp16 step skipped for an overflow is no step).

cadence owns the switch between the two sets of weights (schedule_free #48, #15, #22; accelerate #4159: a checkpoint
saved in train mode holds y, not x). :meth:`ScheduleFreeAdamW.eval` puts x into the parameters (``y + (1 - 1/beta1)
(z - y)``) and keeps y aside in the state (``train_weights``); :meth:`ScheduleFreeAdamW.train` puts y back, bit for bit.
The spec's ``evaluation_weights`` hook wraps every evaluation, checkpoint, best/ and the final weights in eval mode,
so all of them (and --save-hf, ``cadence export``, ``cadence sample``, which read them) hold x; a checkpoint's
optimizer state carries y, which the resumed run restores, so it continues bitwise. ``step`` in eval mode raises.

LR: one --lr, warmed up by --warmup-steps (linear, in optimizer steps); no decay after it (``--lr-schedule constant``:
the averaging replaces the decay). State: z and v, 8 bytes per trained parameter (as AdamW's); eval mode holds y
aside too while it lasts. Not with --strategy fsdp or --offload optimizer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cadence.errors import Problem
from cadence.optim.spec import OptimizerRule, OptimizerSpec, ParamGroup, TrainedTensor, decay_groups
from cadence.optim.state import MOMENT, check_state_shapes
from cadence.optim.stepping import closure_loss
from cadence.records import Record

FP32_BYTES = 4
TRAIN_WEIGHTS = "train_weights"
"""Where eval mode keeps the training weights y (so a checkpoint written in eval mode carries them)."""


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """See the module docstring. Group keys beyond AdamW's: ``k`` (steps done), ``lr_max``, ``weight_sum``,
    ``train_mode``; per parameter: ``z``, ``exp_avg_sq`` (and ``train_weights`` in eval mode)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, weight_lr_power: float = 2.0) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "weight_lr_power": weight_lr_power, "k": 0, "lr_max": 0.0, "weight_sum": 0.0,
                    "train_mode": True}
        super().__init__(params, defaults)

    @property
    def training(self) -> bool:
        return bool(self.param_groups[0]["train_mode"]) if self.param_groups else True

    @torch.no_grad()
    def eval(self) -> None:
        """The parameters become x, the average; y waits in the state until :meth:`train`."""
        for group in self.param_groups:
            if not group["train_mode"]:
                continue
            beta1 = float(group["betas"][0])
            for param in group["params"]:
                state = self.state[param]
                if "z" in state:
                    state[TRAIN_WEIGHTS] = param.detach().clone()
                    param.lerp_(state["z"], 1 - 1 / beta1)
            group["train_mode"] = False

    @torch.no_grad()
    def train(self) -> None:
        """The parameters become y again, exactly as they were before :meth:`eval`."""
        for group in self.param_groups:
            if group["train_mode"]:
                continue
            for param in group["params"]:
                state = self.state[param]
                if TRAIN_WEIGHTS in state:
                    param.copy_(state[TRAIN_WEIGHTS])
                    # A new dict, not a pop: a state dict taken in eval mode (a checkpoint being written) holds this
                    # parameter's dict itself, and must keep y.
                    self.state[param] = {key: value for key, value in state.items() if key != TRAIN_WEIGHTS}
            group["train_mode"] = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state saved in eval mode (a checkpoint) carries y: the parameters (loaded before, holding x) get it back,
        and the optimizer is in train mode, ready to step."""
        super().load_state_dict(state_dict)
        self.train()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure_loss(closure)
        if not self.training:
            raise RuntimeError("ScheduleFreeAdamW.step in eval mode: the parameters hold the averaged weights x, "
                               "not y; call train() first")
        for group in self.param_groups:
            beta1, beta2 = (float(beta) for beta in group["betas"])
            decay, eps, k = float(group["weight_decay"]), float(group["eps"]), int(group["k"])
            lr = float(group["lr"]) * math.sqrt(1 - beta2 ** (k + 1))
            group["lr_max"] = lr_max = max(lr, float(group["lr_max"]))
            weight = lr_max ** float(group["weight_lr_power"])
            group["weight_sum"] = weight_sum = float(group["weight_sum"]) + weight
            average = weight / weight_sum if weight_sum else 0.0
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "z" not in state:
                    state["z"] = param.detach().clone()
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                z, exp_avg_sq = state["z"], state["exp_avg_sq"]
                exp_avg_sq.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denom = exp_avg_sq.sqrt().add_(eps)
                update = param.grad.div(denom)
                if decay:
                    update.add_(param, alpha=decay)  # weight decay at y
                param.lerp_(z, average)
                param.add_(update, alpha=lr * (beta1 * (1 - average) - 1))
                z.sub_(update, alpha=lr)
            group["k"] = k + 1
        return loss


@contextlib.contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside: the model holds x (eval mode); after: y again, bitwise. Nested uses switch once."""
    if not isinstance(optimizer, ScheduleFreeAdamW) or not optimizer.training:
        yield
        return
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()


class ScheduleFreeRule(OptimizerRule):
    """Schedule-Free AdamW: see the module docstring."""

    title = "Schedule-Free AdamW"
    options = frozenset({"weight_decay", "adam_beta1", "adam_beta2"})
    schedules = ("constant",)

    def param_groups(self, spec: OptimizerSpec, model: torch.nn.Module) -> list[ParamGroup]:
        return decay_groups(model, spec.weight_decay)

    def constructor(self, spec: OptimizerSpec, *, device_type: str) -> tuple[type[torch.optim.Optimizer],
                                                                              dict[str, Any]]:
        return ScheduleFreeAdamW, {"lr": spec.lr, "betas": spec.betas}

    def describe(self, spec: OptimizerSpec) -> str:
        return (f"Schedule-Free AdamW (betas {spec.betas[0]:g}, {spec.betas[1]:g}; weight decay {spec.weight_decay:g} "
                f"on matrices and embeddings; evaluated and saved from its averaged weights)")

    def problems(self, spec: OptimizerSpec, *, sharded: bool) -> list[Problem]:
        if sharded:
            return [Problem(where="--optimizer", message=(
                "schedule-free with --strategy fsdp is not supported: its averaged weights are switched in and out "
                "of the parameters, which FSDP2 holds as shards it gathers itself; use --strategy ddp"))]
        return []

    def evaluation_weights(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Any]:
        return averaged_weights(optimizer)

    def end_training(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, ScheduleFreeAdamW):
            optimizer.eval()

    def state_bytes(self, spec: OptimizerSpec, tensors: list[TrainedTensor], *, on_device: bool
                    ) -> tuple[int, int | None]:
        """z and v: two fp32 tensors per trained parameter. The step's scratch, one tensor at a time: its
        denominator and its update, the previous tensor's update still bound to the loop."""
        numels = [tensor.numel for tensor in tensors]
        worst = max((2 * cur + prev for prev, cur in zip([0, *numels[:-1]], numels, strict=True)), default=0)
        return 2 * FP32_BYTES * sum(numels), FP32_BYTES * worst

    def check_saved(self, spec: OptimizerSpec, optimizer: Record) -> None:
        states = optimizer.record("state")
        for key in states.data:
            entry = states.record(key)
            for name in ("z", "exp_avg_sq"):
                entry.take(name, MOMENT)
            if entry.get(TRAIN_WEIGHTS) is not None:
                entry.take(TRAIN_WEIGHTS, MOMENT)

    def check_loaded(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> None:
        check_state_shapes(optimizer, lambda name, parameter: tuple(parameter.shape))


RULE = ScheduleFreeRule()
