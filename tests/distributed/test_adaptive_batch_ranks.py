"""--effective-batch-size adaptive on two gloo ranks: the decision is made from the all-reduced noise-scale terms, so
both ranks group the same windows and switch at the same step; the run equals one process taking one big batch of
the same examples at each step (losses 1e-5, weights 1e-4, as every two-rank parity test here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_big_batch_replay, relative_l2, sample_text
from safetensors.torch import load_file

from cadence.config import TrainConfig
from cadence.training.run_dir import read_metrics

pytestmark = pytest.mark.slow  # real gloo processes

MIN, MAX, BUDGET = 4, 16, 30


def test_two_ranks_switch_together_and_equal_one_process(tmp_path: Path) -> None:
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(16000))
    out = tmp_path / "ranks"
    flags = ["--data", str(data), "--seq-len", "8", "--micro-batch-size", "1", "--effective-batch-size", "adaptive",
             "--min-effective-batch-size", str(MIN), "--max-effective-batch-size", str(MAX), "--max-steps",
             str(BUDGET), "--noise-scale-ema", "0.8", "--val-fraction", "0", "--lr", "3e-3", "--device", "cpu"]
    result = subprocess.run([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", *flags, "--out",
                             str(out)], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(out)
    batches = [row["effective_batch"] for row in rows]
    assert max(batches) > MIN, f"the two ranks did not switch: {batches}"
    assert sum(batches) == BUDGET * MIN
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adaptive_batch"]["switches"]
    config = TrainConfig(data=data, seq_len=8, micro_batch_size=1, effective_batch_size="adaptive",
                         min_effective_batch_size=MIN, max_effective_batch_size=MAX, max_steps=BUDGET,
                         noise_scale_ema=0.8, val_fraction=0.0, lr=3e-3, device="cpu", out=tmp_path / "reference")
    weights = one_big_batch_replay(rows, config)
    assert relative_l2(load_file(str(out / "model.safetensors")), weights) < 1e-4
