"""--effective-batch-size ramp: the preset batch ramp (OLMo-core style) in a run: the batch doubles at the first window
boundary at or past each --batch-ramp-tokens count, each step is one big batch of its examples, evaluations fall
every --eval-every windows of the minimum, and a resume across a doubling is the uninterrupted run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import one_big_batch_replay, relative_l2
from safetensors.torch import load_file

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.training.run_dir import read_metrics

MIN, MAX, BUDGET, SEQ = 4, 16, 12, 8
RAMP = "64,150"
"""A window of the minimum holds 4 x 8 = 32 token slots: x2 after window 2 (64 tokens), x2 again at the first
boundary at or past 150 tokens, window 5 (160)."""


def ramp_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--seq-len", str(SEQ), "--micro-batch-size", "2", "--effective-batch-size",
            "ramp", "--min-effective-batch-size", str(MIN), "--max-effective-batch-size", str(MAX),
            "--batch-ramp-tokens", RAMP, "--max-steps", str(BUDGET), "--val-fraction", "0", "--lr", "3e-3",
            "--noise-scale-ema", "0", "--out", str(out), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def ramp_run(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ramp") / "run"
    assert main(ramp_args(text, out)) == 0
    return out


def test_the_ramp_doubles_at_its_token_counts_without_a_noise_scale(ramp_run: Path) -> None:
    """Windows of the minimum 1 and 2 at 4; the doubling decided after window 2 (64 tokens seen) gives 8 for windows
    3-4 and 5-6; 150 tokens fall inside window 5, so the boundary after window 6 (192 tokens) is the first at or past
    them: 16 from window 7 on, the last step stopping at the budget of 12 windows (8). --noise-scale-ema 0 is enough:
    nothing is measured."""
    rows = read_metrics(ramp_run)
    assert [row["effective_batch"] for row in rows] == [4, 4, 8, 8, 16, 8]
    assert [row["minimum_windows"] for row in rows] == [1, 2, 4, 6, 10, 12]
    assert [row["batch_decision"] for row in rows] == ["hold", "grow", "hold", "grow", "hold", "hold"]
    assert rows[1]["batch_reason"] == "preset ramp: 64 tokens seen (>= 64): 4 -> 8"
    assert rows[3]["batch_reason"] == "preset ramp: 192 tokens seen (>= 150): 8 -> 16"
    assert [row["lr_batch_scale"] for row in rows] == [1.0, 1.0, pytest.approx(2 ** 0.5), pytest.approx(2 ** 0.5),
                                                       2.0, 2.0]  # the last step is still at the ramp's batch
    summary = json.loads((ramp_run / "summary.json").read_text())["adaptive_batch"]
    assert summary["effective_batch_size"] == "ramp" and summary["batch_ramp_tokens"] == [RAMP]
    assert [(switch["step"], switch["from"], switch["to"]) for switch in summary["switches"]] == [(2, 4, 8), (4, 8, 16)]


@pytest.mark.slow  # the run's one-big-batch replay: about 5 s
def test_each_ramp_step_is_one_big_batch_of_its_examples(ramp_run: Path, text: Path, tmp_path: Path) -> None:
    config = TrainConfig(data=text, seq_len=SEQ, micro_batch_size=2, effective_batch_size="ramp",
                         min_effective_batch_size=MIN, max_effective_batch_size=MAX, batch_ramp_tokens=[RAMP],
                         max_steps=BUDGET, noise_scale_ema=0.0, val_fraction=0.0, lr=3e-3, device="cpu",
                         out=tmp_path / "reference")
    weights = one_big_batch_replay(read_metrics(ramp_run), config)
    assert relative_l2(load_file(str(ramp_run / "model.safetensors")), weights) < 1e-4


def test_evaluations_fall_every_eval_every_windows_of_the_minimum(text: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--eval-every 3 counts windows of the minimum: an evaluation at the first step whose windows reach 3, 6, 9, 12
    (steps of 1, 1, 2, 2, 4, 2 windows: windows 1, 2, 4, 6, 10, 12), so at the same examples whatever the batch did."""
    out = tmp_path / "run"
    args = ramp_args(text, out)
    args[args.index("--val-fraction") + 1] = "0.1"
    assert main([*args, "--eval-every", "3", "--eval-batches", "2"]) == 0
    assert "evaluation: every 3 windows of the minimum batch" in capsys.readouterr().err
    rows = read_metrics(out)
    assert [row["minimum_windows"] for row in rows if row.get("val_loss") is not None] == [4, 6, 10, 12]


@pytest.mark.slow  # a run with a checkpoint per step, resumed twice: about 10 s
def test_resume_across_a_ramp_doubling_is_bitwise(ramp_run: Path, text: Path, tmp_path: Path) -> None:
    from cadence.training.checkpoint import checkpoint_dirs

    out = tmp_path / "cut"
    assert main(ramp_args(text, out, "--checkpoint-every", "1")) == 0
    for at in (2, 1):  # right after the first doubling; before it, so the resumed run makes it again
        for path in checkpoint_dirs(out):
            if int(path.name.split("-")[1]) > at:
                shutil.rmtree(path)
        assert main(ramp_args(text, out, "--checkpoint-every", "1", "--resume")) == 0
        fields = ("step", "loss", "lr", "effective_batch", "batch_decision")
        assert [[row[name] for name in fields] for row in read_metrics(out)] == \
            [[row[name] for name in fields] for row in read_metrics(ramp_run)]
        weights, expected = load_file(str(out / "model.safetensors")), load_file(str(ramp_run / "model.safetensors"))
        assert all(torch.equal(weights[name], expected[name]) for name in weights)
