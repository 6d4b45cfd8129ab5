"""A plan's quality checks: the decision against the exact reference, and each lossy lever against its exact twin.

Every exact lever (the split, recompute, offload, loss chunks, the cut) gives the gradient of fp32 accumulation to
rounding; precision gives it within its rounding. So the decision's window gradient is compared with fp32
accumulation of the same window, and its losses over a few steps with fp32's (``cadence.verify.equivalence``). The
lossy levers change the update itself: a lower-precision optimizer state and an nf4 base are kept only when their
losses stay within a stated tolerance of the same configuration without them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from cadence.config import TrainConfig
from cadence.config.commands import PlanOptions
from cadence.config.schema import LoraBasePrecision
from cadence.models.spec import ModelSpec
from cadence.plan.trials import TrialResult, TrialSetup, run_trial
from cadence.training.prepare import Prepared
from cadence.verify.equivalence import compare_gradients, compare_losses

STATE_TOLERANCE = 0.01
"""A lower-precision optimizer state is kept only when, over the quality check's steps, every loss is within 1%
(relative) of the same configuration's with fp32 state. Measured: gpt-small over 200 steps keeps the mean loss of its
last 20 steps within 0.1% (bf16) and 0.1% (8bit) of fp32's (BENCHMARKS.md); a slow test checks the same on gpt-tiny at 1%."""
BASE_TOLERANCE = 0.01
"""An nf4 base is kept only when, over the quality check's steps, every loss is within 1% (relative) of the same
configuration's with the full-precision base (as QLoRA's paper finds 4-bit NormalFloat matching 16-bit LoRA).
Measured: the 49.9M-parameter llama of BENCHMARKS.md ends 20 steps 0.17% from the fp32 base's loss."""
LOSSY_LEVERS = ("optimizer_state", "lora_base_precision")
"""The setup's lossy levers, in the order a decision's are checked."""


def quality_steps(options: PlanOptions) -> int:
    """Optimizer steps of each loss comparison."""
    return max(3, options.quality_steps)


def quality_check(prep: Prepared, setup: TrialSetup, budget: int, options: PlanOptions,
                  model: ModelSpec) -> dict[str, Any]:
    """``setup``'s window gradient against fp32 accumulation of the same window, and its losses over the quality
    check's steps against the same setup in fp32."""
    device = prep.device
    window = next(prep.windows(0, whole=True))  # the first window of the trials' samples, re-cut as ``setup`` cuts it

    def model_factory() -> torch.nn.Module:
        # The chosen base: an nf4 one computes in the chosen precision (its layers' dtype is fixed when quantised).
        return model.build(seed=prep.config.seed, precision=setup.precision,
                           base_precision=setup.lora_base_precision).module.to(device)

    gradient = compare_gradients(model_factory, window, setup)
    steps = quality_steps(options)
    chosen_run = run_trial(prep, setup, steps=steps, budget_bytes=budget)
    reference_setup = dataclasses.replace(setup, precision="fp32")
    # An fp32 choice is its own reference (the same windows, weights and computation): running it again would only
    # repeat its losses, at a third of the quality check's time (the gradient check above is what tests its levers).
    reference_run = chosen_run if reference_setup == setup else run_trial(prep, reference_setup, steps=steps,
                                                                          budget_bytes=budget)
    loss = compare_losses(chosen_run.losses, reference_run.losses, setup.precision)
    return {"gradient": gradient.as_dict(), "loss": {**loss.as_dict(), "reference": reference_run.losses,
                                                     "reference_setup": reference_setup.describe()}}


def unchecked_lossy_lever(setup: TrialSetup, checks: dict[str, list[dict[str, Any]]]) -> str | None:
    """The first lossy lever ``setup`` pulls whose value has not passed its loss check yet (None: all have)."""
    pulled = {"optimizer_state": setup.optimizer_state != "fp32",
              "lora_base_precision": setup.lora_base_precision == "nf4"}
    for lever in LOSSY_LEVERS:
        value = getattr(setup, lever)
        if pulled[lever] and not any(c.get(lever) == value and c["passed"] for c in checks[lever]):
            return lever
    return None


