"""``cadence plan --effective-batch-size auto``: the effective batch chosen from the gradient noise scale.

The noise scale ``B = tr(Sigma) / |G|^2`` (cadence.engine.noise_scale) is about the critical batch (McCandlish et
al. 2018): below it the steps are noisy and a run takes more of them, above it every doubling of the batch buys
little progress per step for twice the tokens. The plan measures it over a stated number of windows (a probe cut
that fits the budget by estimate: several micro-batches per window, since the estimator needs two batch sizes), and
takes the power of two nearest to it, within the user's bounds and the data.

By default the windows are measured at the weights the run starts from: the whole step chain at learning rate 0,
no optimizer step. Measured while training instead (``--noise-scale-training``: the run's own --lr and warmup), the
first Adam steps jolt a loaded model, and the windows describe that jolt rather than the model the run starts from
(issue 43: 1.4 sequences measured so on a partly trained llama whose exact per-sequence noise scale was 12). What the batch
means for the learning rate is said as advice; ``--lr`` is never changed.

The measurement is part of the plan's ``--time-budget``: it stops when NOISE_SCALE_SHARE of the budget is spent
(the rest is the trials' and the quality check's), with the estimate over the windows it ran and a note in the plan
saying how many of the ``--noise-scale-windows`` those were; too few for an estimate is one line saying what to give.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cadence.errors import CadenceFailure, UsageError
from cadence.formatting import format_bytes
from cadence.memory.estimate_for import estimate_for
from cadence.models.spec import ModelSpec
from cadence.plan.measure import Deadline
from cadence.training.noise_scale import NoiseScaleMeasurement, measure_noise_scale
from cadence.training.prepare import Prepared

PROBE_MICRO_BATCHES = 16
"""Micro-batches of one sequence per probe window: the estimator compares one micro-batch's gradient with the
window's, and the further apart the two sizes, the smaller its variance; one sequence also resolves a noise scale
below a few sequences (micro-batches of 8 gave no positive estimate at a random init, where it is about 1), and it
fits wherever anything does."""
NOISE_SCALE_SHARE = 0.5
"""The share of --time-budget the noise-scale measurement may take (from the plan's start): the measured trials and
the quality check need the rest to choose a configuration for the batch."""


class NoiseScaleUnmeasured(CadenceFailure):
    """The probe gave no estimate (the CLI exits 1 with this message, which says to give a number)."""

    label = "plan failed"


@dataclass(frozen=True, kw_only=True)
class BatchChoice:
    """The effective batch a plan chose from its noise-scale measurement, with what it rests on."""

    effective_batch_size: int
    measurement: NoiseScaleMeasurement
    probe: dict[str, Any]
    """How the probe windows were cut and computed (micro-batch, accumulation, precision, recompute)."""
    bounds: tuple[int, int]
    """The user's --min-/--max-effective-batch-size, the upper one also capped by the training sequences."""
    reason: str
    lr_advice: str
    measured_at: str = "the starting weights"
    """Where the noise scale was measured: at the starting weights (no optimizer step), or training through the run's
    own start (--noise-scale-training)."""
    time_note: str | None = None
    """What the --time-budget cut short (fewer windows than --noise-scale-windows), for the plan's notes."""

    def as_dict(self) -> dict[str, Any]:
        return {"given": "auto", "chosen": self.effective_batch_size, "reason": self.reason,
                "bounds": list(self.bounds), "probe": self.probe, "lr_advice": self.lr_advice,
                "measured_at": self.measured_at,
                "noise_scale": dataclasses.asdict(self.measurement)}


def probe_setup(model: ModelSpec, *, seq_len: int, budget: int, precision: str, device_type: str,
                loss_chunk_tokens: int, sequences: int, packed: bool = False,
                lora_base_precision: str | None = None) -> dict[str, Any]:
    """The probe's cut: micro-batches of one sequence, as many per window as the data allows (at least 2, at most
    PROBE_MICRO_BATCHES), without recompute when the estimate fits ``budget``, else with full recompute (``packed``,
    ``lora_base_precision``: the run's --packing and LoRA base, as the estimate takes them)."""
    per_window = max(2, min(PROBE_MICRO_BATCHES, sequences))
    for recompute in ("none", "full"):
        estimate = estimate_for(model, micro_batch_size=1, seq_len=seq_len, precision=precision,
                                checkpointing=recompute, device_type=device_type, grad_accum_steps=per_window,
                                loss_chunk_tokens=loss_chunk_tokens, packed=packed,
                                lora_base_precision=lora_base_precision)
        if estimate.peak_bytes <= budget:
            return {"micro_batch_size": 1, "grad_accum_steps": per_window, "precision": precision,
                    "activation_checkpointing": recompute, "estimated_peak_bytes": estimate.peak_bytes}
    raise NoiseScaleUnmeasured(
        f"no probe for the gradient noise scale fits in {format_bytes(budget)} (one sequence of {seq_len} tokens "
        f"with full recompute is estimated above it); give --effective-batch-size N, a larger --memory-budget or a "
        f"smaller --seq-len")


def nearest_power_of_two(value: float, low: int, high: int) -> int:
    """The power of two nearest to ``value`` on a log scale, within [low, high] (the bounds themselves when no power
    of two lies between them)."""
    exponent = round(math.log2(max(value, 1e-12)))
    candidate = 2 ** max(0, exponent)
    if candidate < low:
        candidate = 1 << math.ceil(math.log2(low))
    if candidate > high:
        candidate = 1 << int(math.floor(math.log2(high)))
    return min(max(candidate, low), high)


def lr_advice(lr: float, chosen: int, reference: int | None) -> str:
    """What the chosen batch means for --lr, as advice: square-root scaling (the usual rule for Adam) or linear
    scaling (SGD-like, with warmup) from the batch --lr was tuned at."""
    if reference is None:
        return (f"--lr {lr:g} is used as given. If it was tuned at another effective batch B0, the usual rules "
                f"scale it by sqrt({chosen}/B0) (Adam) or {chosen}/B0 (SGD, with warmup); give --lr-reference-batch "
                f"B0 for the figures. The plan never changes --lr.")
    if reference == chosen:
        return f"--lr {lr:g} was tuned at the chosen effective batch {chosen}: keep it."
    ratio = chosen / reference
    return (f"--lr {lr:g} was tuned at effective batch {reference}; at {chosen} ({ratio:.3g}x) the usual rules give "
            f"--lr {lr * math.sqrt(ratio):.3g} (square-root scaling, for Adam) or --lr {lr * ratio:.3g} (linear, "
            f"SGD-like, with warmup). The plan trains with --lr {lr:g} unless you give another.")


def choose_effective_batch(prep: Prepared, model: ModelSpec, *, budget: int, windows: int, bounds: tuple[int, int],
                           lr_reference: int | None, constrained: set[str], say: Callable[[str], None],
                           deadline: Deadline | None = None, training: bool = False) -> BatchChoice:
    """Measure the noise scale on ``windows`` probe windows of ``prep`` (at its starting weights; ``training``:
    training from its start with its own --lr and warmup, as the run would) and choose the effective batch from it. ``prep`` is the plan's run at any batch; the probe is a variant of it.
    ``deadline``: the plan's --time-budget, of which the measurement takes at most NOISE_SCALE_SHARE."""
    config = prep.config
    low, high = bounds
    sequences = len(prep.data.train)
    high = min(high, 1 << int(math.floor(math.log2(max(sequences, 1)))))  # a window must hold real sequences
    if high < low:
        raise UsageError.single("--min-effective-batch-size", (
            f"{low} is more than the training split's {sequences} sequences allow (the largest power of two in it is "
            f"{high}); give a smaller bound or more data"))
    precision = config.precision if "precision" in constrained else "fp32"
    probe = probe_setup(model, seq_len=prep.seq_len, budget=budget, precision=precision,
                        device_type=prep.device.type, loss_chunk_tokens=config.loss_chunk_tokens, sequences=sequences,
                        packed=config.packing, lora_base_precision=config.lora_base_precision)
    limit = f"; at most {NOISE_SCALE_SHARE:.0%} of the --time-budget" if deadline is not None else ""
    at = (f"training from the start as the run would (--lr {config.lr:g}, --warmup-steps {config.warmup_steps})"
          if training else "at the weights the run starts from (no optimizer step)")
    say(f"effective batch: auto; measuring the gradient noise scale over {windows:,} windows of "
        f"{probe['micro_batch_size']} x {probe['grad_accum_steps']} sequences ({precision}, recompute "
        f"{probe['activation_checkpointing']}), {at}{limit}")
    trial = prep.variant(micro_batch_size=probe["micro_batch_size"], grad_accum_steps=probe["grad_accum_steps"],
                         effective_batch_size=probe["micro_batch_size"] * probe["grad_accum_steps"],
                         precision=precision, activation_checkpointing=probe["activation_checkpointing"],
                         offload="none")
    stop = (None if deadline is None
            else lambda: deadline.passed(reserve=deadline.seconds * (1 - NOISE_SCALE_SHARE)))
    measurement = measure_noise_scale(trial, windows=windows, train=training, stop=stop)
    time_note = None
    if measurement.stopped_early and deadline is not None:
        time_note = (f"the gradient noise scale was measured over {measurement.windows_run:,} of the {windows:,} "
                     f"--noise-scale-windows: its share ({NOISE_SCALE_SHARE:.0%}) of the --time-budget of "
                     f"{deadline.seconds:g} s was spent after {deadline.elapsed:.0f} s; a larger --time-budget "
                     f"measures more")
    if measurement.sequences is None:
        if time_note is not None and deadline is not None:  # a time note is a deadline's
            raise NoiseScaleUnmeasured(
                f"the gradient noise scale could not be measured: {NOISE_SCALE_SHARE:.0%} of the --time-budget of "
                f"{deadline.seconds:g} s allowed {measurement.windows_run:,} of the {windows:,} "
                f"--noise-scale-windows, too few for an estimate ({measurement.unmeasured}); give a larger "
                f"--time-budget, or --effective-batch-size N")
        raise NoiseScaleUnmeasured(
            f"the gradient noise scale could not be measured over {measurement.windows_run} windows "
            f"({measurement.unmeasured}); give --effective-batch-size N, or more --noise-scale-windows")
    value, error = measurement.sequences, measurement.sequences_error
    chosen = nearest_power_of_two(value, low, high)
    spread = f" +/- {error:.2g}" if error is not None else ""
    reason = (f"the power of two nearest to the gradient noise scale, {value:.3g}{spread} sequences over "
              f"{measurement.windows} windows (about the critical batch: fewer sequences per step make noisier steps, "
              f"more buy little progress per step), within [{low}, {high}]")
    if error is not None and error > 0:
        lower, upper = (nearest_power_of_two(max(value - error, 1e-12), low, high),
                        nearest_power_of_two(value + error, low, high))
        if lower != upper:
            reason += f"; within one standard error the choice would lie between {lower} and {upper}"
    say(f"gradient noise scale: {value:.3g}{spread} sequences ({measurement.tokens or 0:,.0f} tokens) over "
        f"{measurement.windows} windows; effective batch {chosen}")
    if time_note is not None:
        say(f"note: {time_note}")
    return BatchChoice(effective_batch_size=chosen, measurement=measurement, measured_at=at.split(" (")[0],
                       probe=probe, bounds=(low, high), reason=reason,
                       lr_advice=lr_advice(config.lr, chosen, lr_reference), time_note=time_note)
