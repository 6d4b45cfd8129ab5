"""Issue 54 item 2: speed measured once. The contenders are timed in alternating rounds from the start, and a
sequential rule drops a contender whose best round is behind the leader's median by more than the measured noise;
the rounds stop when one is left, at --rounds (twice that while they disagree) or at the time budget."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from cadence.config import TrainConfig
from cadence.config.commands import PlanOptions
from cadence.plan.candidates import Candidate, build_candidates
from cadence.plan.measure import Deadline, Rates
from cadence.plan.rounds import MIN_NOISE, Races, behind, race
from cadence.plan.search import dominates


@pytest.mark.parametrize("rounds, leader, dropped", [
    ([1000.0, 1020.0], [2000.0, 2040.0], True),     # half the leader's speed
    ([1900.0, 1990.0], [2000.0, 2040.0], False),    # within the noise floor of 3%
    ([1800.0, 1850.0], [2000.0, 2040.0], True),     # 9% behind, bands of 25 and 20
    ([1000.0, 1900.0], [2000.0, 2040.0], False),    # its best reaches the leader's noise: a noisy one stays
    ([1500.0, 1600.0], [1300.0, 2700.0], False),    # the leader's own rounds disagree: its band covers it
])
def test_a_contender_is_dropped_only_when_its_best_is_behind_beyond_the_noise(rounds, leader, dropped):
    assert behind(Rates(rounds=rounds), Rates(rounds=leader)) is dropped
    assert MIN_NOISE == 0.03


class ScriptedRaces(Races):
    """Races whose rounds return given figures (tokens/s per candidate, round by round)."""

    def __init__(self, script: dict[str, list[float]]) -> None:
        super().__init__(prep=None, keep=True)  # type: ignore[arg-type]  # never builds a run
        self.script: dict[str, Iterator[float]] = {key: iter(values) for key, values in script.items()}
        self.order: list[str] = []

    def time_round(self, candidate: Candidate) -> float | None:
        self.order.append(candidate.id)
        return next(self.script[candidate.id])


def _contenders(count: int) -> list[Candidate]:
    config = TrainConfig(model="gpt-tiny", effective_batch_size=8, memory_budget="64MiB", precision="fp32")
    pool = build_candidates(config, {"precision"}, torch.device("cpu"), 64, [])
    return pool[:count]


def _race(script: dict[str, list[float]], rounds: int = 3, budget: float = 1e9) -> tuple[list[Candidate], list[str],
                                                                                         list[str]]:
    contenders = _contenders(len(script))
    for candidate, key in zip(contenders, script):
        candidate.id = key
    races = ScriptedRaces(script)
    notes: list[str] = []
    race(contenders, races, PlanOptions(rounds=rounds), Deadline(budget), lambda _: None, notes, lambda: 0.0)
    return contenders, races.order, notes


def test_rounds_alternate_and_a_clear_leader_ends_them_early():
    contenders, order, _ = _race({"a": [1000, 1010, 1005], "b": [2000, 2020, 2010], "c": [1950, 1990, 2030]})
    # Round 0 and round 1 alternate over all three; after round 1, a (best 1010 against b's median 2010) is dropped.
    assert order[:6] == ["a", "b", "c", "a", "b", "c"] and order[6:] == ["b", "c"]
    a = contenders[0]
    assert a.timing.rounds == [1000, 1010] and "behind b after 2 rounds" in a.status
    assert len(contenders[1].timing.rounds) == 3


def test_one_contender_left_stops_the_rounds():
    _, order, _ = _race({"a": [1000, 1010, 1005, 1000], "b": [3000, 3010, 3020, 3000]}, rounds=4)
    assert order == ["a", "b", "a", "b"]  # a dropped after round 1: b alone needs no more rounds


def test_rounds_that_disagree_get_more_rounds_and_the_time_budget_stops_them():
    noisy = {"a": [1000, 400, 1300, 900, 1000, 950], "b": [1100, 500, 1200, 1000, 1050, 1000]}
    contenders, order, notes = _race(noisy, rounds=3)
    assert len(order) == 12 and any("disagreed" in note for note in notes)
    assert all(len(c.timing.rounds) == 6 for c in contenders)
    _, order, notes = _race(noisy, rounds=3, budget=0.0)
    assert order == ["a", "b"] and any("allowed 1 alternating rounds" in note for note in notes)


def test_a_contender_with_costlier_levers_at_no_larger_micro_batch_is_not_timed():
    """Recompute, offload and loss chunks only add work to the same micro-batch: issue 54's c34 (bf16, selective,
    micro 8) cannot beat c22 (bf16, no recompute, micro 8), which fits too."""
    config = TrainConfig(model="gpt-tiny", effective_batch_size=8, memory_budget="64MiB")
    pool = build_candidates(config, set(), torch.device("cpu"), 64, [], precisions=["fp32", "bf16"])

    def find(precision: str, recompute: str, micro: int) -> Candidate:
        return next(c for c in pool if (c.setup.precision, c.setup.activation_checkpointing,
                                        c.setup.micro_batch_size) == (precision, recompute, micro))
    assert dominates(find("bf16", "none", 8), find("bf16", "selective", 8))
    assert dominates(find("bf16", "none", 8), find("bf16", "full", 4))
    assert not dominates(find("bf16", "none", 4), find("bf16", "full", 8))  # recompute buys a larger micro-batch
    assert not dominates(find("fp32", "none", 8), find("bf16", "full", 8))  # another precision: only rounds tell
    assert not dominates(find("bf16", "none", 8), find("bf16", "none", 8))


def test_a_spent_time_budget_still_times_every_contender_once():
    """The first round runs whole whatever the budget: on a loaded machine a round cut short chose the first
    contender (issue 54's case chose fp32 at 283 tokens/s, bf16 untimed); the budget stops the later rounds."""
    contenders, order, notes = _race({"a": [1000.0], "b": [2000.0], "c": [1500.0]}, budget=0.0)
    assert order == ["a", "b", "c"] and all(len(c.timing.rounds) == 1 for c in contenders)
    assert any("allowed 1 alternating rounds of a, b, c" in note for note in notes)


def test_the_precisions_take_turns_in_the_first_round():
    """Issue 54: the CPU prior put every fp32 contender first, so a round cut short by the budget never timed bf16
    (on a CPU with bf16 matrix units, the faster one)."""
    from types import SimpleNamespace

    from cadence.plan.decision import interleaved

    config = TrainConfig(model="gpt-tiny", effective_batch_size=8, memory_budget="64MiB")
    pool = build_candidates(config, set(), torch.device("cpu"), 64, [], precisions=["fp32", "bf16"])
    leaders = [c for c in pool if c.setup.micro_batch_size == 8]
    order = interleaved(leaders, SimpleNamespace(device=torch.device("cpu")))  # type: ignore[arg-type]
    assert [c.setup.precision for c in order[:4]] == ["fp32", "bf16", "fp32", "bf16"]
    assert [c.setup.activation_checkpointing for c in order[:2]] == ["none", "none"]


@pytest.mark.slow  # a whole plan with its rounds and quality check
def test_the_quality_check_reuses_the_rounds_losses_and_says_which(tmp_path) -> None:
    import json

    from test_plan import run_plan

    code, out = run_plan(tmp_path, "--activation-checkpointing", "none", "--rounds", "2")
    assert code == 0
    plan = json.loads((out / "plan.json").read_text())
    choice, loss = plan["choice"], plan["quality"]["loss"]
    reused = loss["reused"]
    assert reused["chosen"].startswith(f"{choice['id']}'s rounds (")  # the choice was a contender: its own run
    steps = len(loss["reference"])
    assert steps >= 3 and all(value is not None for value in loss["reference"])
    if choice["precision"] == "fp32":
        assert reused["reference"] == reused["chosen"]  # an fp32 choice is its own reference
    elif reused["reference"] is not None:  # an fp32 contender's run, trained on the same windows from the same weights
        twin = reused["reference"].split("'")[0]
        assert next(c for c in plan["candidates"] if c["id"] == twin)["precision"] == "fp32"
    assert loss["passed"]


def test_a_dropped_contender_is_out_of_the_decision_even_where_the_tie_rule_would_take_it():
    """The leader's rounds disagree (a busy machine), so every contender whose rounds overlap its own ties and the
    tie goes to the lowest peak: a contender the stopping rule dropped must not come back that way."""
    from cadence.plan.decision import decide
    from cadence.plan.trials import TrialResult

    script = {"a": [2600.0, 2700.0], "b": [4000.0, 9000.0, 2500.0] * 2, "c": [3500.0, 8000.0, 4000.0] * 2}
    config = TrainConfig(model="gpt-tiny", effective_batch_size=8, memory_budget="64MiB")
    pool = build_candidates(config, {"activation_checkpointing"}, torch.device("cpu"), 64, [],
                            precisions=["fp32", "bf16", "fp16"])
    contenders = [c for c in pool if c.setup.micro_batch_size == 8]  # one per precision: none dominates another
    for candidate, key in zip(contenders, script):
        candidate.id = key
        candidate.measured = TrialResult(peak_bytes=100 if key == "a" else 200, fits=True, tokens_per_s=None,
                                         step_time_s=None, losses=[], estimated=True)
    races = ScriptedRaces(script)
    from types import SimpleNamespace
    chosen = decide(contenders, SimpleNamespace(device=torch.device("cpu")), PlanOptions(rounds=3),  # type: ignore[arg-type]
                    Deadline(1e9), lambda _: None, [], races)
    assert "a" in races.dropped and chosen.id != "a"
