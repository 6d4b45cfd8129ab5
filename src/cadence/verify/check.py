"""``cadence verify``: does this configuration train like the big batch it stands for?

The reference is the gradient of the whole effective batch in fp32: one pass when it fits, else accumulated in fp32 at
micro-batch 1 with exact (window target count) normalisation. The configuration's gradient comes from the real step
chain (cadence.verify.equivalence). Compared globally and per parameter, against per-precision tolerances.

Findings explain WHY a configuration cannot match, each with its fix:
- BatchNorm: statistics are computed per micro-batch, so a split changes the math itself.
- dropout: masks differ between a split and the big batch; verify turns dropout off and says so.
- a loss reduced as a mean per micro-batch: detected by comparing the loss function's value with the sum-reduced
  token cross-entropy of the same micro-batch; it weighs micro-batches equally whatever their target counts.
- padding not masked out of the loss: labels that are not -100 where the attention mask is 0.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cadence.config.commands import VerifyOptions
from cadence.distributed.ranks import (
    SINGLE,
    ProcessGroupCollective,
    Ranks,
    broadcast_from_main,
    full_model_state,
    wrap_model,
)
from cadence.engine.chunked_loss import TargetsOnlyCrossEntropy
from cadence.engine.cut import Cut
from cadence.engine.objective import Objective
from cadence.engine.step import Engine, LossFn, token_cross_entropy_sum
from cadence.engine.windows import IGNORE_INDEX, Batch, Window, make_window
from cadence.errors import CadenceFailure, UsageError
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.training.components import build_loss, build_optimizer
from cadence.training.prepare import prepare
from cadence.training.reference import build_reference, precomputed_reference, starting_copy
from cadence.verify.equivalence import (
    GRADIENT_TOLERANCE,
    Setup,
    flat,
    parameter_gradients,
    split_for,
    without_dropout,
)

PARAMETER_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}
"""Relative L2 distance of the parameters after --steps K optimizer steps against the reference run that passes.
fp32: different summation order only (the acceptance tolerance of the split parity tests). bf16/fp16: their rounding
moves AdamW's normalised updates by up to a few percent of the update, far less of the weights."""


@dataclass(kw_only=True)
class Finding:
    """Why a configuration cannot train like the big batch (a BatchNorm, a mean-reduced loss, padding in the loss),
    or what verify changed to compare at all (dropout off), with its fix. Not ``cadence.audit``'s RuleViolation (a
    rule of the step chain that a training loop broke at a line of its code)."""

    code: str
    level: str
    """error (makes the configuration differ from the big batch), warning or info."""
    message: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class VerifyResult:
    setup: Setup
    grad_accum_steps: int
    effective_batch_size: int
    reference: str
    relative_error: float
    cosine: float
    tolerance: float
    worst_parameters: list[dict[str, float | str]]
    findings: list[Finding] = field(default_factory=list)
    parameters_after_steps: dict[str, Any] | None = None
    world_size: int = 1
    """Processes the configuration ran on (each on its share of the window)."""

    @property
    def passed(self) -> bool:
        steps_ok = self.parameters_after_steps is None or bool(self.parameters_after_steps["passed"])
        return (math.isfinite(self.relative_error) and self.relative_error <= self.tolerance and steps_ok
                and not any(f.level == "error" for f in self.findings))

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "setup": dataclasses.asdict(self.setup), "grad_accum_steps": self.grad_accum_steps,
            "effective_batch_size": self.effective_batch_size, "reference": self.reference,
            "relative_error": self.relative_error, "cosine": self.cosine, "tolerance": self.tolerance,
            "worst_parameters": self.worst_parameters, "findings": [f.as_dict() for f in self.findings],
            "parameters_after_steps": self.parameters_after_steps, "world_size": self.world_size,
        }


def _as_window(window: Window | Sequence[Batch]) -> Window:
    return window if isinstance(window, Window) else make_window(list(window))


def model_findings(model: torch.nn.Module) -> list[Finding]:
    """Modules whose math depends on how the batch is split."""
    findings = []
    batch_norms = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if batch_norms:
        findings.append(Finding(
            code="batchnorm", level="error",
            message=f"BatchNorm computes statistics per micro-batch, so a split is not the big batch: "
                    f"{', '.join(batch_norms[:5])}{' ...' if len(batch_norms) > 5 else ''}",
            fix="use LayerNorm/GroupNorm (per-sample statistics), SyncBatchNorm across processes does not fix "
                "micro-batching, or keep the micro-batch at the full batch"))
    dropouts = [name for name, m in model.named_modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)
                and m.p > 0]
    if dropouts:
        findings.append(Finding(
            code="dropout", level="info",
            message=f"dropout was turned off for the comparison (masks cannot match between splits): "
                    f"{', '.join(dropouts[:5])}{' ...' if len(dropouts) > 5 else ''}",
            fix="nothing to fix: dropout is per-sample noise, accumulation is still exact in expectation"))
    return findings


