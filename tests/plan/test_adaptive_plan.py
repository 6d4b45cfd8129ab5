"""``cadence plan --effective-batch-size adaptive``: one micro-batch and one set of levers for a whole range.

The adaptive batch grows the accumulation, never the micro-batch, so the plan's candidates compute the minimum: the
micro-batch must divide it, with at least two micro-batches per window on one process (the noise scale needs two batch
sizes). With --batch-branch-test, the snapshot the branch test keeps (weights and optimizer state) is in every
candidate's memory. plan.json records the policy, and train --plan trains adaptive with it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.config.commands import PlanOptions
from cadence.config.from_plan import apply_plan
from cadence.config.plan_file import PlanAdaptive, read_plan, write_plan
from cadence.engine.adaptive_batch import AdaptiveBatch
from cadence.errors import UsageError
from cadence.plan.adaptive import SNAPSHOT, RangeThroughput, StepSplit, as_fixed, policy
from cadence.plan.candidates import Candidate, build_candidates
from cadence.plan.search import choose_trials, measure_candidate
from cadence.training.branch_test import BranchTest
from cadence.training.components import build_components
from cadence.training.prepare import prepare

CPU = torch.device("cpu")
SEQ = 32
TEXT = ("The quick brown fox jumps over the lazy dog. " * 200).encode()
FIXED_LEVERS = {"precision", "activation_checkpointing"}
"""Constrained (at their defaults, fp32 and no recompute) so that each case has one group of levers: the split alone."""


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(TEXT)
    return path


def adaptive_config(data: Path, low: int, high: int, budget: str, **more: Any) -> TrainConfig:
    """A plan's configuration over [low, high] (the micro-batch left to the plan, as make_plan leaves it)."""
    return TrainConfig(model="gpt-tiny", seq_len=SEQ, data=data, memory_budget=budget, micro_batch_size=1,
                       effective_batch_size="adaptive", min_effective_batch_size=low, max_effective_batch_size=high,
                       **more)


def candidates_of(config: TrainConfig) -> list[Candidate]:
    return build_candidates(config, FIXED_LEVERS, CPU, SEQ, [], precisions=["fp32"])


# (minimum, maximum, budget, the micro-batches that serve the range, whether the budget admits the largest of them)
RANGES = [
    (8, 32, "1GiB", [1, 2, 4], True),
    (12, 48, "1GiB", [1, 2, 3, 4, 6], True),
    (2, 16, "1GiB", [1], True),
    (7, 14, "1GiB", [1], True),
    (16, 64, "18MiB", [1, 2, 4, 8], False),  # gpt-tiny at 32 tokens: micro 1 about 17.7 MiB, 8 about 27 MiB
]


@pytest.mark.parametrize(("low", "high", "budget", "serving", "largest"), RANGES)
def test_the_micro_batch_serves_the_whole_range(text: Path, low: int, high: int, budget: str, serving: list[int],
                                               largest: bool) -> None:
    """Every candidate's micro-batch divides the minimum with at least two micro-batches per window, and the trial
    the search picks (the largest micro-batch the estimate admits) is one of them; a fixed batch of the same size
    would also have tried the whole minimum at once."""
    config = adaptive_config(text, low, high, budget)
    candidates = candidates_of(config)
    assert sorted(c.setup.micro_batch_size for c in candidates) == serving
    for candidate in candidates:
        micro, accum = candidate.setup.micro_batch_size, candidate.setup.grad_accum_steps
        assert micro * accum == low and accum >= 2, candidate.setup.describe()
    [trial] = choose_trials(candidates, int(config.memory_budget_bytes() or 0), 10, CPU)
    assert trial.setup.micro_batch_size in serving
    assert (trial.setup.micro_batch_size == max(serving)) is largest, trial.setup.describe()
    fixed = candidates_of(as_fixed(config, low))
    assert low in {c.setup.micro_batch_size for c in fixed}  # what the range rules out: one micro-batch per window


