"""Is a training configuration the same training? Gradient equivalence and a short loss comparison.

A configuration (micro-batch x accumulation, precision, recompute, offload) is checked against the exact reference:
fp32, no recompute, no offload, the same window of samples. In fp32 any split and any recompute must give the
reference gradient to rounding; bf16 and fp16 differ by their rounding, within documented tolerances.

The gradients come from the real step chain: the engine runs the window with an optimizer that records the
gradients it is handed instead of updating, so what is compared is exactly what an optimizer would have received
(after loss normalisation, accumulation and unscaling, before clipping). ``cadence plan`` uses this for its quality
check; ``cadence verify`` is built on it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from cadence.distributed.ranks import SINGLE, ProcessGroupCollective, Ranks, wrap_model
from cadence.engine.choices import PrecisionName
from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
from cadence.engine.cut import Cut
from cadence.engine.objective import Objective
from cadence.engine.step import Engine, LossFn, token_cross_entropy_sum
from cadence.engine.windows import Window, recut
from cadence.memory.choices import CheckpointingMode, OffloadMode
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.optim.offload import OffloadedOptimizer

GRADIENT_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
"""Relative L2 error of the window gradient against the fp32 reference that passes, per precision. fp32: rounding
of a different summation order only. bf16 has 8 mantissa bits (~0.4% per rounding) and fp16 11 bits; measured on the
built-in GPTs (tests/verify/test_verify.py) they stay well inside these."""

LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}
"""Largest per-step relative loss difference against the fp32 reference over a short run that passes."""


@dataclass(kw_only=True, frozen=True)
class Setup:
    """How one window is cut and computed (``cadence.plan.trials.TrialSetup`` adds the accumulation of a plan)."""

    cut: Cut
    """How the window is cut into micro-batches (its micro-batch size, order, token budget, packing)."""
    precision: PrecisionName = "fp32"
    activation_checkpointing: CheckpointingMode = "none"
    offload: OffloadMode = "none"
    loss_chunk_tokens: int = 0
    """``--loss-chunk-tokens``: the LM head and cross-entropy this many target tokens at a time (0: all at once)."""
    targets_only: bool = False
    """At ``loss_chunk_tokens`` 0, the LM head on the target positions only, as training computes the loss of a
    model whose head it can split (:func:`cadence.training.components.build_loss`): verify checks what train runs."""

    @property
    def micro_batch_size(self) -> int:
        return self.cut.micro_batch_size

    def describe(self) -> str:
        cut = self.cut.describe()
        return (f"micro {self.micro_batch_size}, {self.precision}, recompute {self.activation_checkpointing}, "
                f"offload {self.offload}" + self.lever_text() + (f", {cut}" if cut else ""))

    def lever_text(self) -> str:
        """The levers beyond precision, recompute and offload, as a suffix ("" when none is pulled)."""
        if self.loss_chunk_tokens:
            return f", loss chunks of {self.loss_chunk_tokens}"
        return ", LM head on the targets only" if self.targets_only else ""

    def loss_for(self, loss_fn: LossFn) -> LossFn:
        """The loss this setup computes: ``loss_fn``, or, when it is the default next-token loss and the setup chunks
        it, the same loss a chunk of targets at a time, or the head on the targets only (exact levers: the reference
        keeps all logits at once)."""
        if self.loss_chunk_tokens and loss_fn is token_cross_entropy_sum:
            return ChunkedCrossEntropy(self.loss_chunk_tokens)
        if self.targets_only and loss_fn is token_cross_entropy_sum:
            return TargetsOnlyCrossEntropy()
        return loss_fn

    def engine_loss(self, loss_fn: LossFn, objective: Objective | None) -> dict[str, Any]:
        """The engine's keyword for what this setup computes: ``loss_fn`` as :meth:`loss_for` makes it, or
        ``objective`` (a preference objective, its reference attached) with its log-probabilities computed the same
        way (chunked, on the targets only, or from all logits)."""
        if objective is None:
            return {"loss_fn": self.loss_for(loss_fn)}
        return {"objective": replace(objective, token_loss=self.loss_for(token_cross_entropy_sum))}


def split_for(setup: Setup, window: Window, ranks: Ranks = SINGLE) -> Window:
    """``window`` (a whole window) as ``setup`` runs it on this rank: its share, cut as the setup says."""
    return recut(window, setup.cut, world_size=ranks.world_size if ranks.launched else 1,
                 rank=ranks.rank if ranks.launched else 0)


@dataclass(kw_only=True)
class GradientComparison:
    relative_error: float
    """||g - g_ref|| / ||g_ref||."""
    cosine: float
    max_abs_diff: float
    tolerance: float
    passed: bool
    reference: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose step records the gradients (fp32 copies on the CPU, in parameter order), changing nothing."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.0})
        self.recorded: list[torch.Tensor | None] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]  # returns no loss
        self.recorded = [None if p.grad is None else _whole(p.grad).detach().float().cpu().clone()
                         for g in self.param_groups for p in g["params"]]


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 gradient shard gathered whole (a collective: every rank calls it); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def parameter_gradients(
    build_model: Callable[[], torch.nn.Module], window: Window, setup: Setup, *,
    loss_fn: LossFn = token_cross_entropy_sum, max_overflow_retries: int = 12, ranks: Ranks = SINGLE,
    objective: Objective | None = None,
) -> dict[str, torch.Tensor]:
    """The gradient an optimizer would receive for ``window`` under ``setup``: parameter name -> fp32 CPU tensor.

    Under torchrun (``ranks``) each rank runs its share of the window through DDP or FSDP2, and the gradient is the
    synchronised one every rank's optimizer receives. ``objective``: a preference objective instead of ``loss_fn``."""
    model = build_model()
    apply_activation_checkpointing(model, setup.activation_checkpointing)
    names = [name for name, _ in model.named_parameters()]
    device = next(model.parameters()).device
    model = wrap_model(model, ranks, device, precision=setup.precision)
    recorder = _GradientRecorder(model.parameters())
    optimizer: torch.optim.Optimizer = recorder
    if setup.offload == "optimizer":
        # The offloaded optimizer hands its inner optimizer CPU copies of the gradients: record those.
        optimizer = OffloadedOptimizer(model.parameters(), optimizer_class=_GradientRecorder)
        recorder = optimizer.inner  # type: ignore[assignment]  # made by optimizer_class above
    engine = Engine(model, optimizer, precision=setup.precision, max_grad_norm=0.0,
                    offload_activations=setup.offload == "activations", **setup.engine_loss(loss_fn, objective),
                    collective=ProcessGroupCollective(ranks, device) if ranks.launched else None)
    split = split_for(setup, window, ranks)
    for _ in range(max_overflow_retries + 1):
        result = engine.step(split)
        if not result.skipped:
            break  # fp16 may overflow at its first scale; the scaler backs off and the same window runs again
    if recorder.recorded is None:
        raise RuntimeError(f"no finite gradient for {setup.describe()} after {max_overflow_retries} retries")
    return {name: grad for name, grad in zip(names, recorder.recorded) if grad is not None}


