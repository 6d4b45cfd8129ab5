"""The adaptive batch's rule (``cadence.engine.adaptive_batch.decide``) on given noise-scale series: grow, hold,
shrink, the bounds, the streaks, and the LR and beta2 that follow the batch."""

from __future__ import annotations

import math

import pytest

from cadence.engine.adaptive_batch import (
    LORA_MAX_BATCH,
    AdaptiveBatch,
    BatchMeasurement,
    BatchState,
    Decision,
    decide,
    decide_ramp,
    min_windows_for,
    parse_ramp_tokens,
)
from cadence.engine.choices import BatchLRScaling

POLICY = AdaptiveBatch(minimum=8, maximum=64, patience=3, min_windows=2)


def run(series: list[float | None], *, state: BatchState | None = None, windows: int = 10
        ) -> tuple[list[int], list[Decision], BatchState]:
    """The batch after each window and the decisions, for a series of critical-batch estimates."""
    state = state or BatchState()
    batches: list[int] = []
    decisions: list[Decision] = []
    for critical in series:
        state, decision, _ = decide(POLICY, state, BatchMeasurement(critical=critical, windows=windows))
        batches.append(state.effective(POLICY))
        decisions.append(decision)
    return batches, decisions, state


@pytest.mark.parametrize(("series", "batches", "start"), [
    # grow: three windows in a row with the critical batch at >= 2x the batch (16 >= 2 x 8)
    ([16, 16, 16], [8, 8, 16], 1),
    ([100, 100, 100, 100, 100, 100], [8, 8, 16, 16, 16, 32], 1),
    # hold: inside the band [0.5x, 2x)
    ([15.9, 15.9, 15.9, 15.9], [8, 8, 8, 8], 1),
    ([8, 8, 8, 4, 4, 4], [8, 8, 8, 8, 8, 8], 1),
    # a streak broken by a window in the band starts again
    ([16, 16, 10, 16, 16, 16], [8, 8, 8, 8, 8, 16], 1),
    # a streak broken by a window without an estimate starts again
    ([16, 16, None, 16, 16, 16], [8, 8, 8, 8, 8, 16], 1),
    # a grow streak switching to a shrink streak starts that one afresh
    ([200, 200, 3, 3, 3], [32, 32, 32, 32, 16], 4),
    # shrink: the critical batch below half the batch (32 at 4 windows of 8: below 16)
    ([15, 15, 15], [32, 32, 16], 4),
    ([1, 1, 1, 1, 1, 1, 1, 1, 1], [32, 32, 16, 16, 16, 8, 8, 8, 8], 4),
    # the bounds: never above the maximum, never below the minimum
    ([1000] * 9, [64] * 9, 8),
    ([1] * 6, [8] * 6, 1),
    ([1000] * 12, [8, 8, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64], 1),
    # no estimate: hold
    ([None, None, None], [8, 8, 8], 1),
    ([None, None, None], [32, 32, 32], 4),
])
def test_series(series: list[float | None], batches: list[int], start: int) -> None:
    got, _, _ = run(series, state=BatchState(multiple=start))
    assert got == batches


def test_too_few_windows_holds_and_resets() -> None:
    state = BatchState(grow_streak=2)
    state, decision, reason = decide(POLICY, state, BatchMeasurement(critical=1000, windows=1))
    assert (decision, state.grow_streak, state.multiple) == ("hold", 0, 1)
    assert "1 of 2 windows" in reason


def test_decision_words_and_switch_count() -> None:
    _, decisions, state = run([16, 16, 16, 100, 100, 100])
    assert decisions == ["hold", "hold", "grow", "hold", "hold", "grow"]
    assert state.switches == 2 and state.grow_streak == 0
    _, decision, reason = decide(POLICY, BatchState(multiple=8), BatchMeasurement(critical=1000, windows=10))
    assert decision == "hold" and "at the maximum" in reason
    _, decision, reason = decide(POLICY, BatchState(grow_streak=2), BatchMeasurement(critical=16, windows=10))
    assert decision == "grow" and "8 -> 16" in reason


def test_maximum_not_a_power_of_two_caps_growth() -> None:
    policy = AdaptiveBatch(minimum=8, maximum=24, patience=1, min_windows=0)
    state = BatchState(multiple=2)
    state, decision, _ = decide(policy, state, BatchMeasurement(critical=1000, windows=5))
    assert decision == "grow" and state.effective(policy) == 24


def test_state_round_trips() -> None:
    state = BatchState(multiple=4, grow_streak=1, shrink_streak=0, switches=3)
    assert BatchState.from_state_dict(state.state_dict()) == state


@pytest.mark.parametrize(("scaling", "multiple", "scale"), [
    ("sqrt", 4, 2.0), ("sqrt", 2, math.sqrt(2)), ("linear", 4, 4.0), ("none", 8, 1.0), ("sqrt", 1, 1.0)])
