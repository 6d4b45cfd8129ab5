"""The command line's own help: grouped flags with their choices, usage instead of errors where nothing was asked,
and a typo answered with the flag it was meant to be."""

from __future__ import annotations

import dataclasses

import pytest

from cadence.cli import OPTION_GROUPS, main
from cadence.config import TrainConfig


def test_every_training_flag_is_in_exactly_one_help_group() -> None:
    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert len(grouped) == len(set(grouped))
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    assert fields <= set(grouped), sorted(fields - set(grouped))
    assert set(grouped) - fields == {"config_file", "nproc_per_node"}  # the CLI's own training flags


def test_train_help_is_grouped_and_shows_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert headings == [*OPTION_GROUPS, "Other"]
    for shown in ("--precision [fp32|bf16|fp16]", "--activation-checkpointing [none|full|selective]",
                  "--lr-schedule [constant|linear|cosine]", "--strategy [ddp|fsdp]", "--micro-batch-size N|auto"):
        assert shown in text, shown


def test_a_command_lists_its_own_options_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.index("Profile options:") < text.index("Data:") and "--compare RUN_A RUN_B" in text


@pytest.mark.parametrize(("argv", "shown"), [
    ([], "Commands:"),
    (["report"], "a profile directory (cadence profile)"),
])
def test_asking_for_nothing_shows_the_usage_not_an_error(argv: list[str], shown: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Usage: cadence") and captured.err == ""
    assert shown in " ".join(captured.out.split())  # as wrapped to any terminal width


@pytest.mark.parametrize(("typo", "meant"), [("--lr-shedule", "--lr-schedule"), ("--precison", "--precision"),
                                             ("--max-step", "--max-steps")])
def test_a_mistyped_flag_is_answered_with_the_closest_flag_only(typo: str, meant: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", typo, "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith(f"did you mean {meant}?"), err
    assert err.count("--") == 3  # the typo, the help pointer, the suggestion: nothing else offered


def test_a_flag_like_no_other_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--wibble", "1"]) == 2
    err = capsys.readouterr().err
    assert "--wibble: no such option (see cadence verify --help)" in err and "did you mean" not in err
