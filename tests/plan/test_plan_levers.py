"""Issue 26: the plan chooses among the memory levers of today's models, and checks them like any other lever.

A transformers llama with a 32,000-token vocabulary at seq 512: the fp32 logits of one sequence and their gradient
are most of the step's memory, so under a small budget nothing fits without loss chunking (see the test for the
estimates at the rows the data holds)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from helpers import write_jsonl

from cadence.cli import main

LLAMA = ["--model", "hf:llama", *[item for pair in (("--model-config", f"{k}={v}") for k, v in {
    "vocab_size": 32000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "max_position_embeddings": 512, "tie_word_embeddings": "true"}.items()) for item in pair]]


def rows_near_128(path: Path, count: int = 48) -> Path:
    """Prompt/completion lines of uneven lengths, the longest of 127 positions: a plan measures (and estimates) the
    longest rows the data holds, not --seq-len's (issue 43)."""
    rng = random.Random(11)
    lines = [json.dumps({"prompt": "q:", "completion": "".join(rng.choice("abcdefgh ") for _ in range(
        124 if index % 6 == 0 else rng.randint(10, 90)))}) for index in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_a_large_vocabulary_fits_a_small_budget_through_loss_chunking(tmp_path: Path) -> None:
    """On rows of up to 127 positions nothing without loss chunks fits 66 MiB (estimated 68-80 MiB at micro-batch 1,
    the logits and their gradient), with chunks of 64 targets it does (64-65 MiB)."""
    data = rows_near_128(tmp_path / "data.jsonl")
    common = [*LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "512"]
    assert main(["plan", *common, "--effective-batch-size", "8", "--memory-budget", "66MiB", "--precision", "fp32",
                 "--max-trials", "3", "--trial-steps", "3", "--quality-steps", "2", "--rounds", "1",
                 "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    choice = plan["choice"]
    assert choice["loss_chunk_tokens"] > 0, choice
    assert plan["quality"]["gradient"]["passed"] and plan["quality"]["loss"]["passed"]
    assert plan["prediction"]["peak_bytes"] <= 66 * 2**20
    # train --plan, with the budget enforced (on CPU every step is measured): it stays within it.
    assert main(["train", "--plan", str(tmp_path / "plan" / "plan.json"), "--data-cache", str(tmp_path / "cache"),
                 "--memory-budget", "66MiB", "--max-steps", "3", "--val-fraction", "0",
                 "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["peak_memory_bytes"] <= 66 * 2**20 and summary["oom_retries"] == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["loss_chunk_tokens"] == choice["loss_chunk_tokens"]


def test_verify_accepts_loss_chunking_as_an_exact_lever(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The chunked loss is the same gradient: verify compares it with all logits at once, to fp32 rounding."""
    data = write_jsonl(tmp_path / "data.jsonl", count=32)
    small = [arg.replace("vocab_size=32000", "vocab_size=2048").replace("max_position_embeddings=512",
                                                                        "max_position_embeddings=128") for arg in LLAMA]
    assert main(["verify", *small, "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "64",
                 "--micro-batch-size", "2", "--grad-accum-steps", "4", "--loss-chunk-tokens", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["relative_error"] < 1e-5 and result["setup"]["loss_chunk_tokens"] == 16


STATE_LLAMA = [arg.replace("hidden_size=64", "hidden_size=128").replace("intermediate_size=128", "intermediate_size=256")
               .replace("max_position_embeddings=512", "max_position_embeddings=128") for arg in LLAMA]
"""4.4M parameters, most of them the 32,000-token embedding: at seq 64 the step's peak is the optimizer's (measured
at micro-batch 2 x 2: 98.8 MiB with fp32 AdamW state since accumulation adds the embedding's gradient in place, 114
MiB before; bf16 state saves about 17 MiB of it; the estimate puts 8bit state above fp32's: bitsandbytes' CPU step
needs more scratch than it saves)."""


def _state_plan(tmp_path: Path, out: str, budget: str = "90MiB") -> list[str]:
    data = write_jsonl(tmp_path / "data.jsonl", count=48)
    return ["plan", *STATE_LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "64",
            "--too-long", "truncate", "--effective-batch-size", "4", "--memory-budget", budget, "--precision", "fp32",
            "--max-trials", "3", "--trial-steps", "3", "--quality-steps", "4", "--rounds", "1", "--out",
            str(tmp_path / out)]


@pytest.mark.slow
def test_a_lossy_optimizer_state_is_chosen_only_where_nothing_exact_fits_and_after_its_loss_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 item 5: under 90 MiB no configuration with fp32 optimizer state fits, so bf16 state is a candidate;
    the decision uses it only after its losses stayed within the tolerance of fp32 state's, and the report shows the
    memory-throughput front with the quality column."""
    assert main(_state_plan(tmp_path, "plan")) == 0
    err = capsys.readouterr().err
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["choice"]["optimizer_state"] == "bf16", plan["choice"]
    assert any("no configuration with fp32 optimizer state fits (measured)" in note for note in plan["notes"])
    [check] = plan["quality"]["optimizer_state"]
    assert check["optimizer_state"] == "bf16" and check["passed"] and check["steps"] == 4
    assert 0 < check["max_relative_difference"] <= check["tolerance"] == 0.01
    assert check["losses"][0] == check["reference"][0]  # the first step's loss precedes any update
    assert "optimizer state bf16: losses within" in err
    assert plan["prediction"]["peak_bytes"] <= 90 * 2**20
    report = (tmp_path / "plan" / "report.md").read_text()
    assert "| front | quality |" in report and "PASS (loss within" in report and "exact" in report
    assert "--optimizer-state bf16" in report
    # An exact plan never lists the lossy states: the same model under a budget fp32 state fits.
    assert main(_state_plan(tmp_path, "roomy", budget="160MiB")) == 0
    roomy = json.loads((tmp_path / "roomy" / "plan.json").read_text())
    assert {c["optimizer_state"] for c in roomy["candidates"]} == {"fp32"}


@pytest.mark.slow
def test_a_lossy_optimizer_state_that_fails_its_loss_check_is_never_chosen(tmp_path: Path, monkeypatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """With a tolerance of zero the bf16 state's (different, after the first update) losses fail: every bf16
    candidate is refused, nothing else fits, and the plan fails saying why rather than choosing it."""
    from cadence.plan import quality

    monkeypatch.setattr(quality, "STATE_TOLERANCE", 0.0)
    assert main(_state_plan(tmp_path, "plan")) == 1
    err = capsys.readouterr().err
    assert "optimizer state bf16: losses within" in err and "FAIL" in err
    assert "with an optimizer state whose losses stay within 0% of fp32 state's" in err
    assert not (tmp_path / "plan" / "plan.json").exists()