def flat(gradients: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([gradients[name].flatten() for name in sorted(gradients)]).double()


def without_dropout(build_model: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    """``build_model`` with every dropout layer's rate set to 0: two gradient computations of one window can only
    agree when no random mask differs between them (a model's dropout is a finding of its own, not a split's
    error)."""
    def build() -> torch.nn.Module:
        model = build_model()
        for module in model.modules():
            if isinstance(module, torch.nn.modules.dropout._DropoutNd):
                module.p = 0.0
        return model

    return build


def compare_gradients(
    build_model: Callable[[], torch.nn.Module], window: Window, setup: Setup, *, reference_micro_batch_size: int = 1,
    objective: Objective | None = None,
) -> GradientComparison:
    """``setup``'s window gradient against the exact reference: fp32 accumulation of the same window, no recompute,
    no offload, in micro-batches of ``reference_micro_batch_size`` (1 by default: it always fits in memory);
    ``objective``: a preference objective's (else the next-token loss)."""
    reference_setup = Setup(cut=Cut(micro_batch_size=reference_micro_batch_size))
    build = without_dropout(build_model)
    reference = flat(parameter_gradients(build, window, reference_setup, objective=objective))
    candidate = flat(parameter_gradients(build, window, setup, objective=objective))
    error = float((candidate - reference).norm() / reference.norm().clamp_min(1e-30))
    cosine = float(torch.nn.functional.cosine_similarity(candidate, reference, dim=0))
    tolerance = GRADIENT_TOLERANCE[setup.precision]
    return GradientComparison(
        relative_error=error, cosine=cosine, max_abs_diff=float((candidate - reference).abs().max()),
        tolerance=tolerance, passed=math.isfinite(error) and error <= tolerance,
        reference=f"fp32 accumulation of the same window in micro-batches of {reference_micro_batch_size}, "
                  f"no recompute, no offload",
    )


@dataclass(kw_only=True)
class LossComparison:
    steps: int
    chosen: list[float | None]
    reference: list[float | None]
    max_relative_difference: float
    tolerance: float
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compare_losses(chosen: list[float | None], reference: list[float | None],
                   precision: PrecisionName) -> LossComparison:
    """Per-step losses of the same windows under two configurations; skipped steps (None) are not compared."""
    pairs = [(a, b) for a, b in zip(chosen, reference) if a is not None and b is not None]
    worst = max((abs(a - b) / abs(b) for a, b in pairs), default=math.inf)
    tolerance = LOSS_TOLERANCE[precision]
    return LossComparison(steps=len(chosen), chosen=chosen, reference=reference, max_relative_difference=worst,
                          tolerance=tolerance, passed=worst <= tolerance)