def data_findings(window: Window) -> list[Finding]:
    """Padding that carries loss: labels set where the attention mask says 'padding'."""
    leaking = 0
    for batch in window.micro_batches:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if mask is not None:
            leaking += int(((mask == 0) & (batch["labels"] != IGNORE_INDEX)).sum())
    if not leaking:
        return []
    return [Finding(code="padding-in-loss", level="error",
                    message=f"{leaking} padded positions (attention_mask 0) have labels: padding is trained on, and "
                            f"its share changes with how the batch is split",
                    fix="set labels to -100 wherever attention_mask is 0 (cadence's collate does)")]


def loss_findings(build_model: Callable[[], torch.nn.Module], window: Window, loss_fn: LossFn) -> list[Finding]:
    """A loss function that returns a mean where the step chain needs a sum (the 2024 accumulation bug)."""
    if loss_fn is token_cross_entropy_sum:
        return []
    model = build_model()
    model.eval()
    batch = window.micro_batches[0]
    with torch.no_grad():
        given = float(loss_fn(model, batch))
        summed = float(token_cross_entropy_sum(model, batch))
    targets = int((batch["labels"] != IGNORE_INDEX).sum())
    if targets and math.isclose(given, summed / targets, rel_tol=1e-4) and not math.isclose(given, summed,
                                                                                             rel_tol=1e-4):
        return [Finding(code="mean-reduced-loss", level="error",
                        message=f"the loss is a mean over each micro-batch's {targets} targets (sum {summed:.4g} / "
                                f"{targets} = {given:.4g}): micro-batches are weighted equally whatever their target "
                                f"counts, not like one big batch",
                        fix="return the SUM of per-target losses (reduction='sum'); the step chain divides by the "
                            "window's target count")]
    return []


