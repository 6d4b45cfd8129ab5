"""The optimizer of a run: one frozen value, decided once from the flags and used by every command.

Nothing else decides what the optimizer is. :class:`OptimizerSpec` is made from train's flags
(:meth:`OptimizerSpec.from_flags`), turned back into them for config.json, plan.json and a checkpoint
(:meth:`OptimizerSpec.flags`), said in words (:meth:`OptimizerSpec.describe`), checked (:meth:`OptimizerSpec.problems`:
an option that does not apply to the optimizer is an error naming its flag, never ignored), and it builds the
optimizer (:meth:`OptimizerSpec.build`: its parameter groups, its class, its state precision, the offload wrapper),
tells the memory estimate its state bytes (:meth:`OptimizerSpec.state_bytes`), checks a saved state before a resume
loads it and after (:meth:`OptimizerSpec.check_saved`, :meth:`OptimizerSpec.check_loaded`), and says what a plan may
vary (:meth:`OptimizerSpec.lossy_states`).

What differs between optimizers is an :class:`OptimizerRule`, one per module (``cadence.optim.adamw``, ...), found
through the registry in :mod:`cadence.optim.choices`. Composite optimizers (Muon's orthogonalised groups beside AdamW
groups) are one ``torch.optim.Optimizer`` whose groups carry their own rule, so the LR schedule, the clip, the fp16
scaler, the offload wrapper and both checkpoint formats see one ordinary optimizer with one state dict.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from cadence.errors import Problem
from cadence.optim.choices import OPTIMIZER_MODULES, OPTIMIZER_STATES, OPTIMIZERS, OptimizerName, OptimizerStateName
from cadence.records import Record

OPTIMIZER_FLAG_DEFAULTS: dict[str, Any] = {"optimizer": "adamw", "optimizer_state": "fp32", "weight_decay": 0.1,
                                           "adam_beta1": 0.9, "adam_beta2": 0.95, "momentum": None,
                                           "nesterov": False}
"""The optimizer's flags (beyond ``--lr``, which the schedule shares) at their defaults: a flag at another value was
given, and must apply to the optimizer; a record without a key (an older config.json or plan.json) means its
default."""

OPTIMIZER_REGION_PREFIX = "optimizer."
"""The prefix of the profiler regions an optimizer names inside its step (Muon's ``optimizer.newton_schulz``):
``cadence profile`` reports each one's time (profile.json's ``optimizer_regions``)."""


@dataclass(frozen=True)
class TrainedTensor:
    """A trained parameter as the memory estimate knows it, before any model is built: its shape, and whether it is
    a weight of the repeated blocks (where Muon orthogonalises)."""

    shape: tuple[int, ...]
    in_blocks: bool = False

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class ParamGroup:
    """One group of trained parameters with the rule its optimizer applies to them (its options)."""

    name: str
    """What the group is, in words ("decay", "no decay", "orthogonalised", ...)."""
    params: list[torch.Tensor]
    options: dict[str, Any] = field(default_factory=dict)
    """The group's own options (``weight_decay``, ...), as ``torch.optim`` reads a param group's keys."""

    def as_torch(self) -> dict[str, Any]:
        return {"params": self.params, **self.options}

    def describe(self) -> str:
        """"decay: 26 tensors, 1,234,567 parameters"."""
        count = sum(param.numel() for param in self.params)
        return f"{self.name}: {len(self.params)} tensor{'s' * (len(self.params) != 1)}, {count:,} parameters"


class OptimizerRule:
    """What one optimizer is: overridden by each optimizer's module (its ``RULE``)."""

    title = "?"
    """Its name in sentences ("AdamW")."""
    options: frozenset[str] = frozenset()
    """The optimizer flags of :data:`OPTIMIZER_FLAG_DEFAULTS` it reads besides --optimizer-state (``--lr`` always
    applies)."""
    states: tuple[OptimizerStateName, ...] = ("fp32",)
    """The --optimizer-state values it can store its state in."""
    offloadable = False
    """Whether --offload optimizer can wrap it."""
    default_momentum: float | None = None
    """Its momentum when --momentum is not given (None: it has no momentum, and --momentum does not apply)."""
    schedules: tuple[str, ...] = ("constant", "linear", "cosine")
    """The --lr-schedule values it trains under."""
    batch_lr_scaling: Literal["sqrt", "linear"] = "sqrt"
    """How its LR follows a batch r times larger when --batch-lr-scaling is not given (--effective-batch-size
    adaptive): sqrt(r) for Adam-type updates (Malladi et al. 2022, the square-root rule), r for SGD (Goyal et al.
    2017, the linear rule)."""

    def param_groups(self, spec: OptimizerSpec, model: torch.nn.Module) -> list[ParamGroup]:
        raise NotImplementedError

    def constructor(self, spec: OptimizerSpec, *, device_type: str) -> tuple[type[torch.optim.Optimizer],
                                                                              dict[str, Any]]:
        """The optimizer class and its keyword arguments (the offload wrapper passes them to its inner optimizer)."""
        raise NotImplementedError

    def describe(self, spec: OptimizerSpec) -> str:
        raise NotImplementedError

    def problems(self, spec: OptimizerSpec, *, sharded: bool) -> list[Problem]:
        """Problems of its own beyond the options that do not apply (a missing package, FSDP2)."""
        return []

    def state_bytes(self, spec: OptimizerSpec, trained: list[TrainedTensor], *, on_device: bool
                    ) -> tuple[int, int | None]:
        """(state bytes, the step's largest scratch) for the trained tensors ``trained``, in the optimizer's order; a
        scratch of None is AdamW's elementwise fp32 update's, which the memory replay models itself (it knows torch's
        foreach and per-tensor loops and the order of its model's tensors)."""
        raise NotImplementedError

    def check_saved(self, spec: OptimizerSpec, optimizer: Record) -> None:
        """Raise ``RecordInvalid`` for a saved state dict's per-parameter state this optimizer could not step from."""
        raise NotImplementedError

    def check_loaded(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError for loaded state that does not fit its parameters (shapes)."""
        raise NotImplementedError

    def lossy_states(self, notes: list[str]) -> list[OptimizerStateName]:
        """The lower-precision states a plan may try on this machine (why others cannot be tried goes to ``notes``)."""
        return []

    def evaluation_weights(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Any]:
        """The context in which the model holds the weights to evaluate and save (most optimizers: the weights as they
        are)."""
        return contextlib.nullcontext()

    def end_training(self, optimizer: torch.optim.Optimizer) -> None:
        """No step follows: leave the model holding the weights to save (most optimizers: as they are)."""

    def model_problem(self, spec: OptimizerSpec, model: torch.nn.Module) -> str | None:
        """Why this optimizer cannot train ``model`` (its parameters do not fit its rule), or None."""
        return None

    def notes(self, spec: OptimizerSpec, *, pretrained: bool, adapters: bool) -> list[str]:
        """What to warn about once per run (``pretrained``: the weights come from a model directory; ``adapters``:
        LoRA adapters are trained, not the whole model)."""
        return []


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """The run's optimizer and its options (see the module docstring)."""

    name: OptimizerName = "adamw"
    """--optimizer."""
    lr: float = 1e-3
    """--lr: the peak learning rate (the schedule scales it step by step)."""
    weight_decay: float = 0.1
    """--weight-decay (decoupled), on the groups the optimizer's rule decays."""
    betas: tuple[float, float] = (0.9, 0.95)
    """--adam-beta1, --adam-beta2."""
    state: OptimizerStateName = "fp32"
    """--optimizer-state: how the optimizer stores its state."""
    offload: bool = False
    """--offload optimizer: the state and the update on the host."""
    momentum: float | None = None
    """--momentum (SGD, Muon); None: the optimizer's own default."""
    nesterov: bool = False
    """--nesterov (SGD)."""

    def __post_init__(self) -> None:
        # Library misuse, not user input: the flags are validated (naming them) before a spec is made.
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.state not in OPTIMIZER_STATES:
            raise ValueError(f"state must be one of {', '.join(OPTIMIZER_STATES)}, got {self.state!r}")

    # ------------------------------------------------------------------------------------------------ from and to flags
    @classmethod
    def from_flags(cls, flags: Any) -> OptimizerSpec:
        """The optimizer of train's flags (a TrainConfig, or a record's mapping with the same names)."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        value = {name: get(name, default) for name, default in OPTIMIZER_FLAG_DEFAULTS.items()}
        momentum = value["momentum"]
        return cls(name=value["optimizer"], lr=float(get("lr", 1e-3)), weight_decay=float(value["weight_decay"]),
                   betas=(float(value["adam_beta1"]), float(value["adam_beta2"])), state=value["optimizer_state"],
                   offload=get("offload", "none") == "optimizer",
                   momentum=None if momentum is None else float(momentum), nesterov=bool(value["nesterov"]))

    def flags(self) -> dict[str, Any]:
        """The optimizer as train's flags (the run record's and plan.json's keys; ``--lr`` and ``--offload`` are the
        schedule's and the memory levers' flags, recorded with them)."""
        return {"optimizer": self.name, "optimizer_state": self.state, "weight_decay": self.weight_decay,
                "adam_beta1": self.betas[0], "adam_beta2": self.betas[1], "momentum": self.momentum,
                "nesterov": self.nesterov}

    def with_state(self, state: OptimizerStateName) -> OptimizerSpec:
        """The same optimizer with its state stored in ``state`` (a plan's lossy lever)."""
        return replace(self, state=state)

    @property
    def momentum_value(self) -> float:
        """The momentum the optimizer runs with: --momentum, or its own default."""
        default = self.rule.default_momentum
        return self.momentum if self.momentum is not None else (0.0 if default is None else default)

    @property
    def batch_lr_scaling(self) -> Literal["sqrt", "linear"]:
        """The LR's default rule when the batch changes (:attr:`OptimizerRule.batch_lr_scaling`)."""
        return self.rule.batch_lr_scaling

    @property
    def rule(self) -> OptimizerRule:
        """The optimizer's rule, from its module (imported on first use: the registry names modules)."""
        return importlib.import_module(OPTIMIZER_MODULES[self.name]).RULE

    def describe(self) -> str:
        """In words, for the console and the report: "AdamW (fp32 moments; betas 0.9, 0.95; weight decay 0.1 on
        matrices and embeddings)"."""
        where = ", state and update on the host" if self.offload else ""
        return self.rule.describe(self) + where

    def problems(self, *, sharded: bool = False, lr_schedule: str | None = None) -> list[Problem]:
        """Every option that does not apply to this optimizer, each naming its flag, and the optimizer's own problems
        (``sharded``: the run is sharded by FSDP2; ``lr_schedule``: --lr-schedule)."""
        rule = self.rule
        problems = []
        given = {name for name, value in self.flags().items()
                 if name not in ("optimizer", "optimizer_state") and value != OPTIMIZER_FLAG_DEFAULTS[name]}
        for name in sorted(given - rule.options):
            problems.append(Problem(where="--" + name.replace("_", "-"), message=(
                f"does not apply to --optimizer {self.name} ({rule.title} reads {_listed(rule.options)})")))
        if self.state not in rule.states:
            problems.append(Problem(where="--optimizer-state", message=(
                f"{self.state} does not apply to --optimizer {self.name}: {rule.title} keeps its state in "
                f"{' or '.join(rule.states)}")))
        if self.offload and not rule.offloadable:
            problems.append(Problem(where="--offload", message=(
                f"optimizer does not apply to --optimizer {self.name}: {rule.title}'s update runs on the parameters' "
                f"device")))
        elif self.offload and sharded:
            problems.append(Problem(where="--offload", message=(
                "optimizer offload with --strategy fsdp is not supported; FSDP already shards the optimizer state "
                "over the ranks")))
        if lr_schedule is not None and lr_schedule not in rule.schedules:
            problems.append(Problem(where="--lr-schedule", message=(
                f"{lr_schedule} does not apply to --optimizer {self.name}: {rule.title} trains under "
                f"{' or '.join(rule.schedules)} (with --warmup-steps)")))
        return problems + rule.problems(self, sharded=sharded)

    # ------------------------------------------------------------------------------------------------ the optimizer
    def param_groups(self, model: torch.nn.Module) -> list[ParamGroup]:
        """The trained parameters of ``model`` (a tied weight once; frozen ones, a LoRA run's base, get no state) in
        the groups this optimizer treats alike."""
        return self.rule.param_groups(self, model)

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s trained parameters, as the flags say (offloaded with --offload optimizer)."""
        groups = [group.as_torch() for group in self.param_groups(model)]
        # Where the first group's parameters live (the update runs there, unless offloaded to the host).
        first = groups[0]["params"][0] if groups and groups[0]["params"] else None
        optimizer_class, options = self.rule.constructor(
            self, device_type="cpu" if self.offload or first is None else first.device.type)
        if self.offload:
            from cadence.optim.offload import OffloadedOptimizer

            return OffloadedOptimizer(groups, optimizer_class=optimizer_class, **options)
        return optimizer_class(groups, **options)

    def describe_groups(self, model: torch.nn.Module) -> str:
        """How many tensors and parameters each group holds, for the console: "decay: 26 tensors, 1,234 parameters;
        no decay: ..."."""
        return "; ".join(group.describe() for group in self.param_groups(model))

    def model_problem(self, model: torch.nn.Module) -> str | None:
        """Why this optimizer cannot train ``model`` (Muon on a model with no 2-D block weights), or None."""
        return self.rule.model_problem(self, model)

    def notes(self, *, pretrained: bool, adapters: bool) -> list[str]:
        """What to warn about once per run (Muon fine-tuning a whole pretrained model)."""
        return self.rule.notes(self, pretrained=pretrained, adapters=adapters)

    def evaluation_weights(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[Any]:
        """The one hook for weights that are evaluated or saved: inside it the model holds the weights to evaluate,
        save and export (a schedule-free optimizer's averaged weights), and on leaving it the training weights are
        back exactly. Every evaluation, checkpoint, best/ and final-weights write runs inside it."""
        return self.rule.evaluation_weights(optimizer)

    def end_training(self, optimizer: torch.optim.Optimizer) -> None:
        """The run is over (no step follows): the model keeps the weights to save, export and sample from (a
        schedule-free optimizer's averaged weights) for the final model.safetensors and --save-hf."""
        self.rule.end_training(optimizer)

    def state_bytes(self, trained: list[TrainedTensor], *, on_device: bool) -> tuple[int, int | None]:
        """(state bytes, the step's largest scratch; None: AdamW's elementwise update's, the replay's own) for the
        trained tensors ``trained`` (the memory estimate's question)."""
        return self.rule.state_bytes(self, trained, on_device=on_device)

    def check_saved(self, optimizer: Record) -> None:
        """A saved optimizer state dict (its per-parameter state) this optimizer can step from, or RecordInvalid."""
        self.rule.check_saved(self, optimizer)

    def check_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """Loaded state that fits its parameters, or ValueError naming the first misfit."""
        self.rule.check_loaded(self, optimizer)

    def lossy_states(self, notes: list[str]) -> list[OptimizerStateName]:
        """What a plan may vary: the lower-precision states this optimizer has on this machine (each a lossy lever,
        kept only after its loss check); why one is missing goes to ``notes``."""
        return self.rule.lossy_states(notes)


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model``'s trained parameters with their names, in ``named_parameters`` order, a tied weight once."""
    found, seen = [], set()
    for name, param in model.named_parameters():  # named_parameters() yields a tied weight once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        found.append((name, param))
    return found


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[ParamGroup]:
    """Weight decay on matrices and embeddings only (decaying biases and norm gains only hurts): AdamW's groups, and
    those of the optimizers that decay as AdamW does."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for _, param in trained_parameters(model):
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [ParamGroup("decay", decay, {"weight_decay": weight_decay}),
            ParamGroup("no decay", no_decay, {"weight_decay": 0.0})]


def _listed(options: frozenset[str]) -> str:
    flags = ["--lr"] + ["--" + name.replace("_", "-") for name in sorted(options)]
    return ", ".join(flags[:-1]) + " and " + flags[-1] if len(flags) > 1 else flags[0]
