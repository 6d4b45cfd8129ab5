"""Issue 27 item 3: `cadence plan --effective-batch-size auto` measures the gradient noise scale at the start of
training and chooses the effective batch from it (a power of two near it, within the bounds), records the measurement
in plan.json and the report, and gives advice on --lr without applying it."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from helpers import run_cli, sample_text, spawn, write_jsonl

from cadence.config import TrainConfig
from cadence.models.spec import ModelSpec
from cadence.plan.batch import NoiseScaleUnmeasured, choose_effective_batch, lr_advice, nearest_power_of_two
from cadence.plan.measure import Deadline
from cadence.training.prepare import prepare


@pytest.mark.parametrize(("value", "low", "high", "expected"), [
    (11.0, 1, 4096, 8),     # log2 11 = 3.46: 8 is nearer than 16 on a log scale
    (12.0, 1, 4096, 16),    # log2 12 = 3.58
    (0.3, 1, 4096, 1),      # below one sequence: the smallest batch
    (1.6, 1, 4096, 2),
    (5000.0, 1, 512, 512),  # the upper bound
    (3.0, 16, 4096, 16),    # the lower bound
    (3.0, 3, 3, 3),         # bounds with no power of two between them: the bound itself
    (100.0, 1, 100, 64),    # the largest power of two within the bound
])
def test_the_batch_is_the_power_of_two_nearest_the_noise_scale_within_the_bounds(value, low, high, expected):
    assert nearest_power_of_two(value, low, high) == expected


def test_the_lr_advice_gives_both_rules_and_never_claims_to_change_the_lr():
    advice = lr_advice(1e-3, 64, 16)
    assert "--lr 0.002" in advice and "--lr 0.004" in advice  # sqrt(4) and 4 times
    assert "unless you give another" in advice
    assert "keep it" in lr_advice(1e-3, 16, 16)
    assert "--lr-reference-batch" in lr_advice(1e-3, 16, None) and "never changes --lr" in lr_advice(1e-3, 16, None)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory) -> Path:
    """A transformers llama as save_pretrained writes it (no tokenizer: cadence reads bytes)."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("saved-llama")
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_plan_auto_on_a_saved_model_records_the_noise_scale_and_chooses_from_it(tmp_path, saved_llama):
    data = write_jsonl(tmp_path / "data.jsonl", 96)
    out = tmp_path / "plan"
    status, _, err = run_cli(["plan", "--model", str(saved_llama), "--data", str(data), "--seq-len", "64",
                              "--effective-batch-size", "auto", "--memory-budget", "256MiB", "--noise-scale-windows",
                              "4", "--lr-reference-batch", "8", "--max-trials", "2", "--rounds", "1",
                              "--trial-steps", "3", "--quality-steps", "3", "--out", str(out)])
    assert status == 0, err
    plan = json.loads((out / "plan.json").read_text())
    batch = plan["effective_batch"]
    measured = batch["noise_scale"]
    assert batch["given"] == "auto" and measured["windows"] == 4 and measured["sequences"] > 0
    assert measured["sequences_error"] is not None and measured["tokens"] > 0
    assert batch["probe"]["grad_accum_steps"] >= 2  # the estimator needs two batch sizes
    low, high = batch["bounds"]
    chosen = batch["chosen"]
    assert chosen == nearest_power_of_two(measured["sequences"], low, high)
    assert plan["effective_batch_size"] == chosen
    assert plan["choice"]["micro_batch_size"] * plan["choice"]["grad_accum_steps"] == chosen
    advice = batch["lr_advice"]
    assert ("keep it" in advice) if chosen == 8 else ("tuned at effective batch 8" in advice)
    assert f"gradient noise scale: {measured['sequences']:.3g}" in err
    report = (out / "report.md").read_text()
    assert "The effective batch, from the gradient noise scale" in report and f"**Chosen:** {chosen}" in report
    assert math.isfinite(measured["sequences"])


