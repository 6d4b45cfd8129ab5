"""--batch-branch-test in a run: a grow is kept or rolled back by two branches from an in-memory snapshot, and the run
after it is exactly the run that made that choice without a branch (bitwise), through a resume too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import sample_text
from safetensors.torch import load_file

from cadence.cli import main
from cadence.training.run_dir import read_metrics

SWITCH = 21
"""The step after which this data grows 4 -> 8 (as tests/training/test_adaptive_batch.py's run: the same data)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The training text of test_adaptive_batch.py's run (so it grows at step 21) and a separate validation file
    (--eval-data: a held-out split would change the training data)."""
    folder = tmp_path_factory.mktemp("branch")
    (folder / "text.txt").write_bytes(sample_text(16000))
    (folder / "eval.txt").write_bytes(sample_text(3000)[::-1])
    return folder / "text.txt", folder / "eval.txt"


def args(data: tuple[Path, Path], out: Path, *extra: str, maximum: int = 16) -> list[str]:
    return ["train", "--data", str(data[0]), "--eval-data", str(data[1]), "--eval-every", "100", "--seq-len", "8",
            "--micro-batch-size", "2", "--effective-batch-size", "adaptive", "--min-effective-batch-size", "4",
            "--max-effective-batch-size", str(maximum), "--max-steps", "30", "--noise-scale-ema", "0.8",
            "--val-fraction", "0", "--lr", "3e-3", "--out", str(out), "--device", "cpu", *extra]


KEEP = ("--batch-branch-test", "2", "--batch-branch-tolerance", "1e9")
"""A tolerance no probe loss exceeds: the branch test keeps the grow (the comparison still runs)."""
LOSE = ("--batch-branch-test", "2", "--batch-branch-tolerance", "-1e9")
"""A tolerance no probe loss meets: the branch test rolls the grow back."""


def _same_weights(a: Path, b: Path) -> None:
    weights_a, weights_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


def _losses(run: Path) -> list[tuple[int, float, float, int]]:
    return [(row["step"], row["loss"], row["lr"], row["effective_batch"]) for row in read_metrics(run)]


@pytest.fixture(scope="module")
def kept(data: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("branch") / "kept"
    assert main(args(data, out, *KEEP)) == 0
    return out


@pytest.mark.slow  # two 26-step runs and a branch: about 30 s
def test_a_kept_branch_leaves_the_run_that_grew_without_one(kept: Path, data: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    """The grow kept after its branch test: every step's loss and LR and the final weights are bitwise those of the
    run without a branch test; the test's figures (both probe losses, its tokens and time) are in summary.json."""
    plain = tmp_path / "plain"
    assert main(args(data, plain)) == 0
    assert _losses(kept) == _losses(plain)
    _same_weights(kept, plain)
    batch = json.loads((kept / "summary.json").read_text())["adaptive_batch"]
    (test,) = batch["branch_tests"]
    assert test["step"] == SWITCH and test["kept"] and (test["from"], test["to"], test["windows"]) == (4, 8, 2)
    # the larger branch: 2 windows of 8; the current one: 4 windows of 4; 8 tokens a sequence, 2 x 16 sequences
    assert batch["branch_tokens"] == test["tokens"] == 2 * 16 * 8 and batch["branch_time_s"] > 0
    row = read_metrics(kept)[SWITCH - 1]
    assert row["batch_decision"] == "grow" and "branch test kept: probe loss" in row["batch_reason"]


@pytest.mark.slow  # two 30-step runs and a branch: about 30 s
def test_a_lost_branch_rolls_back_to_the_run_that_never_grew(data: tuple[Path, Path], tmp_path: Path) -> None:
    """The grow rolled back: the run holds at 4 (its hold-off outlasts the 30 windows) and is bitwise the run whose
    maximum is 4; metrics.jsonl says why, with both probe losses."""
    lost, never = tmp_path / "lost", tmp_path / "never"
    assert main(args(data, lost, *LOSE)) == 0
    assert main(args(data, never, maximum=4)) == 0
    assert _losses(lost) == _losses(never)
    _same_weights(lost, never)
    row = read_metrics(lost)[SWITCH - 1]
    assert row["batch_decision"] == "hold" and row["next_effective_batch"] == 4
    assert row["batch_reason"].startswith("branch test lost: probe loss ") and "no grow for 16 windows" in \
        row["batch_reason"]
    batch = json.loads((lost / "summary.json").read_text())["adaptive_batch"]
    assert batch["switches"] == [] and [test["kept"] for test in batch["branch_tests"]] == [False]


@pytest.mark.slow  # a run with a checkpoint per step, resumed twice: about 40 s
def test_resume_after_and_before_a_branch_is_bitwise(kept: Path, data: tuple[Path, Path], tmp_path: Path) -> None:
    """Resumed from the checkpoint of the step whose decision ran the branch test (the controller's branch record is
    in it), or from two steps before it (the resumed run tests again): the uninterrupted run, bitwise."""
    from cadence.training.checkpoint import checkpoint_dirs

    out = tmp_path / "cut"
    assert main(args(data, out, *KEEP, "--checkpoint-every", "1")) == 0
    for at in (SWITCH, SWITCH - 2):
        for path in checkpoint_dirs(out):
            if int(path.name.split("-")[1]) > at:
                shutil.rmtree(path)
        assert main(args(data, out, *KEEP, "--checkpoint-every", "1", "--resume")) == 0
        assert _losses(out) == _losses(kept)
        _same_weights(out, kept)
        tests = json.loads((out / "summary.json").read_text())["adaptive_batch"]["branch_tests"]
        assert [(test["step"], test["kept"]) for test in tests] == [(SWITCH, True)]