def test_a_ramp_serves_its_range_with_any_divisor_of_the_minimum(text: Path) -> None:
    """A preset ramp grows the accumulation the same way but measures nothing: one micro-batch per window serves it,
    and its token counts go into plan.json's policy."""
    config = adaptive_config(text, 8, 32, "1GiB", batch_ramp_tokens=["4096,8192"])
    config = dataclasses.replace(config, effective_batch_size="ramp")
    assert sorted(c.setup.micro_batch_size for c in candidates_of(config)) == [1, 2, 4, 8]
    ramp = policy(config)
    assert ramp is not None and ramp.flags()["effective_batch_size"] == "ramp"
    assert ramp.flags()["batch_ramp_tokens"] == ["4096,8192"]


def test_a_minimum_no_micro_batch_serves_is_refused_naming_the_flag(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A minimum of 1 holds one micro-batch whatever it is (no noise scale on one process): refused before anything
    runs, one line naming --min-effective-batch-size."""
    status = main(["plan", "--model", "gpt-tiny", "--seq-len", "16", "--memory-budget", "1GiB",
                   "--effective-batch-size", "adaptive", "--min-effective-batch-size", "1",
                   "--max-effective-batch-size", "8", "--out", str(tmp_path / "plan")])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, lines
    assert "--min-effective-batch-size" in lines[0] and "two sizes" in lines[0], lines[0]
    assert not (tmp_path / "plan").exists()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def test_the_branch_test_snapshot_enters_the_estimate(text: Path, tmp_path: Path) -> None:
    """With --batch-branch-test every candidate's estimate is its estimate without plus the snapshot, and the
    snapshot is what the branch test really copies: the weights (every state-dict entry: gpt-tiny's tied head
    twice) and AdamW's moments, taken from a real engine after a step (measured 12,817,152 bytes; counted 12,816,896:
    AdamW's per-tensor step counts, 4 bytes each, are left out)."""
    without = candidates_of(adaptive_config(text, 8, 32, "1GiB"))
    with_test = candidates_of(adaptive_config(text, 8, 32, "1GiB", batch_branch_test=2))
    snapshot = with_test[0].snapshot_bytes
    assert snapshot > 0 and all(c.snapshot_bytes == 0 for c in without)
    for plain, tested in zip(without, with_test, strict=True):
        assert tested.estimate.peak_bytes == plain.estimate.peak_bytes + snapshot
        assert tested.estimate.by_category[SNAPSHOT] == snapshot and tested.snapshot_bytes == snapshot
    prep = prepare(TrainConfig(model="gpt-tiny", seq_len=SEQ, data=text, micro_batch_size=4, effective_batch_size=8,
                               val_fraction=0.0), out=tmp_path / "run")
    parts = build_components(prep)
    parts.engine.step(next(iter(prep.windows(0))))  # AdamW's state exists after the first step
    real = BranchTest(parts.engine, []).snapshot()
    weights = sum(tensor.nbytes for tensor in real.weights.values())
    state = sum(tensor.nbytes for tensor in _tensors(real.optimizer))
    assert abs(snapshot - (weights + state)) <= 1e-4 * (weights + state), (snapshot, weights, state)


@pytest.mark.slow
def test_a_trial_fits_only_with_room_for_the_snapshot(text: Path, tmp_path: Path) -> None:
    """A trial runs without the snapshot: its peak is reported with the snapshot added, and it fits only where the
    budget has room for both (real trials, the same memory window each time)."""
    config = adaptive_config(text, 8, 32, "1GiB", batch_branch_test=2)
    prep = prepare(as_fixed(config, 8, val_fraction=0.0), out=tmp_path / "plan")
    [plain] = [c for c in candidates_of(as_fixed(config, 8)) if c.setup.micro_batch_size == 4]
    measure_candidate(plain, prep, 1 << 30, PlanOptions(), lambda _: None, memory_only=True)
    step_peak = plain.peak
    [tested] = [c for c in candidates_of(config) if c.setup.micro_batch_size == 4]
    snapshot = tested.snapshot_bytes
    measure_candidate(tested, prep, step_peak + snapshot - 1, PlanOptions(), lambda _: None, memory_only=True)
    assert tested.peak == step_peak + snapshot and not tested.feasible
    measure_candidate(tested, prep, step_peak + snapshot, PlanOptions(), lambda _: None, memory_only=True)
    assert tested.feasible


def test_the_throughput_at_the_maximum_is_derived_from_the_optimizer_share() -> None:
    """At the maximum the optimizer step runs once per k windows of the minimum: 1,000 tokens/s with a step of 20% of
    the window, k = 4, gives 1000 / (0.8 + 0.05) tokens/s; without the share nothing is derived."""
    policy = AdaptiveBatch(minimum=8, maximum=32)
    speed = RangeThroughput.of(policy, 1000.0, StepSplit(window_s=1.0, optimizer_s=0.2, windows=3))
    assert speed.at_maximum == pytest.approx(1000 / 0.85) and speed.optimizer_share == pytest.approx(0.2)
    record = speed.as_dict()
    assert record["tokens_per_s_at_maximum_from"].startswith("derived")
    assert record["tokens_per_s_at_minimum_from"].startswith("measured")
    assert RangeThroughput.of(policy, 1000.0, None).at_maximum is None
    assert RangeThroughput.of(AdaptiveBatch(minimum=8, maximum=8), 1000.0, StepSplit(
        window_s=1.0, optimizer_s=0.2, windows=3)).at_maximum == pytest.approx(1000.0)


def _plan_file(tmp_path: Path, adaptive: PlanAdaptive | None) -> Path:
    """A plan.json of a gpt-tiny plan that chose micro 4 x accum 2, written by the record's own writer."""
    record = {"version": 1, "created": "2026-12-06T20:00:00", "model": "gpt-tiny", "seq_len": SEQ, "diagnosis": {},
              "candidates": [], "effective_batch_size": 8, "optimizer": "adamw",
              "choice": {"id": "c03", "micro_batch_size": 4, "grad_accum_steps": 2, "reason": "test"},
              "adaptive_batch": adaptive.as_json() if adaptive is not None else None}
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(record))
    path = tmp_path / "plan.json"
    write_plan(path, read_plan(raw, where="--plan"))
    return path


