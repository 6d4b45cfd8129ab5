"""`cadence train --loss-chunk-tokens N` (issue 26 item 1): the same run as whole logits, at a fraction of the peak
memory; recorded in config.json; a resume may change it (it does not change the math)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import relative_l2, sample_text, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.engine import TargetsOnlyCrossEntropy, token_cross_entropy_sum
from cadence.training import components
from cadence.training.checkpoint import checkpoint_dirs
from cadence.training.prepare import prepare
from cadence.training.run_dir import read_metrics

pytest.importorskip("transformers")

LLAMA = ["--model", "hf:llama", *(f"--model-config={key}={value}" for key, value in (
    ("vocab_size", 32000), ("hidden_size", 64), ("num_hidden_layers", 2), ("num_attention_heads", 4),
    ("intermediate_size", 128), ("max_position_embeddings", 512)))]


def train_llama(out: Path, chunk: int) -> dict:
    """3 steps of micro-batch 4 x 512 tokens of the built-in corpus (peak memory measured on the second)."""
    assert main(["train", *LLAMA, "--seq-len", "512", "--micro-batch-size", "4", "--grad-accum-steps", "1",
                 "--max-steps", "3", "--lr", "1e-3", "--val-fraction", "0", "--out", str(out),
                 "--loss-chunk-tokens", str(chunk)]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_large_vocabulary_trains_the_same_at_half_the_peak_memory_or_less(tmp_path: Path) -> None:
    """The acceptance test: a transformers llama with a 32,000-token vocabulary and a width of 64, where the
    [2,048 x 32,000] logits and their gradient are most of the peak (measured: 817 MiB whole, 170 MiB at 256)."""
    whole = train_llama(tmp_path / "whole", 0)
    chunked = train_llama(tmp_path / "chunked", 256)
    rows, whole_rows = read_metrics(tmp_path / "chunked"), read_metrics(tmp_path / "whole")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for mine, theirs in zip(rows, whole_rows, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
    assert relative_l2(load_file(str(tmp_path / "chunked" / "model.safetensors")),
                       load_file(str(tmp_path / "whole" / "model.safetensors"))) < 1e-4
    # cadence's own meter (the profiler's allocation replay on CPU), as summary.json reports it.
    print(f"\npeak memory: whole {whole['peak_memory_bytes'] / 2**20:.1f} MiB, chunk 256 "
          f"{chunked['peak_memory_bytes'] / 2**20:.1f} MiB ({chunked['peak_memory_bytes'] / whole['peak_memory_bytes']:.2f})")
    assert chunked["peak_memory_bytes"] <= 0.5 * whole["peak_memory_bytes"], (chunked["peak_memory_bytes"],
                                                                               whole["peak_memory_bytes"])
    config = json.loads((tmp_path / "chunked" / "config.json").read_text())
    assert config["loss_chunk_tokens"] == 256


def args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--seq-len", "32", "--micro-batch-size", "4", "--grad-accum-steps", "2",
            "--max-steps", "4", "--val-fraction", "0", "--checkpoint-every", "2", "--out", str(out), *extra]


def test_a_resume_may_change_the_chunk_size_and_continues_the_same_run(tmp_path: Path) -> None:
    """Chunking is exact (it is not among resume's math-changing settings): a run checkpointed with whole logits
    resumes with --loss-chunk-tokens 16 and continues with the uninterrupted run's losses and weights."""
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(100 * 32 + 1))
    assert main(args(data, tmp_path / "whole")) == 0
    assert main(args(data, tmp_path / "cut")) == 0
    for late in checkpoint_dirs(tmp_path / "cut")[1:]:  # as if killed right after step 2
        shutil.rmtree(late)
    assert main(args(data, tmp_path / "cut", "--resume", "--loss-chunk-tokens", "16")) == 0
    rows, whole = read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "whole")
    assert [row["step"] for row in rows] == [row["step"] for row in whole] == list(range(1, 5))
    for mine, theirs in zip(rows, whole, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert relative_l2(load_file(str(tmp_path / "cut" / "model.safetensors")),
                       load_file(str(tmp_path / "whole" / "model.safetensors"))) < 1e-5
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["loss_chunk_tokens"] == 16



@pytest.mark.parametrize(("model", "overrides", "gathered"), [
    ("gpt-tiny", [], True),
    # A family whose forward trims its logits after the head: cadence cannot make them from the head's input, so its
    # default loss stays all the logits at once (and --loss-chunk-tokens is refused for it, tests/test_cli_errors.py).
    ("hf:inkling2_text", ["hidden_size=32", "num_hidden_layers=1", "num_attention_heads=2", "num_key_value_heads=1",
                          "head_dim=16", "intermediate_size=64", "vocab_size=512"], False),
])
def test_every_command_gets_the_gathered_head_by_default(tmp_path: Path, model: str, overrides: list[str],
                                                        gathered: bool) -> None:
    """Issue 37 item 7: at --loss-chunk-tokens 0 the run's engine (train, plan's trials, profile: all built by
    build_components) gathers the target positions before the head when the model can be split at its head; its
    parity with the full logits is tests/engine/test_targets_only_loss.py's."""
    config = TrainConfig(model=model, model_config=overrides or None, data=write_jsonl(tmp_path / "examples.jsonl"),
                         data_cache=tmp_path / "cache", seq_len=32, micro_batch_size=4, val_fraction=0.0,
                         out=tmp_path / "run")
    loss_fn = components.build_components(prepare(config)).engine.loss_fn
    if gathered:
        assert isinstance(loss_fn, TargetsOnlyCrossEntropy)
    else:
        assert loss_fn is token_cross_entropy_sum
