"""--loss-chunk-tokens under DDP and FSDP2 (2 gloo ranks): the head is called through its module after the model's
own forward, so DDP's gradient hooks and FSDP2's root unit (which holds the head and keeps it gathered until the
backward) see it as they see the whole-logits loss; the run is the one-process whole-logits run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import relative_l2, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.training.run_dir import read_metrics

pytestmark = pytest.mark.slow  # real gloo processes

COMMON = ["--seq-len", "32", "--max-steps", "4", "--lr", "3e-3", "--warmup-steps", "1", "--val-fraction", "0"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_with_chunked_loss_give_the_one_process_whole_logits_run(tmp_path: Path, strategy: str) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")  # prompt/completion: the ranks hold different target counts
    reference = tmp_path / "one"
    assert main(["train", "--data", str(data), "--micro-batch-size", "2", "--grad-accum-steps", "8",
                 "--out", str(reference), *COMMON]) == 0
    out = tmp_path / strategy
    result = subprocess.run(
        [sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", "--strategy", strategy, "--data",
         str(data), "--micro-batch-size", "2", "--grad-accum-steps", "4", "--out", str(out), "--loss-chunk-tokens",
         "16", *COMMON], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows, whole = read_metrics(out), read_metrics(reference)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for mine, theirs in zip(rows, whole, strict=True):
        assert mine["targets"] == theirs["targets"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert relative_l2(load_file(str(out / "model.safetensors")), load_file(str(reference / "model.safetensors"))) < 1e-4
