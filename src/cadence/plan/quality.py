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
from cadence.plan.candidates import Candidate
from cadence.plan.rounds import Races, start_run
from cadence.plan.tolerances import BASE_TOLERANCE, STATE_TOLERANCE
from cadence.plan.trials import TrialResult, TrialSetup, run_trial
from cadence.training.prepare import Prepared
from cadence.verify.equivalence import compare_gradients, compare_losses

LOSSY_LEVERS = ("optimizer_state", "lora_base_precision")
"""The setup's lossy levers, in the order a decision's are checked."""


def quality_steps(options: PlanOptions) -> int:
    """Optimizer steps of each loss comparison."""
    return max(3, options.quality_steps)


def quality_check(prep: Prepared, chosen: Candidate, budget: int, options: PlanOptions, model: ModelSpec,
                  races: Races, timed: list[Candidate]) -> dict[str, Any]:
    """The choice's window gradient against fp32 accumulation of the same window, and its losses over the quality
    check's steps against the same windows trained in fp32. The losses are the rounds' where the choice, and an fp32
    candidate (every exact lever gives fp32 accumulation's gradient: any fp32 split is the reference), trained on
    those windows already (``timed``: the candidates the rounds may have trained); plan.json's
    ``quality.loss.reused`` says which."""
    setup = chosen.setup
    device = prep.device
    window = next(prep.windows(0, whole=True))  # the first window of the trials' samples, re-cut as ``setup`` cuts it

    def model_factory() -> torch.nn.Module:
        # The chosen base: an nf4 one computes in the chosen precision (its layers' dtype is fixed when quantised).
        return model.build(seed=prep.config.seed, precision=setup.precision,
                           base_precision=setup.lora_base_precision).module.to(device)

    gradient = compare_gradients(model_factory, window, setup)
    steps = quality_steps(options)
    reference_setup = dataclasses.replace(setup, precision="fp32")
    losses, reused_chosen = _run_losses(races, chosen.id, setup, steps)
    # An fp32 choice is its own reference (the same windows, weights and computation): training it again would only
    # repeat its losses (the gradient check above is what tests its levers).
    if reference_setup == setup:
        reference, reused_reference = losses, reused_chosen
    else:
        # The fp32 contender whose run trained furthest (still kept, or with its windows' losses already).
        twins = [c for c in timed if _same_math(c.setup, reference_setup) and c.id in races.runs
                 and races.runs[c.id].setup == c.setup
                 and (races.runs[c.id].parts is not None or len(races.runs[c.id].losses) >= steps)]
        twin = max(twins, key=lambda c: len(races.runs[c.id].losses), default=None)
        reference, reused_reference = (_run_losses(races, twin.id, twin.setup, steps) if twin is not None
                                       else _run_losses(races, "reference", reference_setup, steps))
    loss = compare_losses(losses, reference, setup.precision)
    return {"gradient": gradient.as_dict(), "loss": {**loss.as_dict(), "reference": reference,
                                                     "reference_setup": reference_setup.describe(),
                                                     "reused": {"chosen": reused_chosen,
                                                                "reference": reused_reference}}}


def _same_math(setup: TrialSetup, reference: TrialSetup) -> bool:
    """Whether ``setup`` trains as ``reference`` does up to fp32 rounding: the same precision, optimizer state,
    base and cut order, any split, recompute, offload or loss chunking (the exact levers)."""
    return (setup.precision == reference.precision and setup.optimizer_state == reference.optimizer_state
            and setup.lora_base_precision == reference.lora_base_precision
            and setup.cut == reference.cut.resized(setup.micro_batch_size))


def _run_losses(races: Races, key: str, setup: TrialSetup, steps: int) -> tuple[list[float | None], str | None]:
    """The first ``steps`` losses of ``setup``: the rounds' run of candidate ``key`` where it has one (said in the
    second value: which run, how many of the windows it had trained there) or else a run started for the check
    (None)."""
    run = races.runs.get(key)
    trained = len(run.losses) if run is not None else 0
    losses = races.losses(key, setup, steps) if run is not None else None
    if losses is not None:
        return losses, f"{key}'s rounds ({min(trained, steps)} of {steps} windows trained there)"
    run = start_run(races.prep, setup)
    try:
        for _ in range(steps):
            run.step()
    finally:
        run.close()
    return run.losses, None


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