def verify(
    build_model: Callable[[], torch.nn.Module],
    windows: Sequence[Window | Sequence[Batch]],
    setup: Setup,
    *,
    loss_fn: LossFn = token_cross_entropy_sum,
    reference_loss_fn: LossFn = token_cross_entropy_sum,
    steps: int = 0,
    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    max_grad_norm: float = 1.0,
    reference_in_one_pass: bool = True,
    ranks: Ranks = SINGLE,
    objective: Objective | None = None,
) -> VerifyResult:
    """Verify ``setup`` on ``windows[0]`` (and, with ``steps`` K > 0, the parameters after K windows).

    ``loss_fn`` is the loss under test (it must return the SUM of per-target losses); ``reference_loss_fn`` is the
    exact one the reference uses (next-token cross-entropy summed over labels != -100 by default). Under torchrun
    (``ranks``) the configuration runs on all ranks, each on its share of every window, through DDP or FSDP2; the
    reference is always one process. ``build_optimizer`` and ``max_grad_norm`` (clipping, 0 = off) are those of the
    K steps. ``objective``: a preference objective (its reference attached) instead of the losses: the reference then
    computes its log-probabilities from all logits, the configuration as it computes them.
    """
    build = without_dropout(build_model)
    window = _as_window(windows[0])
    findings = model_findings(build_model()) + data_findings(window) + (
        loss_findings(build, window, loss_fn) if objective is None else [])
    reference_micro = window.samples if reference_in_one_pass else 1
    reference = _reference_gradients(build, window, reference_micro, reference_loss_fn, objective)
    candidate = parameter_gradients(build, window, setup, loss_fn=loss_fn, ranks=ranks, objective=objective)
    ref_flat, cand_flat = flat(reference), flat(candidate)
    error = float((cand_flat - ref_flat).norm() / ref_flat.norm().clamp_min(1e-30))
    per_parameter: list[dict[str, float | str]] = []
    for name, ref in reference.items():
        got = candidate.get(name, torch.zeros_like(ref))
        per_parameter.append({"name": name, "relative_error": float((got - ref).norm() / ref.norm().clamp_min(1e-30)),
                              "reference_norm": float(ref.norm())})
    per_parameter.sort(key=lambda row: -float(row["relative_error"]))
    result = VerifyResult(
        # A cut by length, budget or packing runs as many micro-batches as it needs: count them.
        setup=setup, grad_accum_steps=len(split_for(setup, window, ranks)) if setup.cut.by_length
        else -(-window.samples // (setup.micro_batch_size * ranks.world_size)),
        world_size=ranks.world_size,
        effective_batch_size=window.samples,
        reference=f"fp32 gradient of the whole window of {window.samples} samples "
                  + ("in one pass" if reference_micro == window.samples else "accumulated at micro-batch 1"),
        relative_error=error, cosine=float(torch.nn.functional.cosine_similarity(cand_flat, ref_flat, dim=0)),
        tolerance=GRADIENT_TOLERANCE[setup.precision], worst_parameters=per_parameter[:5], findings=findings,
    )
    if steps > 0:
        result.parameters_after_steps = _compare_after_steps(build, windows, setup, loss_fn, reference_loss_fn, steps,
                                                             build_optimizer, max_grad_norm, ranks, objective)
    return result


def _reference_gradients(build: Callable[[], torch.nn.Module], window: Window, micro: int,
                         loss_fn: LossFn, objective: Objective | None = None) -> dict[str, torch.Tensor]:
    """The whole window in fp32 in one pass; if that runs out of memory, accumulated at micro-batch 1."""
    try:
        return parameter_gradients(build, window, Setup(cut=Cut(micro_batch_size=micro)), loss_fn=loss_fn,
                                   objective=objective)
    except torch.OutOfMemoryError:
        if micro == 1:
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return parameter_gradients(build, window, Setup(cut=Cut(micro_batch_size=1)), loss_fn=loss_fn,
                                   objective=objective)


def _compare_after_steps(build: Callable[[], torch.nn.Module], windows: Sequence[Window | Sequence[Batch]],
                         setup: Setup, loss_fn: LossFn, reference_loss_fn: LossFn, steps: int,
                         build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None,
                         max_grad_norm: float,
                         ranks: Ranks = SINGLE, objective: Objective | None = None) -> dict[str, Any]:
    if len(windows) < steps:
        raise ValueError(f"--steps {steps} needs {steps} windows, got {len(windows)}")
    make_optimizer = build_optimizer or (lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))

    def train(run_setup: Setup, user_loss: LossFn, run_ranks: Ranks) -> dict[str, torch.Tensor]:

        model = build()
        apply_activation_checkpointing(model, run_setup.activation_checkpointing)
        names = [name for name, _ in model.named_parameters()]
        device = next(model.parameters()).device
        model = wrap_model(model, run_ranks, device, precision=run_setup.precision)
        engine = Engine(model, make_optimizer(model), precision=run_setup.precision,
                        max_grad_norm=max_grad_norm, **run_setup.engine_loss(user_loss, objective),
                        collective=ProcessGroupCollective(run_ranks, device) if run_ranks.launched else None)
        for window in windows[:steps]:
            engine.step(split_for(run_setup, _as_window(window), run_ranks))
        weights = full_model_state(model, run_ranks)  # FSDP2 gathers the shards on rank 0
        return {name: weights[name].detach().float().cpu() for name in names if name in weights}

    samples = _as_window(windows[0]).samples
    reference = train(Setup(cut=Cut(micro_batch_size=samples)), reference_loss_fn, SINGLE)
    candidate = train(setup, loss_fn, ranks)
    distance = broadcast_from_main(
        float((flat(candidate) - flat(reference)).norm() / flat(reference).norm()) if ranks.is_main else None, ranks)
    tolerance = PARAMETER_TOLERANCE[setup.precision]
    return {"steps": steps, "relative_distance": distance, "tolerance": tolerance, "passed": distance <= tolerance,
            "reference": "the same windows, fp32, one pass per window, AdamW lr 1e-3, clipping 1.0"}


