"""Issue 51 item 5, through `cadence train`: for every optimizer, a run stopped mid-window (SIGTERM, a mid-window
checkpoint) or killed (SIGKILL, the last checkpoint) and resumed is the uninterrupted run bit for bit, and two ranks
give the weights of one process on uneven data.

The SIGTERM case of one optimizer runs in make test (in this process); the rest start processes: make test-slow."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import relative_l2, run_cli, sigterm_at, spawn, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.optim.choices import OPTIMIZERS
from cadence.training.run_dir import read_metrics

FAST = "sgd"
"""The optimizer whose mid-window resume runs in make test (the others' in make test-slow)."""
TOLERANCE = {"adamw": 1e-5, "muon": 1e-5, "schedule-free": 1e-5}
"""Relative L2 of two ranks' weights against one process's: 1e-6; 1e-5 where AdamW steps (Muon's embeddings too), whose
first steps turn rounding-level gradient differences of tiny gradients into update-sized ones (test_optimizers.py;
measured here: Muon 1.1e-6, AdamW, SGD, Adafactor under 1e-6)."""
LR = {"adamw": "3e-3", "sgd": "0.1", "adafactor": "1e-2", "muon": "1e-2", "schedule-free": "3e-3"}


def flags(name: str, data: Path, *extra: str, steps: int = 6) -> list[str]:
    schedule = ["--lr-schedule", "constant"] if name == "schedule-free" else []
    return ["--data", str(data), "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum-steps", "4",
            "--max-steps", str(steps), "--lr", LR[name], "--warmup-steps", "2", "--val-fraction", "0",
            "--checkpoint-every", "2", "--too-long", "truncate", "--optimizer", name, *schedule, *extra]


def same_run(a: Path, b: Path) -> None:
    assert [r["loss"] for r in read_metrics(a)] == [r["loss"] for r in read_metrics(b)]
    mine, theirs = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[name], theirs[name]) for name in theirs)


def every_optimizer(fast: str | None = None) -> list:
    return [name if name == fast else pytest.param(name, marks=pytest.mark.slow) for name in OPTIMIZERS]


@pytest.mark.parametrize("name", every_optimizer(fast=FAST))
def test_a_mid_window_stop_resumes_bitwise(tmp_path: Path, name: str) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")
    common = flags(name, data, "--checkpoint-mid-window", steps=3)
    assert main(["train", *common, "--out", str(tmp_path / "whole")]) == 0
    with sigterm_at(step=2, micro=1):  # step 3's first micro-batch done: its window is cut in two
        main(["train", *common, "--out", str(tmp_path / "cut")])
    assert len(read_metrics(tmp_path / "cut")) == 2
    assert main(["train", *common, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    same_run(tmp_path / "cut", tmp_path / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_sigkill_then_resume_is_bitwise_the_uninterrupted_run(tmp_path: Path, name: str) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")
    common = flags(name, data, steps=8)
    assert main(["train", *common, "--out", str(tmp_path / "whole")]) == 0
    cut = ["train", *common, "--out", str(tmp_path / "cut")]
    process = spawn(cut)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    started = time.monotonic()
    # Killed after its third step's row: the step-2 checkpoint is the one to resume from.
    while process.poll() is None and (len(metrics.read_text().splitlines()) if metrics.exists() else 0) < 3:
        assert time.monotonic() - started < 240
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    assert main([*cut, "--resume"]) == 0
    same_run(tmp_path / "cut", tmp_path / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_two_ranks_give_the_weights_of_one_process(tmp_path: Path, name: str) -> None:
    """DDP 2 ranks x 2 x 4 against one process at 2 x 8, on prompt/completion data where the ranks hold different
    target counts in every window."""
    data = write_jsonl(tmp_path / "examples.jsonl")
    common = flags(name, data)
    result = subprocess.run([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", *common,
                             "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    one = [*common, "--out", str(tmp_path / "one")]
    one[one.index("--grad-accum-steps") + 1] = "8"
    assert main(["train", *one]) == 0
    two, single = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in single], rel=1e-6)
    assert relative_l2(load_file(str(tmp_path / "two" / "model.safetensors")),
                       load_file(str(tmp_path / "one" / "model.safetensors"))) < TOLERANCE.get(name, 1e-6)


def test_a_resume_that_changes_the_optimizer_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                                  ) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")
    short = ["--grad-accum-steps", "1", "--warmup-steps", "0"]  # later flags win: one micro-batch per step
    assert main(["train", *flags("sgd", data, steps=2), *short, "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    assert main(["train", *flags("adafactor", data, steps=4), *short, "--lr", LR["sgd"], "--out",
                 str(tmp_path / "run"), "--resume"]) == 2  # the same --lr: the optimizer is the one change
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("cadence: error:")]
    assert len(lines) == 1 and "--optimizer: 'adafactor' differs from the checkpoint's 'sgd'" in lines[0], err
    # Nothing written: the run directory is byte for byte what the first run left.
    assert {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("name", every_optimizer())
def test_verify_proves_accumulation_for_every_optimizer(name: str) -> None:
    """`cadence verify --optimizer X`: k micro-batches give the big batch's gradient, and K steps of X the big batch's
    parameters (verify steps at the peak LR, without a schedule)."""
    status, out, err = run_cli(["verify", "--optimizer", name, "--micro-batch-size", "2", "--grad-accum-steps", "4",
                                "--seq-len", "32", "--precision", "fp32", "--steps", "2", "--lr", LR[name]])
    assert status == 0, err
    assert "parameters after 2 steps" in out and out.rstrip().endswith("PASS")


@pytest.mark.slow
def test_profile_shows_the_optimizer_steps_own_time(tmp_path: Path) -> None:
    """Muon's Newton-Schulz is part of the optimizer step: profile.json's optimizer_step phase holds it."""
    status, _, err = run_cli(["profile", "--optimizer", "muon", "--micro-batch-size", "2", "--seq-len", "32",
                              "--steps", "2", "--out", str(tmp_path / "profile")])
    assert status == 0, err
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert profile["config"]["optimizer"] == "muon"
    step = profile["phases"]["optimizer_step"]
    assert len(step["per_step"]) == 2 and step["share"] > 0
    # Newton-Schulz's own time, inside the optimizer step: once per block matrix per step (gpt-tiny: 5 blocks x 4).
    newton_schulz = profile["optimizer_regions"]["newton_schulz"]
    assert newton_schulz["calls"] == 2 * 5 * 4
    assert 0 < newton_schulz["total_time_s"] <= sum(step["per_step"])
    report = (tmp_path / "profile" / "report.md").read_text()
    assert "Inside the optimizer step" in report and "`newton_schulz`: 40 calls" in report