def lossy_words(lever: str, check: dict[str, Any]) -> tuple[str, str, str, float]:
    """A loss check in words: its label, the lever's value, its reference, and its tolerance."""
    if lever == "optimizer_state":
        state = check["optimizer_state"]
        return f"optimizer state {state}", f"{state} optimizer state", "fp32 state's", STATE_TOLERANCE
    base = check["lora_base_precision"]
    return f"{base} base", f"the {base} base", f"the {check['reference_base']} base's", BASE_TOLERANCE


def lossy_check(lever: str, prep: Prepared, setup: TrialSetup, budget: int, options: PlanOptions) -> dict[str, Any]:
    """The loss check of ``setup``'s lossy ``lever`` (:data:`LOSSY_LEVERS`)."""
    if lever == "optimizer_state":
        return state_check(prep, setup, budget, options)
    return base_check(prep, setup, budget, options)


def state_check(prep: Prepared, setup: TrialSetup, budget: int, options: PlanOptions) -> dict[str, Any]:
    """``setup``'s losses over the quality check's steps against the same setup with fp32 optimizer state (the same
    windows and weights: only the state's precision differs)."""
    reference = dataclasses.replace(setup, optimizer_state="fp32")
    return {"optimizer_state": setup.optimizer_state,
            **loss_check(prep, setup, reference, budget, options, STATE_TOLERANCE)}


def reference_base(config: TrainConfig, precision: str) -> LoraBasePrecision:
    """The full-precision base an nf4 base is checked against: the given one, or, where nf4 was given, bf16 under
    --precision bf16 (the same math as fp32 there, in half the memory) and fp32 otherwise."""
    if config.lora_base_precision != "nf4":
        return config.lora_base_precision
    return "bf16" if precision == "bf16" else "fp32"


def base_check(prep: Prepared, setup: TrialSetup, budget: int, options: PlanOptions) -> dict[str, Any]:
    """``setup``'s losses over the quality check's steps against the same setup with the full-precision base (the
    same windows, the same initial weights before quantisation, the same adapters' initialisation: only the base's
    4-bit rounding differs)."""
    base = reference_base(prep.config, setup.precision)
    reference = dataclasses.replace(setup, lora_base_precision=base)
    return {"lora_base_precision": setup.lora_base_precision, "reference_base": base,
            **loss_check(prep, setup, reference, budget, options, BASE_TOLERANCE)}


def loss_check(prep: Prepared, setup: TrialSetup, reference_setup: TrialSetup, budget: int, options: PlanOptions,
               tolerance: float) -> dict[str, Any]:
    """``setup``'s losses over the quality check's steps against ``reference_setup``'s (a lossy lever's exact
    counterpart), on the same windows. When the reference runs out of memory, it runs one sequence per micro-batch
    with full recompute: the same math."""
    steps = quality_steps(options)
    run = run_trial(prep, setup, steps=steps, budget_bytes=budget)
    reference = run_trial(prep, reference_setup, steps=steps, budget_bytes=budget)
    if reference.error is not None and reference.error.startswith("out of memory"):
        reference_setup = dataclasses.replace(reference_setup, cut=setup.cut.resized(1), activation_checkpointing="full",
                                              grad_accum_steps=setup.grad_accum_steps * setup.micro_batch_size)
        reference = run_trial(prep, reference_setup, steps=steps, budget_bytes=budget)
    return loss_verdict(run, reference, reference_setup, steps, tolerance)


def loss_verdict(run: TrialResult, reference: TrialResult, reference_setup: TrialSetup, steps: int,
                 tolerance: float) -> dict[str, Any]:
    """Two runs' losses over the same ``steps`` windows compared: the largest relative difference against
    ``tolerance``."""
    pairs = [(a, b) for a, b in zip(run.losses, reference.losses) if a is not None and b is not None]
    worst = max((abs(a - b) / abs(b) for a, b in pairs), default=math.inf)
    error = run.error or reference.error
    return {"steps": steps, "losses": run.losses, "reference": reference.losses,
            "reference_setup": reference_setup.describe(), "max_relative_difference": worst, "tolerance": tolerance,
            "passed": error is None and len(pairs) == steps and worst <= tolerance, "error": error}