def format_result(result: VerifyResult) -> str:
    """The table the CLI prints."""
    s = result.setup
    lines = [
        f"cadence verify: micro {s.micro_batch_size} x accum {result.grad_accum_steps}"
        + (f" x {result.world_size} processes" if result.world_size > 1 else "") + f" = {result.effective_batch_size}"
        f", {s.precision}, recompute {s.activation_checkpointing}, offload {s.offload}{s.lever_text()}"
        + (f", {s.cut.describe()}" if s.cut.by_length else ""),
        f"reference: {result.reference}",
        f"{'gradient relative error':<28}{result.relative_error:>12.3e}   tolerance {result.tolerance:.0e}",
        f"{'cosine similarity':<28}{result.cosine:>12.8f}",
        "worst parameters:",
    ]
    lines += [f"  {row['name']:<40}{float(row['relative_error']):>12.3e}" for row in result.worst_parameters]
    if result.parameters_after_steps:
        after = result.parameters_after_steps
        lines.append(f"parameters after {after['steps']} steps: relative distance {after['relative_distance']:.3e} "
                     f"(tolerance {after['tolerance']:.0e}) {'pass' if after['passed'] else 'FAIL'}")
    for finding in result.findings:
        lines.append(f"{finding.level}: [{finding.code}] {finding.message}\n    fix: {finding.fix}")
    lines.append("PASS" if result.passed else "FAIL")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the command



def verified_objective(prep: Any, model_factory: Callable[[], torch.nn.Module], vocab_size: int) -> Objective | None:
    """A preference objective as every run under test computes it, or None for sft (its losses are compared as
    they are). Its reference is the starting weights, frozen (under LoRA the adapters start at zero, so the starting
    weights are the base the adapters-off reference scores with), or --reference-model."""
    objective = prep.objective
    if objective.name == "sft":
        return None
    config = dataclasses.replace(prep.config, lora_rank=0)  # a frozen copy, never the run's own adapters
    start = model_factory()
    # --reference-logprobs precomputed: the run's looked-up log-probabilities, checked under every split too.
    precomputed = precomputed_reference(objective, config, starting=start, data=prep.data, device=prep.device,
                                        vocab_size=vocab_size, main=prep.ranks.is_main)
    return objective.with_reference(precomputed or build_reference(objective, config, policy=start,
                                                                    starting=starting_copy(objective, config, start),
                                                                    device=prep.device, vocab_size=vocab_size))


class VerifyFailed(CadenceFailure):
    """The configuration does not match the big batch (the CLI exits with status 1). Every rank compared the same
    gradients, so rank 0 alone reports it."""

    label = "verify failed"


def run_verify(config: Any, options: VerifyOptions, *, as_json: bool = False, ranks: Ranks = SINGLE) -> VerifyResult:
    """`cadence verify`: the configuration's windows from the data, verified; prints a table (or JSON). Under
    torchrun every rank runs it and rank 0 prints."""
    import json


    if options.steps < 0:
        raise UsageError.single("--steps", f"must be at least 0, got {options.steps}")
    if config.micro_batch_size == "auto":
        raise UsageError.single("--micro-batch-size", "verify checks one fixed micro-batch size; give a number")
    # Its K steps run at the peak LR without a schedule (verify takes no schedule flag): constant, which every
    # optimizer trains under (schedule-free refuses a decaying one).
    prep = prepare(dataclasses.replace(config, out=None, val_fraction=0.0, lr_schedule="constant"), ranks=ranks)
    # Whole windows of the run's samples: each configuration compared re-cuts them (the same samples, every rank).
    windows = list(itertools.islice(prep.windows(0, whole=True), max(1, options.steps)))
    if len(windows) < max(1, options.steps):
        raise UsageError.single("--steps", f"the data holds only {len(windows)} windows of {prep.effective_batch_size}")

    built = prep.built.module  # built (and seeded) once by prepare

    def model_factory() -> torch.nn.Module:
        # Every call the same initial weights: the model prepare built, copied.
        return copy.deepcopy(built).to(prep.device)

    # The loss train would compute (the head on the targets only, where the model's head splits): the one verified.
    probe, vocab_size = prep.built.probe
    loss = build_loss(config, probe, vocab_size=vocab_size)
    setup = Setup(cut=prep.cut, precision=config.precision, activation_checkpointing=config.activation_checkpointing,
                  offload=config.offload, loss_chunk_tokens=config.loss_chunk_tokens,
                  targets_only=isinstance(loss, TargetsOnlyCrossEntropy))
    result = verify(model_factory, windows, setup, steps=options.steps,
                    build_optimizer=lambda model: build_optimizer(model, config),
                    max_grad_norm=config.max_grad_norm, ranks=ranks,
                    objective=verified_objective(prep, model_factory, vocab_size))
    if ranks.is_main:
        print(json.dumps(result.as_dict(), indent=2) if as_json else format_result(result), flush=True)
    if not result.passed:
        raise VerifyFailed("the configuration does not train like the big batch (see the findings above)",
                           every_rank_agrees=True)
    return result
