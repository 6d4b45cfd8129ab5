"""--effective-batch-size adaptive's flags: bad input is one line naming the flag, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.cli import main

FAST = ["--max-steps", "1", "--seq-len", "16", "--micro-batch-size", "2"]
ADAPTIVE = ["--effective-batch-size", "adaptive"]

CASES = [
    # (id, arguments, the flag named, words of the message)
    ("min-above-max", [*ADAPTIVE, "--min-effective-batch-size", "16", "--max-effective-batch-size", "8"],
     "--max-effective-batch-size", "below --min-effective-batch-size 16"),
    ("max-not-a-multiple", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size", "10"],
     "--max-effective-batch-size", "not a multiple"),
    ("min-not-a-multiple-of-micro", [*ADAPTIVE, "--min-effective-batch-size", "5", "--max-effective-batch-size", "20"],
     "--min-effective-batch-size", "not a multiple of --micro-batch-size"),
    ("min-one-micro-batch", [*ADAPTIVE, "--min-effective-batch-size", "2", "--max-effective-batch-size", "8"],
     "--min-effective-batch-size", "needs two sizes"),
    ("no-bounds", ADAPTIVE, "--effective-batch-size", "between --min-effective-batch-size"),
    ("no-min", [*ADAPTIVE, "--max-effective-batch-size", "16"], "--min-effective-batch-size", "is required"),
    ("no-max", [*ADAPTIVE, "--min-effective-batch-size", "4"], "--max-effective-batch-size", "is required"),
    ("fixed-accumulation", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size", "16",
                            "--grad-accum-steps", "2"], "--grad-accum-steps", "contradicts"),
    ("auto-micro-batch", ["--effective-batch-size", "adaptive", "--min-effective-batch-size", "4",
                          "--max-effective-batch-size", "16", "--micro-batch-size", "auto"],
     "--micro-batch-size", "auto does not combine"),
    ("noise-scale-off", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size", "16",
                         "--noise-scale-ema", "0"], "--noise-scale-ema", "turns off"),
    ("mid-window-checkpoint", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size", "16",
                               "--checkpoint-mid-window"], "--checkpoint-mid-window", "does not combine"),
    ("bad-lr-scaling", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size", "16",
                        "--batch-lr-scaling", "cube"], "--batch-lr-scaling", "not one of sqrt, linear, none"),
    ("min-without-adaptive", ["--min-effective-batch-size", "4"], "--min-effective-batch-size",
     "applies only with --effective-batch-size adaptive"),
    ("lr-scaling-without-adaptive", ["--batch-lr-scaling", "sqrt"], "--batch-lr-scaling", "applies only"),
    ("branch-test-without-adaptive", ["--batch-branch-test", "2"], "--batch-branch-test", "applies only"),
    ("branch-test-zero", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size", "16",
                          "--eval-every", "5", "--batch-branch-test", "0"], "--batch-branch-test",
     "must be at least 1 window"),
    ("branch-test-without-validation", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size",
                                        "16", "--batch-branch-test", "2"], "--batch-branch-test", "give --eval-every"),
    ("branch-tolerance-without-test", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size",
                                       "16", "--batch-branch-tolerance", "0.1"], "--batch-branch-tolerance",
     "applies only with --batch-branch-test"),
    ("branch-tolerance-not-finite", [*ADAPTIVE, "--min-effective-batch-size", "4", "--max-effective-batch-size",
                                     "16", "--eval-every", "5", "--batch-branch-test", "2",
                                     "--batch-branch-tolerance", "nan"], "--batch-branch-tolerance", "finite"),
    ("a-word-that-is-not-a-batch", ["--effective-batch-size", "adaptiv"], "--effective-batch-size",
     "neither a whole number nor auto nor adaptive"),
]


RAMP = ["--effective-batch-size", "ramp", "--min-effective-batch-size", "4", "--max-effective-batch-size", "16"]
CASES += [
    ("ramp-without-tokens", RAMP, "--batch-ramp-tokens", "is required with --effective-batch-size ramp"),
    ("ramp-tokens-without-ramp", ["--batch-ramp-tokens", "1024"], "--batch-ramp-tokens",
     "applies only with --effective-batch-size ramp"),
    ("ramp-tokens-with-adaptive", [*ADAPTIVE, *RAMP[2:], "--batch-ramp-tokens", "1024"], "--batch-ramp-tokens",
     "applies only with --effective-batch-size ramp"),
    ("ramp-tokens-not-numbers", [*RAMP, "--batch-ramp-tokens", "64k"], "--batch-ramp-tokens",
     "not a list of whole token counts"),
    ("ramp-tokens-not-increasing", [*RAMP, "--batch-ramp-tokens", "2048,1024"], "--batch-ramp-tokens",
     "positive and increasing"),
    ("ramp-past-the-maximum", [*RAMP, "--batch-ramp-tokens", "64,128,256"], "--batch-ramp-tokens",
     "doubles 3 times from 4, but --max-effective-batch-size 16 leaves room for 2"),
    ("ramp-with-branch-test", [*RAMP, "--batch-ramp-tokens", "64", "--eval-every", "5", "--batch-branch-test", "2"],
     "--batch-branch-test", "a preset ramp grows when its token counts say"),
    ("ramp-with-fixed-accumulation", [*RAMP, "--batch-ramp-tokens", "64", "--grad-accum-steps", "2"],
     "--grad-accum-steps", "contradicts --effective-batch-size ramp"),
]


@pytest.mark.parametrize(("args", "where", "words"), [pytest.param(a, w, m, id=i) for i, a, w, m in CASES])
def test_bad_adaptive_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], where: str,
                            words: str) -> None:
    out = tmp_path / "run"
    status = main(["train", "--out", str(out), *FAST, *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert where in lines[0] and words in lines[0], lines[0]
    assert not out.exists()


def test_plan_adaptive_needs_its_range_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """cadence plan plans adaptive over a range: without the range it is refused by the config's validation, one
    line."""
    status = main(["plan", "--out", str(tmp_path / "plan"), "--seq-len", "16", "--memory-budget", "1GiB",
                   "--effective-batch-size", "adaptive"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert "--effective-batch-size" in lines[0] and "--min-effective-batch-size" in lines[0], lines[0]
