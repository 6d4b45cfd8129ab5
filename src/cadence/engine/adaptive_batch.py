"""The adaptive effective batch (``--effective-batch-size adaptive``): when to grow, hold or shrink the batch.

The rule is a pure function, :func:`decide`, of a frozen policy (:class:`AdaptiveBatch`), the controller's state
(:class:`BatchState`) and one window's measurement: the critical batch ``B_crit`` (the gradient noise scale in
sequences, :mod:`cadence.engine.noise_scale`, the same value on every rank). With ``r = B_crit / B`` for the current
effective batch ``B``:

- grow (``B -> 2B``, at most the maximum) once ``r >= grow_at`` (2: the doubled batch is still at or below the
  critical one) for ``patience`` measured windows in a row;
- shrink (``B -> B/2``, at least the minimum) once ``r < shrink_at`` (1/2: the batch is more than twice the critical
  one) for ``patience`` windows in a row;
- hold otherwise. A window without an estimate (not measured yet, a skipped step, fewer than ``min_windows`` windows
  in the moving average) holds and resets both streaks: the estimate has not said anything.

Why these constants: at ``B = B_crit`` a step costs twice the fewest steps and twice the fewest examples
(McCandlish et al. 2018: ``steps ~ 1 + B_crit / B``, ``examples ~ 1 + B / B_crit``), the usual compromise; doubling
only while ``2B <= B_crit`` keeps every batch at or below the critical one (at most 2x the fewest examples), and the
factor 4 between the two thresholds (hysteresis) means a switch is never undone by the next window's noise. The
batch is always the minimum times a whole number of windows (``multiple``), so the data order stays the minimum
batch's windows, grouped.

A window whose signal the two batch sizes cannot resolve (the averaged ``|G|^2`` not positive) holds like any window
without an estimate. Counting it as a critical batch far above the batch was tried in benchmarks/adaptive_batch.py's
setting and dropped: on gpt-small at a batch of 4 and a 2-micro-batch window the averaged ``|G|^2`` is often not
positive early in training while the batch is not small against the critical one, and such windows grew seed 1 from 4
to 32 between windows 53 and 77; it ended above the fixed small batch's loss (2.348 against 2.318).

``--effective-batch-size ramp`` (:func:`decide_ramp`) is the preset alternative the field ships (OLMo-core's batch
size scheduler): the batch doubles from the minimum each time the run has seen one of ``--batch-ramp-tokens``,
nothing measured; everything else (the data order, the LR and beta2 at a switch, the schedule in windows of the
minimum, the checkpoint) is the adaptive batch's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from cadence.engine.choices import BATCH_LR_SCALINGS, BatchLRScaling
from cadence.errors import Problem

Decision = Literal["grow", "hold", "shrink"]
BatchMode = Literal["adaptive", "ramp"]
BATCH_MODES: tuple[BatchMode, ...] = ("adaptive", "ramp")
"""The --effective-batch-size values whose batch changes during the run."""

LORA_MAX_BATCH = 32
"""LoRA trains best at small batches ("LoRA Without Regret", Thinking Machines 2025: the loss is worse above about 32
sequences): a LoRA run's --max-effective-batch-size unless given."""
GROW_AT = 2.0
SHRINK_AT = 0.5
PATIENCE = 4
"""Windows in a row that must agree: the per-window noise-scale estimate is noisy; the moving average still lags."""
MIN_WINDOWS = 8
"""Measured windows in the moving average before any decision (its first windows are a handful of noisy terms), at
least the average's own span, ``1 / (1 - --noise-scale-ema)`` (:func:`min_windows_for`)."""
BETA2_FLOOR = 0.9
"""The lowest AdamW beta2 a rescale gives (its second moment would otherwise average over too few steps to be a
scale at all: 0.95 ** 8 = 0.66)."""
BRANCH_TOLERANCE = 0.01
"""--batch-branch-tolerance's default: the larger batch's probe loss may be 1% above the current batch's and the grow
still be kept (a grow buys fewer optimizer steps; a loss within the probe's own noise is not a loss)."""
BRANCH_HOLD_OFF = 16
"""Windows a lost branch test keeps the controller from growing again (4 x the patience: the estimate that asked for
the grow has to be renewed by windows the branch did not see)."""


