"""End to end through `cadence.cli.main`: a tiny real run and the run directory of DESIGN.md section 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli, sample_text

from cadence.training.noise_scale import batch_side
from cadence.training.run_dir import read_metrics

METRIC_FIELDS = ("step", "micro_steps", "samples", "tokens", "loss", "grad_norm", "lr", "loss_scale", "skipped",
                 "step_time_s", "tokens_per_s", "peak_memory_bytes")
PARAGRAPH = (
    "A window is the set of micro-batches that make one optimizer step. Gradients are accumulated in fp32 over the "
    "window and divided by the number of target tokens in it, so the step does not depend on how the window was "
    "cut into micro-batches. The loss scale only exists in fp16.\n"
)
RUN_FLAGS = ["--seq-len", "32", "--micro-batch-size", "4", "--grad-accum-steps", "2"]


def _text_file(directory: Path) -> Path:
    path = directory / "tiny.txt"
    path.write_text(PARAGRAPH * 16, encoding="utf-8")  # ~4.4 KB: ~130 sequences of 32 bytes
    return path


def _metrics(run: Path) -> list[dict]:
    return read_metrics(run)


def _no_hidden_leftovers(root: Path) -> None:
    hidden = [str(p.relative_to(root)) for p in root.rglob(".*")]
    assert not hidden, f"temporary files left behind: {hidden}"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    base = tmp_path_factory.mktemp("train")
    out = base / "run"
    status, _, err = run_cli(["train", "--data", str(_text_file(base)), "--out", str(out), *RUN_FLAGS,
                           "--max-steps", "4", "--eval-every", "2"])
    return out, status, err


def test_exits_0_and_says_where(run: tuple[Path, int, str]) -> None:
    out, status, err = run
    assert status == 0, err
    assert "Traceback" not in err and "error" not in err.lower()
    assert str(out) in err


def test_config_json(run: tuple[Path, int, str]) -> None:
    out, status, err = run
    assert status == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["effective_batch_size"] == 8
    assert config["world_size"] == 1
    assert config["grad_accum_steps"] == 2
    assert config["micro_batch_size"] == 4 and config["seq_len"] == 32 and config["max_steps"] == 4
    assert config["model"] == "gpt-tiny" and config["precision"] == "fp32"


def test_metrics_jsonl(run: tuple[Path, int, str]) -> None:
    out, status, err = run
    assert status == 0, err
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        missing = [name for name in METRIC_FIELDS if name not in row]
        assert not missing, f"step {row.get('step')} lacks {missing}"
        assert row["loss_scale"] is None  # fp32
        assert row["skipped"] is False
        assert row["micro_steps"] == 2 and row["samples"] == 8 and row["tokens"] == 8 * 32
        assert row["loss"] > 0 and row["grad_norm"] > 0 and row["lr"] > 0
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
    assert [("val_loss" in row and row["val_loss"] is not None) for row in rows] == [False, True, False, True]
    assert all(row["val_loss"] > 0 for row in rows if "val_loss" in row)
    assert any(isinstance(row["peak_memory_bytes"], int) and row["peak_memory_bytes"] > 0 for row in rows)


def test_summary_json(run: tuple[Path, int, str]) -> None:
    out, status, err = run
    assert status == 0, err
    summary = json.loads((out / "summary.json").read_text())
    rows = _metrics(out)
    assert summary["steps"] == 4 and summary["skipped"] == 0
    assert summary["tokens"] == sum(row["tokens"] for row in rows)
    assert summary["final_loss"] == rows[-1]["loss"]
    assert summary["final_val_loss"] == rows[-1]["val_loss"]
    assert summary["wall_time_s"] > 0
    assert "tokens_per_s" in summary and "peak_memory_bytes" in summary


def test_model_safetensors_loads_strictly(run: tuple[Path, int, str]) -> None:
    from safetensors.torch import load_file

    from cadence.models import build_model

    out, status, err = run
    assert status == 0, err
    weights = load_file(str(out / "model.safetensors"))
    model = build_model("gpt-tiny")
    model.load_state_dict(weights, strict=True)
    assert set(weights) == set(model.state_dict())


def test_tensorboard_events(run: tuple[Path, int, str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, status, err = run
    assert status == 0, err
    assert list((out / "tensorboard").glob("events.out.tfevents.*")), "no event file"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"]
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == [1, 2, 3, 4]
    rows = _metrics(out)
    assert [event.value for event in losses] == pytest.approx([row["loss"] for row in rows], rel=1e-5)


def test_no_temporary_files_left(run: tuple[Path, int, str]) -> None:
    out, status, err = run
    assert status == 0, err
    _no_hidden_leftovers(out)


def test_toml_config_with_a_flag_that_wins(tmp_path: Path) -> None:
    config = tmp_path / "train.toml"
    config.write_text(f'max_steps = 2\ndata = "{_text_file(tmp_path)}"\nseq_len = 32\nmicro_batch_size = 4\n'
                      f"lr = 1\n", encoding="utf-8")  # an int for a float field is accepted
    out = tmp_path / "run"
    status, _, err = run_cli(["train", "--config", str(config), "--max-steps", "3", "--lr", "0.002", "--out", str(out)])
    assert status == 0, err
    assert [row["step"] for row in _metrics(out)] == [1, 2, 3]
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["max_steps"] == 3 and resolved["lr"] == 0.002 and resolved["micro_batch_size"] == 4
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_checkpoint_every(tmp_path: Path) -> None:
    out = tmp_path / "run"
    status, _, err = run_cli(["train", "--data", str(_text_file(tmp_path)), "--out", str(out), *RUN_FLAGS,
                           "--max-steps", "4", "--checkpoint-every", "2"])
    assert status == 0, err
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4"]  # also: no hidden staging folder
    for step in (2, 4):
        folder = checkpoints / f"step-{step}"
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.json", "manifest.json", "model.safetensors",
                                                           "training_state.json", "training_state.safetensors"]
        assert json.loads((folder / "checkpoint.json").read_text())["step"] == step
    _no_hidden_leftovers(out)


@pytest.mark.parametrize(("text", "extra"), [("-" * 2000, []), ("x" * 65, ["--packing"])], ids=["dashes", "packed-x"])
def test_text_of_one_repeated_character_trains(tmp_path: Path, text: str, extra: list[str]) -> None:
    """Issue 29 item 10: its next-token labels equal its inputs, which the one-time Hugging Face label check took for
    HF style labels (a ValueError traceback, the run directory left behind)."""
    data = tmp_path / "same.txt"
    data.write_text(text, encoding="utf-8")
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "32", "--micro-batch-size", "1",
                              "--max-steps", "2", "--out", str(tmp_path / "run"), *extra])
    assert status == 0, err
    assert "Traceback" not in err and (tmp_path / "run" / "model.safetensors").is_file()


def test_the_noise_scale_is_logged_summarised_and_placed_against_the_effective_batch(tmp_path: Path) -> None:
    """Issue 27: with accumulation a run measures the gradient noise scale: in every metrics.jsonl row, TensorBoard
    and summary.json (the last moving average and the windows it is over), and the report says which side of it the
    effective batch is on. Without accumulation the run says once why there is none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = tmp_path / "words.txt"
    data.write_bytes(sample_text(40_000))
    out = tmp_path / "run"
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "8", "--micro-batch-size", "4",
                              "--grad-accum-steps", "4", "--max-steps", "20", "--lr", "3e-3", "--val-fraction", "0",
                              "--noise-scale-ema", "0.9", "--out", str(out)])
    assert status == 0, err
    assert "gradient noise scale: measured" in err
    rows = _metrics(out)
    assert all(row["grad_noise_scale"] > 0 for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grad_noise_scale"] == rows[-1]["grad_noise_scale"]
    assert summary["grad_noise_scale_windows"] == 20 and summary["grad_noise_scale_ema"] == 0.9
    # Packed text: every sequence holds 8 tokens and 8 targets.
    assert summary["grad_noise_scale_tokens"] == pytest.approx(8 * summary["grad_noise_scale"])
    assert summary["grad_noise_scale_targets"] == pytest.approx(8 * summary["grad_noise_scale"])
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/grad_noise_scale")] == pytest.approx(
        [row["grad_noise_scale"] for row in rows], rel=1e-5)
    assert run_cli(["report", str(out)])[0] == 0
    report = (out / "report.md").read_text()
    side = batch_side(16, summary["grad_noise_scale"])
    assert (f"is {16 / summary['grad_noise_scale']:.2g}x the gradient noise scale" in report
            and ("near the critical batch" if side == "near" else f"{side} the critical batch") in report)
    assert (out / "report-noise-scale.png").is_file()

    single = tmp_path / "single"
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "8", "--micro-batch-size", "16",
                              "--max-steps", "2", "--val-fraction", "0", "--out", str(single)])
    assert status == 0, err
    assert err.count("one micro-batch per window on one process") == 1
    summary = json.loads((single / "summary.json").read_text())
    assert summary["grad_noise_scale"] is None and "accumulate" in summary["grad_noise_scale_note"]
    assert run_cli(["report", str(single)])[0] == 0
    assert "**No estimate:** one micro-batch per window" in (single / "report.md").read_text()