def test_lr_scale(scaling: BatchLRScaling, multiple: int, scale: float) -> None:
    policy = AdaptiveBatch(minimum=8, maximum=64, lr_scaling=scaling)
    assert policy.lr_scale(multiple) == pytest.approx(scale)


def test_beta2_keeps_its_half_life_in_examples_with_a_floor() -> None:
    policy = AdaptiveBatch(minimum=8, maximum=64)
    assert policy.beta2(0.99, 1) == 0.99
    assert policy.beta2(0.99, 2) == pytest.approx(0.99 ** 2)
    # half-life in steps halves when a step holds twice the examples: the same in examples
    half_life = math.log(0.5) / math.log(0.99)
    assert math.log(0.5) / math.log(policy.beta2(0.99, 4)) == pytest.approx(half_life / 4)
    assert policy.beta2(0.95, 8) == 0.9  # 0.95 ** 8 = 0.66: floored


def test_from_flags() -> None:
    flags = {"effective_batch_size": "adaptive", "min_effective_batch_size": 8, "max_effective_batch_size": None,
             "batch_lr_scaling": None}
    policy = AdaptiveBatch.from_flags(flags, lr_scaling="sqrt", maximum=LORA_MAX_BATCH)
    assert policy is not None and (policy.minimum, policy.maximum, policy.lr_scaling) == (8, 32, "sqrt")
    assert AdaptiveBatch.from_flags({**flags, "effective_batch_size": 16}, lr_scaling="sqrt") is None
    policy = AdaptiveBatch.from_flags({**flags, "max_effective_batch_size": 128, "batch_lr_scaling": "linear"},
                                      lr_scaling="sqrt", maximum=LORA_MAX_BATCH)
    assert policy is not None and (policy.maximum, policy.lr_scaling) == (128, "linear")
    assert policy.flags()["max_effective_batch_size"] == 128
    assert "8 to 128" in policy.describe()


@pytest.mark.parametrize(("minimum", "maximum", "where", "words"), [
    (16, 8, "--max-effective-batch-size", "below"),
    (8, 20, "--max-effective-batch-size", "not a multiple"),
    (0, 8, "--min-effective-batch-size", "at least 1"),
])
def test_problems(minimum: int, maximum: int, where: str, words: str) -> None:
    problems = AdaptiveBatch(minimum=minimum, maximum=maximum).problems()
    assert len(problems) == 1 and problems[0].where == where and words in problems[0].message


def test_a_lost_branch_test_holds_growth_for_its_hold_off_then_grows_again() -> None:
    """After a lost branch test (the controller sets ``hold_off``) the rule holds however strongly the estimate asks
    to grow, counting the hold-off down with every window; a shrink is still possible."""
    batches, decisions, state = run([100] * 5, state=BatchState(multiple=1, hold_off=3))
    assert batches == [8, 8, 8, 8, 16] and decisions == ["hold"] * 4 + ["grow"]
    assert state.hold_off == 0
    _, decision, why = decide(POLICY, BatchState(hold_off=5), BatchMeasurement(critical=100, windows=10))
    assert decision == "hold" and "the last branch test lost: grow again after 4 more" in why
    shrunk, _, _ = run([1, 1, 1], state=BatchState(multiple=4, hold_off=10))
    assert shrunk == [32, 32, 16]


@pytest.mark.parametrize(("larger", "current", "tolerance", "kept"), [
    (2.0, 2.0, 0.01, True), (2.02, 2.0, 0.01, True), (2.03, 2.0, 0.01, False), (1.5, 2.0, 0.0, True),
    (2.0001, 2.0, 0.0, False), (1.9, 2.0, -0.1, False)])
def test_branch_verdict(larger: float, current: float, tolerance: float, kept: bool) -> None:
    """Kept unless the larger batch's probe loss is above the current one's x (1 + tolerance)."""
    policy = AdaptiveBatch(minimum=8, maximum=64, branch_windows=2, branch_tolerance=tolerance)
    verdict, why = policy.branch_verdict(larger, current)
    assert verdict is kept
    assert why.startswith("branch test kept: " if kept else "branch test lost: ")


def test_an_old_checkpoint_state_has_no_hold_off() -> None:
    """A controller state saved before the branch test existed loads with no hold-off."""
    assert BatchState.from_state_dict({"multiple": 2, "grow_streak": 1, "shrink_streak": 0, "switches": 1}) == \
        BatchState(multiple=2, grow_streak=1, switches=1)


RAMP = AdaptiveBatch(minimum=4, maximum=32, ramp_tokens=(1024, 4096, 6000), window_tokens=4 * 64)