@dataclass(frozen=True, kw_only=True)
class AdaptiveBatch:
    """The adaptive-batch policy of a run: its bounds (sequences), how the LR follows the batch, and the rule's
    constants."""

    minimum: int
    """--min-effective-batch-size: the starting batch and the smallest; one window of the data order."""
    maximum: int
    """--max-effective-batch-size: the largest (a multiple of the minimum)."""
    lr_scaling: BatchLRScaling = "sqrt"
    """--batch-lr-scaling: the LR multiplier for a batch ``r`` times the minimum (sqrt(r), r or 1)."""
    grow_at: float = GROW_AT
    shrink_at: float = SHRINK_AT
    patience: int = PATIENCE
    min_windows: int = MIN_WINDOWS
    beta2_floor: float = BETA2_FLOOR
    branch_windows: int | None = None
    """--batch-branch-test: the grown windows each branch trains before a grow is kept (None: no branch test)."""
    branch_tolerance: float = BRANCH_TOLERANCE
    """--batch-branch-tolerance: how much worse (relative) the larger batch's probe loss may be."""
    branch_hold_off: int = BRANCH_HOLD_OFF
    ramp_tokens: tuple[int, ...] = ()
    """--batch-ramp-tokens (with --effective-batch-size ramp): the token counts at which the batch doubles; empty:
    the measured rule decides (adaptive)."""
    window_tokens: int = 0
    """Tokens in one window of the minimum (minimum x --seq-len: sequence slots, padding included, so that every rank
    counts the same without a collective): converts the ramp's tokens into the run's clock."""

    @classmethod
    def from_flags(cls, flags: Any, *, lr_scaling: BatchLRScaling, maximum: int | None = None) -> AdaptiveBatch | None:
        """The policy of train's flags (a TrainConfig or a mapping), None unless --effective-batch-size adaptive.
        ``lr_scaling``: the optimizer's default when --batch-lr-scaling is not given; ``maximum``: the default
        maximum (a LoRA run's :data:`LORA_MAX_BATCH`) when --max-effective-batch-size is not given."""
        get = flags.get if isinstance(flags, dict) else lambda name, default=None: getattr(flags, name, default)
        mode = get("effective_batch_size", None)
        if mode not in BATCH_MODES:
            return None
        minimum = int(get("min_effective_batch_size", None) or 0)
        given_max = get("max_effective_batch_size", None)
        top = int(given_max) if given_max is not None else max(minimum, int(maximum or minimum))
        branch = get("batch_branch_test", None)
        tolerance = get("batch_branch_tolerance", None)
        ramp = parse_ramp_tokens(get("batch_ramp_tokens", None)) if mode == "ramp" else ()
        ema = get("noise_scale_ema", None)
        return cls(minimum=minimum, maximum=top, lr_scaling=get("batch_lr_scaling", None) or lr_scaling,
                   min_windows=min_windows_for(None if ema is None else float(ema)),
                   branch_windows=None if branch is None else int(branch),
                   branch_tolerance=BRANCH_TOLERANCE if tolerance is None else float(tolerance),
                   ramp_tokens=tuple(ramp or ()), window_tokens=minimum * int(get("seq_len", None) or 0))

    @property
    def mode(self) -> BatchMode:
        return "ramp" if self.ramp_tokens else "adaptive"

    def flags(self) -> dict[str, Any]:
        flags: dict[str, Any] = {"effective_batch_size": self.mode, "min_effective_batch_size": self.minimum,
                                 "max_effective_batch_size": self.maximum, "batch_lr_scaling": self.lr_scaling}
        if self.ramp_tokens:
            flags["batch_ramp_tokens"] = [",".join(str(tokens) for tokens in self.ramp_tokens)]
        if self.branch_windows is not None:
            flags.update(batch_branch_test=self.branch_windows, batch_branch_tolerance=self.branch_tolerance)
        return flags

    def ramp_windows(self) -> tuple[int, ...]:
        """The ramp's token counts as the run's clock (windows of the minimum): a doubling takes effect from the
        first window boundary at or past its tokens."""
        per_window = max(1, self.window_tokens)
        return tuple(-(-tokens // per_window) for tokens in self.ramp_tokens)

    def describe(self) -> str:
        if self.ramp_tokens:
            return (f"preset batch ramp from {self.minimum} to {self.maximum} sequences, x2 at "
                    f"{', '.join(f'{tokens:,}' for tokens in self.ramp_tokens)} tokens (windows of "
                    f"{self.window_tokens:,} tokens); LR x {_scaling_words(self.lr_scaling)}")
        return (f"adaptive effective batch from {self.minimum} to {self.maximum} sequences, x2 / /2 at window "
                f"boundaries after {self.patience} windows in a row with the critical batch >= {self.grow_at:g}x / < "
                f"{self.shrink_at:g}x the batch; LR x {_scaling_words(self.lr_scaling)}"
                + ("" if self.branch_windows is None else
                   f"; each grow branch-tested over {self.branch_windows} grown windows (kept unless the larger "
                   f"batch's probe loss is more than {self.branch_tolerance:.1%} worse)"))

    def problems(self) -> list[Problem]:
        problems = []
        if self.minimum < 1:
            problems.append(Problem(where="--min-effective-batch-size",
                                    message=f"must be at least 1, got {self.minimum}"))
        elif self.maximum < self.minimum:
            problems.append(Problem(where="--max-effective-batch-size",
                                    message=f"{self.maximum} is below --min-effective-batch-size {self.minimum}"))
        elif self.maximum % self.minimum != 0:
            problems.append(Problem(where="--max-effective-batch-size", message=(
                f"{self.maximum} is not a multiple of --min-effective-batch-size {self.minimum} (the batch grows by "
                f"whole windows of the minimum); use {self.maximum // self.minimum * self.minimum}")))
        if self.ramp_tokens and self.maximum >= self.minimum:
            doublings, room = len(self.ramp_tokens), (self.maximum // self.minimum).bit_length() - 1
            if list(self.ramp_tokens) != sorted(set(self.ramp_tokens)) or self.ramp_tokens[0] < 1:
                problems.append(Problem(where="--batch-ramp-tokens", message=(
                    f"{', '.join(map(str, self.ramp_tokens))}: the token counts must be positive and increasing")))
            elif doublings > room:
                problems.append(Problem(where="--batch-ramp-tokens", message=(
                    f"doubles {doublings} times from {self.minimum}, but --max-effective-batch-size {self.maximum} "
                    f"leaves room for {room}: give fewer token counts or a larger maximum")))
        if self.lr_scaling not in BATCH_LR_SCALINGS:
            problems.append(Problem(where="--batch-lr-scaling",
                                    message=f"{self.lr_scaling!r} is not one of {', '.join(BATCH_LR_SCALINGS)}"))
        return problems

    @property
    def most_windows(self) -> int:
        """The largest batch in windows of the minimum."""
        return max(1, self.maximum // self.minimum)

    def lr_scale(self, multiple: int) -> float:
        """The LR multiplier for a batch of ``multiple`` windows of the minimum."""
        if self.lr_scaling == "sqrt":
            return math.sqrt(multiple)
        return float(multiple) if self.lr_scaling == "linear" else 1.0

    def branch_verdict(self, larger: float, current: float) -> tuple[bool, str]:
        """Whether a branch-tested grow is kept, from the two branches' probe losses, and why in words: kept unless
        ``larger > current x (1 + tolerance)``."""
        limit = current * (1.0 + self.branch_tolerance)
        said = f"probe loss {larger:.4f} at the larger batch against {current:.4f} at the current one"
        if larger <= limit:
            return True, f"branch test kept: {said} (at most {limit:.4f} allowed)"
        return False, f"branch test lost: {said} (above {limit:.4f} allowed)"

    def beta2(self, base: float, multiple: int) -> float:
        """AdamW's beta2 for a batch of ``multiple`` windows, keeping its half-life in examples (Marek et al.): a step
        of r times the examples is r steps of the minimum, so ``base ** r``; never below ``beta2_floor`` (nor above
        ``base``)."""
        return min(base, max(self.beta2_floor, base ** multiple))


@dataclass(frozen=True, kw_only=True)
class BatchState:
    """The controller's state: what the next window holds and the streaks so far (in the checkpoint)."""

    multiple: int = 1
    """The effective batch in windows of the minimum (the batch is ``minimum x multiple``)."""
    grow_streak: int = 0
    shrink_streak: int = 0
    switches: int = 0
    """Grows and shrinks so far."""
    hold_off: int = 0
    """Windows left before a grow may be tried again after a lost branch test (--batch-branch-test)."""

    def effective(self, policy: AdaptiveBatch) -> int:
        return policy.minimum * self.multiple

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BatchState:
        # A checkpoint from before the branch test has no hold_off: 0.
        return cls(**{field.name: int(state.get(field.name, 0)) for field in dataclasses.fields(cls)})


@dataclass(frozen=True, kw_only=True)
class BatchMeasurement:
    """What one window said: the critical batch in sequences (None: no estimate) over ``windows`` measured windows."""

    critical: float | None
    windows: int = 0


def decide(policy: AdaptiveBatch, state: BatchState, measured: BatchMeasurement
           ) -> tuple[BatchState, Decision, str]:
    """The rule of the module docstring: the state for the next window, the decision and its reason in words."""
    batch = state.effective(policy)
    # A lost branch test's hold-off counts down with every window, whatever the window said.
    state = dataclasses.replace(state, hold_off=max(0, state.hold_off - 1))
    if measured.critical is None or measured.windows < policy.min_windows:
        why = ("no noise-scale estimate yet" if measured.critical is None
               else f"{measured.windows} of {policy.min_windows} windows measured")
        return dataclasses.replace(state, grow_streak=0, shrink_streak=0), "hold", why
    ratio = measured.critical / batch
    said = f"critical batch {measured.critical:.1f} = {ratio:.2f}x the batch {batch}"
    if ratio >= policy.grow_at:
        if state.multiple >= policy.most_windows:
            return dataclasses.replace(state, grow_streak=0, shrink_streak=0), "hold", f"{said}; at the maximum"
        if state.hold_off > 0:
            return (dataclasses.replace(state, grow_streak=0, shrink_streak=0), "hold",
                    f"{said}; the last branch test lost: grow again after {state.hold_off} more")
        streak = state.grow_streak + 1
        if streak < policy.patience:
            return (dataclasses.replace(state, grow_streak=streak, shrink_streak=0), "hold",
                    f"{said}; grow after {policy.patience - streak} more")
        multiple = min(policy.most_windows, state.multiple * 2)
        return (BatchState(multiple=multiple, switches=state.switches + 1), "grow",
                f"{said} for {streak} windows: {batch} -> {policy.minimum * multiple}")
    if ratio < policy.shrink_at:
        if state.multiple <= 1:
            return dataclasses.replace(state, grow_streak=0, shrink_streak=0), "hold", f"{said}; at the minimum"
        streak = state.shrink_streak + 1
        if streak < policy.patience:
            return (dataclasses.replace(state, grow_streak=0, shrink_streak=streak), "hold",
                    f"{said}; shrink after {policy.patience - streak} more")
        multiple = max(1, state.multiple // 2)
        return (BatchState(multiple=multiple, switches=state.switches + 1), "shrink",
                f"{said} for {streak} windows: {batch} -> {policy.minimum * multiple}")
    return dataclasses.replace(state, grow_streak=0, shrink_streak=0), "hold", f"{said}; within the band"


def min_windows_for(ema: float | None) -> int:
    """The windows measured before the rule decides: :data:`MIN_WINDOWS`, and at least the moving average's span
    ``1 / (1 - ema)`` (50 windows at 0.98, 100 at the default 0.99). Measured (BENCHMARKS.md, the adaptive batch):
    with 8 windows at --noise-scale-ema 0.98, two of three llama seeds grew to the maximum within their first 80
    windows, one on estimates of 15-90 sequences that fell to 0.3-1.4 by window 57: an average has to span its length
    before its ratio says anything."""
    if ema is None or not 0.0 < ema < 1.0:
        return MIN_WINDOWS
    return max(MIN_WINDOWS, math.ceil(1.0 / (1.0 - ema) - 1e-9))


def decide_ramp(policy: AdaptiveBatch, state: BatchState, clock: int) -> tuple[BatchState, Decision, str]:
    """The preset ramp (--effective-batch-size ramp): after ``clock`` windows of the minimum, the batch is the
    minimum doubled once per ramp point reached, at most the maximum; nothing is measured."""
    batch = state.effective(policy)
    points = policy.ramp_windows()
    reached = sum(clock >= point for point in points)
    multiple = min(policy.most_windows, 2 ** reached)
    seen = clock * policy.window_tokens
    if multiple > state.multiple:
        return (BatchState(multiple=multiple, switches=state.switches + 1), "grow",
                f"preset ramp: {seen:,} tokens seen (>= {policy.ramp_tokens[reached - 1]:,}): "
                f"{batch} -> {policy.minimum * multiple}")
    if reached < len(points) and multiple < policy.most_windows:
        return state, "hold", f"preset ramp: {seen:,} tokens seen, next x2 at {policy.ramp_tokens[reached]:,}"
    return state, "hold", f"preset ramp: {seen:,} tokens seen, at its last batch {batch}"


def parse_ramp_tokens(given: Any) -> tuple[int, ...] | None:
    """--batch-ramp-tokens as given (repeated and/or comma-separated, underscores allowed: 16_384) as token counts;
    None when a part is not a whole number."""
    if given is None:
        return ()
    parts = [part.strip().replace("_", "") for item in ([given] if isinstance(given, str | int) else given)
             for part in str(item).split(",") if part.strip()]
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        return None


def _scaling_words(scaling: str) -> str:
    return {"sqrt": "sqrt(batch ratio)", "linear": "batch ratio", "none": "1"}.get(scaling, scaling)
