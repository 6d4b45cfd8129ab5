"""Issue 39 item 3: under LoRA a plan may hold the frozen base in 4-bit NormalFloat (--lora-base-precision nf4) where
nothing with the full-precision base fits, and keeps it only after its losses stay within 1% of that base's, as it
keeps a lower-precision optimizer state; plan.json and train --plan carry it, and the report shows it.

The model is a transformers llama whose blocks' linear layers are 524K of its 590K parameters: with the fp32 base
its smallest estimated peak (3.4 MiB: 2.3 MiB of weights) is over a budget of 2.75 MiB, with the nf4 base (0.56 MiB of
weights) its estimates are 1.8-2.3 MiB at micro-batch 1."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_cli, write_jsonl

from cadence.config import TrainConfig
from cadence.memory.estimate_for import estimate_for
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.models.lora import lora_shape
from cadence.models.spec import ModelSpec
from cadence.plan.decision import nf4_buys_speed, nf4_clearly_faster
from cadence.plan.measure import Rates
from cadence.plan.trials import TrialSetup

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

SIZES = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 512,
         "vocab_size": 256, "max_position_embeddings": 128}
LLAMA = ["--model", "hf:llama", *[item for key, value in SIZES.items() for item in ("--model-config", f"{key}={value}")]]
BUDGET = int(2.75 * 2**20)
# A given cut (drawn order) leaves the cuts by length unmeasured: the test is about the base.
PLAN = ["--seq-len", "64", "--lora-rank", "8", "--effective-batch-size", "2", "--precision", "fp32",
        "--micro-batch-order", "drawn", "--max-trials", "1", "--trial-steps", "3", "--quality-steps", "3",
        "--rounds", "1"]


def test_a_plan_picks_an_nf4_base_where_only_it_fits_after_its_loss_check(tmp_path: Path, one_thread: None) -> None:
    """Acceptance (issue 39 item 3): under 2.75 MiB nothing with the fp32 base fits (estimated 3.4 MiB at best), so
    the plan measures an nf4 base, chooses it after its losses stayed within 1% of the fp32 base's, records it in
    plan.json and the report, and train --plan trains it within the budget."""
    data = write_jsonl(tmp_path / "data.jsonl", count=32)
    cache = ["--data-cache", str(tmp_path / "cache")]
    status, _, err = run_cli(["plan", *LLAMA, "--data", str(data), *cache, *PLAN, "--memory-budget", "2.75MiB",
                              "--out", str(tmp_path / "plan")])
    assert status == 0, err
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    choice = plan["choice"]
    assert choice["lora_base_precision"] == "nf4" and plan["lora"]["lora_base_precision"] == "nf4", choice
    bases = {c["lora_base_precision"] for c in plan["candidates"]}
    assert bases == {"fp32", "nf4"}
    fp32 = [c for c in plan["candidates"] if c["lora_base_precision"] == "fp32"]
    assert min(c["estimated_peak_bytes"] for c in fp32) > BUDGET
    assert any("no configuration with the fp32 base fits (measured)" in note for note in plan["notes"])
    [check] = plan["quality"]["lora_base_precision"]
    print(f"nf4 base: losses {check['losses']} against the fp32 base's {check['reference']}: largest relative "
          f"difference {check['max_relative_difference']:.3%}; measured peak {plan['prediction']['peak_bytes']:,} "
          f"bytes of {BUDGET:,}")
    assert check["lora_base_precision"] == "nf4" and check["reference_base"] == "fp32" and check["passed"]
    assert 0 < check["max_relative_difference"] <= check["tolerance"] == 0.01 and check["steps"] == 3
    assert plan["quality"]["gradient"]["passed"] and plan["quality"]["loss"]["passed"]
    assert plan["prediction"]["peak_bytes"] <= BUDGET
    assert "nf4 base: losses within" in err
    report = (tmp_path / "plan" / "report.md").read_text()
    assert "--lora-base-precision nf4" in report and "nf4 base: PASS (loss within" in report
    assert "nf4 LoRA base against the fp32 base over 3 steps: PASS" in report
    # train --plan, with the budget enforced (on CPU every step is measured): the nf4 base, within it.
    status, _, err = run_cli(["train", "--plan", str(tmp_path / "plan" / "plan.json"), *cache, "--memory-budget",
                              "2.75MiB", "--max-steps", "3", "--val-fraction", "0", "--out", str(tmp_path / "run")])
    assert status == 0, err
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["lora_base_precision"] == "nf4" and config["lora_rank"] == 8
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"train --plan: peak {summary['peak_memory_bytes']:,} bytes of {BUDGET:,}")
    assert summary["peak_memory_bytes"] <= BUDGET and summary["oom_retries"] == 0
    # A flag that contradicts the plan's base is an error, as any other.
    status, _, err = run_cli(["train", "--plan", str(tmp_path / "plan" / "plan.json"), "--lora-base-precision",
                              "fp32", "--out", str(tmp_path / "other")])
    assert status == 2 and "--lora-base-precision: 'fp32' contradicts the plan's 'nf4'" in err


def test_the_plan_estimates_an_nf4_base_as_the_estimate_of_the_quantised_model() -> None:
    """The plan counts an nf4 base from the layers quantisation would replace (without building it): the same
    estimate as the model built with --lora-base-precision nf4."""
    config = TrainConfig(model="hf:llama", model_config=[f"{k}={v}" for k, v in SIZES.items()], lora_rank=8,
                         seq_len=64)
    planned = ModelSpec.from_flags(config)
    built = lora_shape(planned.build(seed=config.seed, base_precision="nf4").module)  # the quantised model's
    assert built == planned.adapters_for("nf4")
    for checkpointing in ("none", "full"):
        options = {"micro_batch_size": 2, "seq_len": 64, "precision": "fp32", "checkpointing": checkpointing,
                   "grad_accum_steps": 2}
        assert estimate_for(planned, **options, lora_base_precision="nf4") == estimate_hf_step_memory(
            planned.shape, style="llama", lora=built, **options)
        full, nf4 = estimate_for(planned, **options), estimate_for(planned, **options, lora_base_precision="nf4")
        assert full.by_category["parameters"] > 3 * nf4.by_category["parameters"] and full.peak_bytes > nf4.peak_bytes


def test_without_bitsandbytes_an_nf4_base_is_not_a_candidate_and_the_failure_says_why(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """bitsandbytes not installed (hidden from the import system): under the same budget nothing fits, and the
    failed plan names the untried nf4 base, why, and the install line."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    data = write_jsonl(tmp_path / "data.jsonl", count=32)
    status, _, err = run_cli(["plan", *LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), *PLAN,
                              "--memory-budget", "2.75MiB", "--out", str(tmp_path / "plan")])
    assert status == 1, err
    assert "no configuration fits in 2.8 MiB" in err
    assert ("An nf4 base (--lora-base-precision nf4) was not a candidate: it needs bitsandbytes (pip install "
            "'cadence[8bit]', or pip install bitsandbytes)") in err
    assert "measuring an nf4 base" not in err and not (tmp_path / "plan" / "plan.json").exists()


