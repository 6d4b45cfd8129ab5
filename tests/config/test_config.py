"""config.py: the TrainConfig dataclass, TOML loading and its types, flags over TOML, validation and field help."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import get_type_hints

import pytest

from cadence.cli import main
from cadence.config import FIELD_NAMES, TrainConfig, field_help, flag, hint_types, validate
from cadence.config.sources import build_config, load_toml
from cadence.errors import UsageError


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _wheres(err: UsageError) -> list[str]:
    return [problem.where for problem in err.problems]


# ---------------------------------------------------------------------------------------------------- defaults
def test_defaults_validate() -> None:
    validate(TrainConfig(), cuda_available=False)


def test_defaults_validate_with_real_device_probe() -> None:
    validate(TrainConfig(device="cpu"))


def test_flag_spelling() -> None:
    assert flag("micro_batch_size") == "--micro-batch-size"
    assert flag("lr") == "--lr"


def test_field_names_are_the_dataclass_fields() -> None:
    assert FIELD_NAMES == tuple(f.name for f in dataclasses.fields(TrainConfig))
    assert len(set(FIELD_NAMES)) == len(FIELD_NAMES)


# ---------------------------------------------------------------------------------------------------- TOML
def test_toml_values_load_with_the_right_types(tmp_path: Path) -> None:
    path = _toml(tmp_path, """
