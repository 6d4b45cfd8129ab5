"""Issue 26: the plan chooses among the memory levers of today's models, and checks them like any other lever.

A transformers llama with a 32,000-token vocabulary at seq 512: the fp32 logits of one sequence and their gradient
are most of the step's memory, so under 64 MiB nothing fits without loss chunking (the estimate says 217 MiB at
micro-batch 1, 61 MiB with chunks of 64 targets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_jsonl

from cadence.cli import main

LLAMA = ["--model", "hf:llama", *[item for pair in (("--model-config", f"{k}={v}") for k, v in {
    "vocab_size": 32000, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 128, "max_position_embeddings": 512, "tie_word_embeddings": "true"}.items()) for item in pair]]


@pytest.mark.slow
def test_a_large_vocabulary_fits_a_small_budget_through_loss_chunking(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", count=64)
    common = [*LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "512"]
    assert main(["plan", *common, "--effective-batch-size", "8", "--memory-budget", "64MiB", "--precision", "fp32",
                 "--max-trials", "3", "--trial-steps", "3", "--quality-steps", "2", "--rounds", "1",
                 "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    choice = plan["choice"]
    assert choice["loss_chunk_tokens"] > 0, choice
    assert plan["quality"]["gradient"]["passed"] and plan["quality"]["loss"]["passed"]
    assert plan["prediction"]["peak_bytes"] <= 64 * 2**20
    # train --plan, with the budget enforced (on CPU every step is measured): it stays within it.
    assert main(["train", "--plan", str(tmp_path / "plan" / "plan.json"), "--data-cache", str(tmp_path / "cache"),
                 "--memory-budget", "64MiB", "--max-steps", "3", "--val-fraction", "0",
                 "--out", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["peak_memory_bytes"] <= 64 * 2**20 and summary["oom_retries"] == 0
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