def test_under_packing_the_header_and_report_speak_in_what_the_cut_does(tmp_path: Path) -> None:
    """Issue 30 item 2: under --packing the header once said "4 micro-batch x 8 accumulation = 32 sequences of 1024
    tokens" and the report "32,768 tokens per optimizer step", while the windows held 2-3 micro-batches and ~6k
    tokens: now the header names the window's sequences and how each is cut, and the report the tokens the steps
    really held (metrics.jsonl) beside the most a window can hold."""
    from helpers import write_jsonl

    data = write_jsonl(tmp_path / "data.jsonl", 64)
    out = tmp_path / "run"
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "64", "--packing", "--micro-batch-size", "4",
                              "--grad-accum-steps", "4", "--max-steps", "3", "--val-fraction", "0", "--out", str(out)])
    assert status == 0, err
    assert ("effective batch = 16 sequences of up to 64 tokens per optimizer step = 4 rows x 4 accumulation x 1 "
            "process(es); each window packed into rows of 64") in err and "as many as its lengths need" in err
    assert run_cli(["report", str(out)])[0] == 0
    report = (out / "report.md").read_text()
    mean = sum(row["tokens"] for row in _metrics(out)) / 3
    assert f"{mean:,.0f} tokens per optimizer step on average (at most 1,024)" in report
    assert "micro-batches per window follow the lengths" in report


