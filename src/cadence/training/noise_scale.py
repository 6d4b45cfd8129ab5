"""The gradient noise scale of a prepared run: what a run, a profile and a plan say about it.

The estimator itself is ``cadence.engine.noise_scale`` (the engine measures it window by window). This module gives the
commands one way to speak of it: the fields of summary.json and profile.json (:func:`noise_scale_fields`), the line a
run announces (:func:`noise_scale_announcement`), and a measurement of a stated number of windows of a ``Prepared`` run
at fixed weights or training (:func:`measure_noise_scale`), which ``cadence plan`` can call to choose an effective
batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from cadence.engine.noise_scale import (
    DEFAULT_EMA,
    ONE_SIZE,
    NoiseScale,
    WindowTerms,
    ratio_estimate,
)
from cadence.engine.precision import fp32_matmul
from cadence.engine.step import Engine
from cadence.engine.windows import Window
from cadence.training.components import build_components
from cadence.training.prepare import Prepared

OFF = "off (--noise-scale-ema 0)"


def noise_scale_fields(engine: Engine) -> dict[str, Any]:
    """summary.json's and profile.json's noise-scale fields: the moving average after the last window (sequences,
    tokens, targets), how many windows it is over and its decay, or null and why."""
    meter = engine.noise_scale
    if meter is None:
        return {"grad_noise_scale": None, "grad_noise_scale_tokens": None, "grad_noise_scale_targets": None,
                "grad_noise_scale_windows": 0, "grad_noise_scale_ema": None,
                "grad_noise_scale_note": OFF}
    value = meter.estimate()
    return {"grad_noise_scale": value.sequences if value else None,
            "grad_noise_scale_tokens": value.tokens if value else None,
            "grad_noise_scale_targets": value.targets if value else None,
            "grad_noise_scale_windows": meter.windows, "grad_noise_scale_ema": meter.ema,
            "grad_noise_scale_note": meter.why_none()}


def why_not_measurable(engine: Engine, micro_batches: int) -> str | None:
    """Why windows of ``micro_batches`` micro-batches per rank give this engine no noise scale at all (None: they
    do), said before the first window so that a run says it once."""
    if engine.noise_scale is None:
        return OFF
    collective = engine.collective
    if micro_batches == 1 and collective.world_size == 1:
        return ONE_SIZE
    problem = getattr(collective, "first_gradient_problem", None)
    return problem(synced=micro_batches == 1) if problem is not None else None


def noise_scale_announcement(engine: Engine, micro_batches: int) -> str | None:
    """The run's one line about the noise scale, before its first window (None when it is turned off)."""
    if engine.noise_scale is None:
        return None
    reason = why_not_measurable(engine, micro_batches)
    if reason is not None:
        return f"gradient noise scale: not measured: {reason}"
    return (f"gradient noise scale: measured from each window's first micro-batch against the window (moving average "
            f"{engine.noise_scale.ema:g}), as grad_noise_scale in metrics.jsonl")


def noise_scale_line(fields: dict[str, Any], effective: int) -> str:
    """One printed line from :func:`noise_scale_fields` (as summary.json or profile.json hold them): the noise scale
    and which side of it the effective batch is on, or why there is none."""
    value, windows = fields.get("grad_noise_scale"), fields.get("grad_noise_scale_windows") or 0
    if not isinstance(value, (int, float)) or not value > 0:
        return f"gradient noise scale: none ({fields.get('grad_noise_scale_note') or 'not measured'})"
    return (f"gradient noise scale: {value:,.3g} sequences ({fields.get('grad_noise_scale_tokens') or 0:,.0f} "
            f"tokens) over {windows} windows; the effective batch, {effective:,}, is "
            f"{batch_side(effective, value)} it ({effective / value:.2g}x)")


FAR = 2.0
"""An effective batch more than this many times the noise scale (or less than its inverse) is clearly on one side."""


def batch_side(effective: float, noise_scale: float) -> str:
    """"above", "below" or "near": where the effective batch is against the noise scale (both in sequences)."""
    ratio = effective / noise_scale
    return "above" if ratio > FAR else "below" if ratio < 1 / FAR else "near"


def batch_against_noise_scale(effective: float, noise_scale: float, *, windows: int | None) -> str:
    """In words: which side of the measured noise scale the effective batch is on, and what that costs.

    McCandlish et al. (2018) model the steps S and the examples E that reach a given loss as ``S = S_min (1 +
    B_noise / B)`` and ``E = E_min (1 + B / B_noise)``: at ``B = B_noise`` (about the critical batch) twice the fewest
    of each; above it tokens grow with the batch for almost no fewer steps, below it steps grow."""
    ratio = effective / noise_scale
    steps, tokens = 1 + 1 / ratio, 1 + ratio
    over = "" if windows is None else f", over {windows} window{'' if windows == 1 else 's'}"
    head = (f"The effective batch, {effective:,.0f} sequences, is {ratio:.2g}x the gradient noise scale "
            f"({noise_scale:,.3g} sequences{over})")
    side = batch_side(effective, noise_scale)
    if side == "above":
        text = (f"{head}: above the critical batch. Each step makes little more progress than a smaller one: the run "
                f"needs about {tokens:.2g}x the fewest tokens that reach the same loss (2x at the noise scale), for "
                f"{steps:.2g}x the fewest steps. A smaller effective batch, toward {noise_scale:,.0f}, reaches that "
                f"loss on fewer tokens, unless steps (wall time over many devices) are what costs.")
    elif side == "below":
        text = (f"{head}: below the critical batch. Its steps are noisy: the run needs about {steps:.2g}x the fewest "
                f"steps that reach the same loss, on nearly the fewest tokens ({tokens:.2g}x). A larger effective "
                f"batch, toward {noise_scale:,.0f}, takes fewer steps for few more tokens: worth it where steps cost "
                f"(wall time, several devices).")
    else:
        text = (f"{head}: near the critical batch, the balance of steps ({steps:.2g}x the fewest that reach the same "
                f"loss) and tokens ({tokens:.2g}x the fewest).")
    return text + (" (McCandlish et al. 2018; the noise scale grows as the loss falls, so a batch near it early in "
                   "a run ends below it later.)")


