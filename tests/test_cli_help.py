"""The command line's own help: grouped flags with their choices, usage instead of errors where nothing was asked,
and a typo answered with the flag it was meant to be."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from cadence.cli import EVERYDAY_TITLE, OTHER_OPTION_SECTIONS, app, main
from cadence.config import TrainConfig
from cadence.config.commands import PlanOptions, PrepareDataOptions, ProfileOptions, VerifyOptions
from cadence.config.schema import EVERYDAY, SECTIONS, Section, command_fields, flag


def test_every_training_flag_has_one_section_and_the_help_shows_them_all() -> None:
    for field in dataclasses.fields(TrainConfig):
        assert isinstance(field.metadata.get("section"), Section), field.name
    titles = [section.title for section in SECTIONS]
    assert len(titles) == len(set(titles))
    assert {field.metadata["section"] for field in dataclasses.fields(TrainConfig)} == set(SECTIONS)
    assert set(OTHER_OPTION_SECTIONS) == {"config_file", "nproc_per_node", "max_restarts"}  # the CLI's own training flags


@pytest.mark.parametrize(("command", "own"), [("train", None), ("plan", PlanOptions), ("profile", ProfileOptions),
                                              ("verify", VerifyOptions), ("prepare-data", PrepareDataOptions)])
def test_a_command_takes_exactly_the_flags_of_its_sections(command: str, own: type | None) -> None:
    """Which train flags a command takes comes from the schema's sections alone: the command's options are its
    own options dataclass's plus the fields of the sections that name it."""
    options = {name for param in app.commands[command].params for name in param.opts}
    own_names = {f.name for f in dataclasses.fields(own)} if own else set()
    for name in (f.name for f in dataclasses.fields(TrainConfig)):
        if name not in own_names:  # prepare-data's --out is its own (a store directory), not train's
            assert (flag(name) in options) == (name in command_fields(command)), (command, name)


@pytest.mark.parametrize(("command", "takes", "refuses"), [
    # Every command that runs a step takes the model, data, batch, cut and precision of a run.
    ("plan", ["--model-config", "--packing", "--micro-batch-tokens", "--fp32-matmul", "--lr-schedule"],
     ["--compile", "--resume", "--max-steps", "--strategy"]),
    ("profile", ["--model-config", "--packing", "--compile", "--prefetch-windows", "--plan"],
     ["--resume", "--max-steps", "--eval-every"]),
    ("verify", ["--model-config", "--packing", "--micro-batch-order", "--weight-decay", "--strategy"],
     ["--memory-budget", "--fp32-matmul", "--lr-schedule", "--out", "--plan"]),
    ("prepare-data", ["--model", "--text-field", "--seq-len"], ["--packing", "--precision"]),
])
def test_what_each_command_takes(command: str, takes: list[str], refuses: list[str]) -> None:
    options = {name for param in app.commands[command].params for name in param.opts}
    assert set(takes) <= options and not set(refuses) & options


def test_train_help_is_grouped_and_shows_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    headings = [line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    # A section whose flags are all everyday ones (Output: --out) has no heading of its own.
    rest = {f.metadata["section"] for f in dataclasses.fields(TrainConfig) if f.name not in EVERYDAY}
    rest |= set(OTHER_OPTION_SECTIONS.values())
    assert headings == [EVERYDAY_TITLE, *(section.title for section in SECTIONS if section in rest), "Other"]
    # The everyday flags come first, in their order, and are not repeated under their sections.
    everyday = text[:text.index("\nModel:")]
    starts = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert [start for start in starts if start in map(flag, EVERYDAY)] == [flag(name) for name in EVERYDAY]
    assert all(f"\n  {flag(name)} " in everyday for name in EVERYDAY)
    for shown in ("--precision [fp32|bf16|fp16]", "--activation-checkpointing [none|full|selective]",
                  "--lr-schedule [constant|linear|cosine]", "--strategy [ddp|fsdp]", "--micro-batch-size N|auto"):
        assert shown in text, shown


def test_a_command_lists_its_own_options_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.index("Profile options:") < text.index(EVERYDAY_TITLE) < text.index("Data:")
    assert "--compare RUN_A RUN_B" in text


HELPS = [["--help"], ["--version"], *([command, "--help"] for command in app.commands)]


def test_no_help_imports_torch() -> None:
    """Issue 41: a help took 5 s, most of it importing torch before click answered. Every help (and --version) is
    asked in one fresh interpreter each, and none may import torch, numpy, transformers or safetensors: a module
    added to a help's imports that pulls them in fails here (its time is in BENCHMARKS.md, not asserted)."""
    script = (
        "import sys, io, contextlib\n"
        "from cadence.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    status = main(sys.argv[1:])\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers', 'safetensors', 'datasets') if m in sys.modules)\n"
        "print(status, len(out.getvalue().splitlines()), ','.join(heavy))\n")
    for argv in HELPS:
        shown = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, check=True)
        status, lines, heavy = (shown.stdout.split(" ") + [""])[:3]
        assert (status, heavy.strip()) == ("0", ""), (argv, shown.stdout, shown.stderr)
        assert int(lines) >= 1, argv


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