@pytest.mark.parametrize(("clocks", "batches", "decisions"), [
    # 1024 tokens = 4 windows of 256; 4096 = 16; 6000 -> the first boundary at or past it: 24 (6,144 tokens)
    ([1, 2, 3], [4, 4, 4], ["hold"] * 3),
    ([3, 4, 6, 8], [4, 8, 8, 8], ["hold", "grow", "hold", "hold"]),
    ([14, 16, 20, 23, 24, 28, 40], [8, 16, 16, 16, 32, 32, 32], ["grow", "grow", "hold", "hold", "grow", "hold",
                                                                 "hold"]),
    # a step that passes two points at once (a resume, a short budget) goes straight to the batch they say
    ([2, 17], [4, 16], ["hold", "grow"]),
])
def test_the_preset_ramp_doubles_at_its_token_counts(clocks: list[int], batches: list[int],
                                                     decisions: list[Decision]) -> None:
    state = BatchState()
    got, said = [], []
    for clock in clocks:
        state, decision, _ = decide_ramp(RAMP, state, clock)
        got.append(state.effective(RAMP))
        said.append(decision)
    assert (got, said) == (batches, decisions)


def test_the_ramp_says_where_it_is() -> None:
    assert RAMP.ramp_windows() == (4, 16, 24)
    _, _, reason = decide_ramp(RAMP, BatchState(), 4)
    assert reason == "preset ramp: 1,024 tokens seen (>= 1,024): 4 -> 8"
    _, _, reason = decide_ramp(RAMP, BatchState(multiple=2), 5)
    assert reason == "preset ramp: 1,280 tokens seen, next x2 at 4,096"
    _, _, reason = decide_ramp(RAMP, BatchState(multiple=8), 30)
    assert reason == "preset ramp: 7,680 tokens seen, at its last batch 32"
    capped = AdaptiveBatch(minimum=4, maximum=8, ramp_tokens=(256,), window_tokens=256)
    state, decision, _ = decide_ramp(capped, BatchState(multiple=2), 100)
    assert (decision, state.multiple) == ("hold", 2)
    assert "preset batch ramp from 4 to 32 sequences, x2 at 1,024, 4,096, 6,000 tokens" in RAMP.describe()


def test_ramp_flags_round_trip() -> None:
    flags = {"effective_batch_size": "ramp", "min_effective_batch_size": 4, "max_effective_batch_size": 32,
             "batch_lr_scaling": None, "batch_ramp_tokens": ["1024,4_096", "6000"], "seq_len": 64}
    policy = AdaptiveBatch.from_flags(flags, lr_scaling="sqrt")
    assert policy is not None and policy.mode == "ramp"
    assert (policy.ramp_tokens, policy.window_tokens) == ((1024, 4096, 6000), 256)
    again = AdaptiveBatch.from_flags({**policy.flags(), "seq_len": 64}, lr_scaling="sqrt")
    assert again == policy
    assert AdaptiveBatch.from_flags({**flags, "effective_batch_size": "adaptive"}, lr_scaling="sqrt").mode == \
        "adaptive"  # type: ignore[union-attr]


@pytest.mark.parametrize(("given", "parsed"), [
    (["1024"], (1024,)), (["1024,2048"], (1024, 2048)), (["1_024", "2048,"], (1024, 2048)), (["1k"], None),
    (None, ())])
def test_parse_ramp_tokens(given: list[str] | None, parsed: tuple[int, ...] | None) -> None:
    assert parse_ramp_tokens(given) == parsed


@pytest.mark.parametrize(("tokens", "words"), [
    ((2048, 1024), "positive and increasing"), ((1024, 1024), "positive and increasing"), ((0, 10), "positive"),
    ((1, 2, 3, 4), "doubles 4 times from 4, but --max-effective-batch-size 32 leaves room for 3")])
def test_ramp_problems(tokens: tuple[int, ...], words: str) -> None:
    problems = AdaptiveBatch(minimum=4, maximum=32, ramp_tokens=tokens, window_tokens=64).problems()
    assert len(problems) == 1 and problems[0].where == "--batch-ramp-tokens" and words in problems[0].message


@pytest.mark.parametrize(("ema", "windows"), [(0.8, 8), (0.9, 10), (0.98, 50), (0.99, 100), (None, 8), (0.0, 8)])
def test_the_rule_waits_for_the_average_to_span_its_length(ema: float | None, windows: int) -> None:
    """Before any decision the moving average must hold at least MIN_WINDOWS windows and its own span 1 / (1 - ema):
    its first windows are a few noisy terms (two llama seeds grew to the maximum within 80 windows on them)."""
    assert min_windows_for(ema) == windows
    flags = {"effective_batch_size": "adaptive", "min_effective_batch_size": 8, "max_effective_batch_size": 64,
             "noise_scale_ema": ema}
    policy = AdaptiveBatch.from_flags(flags, lr_scaling="sqrt")
    assert policy is not None and policy.min_windows == windows
    state, decision, reason = decide(policy, BatchState(grow_streak=3), BatchMeasurement(critical=1000,
                                                                                         windows=windows - 1))
    assert decision == "hold" and f"{windows - 1} of {windows} windows measured" in reason