POLICY = PlanAdaptive(flags=AdaptiveBatch(minimum=8, maximum=32, lr_scaling="sqrt", branch_windows=2).flags(),
                      snapshot_bytes=12_816_896, throughput={"tokens_per_s_at_minimum": 5000.0})


def test_plan_json_round_trips_the_policy_and_train_plan_applies_it(tmp_path: Path) -> None:
    """The policy goes through plan.json's one writer and reader unchanged, and train --plan trains adaptive with it:
    the plan's micro-batch, the accumulation left to the run (windows of the minimum)."""
    path = _plan_file(tmp_path, POLICY)
    again = read_plan(path, where="--plan")
    assert again.adaptive_batch == POLICY
    assert json.loads(path.read_text())["adaptive_batch"]["min_effective_batch_size"] == 8
    config = apply_plan(TrainConfig(plan=path), set())
    assert (config.effective_batch_size, config.min_effective_batch_size, config.max_effective_batch_size) == (
        "adaptive", 8, 32)
    assert (config.batch_lr_scaling, config.batch_branch_test, config.batch_branch_tolerance) == ("sqrt", 2, 0.01)
    assert (config.micro_batch_size, config.grad_accum_steps) == (4, None)
    same = apply_plan(TrainConfig(plan=path, effective_batch_size="adaptive", max_effective_batch_size=32),
                      {"effective_batch_size", "max_effective_batch_size"})
    assert same == dataclasses.replace(config, effective_batch_size="adaptive")