# ------------------------------------------------------------------------------------------------ a measurement
@dataclass(frozen=True, kw_only=True)
class NoiseScaleMeasurement:
    """The gradient noise scale over a stated number of windows, each weighing the same (no moving average)."""

    sequences: float | None
    """In sequences (the unit of --effective-batch-size); None when no estimate (see ``unmeasured``)."""
    sequences_error: float | None
    """Its standard error over the windows (jackknife: leave one window out at a time); None with fewer than 2."""
    tokens: float | None
    targets: float | None
    """What the estimator measures (see cadence.engine.noise_scale)."""
    windows: int
    """Windows that gave an estimate."""
    windows_run: int
    """Windows run (a skipped fp16 step gives none)."""
    fixed_weights: bool
    """True: every window was measured at the same weights (the optimizer did not move them)."""
    unmeasured: str | None = None
    """Why there is no estimate (None when there is one)."""
    windows_asked: int | None = None
    """Windows asked for; more than ``windows_run`` when ``stop`` ended the measurement early."""
    stopped_early: bool = False
    """True: ``stop`` said to stop (a plan's --time-budget) before every window asked for had run."""


def measure_noise_scale(prep: Prepared, *, windows: int, train: bool = False,
                        stop: Callable[[], bool] | None = None) -> NoiseScaleMeasurement:
    """Run ``windows`` windows of ``prep`` (``prep.windows(0)``, then the next epochs, cut as ``cadence train`` cuts
    them) and measure the noise scale over them: at the prepared weights (``train=False``: the step chain runs
    whole, with an optimizer of learning rate 0, so every window sees the same weights), or training as the run
    would. Every rank of a distributed ``prep`` calls it; each returns the same measurement.

    The estimate is ``sum(tr Sigma) / sum(|G|^2)`` over the windows; the error is the jackknife's over windows, which
    holds the numerator and denominator's correlation.

    ``stop``, asked before each window, ends the measurement early (a plan's deadline): the estimate is over the
    windows run, and ``stopped_early`` says so. Under several processes it must answer the same on every rank (a
    shared clock, or a window count)."""
    if windows < 1:
        raise ValueError(f"windows must be at least 1, got {windows}")
    config = prep.config
    ema = config.noise_scale_ema if config.noise_scale_ema > 0 else DEFAULT_EMA
    parts = build_components(dataclasses.replace(prep, config=dataclasses.replace(config, noise_scale_ema=ema)))
    engine = parts.engine
    if not train:
        # lr 0 and no schedule: the optimizer's update is exactly zero, so the weights stay as prepared (AdamW's
        # decoupled weight decay would still move them; plain SGD at lr 0 does not).
        engine.optimizer = torch.optim.SGD(parts.model.parameters(), lr=0.0)
        engine.scheduler = None
    reason = why_not_measurable(engine, prep.grad_accum_steps)
    meter = engine.noise_scale
    if reason is not None or meter is None:  # (no meter has a reason: the noise scale is off)
        return NoiseScaleMeasurement(sequences=None, sequences_error=None, tokens=None, targets=None, windows=0,
                                     windows_run=0, fixed_weights=not train, unmeasured=reason,
                                     windows_asked=windows)
    terms: list[WindowTerms] = []
    run, stopped = 0, False
    with fp32_matmul(config.fp32_matmul):
        for window in _windows(prep, windows):
            if stop is not None and stop():
                stopped = True
                break
            engine.step(window)
            run += 1
            if meter.last is not None:
                terms.append(meter.last)
    value = _pooled(terms)
    if value:
        unmeasured = None
    elif stopped and not terms:
        unmeasured = f"stopped after {run} of {windows} windows, before any gave an estimate"
    else:
        unmeasured = meter.unmeasured if not terms else "the pooled estimates are not positive"
    return NoiseScaleMeasurement(
        sequences=value.sequences if value else None, sequences_error=_jackknife_error(terms),
        tokens=value.tokens if value else None, targets=value.targets if value else None, windows=len(terms),
        windows_run=run, fixed_weights=not train, unmeasured=unmeasured, windows_asked=windows,
        stopped_early=stopped)


def _windows(prep: Prepared, count: int) -> Iterator[Window]:
    """The first ``count`` windows of the run, epoch after epoch."""
    epoch, given = 0, 0
    while given < count:
        for window in prep.windows(epoch):
            yield window
            given += 1
            if given == count:
                return
        epoch += 1


def _pooled(terms: list[WindowTerms]) -> NoiseScale | None:
    """Every window weighing the same: the sums of the terms and the counts."""
    return ratio_estimate(sum(t.trace for t in terms), sum(t.grad_sq for t in terms), sum(t.samples for t in terms),
                          sum(t.targets for t in terms), sum(t.tokens for t in terms), windows=len(terms))


def _jackknife_error(terms: list[WindowTerms]) -> float | None:
    """The standard error (in sequences) of the pooled estimate, from the estimates that leave out one window each."""
    if len(terms) < 2:
        return None
    left_out = [_pooled(terms[:k] + terms[k + 1:]) for k in range(len(terms))]
    values = [value.sequences for value in left_out if value is not None]
    if len(values) < len(terms):
        return None  # some subset is not positive: the estimate is not yet resolved
    mean = sum(values) / len(values)
    n = len(values)
    return math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values))