model = "gpt-small"
data = "corpus/text.txt"
seq_len = 64
micro_batch_size = 4
effective_batch_size = 32
precision = "bf16"
lr = 3e-4
max_grad_norm = 0.5
max_steps = 10
val_fraction = 0.1
out = "runs/x"
""")
    values = load_toml(path)
    assert values == {
        "model": "gpt-small", "data": Path("corpus/text.txt"), "seq_len": 64, "micro_batch_size": 4,
        "effective_batch_size": 32, "precision": "bf16", "lr": 3e-4, "max_grad_norm": 0.5, "max_steps": 10,
        "val_fraction": 0.1, "out": Path("runs/x"),
    }
    assert isinstance(values["data"], Path) and isinstance(values["out"], Path)
    assert type(values["seq_len"]) is int and type(values["max_steps"]) is int
    assert type(values["lr"]) is float
    config = build_config(toml_path=path, flags={})
    assert config.model == "gpt-small" and config.seq_len == 64 and config.data == Path("corpus/text.txt")
    assert config.weight_decay == TrainConfig().weight_decay  # untouched fields keep their defaults


def test_int_is_accepted_for_a_float_field(tmp_path: Path) -> None:
    values = load_toml(_toml(tmp_path, "lr = 1\nmax_grad_norm = 0\n"))
    assert values == {"lr": 1.0, "max_grad_norm": 0.0}
    assert type(values["lr"]) is float and type(values["max_grad_norm"]) is float


@pytest.mark.parametrize("text", ["max_steps = 2.0", "micro_batch_size = 2.5", "max_steps = true",
                                  "seq_len = false", 'seed = "1"'])
def test_float_bool_or_string_is_rejected_for_an_int_field(tmp_path: Path, text: str) -> None:
    path = _toml(tmp_path, text + "\n")
    key = text.split(" =")[0]
    with pytest.raises(UsageError) as caught:
        load_toml(path)
    assert _wheres(caught.value) == [f"--config {path}: {key}"]
    assert "integer" in caught.value.problems[0].message


@pytest.mark.parametrize(("text", "kind"), [("lr = true", "number"), ('lr = "fast"', "number"),
                                            ("precision = 16", "string"), ("data = 3", "path string"),
                                            ("out = [1]", "path string")])
def test_wrong_types_are_rejected_naming_the_key(tmp_path: Path, text: str, kind: str) -> None:
    path = _toml(tmp_path, text + "\n")
    with pytest.raises(UsageError) as caught:
        load_toml(path)
    key = text.split(" =")[0]
    assert _wheres(caught.value) == [f"--config {path}: {key}"]
    assert caught.value.problems[0].message.endswith(f"is not a valid {kind}")


def test_every_toml_problem_is_reported(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'lr = "fast"\nlearning_rate = 1\nmax_steps = 1.5\nmodel = "gpt-tiny"\n')
    with pytest.raises(UsageError) as caught:
        load_toml(path)
    assert sorted(_wheres(caught.value)) == sorted(
        [f"--config {path}: lr", f"--config {path}", f"--config {path}: max_steps"]
    )
    assert any("'learning_rate'" in p.message for p in caught.value.problems)


def test_flag_style_key_with_dashes_is_unknown(tmp_path: Path) -> None:
    path = _toml(tmp_path, "max-steps = 3\n")
    with pytest.raises(UsageError) as caught:
        load_toml(path)
    assert "'max-steps'" in caught.value.problems[0].message


def test_missing_invalid_and_directory_config(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.toml", _toml(tmp_path, "lr = = 1\n"), tmp_path):
        with pytest.raises(UsageError) as caught:
            load_toml(path)
        assert _wheres(caught.value) == ["--config"]
    (tmp_path / "latin1.toml").write_bytes(b'model = "caf\xe9"\n')
    with pytest.raises(UsageError):
        load_toml(tmp_path / "latin1.toml")


def test_empty_toml_is_the_defaults(tmp_path: Path) -> None:
    assert build_config(toml_path=_toml(tmp_path, "# nothing\n"), flags={}) == TrainConfig()


# ---------------------------------------------------------------------------------------------------- precedence
def test_flags_win_over_toml_which_wins_over_defaults(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'max_steps = 2\nlr = 0.01\nprecision = "bf16"\n')
    flags = {name: None for name in FIELD_NAMES}  # what the CLI passes for flags that were not given
    flags.update(max_steps=3, seed=7)
    config = build_config(toml_path=path, flags=flags)
    assert config.max_steps == 3  # flag over TOML
    assert config.lr == 0.01 and config.precision == "bf16"  # TOML over default
    assert config.seed == 7  # flag over default
    assert config.micro_batch_size == TrainConfig().micro_batch_size  # default


def test_flags_without_toml() -> None:
    assert build_config(toml_path=None, flags={"lr": 0.5, "model": None}) == TrainConfig(lr=0.5)


# ---------------------------------------------------------------------------------------------------- derived
def test_resolved_grad_accum_steps() -> None:
    assert TrainConfig().resolved_grad_accum_steps() == 1
    assert TrainConfig(micro_batch_size=8, effective_batch_size=32).resolved_grad_accum_steps() == 4
    assert TrainConfig(micro_batch_size=8, effective_batch_size=32).resolved_grad_accum_steps(world_size=2) == 2
    assert TrainConfig(micro_batch_size=8, grad_accum_steps=3).resolved_grad_accum_steps() == 3
    consistent = TrainConfig(micro_batch_size=4, grad_accum_steps=2, effective_batch_size=8)
    validate(consistent, cuda_available=False)
    assert consistent.resolved_grad_accum_steps() == 2
    assert TrainConfig(micro_batch_size=8, effective_batch_size=32).resolved_effective_batch_size() == 32
    assert TrainConfig(micro_batch_size=4, grad_accum_steps=2).resolved_effective_batch_size(world_size=3) == 24


def test_effective_batch_divisibility_counts_processes() -> None:
    validate(TrainConfig(micro_batch_size=8, effective_batch_size=32), world_size=2, cuda_available=False)
    with pytest.raises(UsageError) as caught:
        validate(TrainConfig(micro_batch_size=8, effective_batch_size=24), world_size=2, cuda_available=False)
    assert _wheres(caught.value) == ["--effective-batch-size"]
    assert "16" in caught.value.problems[0].message


def test_to_json_dict_is_plain_json() -> None:
    import json

    config = TrainConfig(data=Path("a/b.txt"), out=Path("runs/x"))
    as_dict = config.to_json_dict()
    assert as_dict["data"] == "a/b.txt" and as_dict["out"] == "runs/x"
    assert set(as_dict) == set(FIELD_NAMES)
    json.dumps(as_dict)


# ---------------------------------------------------------------------------------------------------- validation
def test_validate_reports_every_problem_naming_each_flag() -> None:
    config = TrainConfig(micro_batch_size=0, precision="fp8", lr=-1.0, lr_schedule="step", last_window="keep",
                         device="tpu", max_grad_norm=-1.0, seq_len=1, val_fraction=0.9, seed=-1, noise_scale_ema=1.0)
    with pytest.raises(UsageError) as caught:
        validate(config, cuda_available=False)
    assert sorted(_wheres(caught.value)) == sorted([
        "--micro-batch-size", "--precision", "--lr", "--lr-schedule", "--last-window", "--device",
        "--max-grad-norm", "--seq-len", "--val-fraction", "--seed", "--noise-scale-ema",
    ])


def test_cuda_requested_without_cuda() -> None:
    with pytest.raises(UsageError) as caught:
        validate(TrainConfig(device="cuda"), cuda_available=False)
    assert _wheres(caught.value) == ["--device"]


def test_seq_len_limit_is_the_models_context() -> None:
    validate(TrainConfig(seq_len=256), cuda_available=False)
    with pytest.raises(UsageError) as caught:
        validate(TrainConfig(seq_len=257), cuda_available=False)
    assert _wheres(caught.value) == ["--seq-len"] and "256" in caught.value.problems[0].message


def test_warmup_must_leave_steps() -> None:
    validate(TrainConfig(max_steps=5, warmup_steps=4), cuda_available=False)
    with pytest.raises(UsageError) as caught:
        validate(TrainConfig(max_steps=5, warmup_steps=5), cuda_available=False)
    assert _wheres(caught.value) == ["--warmup-steps"]


def test_out_checks(tmp_path: Path) -> None:
    validate(TrainConfig(out=tmp_path / "new" / "run"), cuda_available=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    validate(TrainConfig(out=empty), cuda_available=False)  # an existing empty directory is fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as caught:
        validate(TrainConfig(out=tmp_path / "file"), cuda_available=False)
    assert _wheres(caught.value) == ["--out"]


# ---------------------------------------------------------------------------------------------------- help
def test_every_field_has_help_from_its_docstring() -> None:
    for name in FIELD_NAMES:
        text = field_help(name)
        assert text.strip(), f"{name} has no help"
        assert "\n" not in text and "  " not in text  # whitespace of multi-line docstrings is collapsed
    assert field_help("lr") == "Peak learning rate (AdamW)."
    assert field_help("data").startswith("Training data: omitted = the built-in corpus")
    assert field_help("data").endswith('a token store directory written by cadence prepare-data --out.')
    assert field_help("no_such_field") == ""


def test_train_help_lists_every_flag_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--help"]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    listed = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    missing = [flag(name) for name in FIELD_NAMES if flag(name) not in listed]
    assert not missing, f"--help does not list {missing}"
    assert "--config" in listed
    assert "Traceback" not in text


# ---------------------------------------------------------------------------------------------------- choices
def test_choice_fields_parse_as_strings_whatever_their_literal() -> None:
    hints = get_type_hints(TrainConfig)
    for name in ("precision", "activation_checkpointing", "offload", "lr_schedule", "last_window", "device",
                 "strategy"):
        assert hint_types(hints[name]) == {str}, name
    assert hint_types(hints["micro_batch_size"]) == {int, str}
    assert hint_types(hints["seq_len"]) == {int, type(None)}


def test_a_value_outside_a_choice_is_read_then_named_by_validation(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'precision = "fp8"\nlr_schedule = "step"\n')
    assert load_toml(path) == {"precision": "fp8", "lr_schedule": "step"}
    config = build_config(toml_path=path, flags={"device": "tpu", "strategy": "zero"})
    with pytest.raises(UsageError) as caught:
        validate(config)
    problems = {problem.where: problem.message for problem in caught.value.problems}
    assert problems["--precision"] == "'fp8' is not one of fp32, bf16, fp16"
    assert problems["--lr-schedule"] == "'step' is not one of constant, linear, cosine"
    assert problems["--device"] == "'tpu' is not one of auto, cpu, cuda"
    assert problems["--strategy"] == "'zero' is not one of ddp, fsdp"


@pytest.mark.parametrize("flag_name, value", [
    ("--out", "{tmp}/" + "a" * 300),
    ("--out", "{tmp}/" + "b/" * 2600),
    ("--data", "{tmp}/" + "c" * 300 + ".txt"),
    ("--data-cache", "{tmp}/" + "d" * 300),
])
def test_a_path_the_file_system_cannot_hold_is_one_line_naming_its_flag(tmp_path, capsys, flag_name, value):
    """Issue 29 item 7: a 300-byte name or a 5,000-byte path ended in an ENAMETOOLONG traceback."""
    from cadence.cli import main

    assert main(["train", flag_name, value.format(tmp=tmp_path), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cadence: error: {flag_name}: ") and "Traceback" not in err and "bytes" in err


def test_a_long_path_from_a_toml_file_is_named_too(tmp_path, capsys):
    from cadence.cli import main

    toml = tmp_path / "run.toml"
    toml.write_text(f'out = "{tmp_path}/{"e" * 300}"\nmax_steps = 1\n')
    assert main(["train", "--config", str(toml)]) == 2
    assert capsys.readouterr().err.startswith("cadence: error: --out: a name in ")