def test_an_nf4_base_that_fails_its_loss_check_is_never_chosen(tmp_path: Path, monkeypatch, one_thread: None) -> None:
    """With a tolerance of zero the nf4 base's (4-bit) losses fail against the fp32 base's: every nf4 candidate is
    refused, nothing else fits, and the plan fails saying why rather than choosing it."""
    from cadence.plan import quality

    monkeypatch.setattr(quality, "BASE_TOLERANCE", 0.0)
    data = write_jsonl(tmp_path / "data.jsonl", count=32)
    status, _, err = run_cli(["plan", *LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), *PLAN,
                              "--memory-budget", "2.75MiB", "--out", str(tmp_path / "plan")])
    assert status == 1, err
    assert "nf4 base: losses within" in err and "FAIL" in err
    assert "with a base whose losses stay within 0% of the full-precision base's" in err
    assert "give --lora-base-precision nf4 to train with it anyway" in err
    assert not (tmp_path / "plan" / "plan.json").exists()


def _setup(micro: int, recompute: str = "none", **levers: object) -> TrialSetup:
    from cadence.engine.cut import Cut

    return TrialSetup(cut=Cut(micro_batch_size=micro), grad_accum_steps=4 // micro, precision="fp32",
                      activation_checkpointing=recompute, offload="none", **levers)  # type: ignore[arg-type]