@pytest.mark.parametrize(("given", "where"), [
    ({"max_effective_batch_size": 64}, "--max-effective-batch-size"),
    ({"effective_batch_size": 16}, "--effective-batch-size"),
    ({"batch_lr_scaling": "linear"}, "--batch-lr-scaling"),
])
def test_train_plan_refuses_flags_that_contradict_the_policy(tmp_path: Path, given: dict[str, Any],
                                                             where: str) -> None:
    path = _plan_file(tmp_path, POLICY)
    with pytest.raises(UsageError) as caught:
        apply_plan(TrainConfig(plan=path, **given), set(given))
    assert [problem.where for problem in caught.value.problems] == [where]


def test_train_plan_refuses_a_branch_test_the_plan_did_not_count(tmp_path: Path) -> None:
    no_test = PlanAdaptive(flags=AdaptiveBatch(minimum=8, maximum=32).flags())
    path = _plan_file(tmp_path, no_test)
    with pytest.raises(UsageError) as caught:
        apply_plan(TrainConfig(plan=path, batch_branch_test=2), {"batch_branch_test"})
    [problem] = caught.value.problems
    assert problem.where == "--batch-branch-test" and "snapshot" in problem.message


@pytest.mark.slow
def test_plan_adaptive_then_train_plan_runs_adaptive_within_the_estimate(text: Path, tmp_path: Path) -> None:
    """gpt-tiny over [8, 32] with the branch test: the plan chooses a micro-batch that serves the range, records the
    policy and the throughput at both ends; train --plan runs adaptive (summary.json's adaptive_batch) and its
    measured peak is within the chosen candidate's estimate (which counts the snapshot)."""
    plan_dir, run_dir = tmp_path / "plan", tmp_path / "run"
    cache = ["--data", str(text), "--data-cache", str(tmp_path / "cache")]
    assert main(["plan", "--model", "gpt-tiny", "--seq-len", str(SEQ), *cache, "--memory-budget", "256MiB",
                 "--effective-batch-size", "adaptive", "--min-effective-batch-size", "8",
                 "--max-effective-batch-size", "32", "--batch-branch-test", "2", "--max-trials", "2",
                 "--trial-steps", "3", "--quality-steps", "2", "--rounds", "1", "--time-budget", "30",
                 "--out", str(plan_dir)]) == 0
    plan = json.loads((plan_dir / "plan.json").read_text())
    micro, accum = plan["choice"]["micro_batch_size"], plan["choice"]["grad_accum_steps"]
    assert 8 % micro == 0 and micro * accum == 8 and accum >= 2
    adaptive = plan["adaptive_batch"]
    assert (adaptive["min_effective_batch_size"], adaptive["max_effective_batch_size"],
            adaptive["batch_branch_test"]) == (8, 32, 2)
    chosen = next(row for row in plan["candidates"] if row["id"] == plan["choice"]["id"].split("-")[0])
    assert adaptive["snapshot_bytes"] > 0 and chosen["estimated_by_category"][SNAPSHOT] == adaptive["snapshot_bytes"]
    speed = adaptive["throughput"]
    assert speed["tokens_per_s_at_minimum"] > 0 and speed["tokens_per_s_at_maximum"] >= speed["tokens_per_s_at_minimum"]
    assert main(["train", "--plan", str(plan_dir / "plan.json"), "--data-cache", str(tmp_path / "cache"),
                 "--max-steps", "6", "--eval-every", "3", "--eval-batches", "2", "--out", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["adaptive_batch"]["min_effective_batch_size"] == 8
    assert summary["adaptive_batch"]["batch_branch_test"] == 2
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["micro_batch_size"], config["min_effective_batch_size"]) == (micro, 8)
    assert 0 < summary["peak_memory_bytes"] <= chosen["estimated_peak_bytes"]
