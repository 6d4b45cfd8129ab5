"""--effective-batch-size adaptive in a run: the same examples in the same order grouped into larger windows, each
window the one-big-batch gradient of its examples (through a switch), the LR and beta2 that follow the batch, the
schedule counted in windows of the minimum, and the controller's state through a resume."""

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

MIN, MAX, BUDGET = 4, 16, 30
"""Seq-len 8 text at --noise-scale-ema 0.8: this run grows 4 -> 8 at step 21 (measured), inside 30 windows of 4."""


def adaptive_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--seq-len", "8", "--micro-batch-size", "2", "--effective-batch-size",
            "adaptive", "--min-effective-batch-size", str(MIN), "--max-effective-batch-size", str(MAX),
            "--max-steps", str(BUDGET), "--noise-scale-ema", "0.8", "--val-fraction", "0", "--lr", "3e-3",
            "--out", str(out), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def adaptive_run(text: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adaptive") / "run"
    assert main(adaptive_args(text, out)) == 0
    return out


@pytest.mark.slow  # a 26-step run and its reference: about 10 s
def test_a_run_grows_and_equals_one_big_batch_per_step(adaptive_run: Path, text: Path, tmp_path: Path) -> None:
    """The run's losses and final weights against a hand-written loop that takes, step by step, the next
    ``effective_batch`` examples of the epoch's order as one batch (mean loss over its targets, clip, AdamW with the
    LR of the schedule counted in windows of the minimum times sqrt(batch / minimum), beta2 = 0.95 ** ratio)."""
    rows = read_metrics(adaptive_run)
    batches = [row["effective_batch"] for row in rows]
    assert MIN * 2 in batches, f"the run did not switch: {batches}"
    assert sum(batches) == BUDGET * MIN  # --max-steps counts windows of the minimum
    # each window holds the batch decided after the one before (the last stops at the budget)
    assert all(batches[i + 1] == row["next_effective_batch"] for i, row in enumerate(rows[:-2]))
    switches = json.loads((adaptive_run / "summary.json").read_text())["adaptive_batch"]["switches"]
    assert switches and switches[0]["decision"] == "grow" and switches[0]["from"] == MIN

    config = TrainConfig(data=text, seq_len=8, micro_batch_size=2, effective_batch_size="adaptive",
                         min_effective_batch_size=MIN, max_effective_batch_size=MAX, max_steps=BUDGET,
                         noise_scale_ema=0.8, val_fraction=0.0, lr=3e-3, device="cpu",
                         out=tmp_path / "reference")
    weights = one_big_batch_replay(rows, config)
    assert relative_l2(load_file(str(adaptive_run / "model.safetensors")), weights) < 1e-4


def _same_run(a: Path, b: Path) -> None:
    """Bitwise: every metrics row's loss, LR and batch, and the final weights."""
    fields = ("step", "loss", "lr", "effective_batch", "batch_decision", "next_effective_batch")
    assert [[row[name] for name in fields] for row in read_metrics(a)] == \
        [[row[name] for name in fields] for row in read_metrics(b)]
    weights_a, weights_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    summary_a, summary_b = (json.loads((run / "summary.json").read_text()) for run in (a, b))
    assert summary_a["adaptive_batch"] == summary_b["adaptive_batch"]


@pytest.mark.slow  # a run with a checkpoint per step, resumed twice: about 30 s
def test_resume_right_after_and_across_a_switch_is_bitwise(adaptive_run: Path, text: Path, tmp_path: Path) -> None:
    """The controller's state (its multiple and streaks), the LR scale and beta2 are in the checkpoint: a run resumed
    from the checkpoint of the step that decided a switch, or from two steps before it, is the uninterrupted run."""
    from cadence.training.checkpoint import checkpoint_dirs

    switch = json.loads((adaptive_run / "summary.json").read_text())["adaptive_batch"]["switches"][0]["step"]
    out = tmp_path / "cut"
    assert main(adaptive_args(text, out, "--checkpoint-every", "1")) == 0
    saved = {path: path.name for path in checkpoint_dirs(out)}
    for at in (switch, switch - 2):  # right after the switch; before it, so the resumed run makes it again
        for path in checkpoint_dirs(out):
            if int(path.name.split("-")[1]) > at:
                shutil.rmtree(path)
        assert main(adaptive_args(text, out, "--checkpoint-every", "1", "--resume")) == 0
        _same_run(out, adaptive_run)
    assert saved


def test_adaptive_resume_of_a_fixed_batch_run_is_refused(text: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A fixed-batch run continued with --effective-batch-size adaptive changes the math: refused, one line."""
    out = tmp_path / "fixed"
    assert main(["train", "--data", str(text), "--seq-len", "8", "--micro-batch-size", "2", "--effective-batch-size",
                 "4", "--max-steps", "2", "--checkpoint-every", "1", "--val-fraction", "0", "--lr", "3e-3", "--noise-scale-ema",
                 "0.8", "--out", str(out)]) == 0
    capsys.readouterr()
    status = main(adaptive_args(text, out, "--resume"))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("cadence: error: --effective-batch-size: adaptive cannot continue "
                                                   "a run trained at a fixed batch"), err


def test_a_short_adaptive_run_states_its_batch_everywhere(text: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The fast tier's adaptive run (4 windows, too few to decide): the policy at the start, the batch on the progress
    line, the metrics fields, summary.json's adaptive_batch, and the report's plot of batch, noise scale and LR."""
    from cadence.rebuild import build_report

    out = tmp_path / "run"
    assert main([*adaptive_args(text, out, "--log-every", "1")[:-2], "--max-steps", "4", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "batch: adaptive effective batch from 4 to 16 sequences" in err and "| batch 4 |" in err
    rows = read_metrics(out)
    assert [row["effective_batch"] for row in rows] == [4, 4, 4, 4]
    assert {row["batch_decision"] for row in rows} == {"hold"}
    assert rows[0]["batch_reason"].startswith("1 of 8 windows measured") or "no noise-scale" in rows[0]["batch_reason"]
    assert all(row["lr_batch_scale"] == 1.0 and row["next_effective_batch"] == 4 for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adaptive_batch"] == {"effective_batch_size": "adaptive", "min_effective_batch_size": 4,
                                         "max_effective_batch_size": 16, "batch_lr_scaling": "sqrt",
                                         "final_effective_batch": 4, "switches": []}
    assert out / "report-adaptive-batch.png" in build_report(out)


def test_a_lora_run_defaults_to_a_maximum_of_32_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    """"LoRA Without Regret": a LoRA run's adaptive batch is at most 32 sequences unless --max-effective-batch-size is
    given, and the run says so at the start."""
    pytest.importorskip("peft")
    sizes = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 256, "max_position_embeddings": 64}
    llama = ["--model", "hf:llama", *[item for key, value in sizes.items() for item in ("--model-config",
                                                                                         f"{key}={value}")]]
    out = tmp_path / "lora"
    assert main(["train", *llama, "--lora-rank", "4", "--seq-len", "16", "--micro-batch-size", "2",
                 "--effective-batch-size", "adaptive", "--min-effective-batch-size", "4", "--max-steps", "2",
                 "--val-fraction", "0", "--out", str(out), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "adaptive effective batch from 4 to 32 sequences" in err
    assert "LoRA: at most 32 unless --max-effective-batch-size is given" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["adaptive_batch"]["max_effective_batch_size"] == 32


def test_an_unresolved_average_is_no_measurement() -> None:
    """The controller's measurement from the engine's noise scale: its estimate in sequences when there is one; none
    while either average is not positive (the signal or the noise unresolved: counting an unresolved signal as a
    critical batch far above was measured and dropped, docs/adaptive_batch.md), and none with no noise scale (a ramp)."""
    from cadence.engine.adaptive_batch import AdaptiveBatch
    from cadence.engine.noise_scale import GradientNoiseScale
    from cadence.engine.schedules import BatchScaledLR
    from cadence.training.adaptive_batch import BatchController

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = BatchScaledLR(optimizer, schedule="constant", warmup_steps=0, max_steps=10)
    noise = GradientNoiseScale(ema=0.9)
    controller = BatchController(AdaptiveBatch(minimum=4, maximum=16), scheduler=scheduler, optimizer=optimizer,
                                 noise_scale=noise, beta2=None, budget=10)
    result = type("Result", (), {"skipped": False})()

    def measured(trace: float, grad_sq: float) -> float | None:
        # the averages as the windows left them: tr(Sigma), |G|^2, samples, targets, tokens
        noise.load_state_dict({"ema": 0.9, "windows": 12, "averages": [trace, grad_sq, 4.0, 32.0, 32.0]})
        return controller._measured(result).critical  # type: ignore[arg-type]

    assert measured(8.0, 1.0) == pytest.approx(8.0 / 8)  # 8 targets per sequence: 1 sequence
    assert measured(8.0, -0.5) is None
    assert measured(-1.0, 1.0) is None
    controller.noise_scale = None
    assert controller._measured(result).critical is None  # type: ignore[arg-type]