@pytest.mark.parametrize(("nf4", "chosen", "buys"), [
    (_setup(2, "full", lora_base_precision="nf4"), _setup(1, "full"), True),  # a larger micro-batch
    (_setup(1, "none", lora_base_precision="nf4"), _setup(1, "full"), True),  # less recompute
    (_setup(1, "full", lora_base_precision="nf4"), _setup(1, "full"), False),  # the same levers: only slower
    (_setup(4, "full", lora_base_precision="nf4"), _setup(1, "none"), False),  # larger, but more recompute
    (_setup(1, "none", lora_base_precision="nf4", loss_chunk_tokens=64), _setup(1, "full"), False),  # chunks added
])
def test_an_nf4_base_is_measured_only_where_its_freed_memory_buys_a_speed_lever(nf4: TrialSetup, chosen: TrialSetup,
                                                                                buys: bool) -> None:
    assert nf4_buys_speed(nf4, chosen) is buys


def test_an_nf4_base_replaces_a_choice_only_when_clearly_faster() -> None:
    """More than 10% faster by the median and outside the rounds' noise; a tie or a small gain keeps the choice."""
    exact = Rates(rounds=[100.0, 101.0, 99.0])
    assert nf4_clearly_faster(Rates(rounds=[120.0, 121.0, 119.0]), exact)
    assert not nf4_clearly_faster(Rates(rounds=[108.0, 109.0, 107.0]), exact)  # 8%: not clear enough
    assert not nf4_clearly_faster(Rates(rounds=[80.0, 160.0, 120.0]), exact)  # 19% by the median, within its noise
    assert not nf4_clearly_faster(Rates(), exact)


def test_where_the_full_precision_base_fits_only_with_recompute_the_plan_measures_an_nf4_base_against_it(
        tmp_path: Path, one_thread: None) -> None:
    """Issue 39 item 3, "or clearly faster": at 3.75 MiB with effective batch 4 the fp32 base fits at micro-batch 1
    with full recompute (estimated 3.43 MiB) while an nf4 base fits larger micro-batches or no recompute. The plan
    measures the nf4 configurations its freed memory buys, times them against its choice, says what it found, and
    takes one only when it is more than 10% faster outside the noise and its losses pass their check."""
    data = write_jsonl(tmp_path / "data.jsonl", count=32)
    plan_flags = [*PLAN, "--effective-batch-size", "4", "--max-trials", "4", "--rounds", "2"]
    status, _, err = run_cli(["plan", *LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"),
                              *plan_flags, "--memory-budget", "3.75MiB", "--out", str(tmp_path / "plan")])
    assert status == 0, err
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    nf4 = [c for c in plan["candidates"] if c["lora_base_precision"] == "nf4"]
    assert 1 <= len(nf4) <= 2 and all(c["measured"] is not None for c in nf4), plan["candidates"]
    assert all(c["estimated_peak_bytes"] <= int(3.75 * 2**20) for c in nf4)
    verdict = [note for note in plan["notes"] if note.startswith("an nf4 base was ")]
    print(verdict, plan["choice"]["id"], plan["choice"]["lora_base_precision"])
    assert len(verdict) == 1 and "tokens/s against" in verdict[0]
    if plan["choice"]["lora_base_precision"] == "nf4":
        assert verdict[0].startswith("an nf4 base was clearly faster")
        [check] = plan["quality"]["lora_base_precision"]
        assert check["passed"]
    else:
        assert verdict[0].startswith("an nf4 base was not clearly faster")
        assert plan["quality"]["lora_base_precision"] == []
    assert "nf4 base: the memory it frees buys" in err
