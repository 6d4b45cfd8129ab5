"""Issue 30 item 7: what a Transformers Trainer user reaches for: --epochs, validation perplexity, --eval-data,
--keep-best and --early-stop-after."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import run_cli, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.engine.step import Engine
from cadence.training.run_dir import read_metrics


def _common(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--seq-len", "64", "--too-long", "truncate", "--micro-batch-size", "4",
            "--grad-accum-steps", "2", "--out", str(out), *extra]


def test_epochs_set_the_steps_from_the_data_and_the_schedule_runs_over_them(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", 52)  # 52 examples, 5% held out: 50 train, windows of 8: 7 per epoch
    out = tmp_path / "run"
    assert main(_common(data, out, "--epochs", "2", "--lr-schedule", "linear")) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = read_metrics(out)
    assert summary["steps"] == len(rows) == 14 and summary["epochs"] == 2
    assert [row["epoch"] for row in rows] == [0] * 7 + [1] * 7
    config = json.loads((out / "config.json").read_text())
    assert config["epochs"] == 2 and config["max_steps"] == 14
    # Decayed over the 14 steps (over the default 100 it would still be near --lr): one step from the floor.
    assert rows[-1]["lr"] == pytest.approx(config["lr"] * (0.1 + 0.9 / 14))


def test_epochs_and_max_steps_together_are_refused(tmp_path: Path) -> None:
    status, _, err = run_cli(_common(write_jsonl(tmp_path / "d.jsonl", 16), tmp_path / "run", "--epochs", "1",
                                     "--max-steps", "5"))
    assert status == 2 and "--epochs" in err and "--max-steps" in err


def test_validation_perplexity_and_a_separate_evaluation_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, held = write_jsonl(tmp_path / "train.jsonl", 40), write_jsonl(tmp_path / "held.jsonl", 12)
    out = tmp_path / "run"
    assert main(_common(train, out, "--max-steps", "4", "--eval-every", "2", "--eval-data", str(held))) == 0
    rows = read_metrics(out)
    evaluated = [row for row in rows if row.get("val_loss") is not None]
    assert [row["step"] for row in evaluated] == [2, 4]
    assert all(row["val_perplexity"] == pytest.approx(math.exp(row["val_loss"])) for row in evaluated)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_perplexity"] == pytest.approx(math.exp(summary["final_val_loss"]))
    assert summary["samples"] == 4 * 8  # every window drawn from all 40 training examples: none held out
    config = json.loads((out / "config.json").read_text())
    assert "evaluated on" in config["data_description"]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert len(events.Scalars("val/perplexity")) == 2
    status, _, err = run_cli(_common(train, tmp_path / "bad", "--eval-every", "2", "--eval-data",
                                     str(tmp_path / "missing.jsonl")))
    assert status == 2 and "--eval-data" in err


def test_early_stop_and_keep_best(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Scripted validation losses (3.0, 2.0, 2.5, 2.6, ...): the best is the second evaluation (step 4); with
    --early-stop-after 2 the run stops at the fourth (step 8), and OUT/best holds step 4's weights, which the
    checkpoint of step 4 also holds."""
    losses = iter([3.0, 2.0, 2.5, 2.6, 2.7, 2.8])
    monkeypatch.setattr(Engine, "evaluate", lambda self, batches: next(losses))
    data = write_jsonl(tmp_path / "data.jsonl", 64)
    out = tmp_path / "run"
    assert main(_common(data, out, "--max-steps", "20", "--eval-every", "2", "--early-stop-after", "2",
                        "--keep-best", "--checkpoint-every", "2")) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["stopped_by"].startswith("early stop: 2 evaluations")
    assert (summary["best_val_loss"], summary["best_val_step"]) == (2.0, 4)
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["step"] == 4 and best["val_loss"] == 2.0
    kept, checkpointed = (load_file(str(path)) for path in (out / "best" / "model.safetensors",
                                                              out / "checkpoints" / "step-4" / "model.safetensors"))
    assert kept.keys() == checkpointed.keys() and all((kept[k] == checkpointed[k]).all() for k in kept)
    status, _, err = run_cli(_common(data, tmp_path / "x", "--keep-best"))
    assert status == 2 and "--keep-best" in err
    status, _, err = run_cli(_common(data, tmp_path / "y", "--early-stop-after", "2"))
    assert status == 2 and "--early-stop-after" in err


def test_the_console_s_evaluated_count_is_the_examples_used_and_best_follows_that_figure(tmp_path, monkeypatch):
    """Issue 41 item 5: the console said "evaluated on 250 examples" while --eval-batches 20 used a slice. Now the
    whole validation set by default, the console states how many examples each evaluation reads, --eval-batches N
    is said as what it is, and --keep-best decides on the figure logged (the same evaluate call's)."""
    import io
    import re

    seen: list[int] = []
    real = Engine.evaluate

    def counting(self, batches):
        seen.append(sum(int((batch["labels"] != -100).any(dim=1).sum()) for batch in batches))
        return real(self, batches)

    monkeypatch.setattr(Engine, "evaluate", counting)
    data = write_jsonl(tmp_path / "data.jsonl", 64)
    stream = io.StringIO()
    from cadence.config.sources import build_config
    from cadence.training.loop import train

    args = {"data": data, "seq_len": 64, "too_long": "truncate", "micro_batch_size": 2, "grad_accum_steps": 2,
            "max_steps": 4, "eval_every": 2, "keep_best": True, "out": tmp_path / "run"}
    summary = train(build_config(toml_path=None, flags=args), stream=stream, live=False)
    said = int(re.search(r"evaluation: every 2 steps on (\d+) validation examples \(all of them\)",
                         stream.getvalue()).group(1))
    assert said == seen[0] == 3  # 5% of 64 held out (the last 3 examples), every one evaluated
    rows = [row for row in read_metrics(tmp_path / "run") if row.get("val_loss") is not None]
    best = min(rows, key=lambda row: row["val_loss"])
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["val_loss"] == best["val_loss"]
    assert summary["best_val_loss"] == best["val_loss"]
    stream = io.StringIO()
    train(build_config(toml_path=None, flags={**args, "eval_batches": 1, "out": tmp_path / "slice"}), stream=stream,
          live=False)
    assert "on 2 validation examples (the first 1 micro-batches of 3: --eval-batches)" in stream.getvalue()


def test_nothing_is_held_out_when_nothing_evaluates(tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", 40)
    assert main(_common(data, tmp_path / "run", "--max-steps", "1")) == 0
    assert "validation" not in json.loads((tmp_path / "run" / "config.json").read_text())["data_description"]