@pytest.mark.parametrize(("argv", "flag"), [
    (["train", "--effective-batch-size", "auto"], "--effective-batch-size"),
    (["verify", "--effective-batch-size", "auto"], "--effective-batch-size"),
    (["plan", "--effective-batch-size", "16", "--memory-budget", "64MiB", "--noise-scale-windows", "4"],
     "--noise-scale-windows"),
    (["plan", "--effective-batch-size", "auto", "--memory-budget", "64MiB", "--min-effective-batch-size", "64",
      "--max-effective-batch-size", "8"], "--min-effective-batch-size"),
    (["plan", "--effective-batch-size", "auto", "--memory-budget", "64MiB", "--micro-batch-size", "2"],
     "--micro-batch-size"),
    (["plan", "--effective-batch-size", "auto", "--memory-budget", "64MiB", "--noise-scale-windows", "0"],
     "--noise-scale-windows"),
])
def test_auto_is_refused_where_it_means_nothing(tmp_path, argv, flag):
    status, _, err = run_cli([*argv, *(["--out", str(tmp_path / "out")] if argv[0] != "verify" else [])])
    assert status == 2, err
    assert flag in err and "Traceback" not in err


# ---------------------------------------------------------------------------------- the --time-budget (issue 44)
class _CountedDeadline(Deadline):
    """A deadline that passes after ``checks`` questions: the test, not the machine's speed, says when."""

    def __init__(self, checks: int) -> None:
        super().__init__(60.0)
        self.left = checks

    def passed(self, reserve: float = 0.0) -> bool:
        self.left -= 1
        return self.left < 0


@pytest.mark.parametrize(("checks", "said"), [
    (3, "the gradient noise scale was measured over 3 of the 1,000,000 --noise-scale-windows: its share (50%) of "
        "the --time-budget of 60 s was spent"),
    (0, "the gradient noise scale could not be measured: 50% of the --time-budget of 60 s allowed 0 of the "
        "1,000,000 --noise-scale-windows, too few for an estimate"),
], ids=["measures-what-it-can", "too-few-windows"])
def test_the_noise_scale_stops_at_the_plan_s_deadline(tmp_path: Path, checks: int, said: str) -> None:
    """Issue 44: a huge --noise-scale-windows ran past --time-budget; now the measurement stops at the deadline."""
    data = tmp_path / "words.txt"
    data.write_bytes(sample_text(20_000))
    config = TrainConfig(data=data, seq_len=16, effective_batch_size=1, micro_batch_size=1,  # type: ignore[arg-type]
                         val_fraction=0.0, data_cache=tmp_path / "cache", out=tmp_path / "unused")
    prep = prepare(config)
    lines: list[str] = []

    def choose(deadline: Deadline):  # type: ignore[no-untyped-def]
        return choose_effective_batch(prep, ModelSpec.from_flags(config), budget=256 << 20, windows=1_000_000,
                                      bounds=(1, 4096), lr_reference=None, constrained=set(), say=lines.append,
                                      deadline=deadline)

    if checks == 0:
        with pytest.raises(NoiseScaleUnmeasured, match=said):
            choose(_CountedDeadline(checks))
        return
    choice = choose(_CountedDeadline(checks))
    measured = choice.measurement
    assert measured.windows_run == 3 and measured.stopped_early and measured.windows_asked == 1_000_000
    assert choice.time_note is not None and choice.time_note.startswith(said)
    assert f"note: {choice.time_note}" in lines


@pytest.mark.slow
def test_plan_keeps_its_time_budget_with_a_huge_noise_scale_windows(tmp_path: Path) -> None:
    """The whole command, in a process of its own: it used to run a million windows, whatever --time-budget said."""
    data = tmp_path / "words.txt"
    data.write_bytes(sample_text(20_000))
    process = spawn(["plan", "--data", str(data), "--seq-len", "16", "--effective-batch-size", "auto",
                     "--noise-scale-windows", "1000000", "--time-budget", "0.001", "--memory-budget", "256MiB",
                     "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "plan")])
    try:
        _, err = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("cadence plan ran past its --time-budget")
    assert process.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("cadence: plan failed: the gradient noise scale could not be measured: 50% of the "
                                "--time-budget of 0.001 s allowed 0 of the 1,000,000 --noise-scale-windows"), err
    assert "Traceback" not in err and not (tmp_path / "plan" / "plan.json").exists()