def test_a_runs_config_json_is_a_config_file_that_trains_the_same_run(tmp_path: Path) -> None:
    """Issue 30 item 7: a run's recorded configuration reused as --config (flags still win): the same math, the same
    losses, bit for bit; a JSON file that is not a cadence config.json is refused naming --config."""
    data = tmp_path / "words.txt"
    data.write_bytes(sample_text(20_000))
    first = tmp_path / "first"
    assert run_cli(["train", "--data", str(data), "--seq-len", "16", "--micro-batch-size", "2",
                    "--grad-accum-steps", "2", "--lr", "3e-3", "--max-steps", "3", "--val-fraction", "0",
                    "--out", str(first)])[0] == 0
    again = tmp_path / "again"
    status, _, err = run_cli(["train", "--config", str(first / "config.json"), "--out", str(again)])
    assert status == 0, err
    assert [row["loss"] for row in _metrics(again)] == [row["loss"] for row in _metrics(first)]
    recorded = json.loads((again / "config.json").read_text())
    assert (recorded["lr"], recorded["seq_len"], recorded["effective_batch_size"]) == (3e-3, 16, 4)
    longer = tmp_path / "longer"
    assert run_cli(["train", "--config", str(first / "config.json"), "--max-steps", "4", "--out", str(longer)])[0] == 0
    assert len(_metrics(longer)) == 4  # a flag wins over the file
    other = tmp_path / "other.json"
    other.write_text('{"lr": 0.1}')
    status, _, err = run_cli(["train", "--config", str(other), "--out", str(tmp_path / "x")])
    assert status == 2 and "--config" in err
