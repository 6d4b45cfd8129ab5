"""Issue 51: a plan may list another optimizer as a memory lever, with its estimate, but never tries it and never
switches the optimizer the user chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import sample_text

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.config.plan_file import OptimizerLever, PlanRecord
from cadence.models.spec import ModelSpec
from cadence.optim.choices import OPTIMIZERS
from cadence.optim.spec import OptimizerSpec
from cadence.plan.optimizer_levers import optimizer_levers, state_bytes
from cadence.plan.report import _optimizer_lever
from cadence.records import Record


def levers_of(optimizer: str, **options: object) -> list[OptimizerLever]:
    config = TrainConfig(model="gpt-tiny", optimizer=optimizer, **options)  # type: ignore[arg-type]
    return optimizer_levers(config, ModelSpec.from_flags(config), seq_len=32)


def test_the_levers_are_the_other_optimizers_with_less_state_smallest_first() -> None:
    adamw = levers_of("adamw")
    # gpt-tiny: AdamW 8 bytes per parameter; Muon 4 on the blocks' matrices and 8 elsewhere; SGD 4; Adafactor rows
    # and columns.
    assert [lever.optimizer for lever in adamw] == ["adafactor", "sgd", "muon"]
    assert all(not lever.tried and lever.state_bytes < lever.chosen_state_bytes for lever in adamw)
    assert [lever.state_bytes for lever in adamw] == sorted(lever.state_bytes for lever in adamw)
    assert {lever.chosen_state_bytes for lever in adamw} == {8 * 1_057_152}
    assert [lever.optimizer for lever in levers_of("sgd", momentum=0.9)] == ["adafactor"]
    assert levers_of("adafactor") == []  # nothing keeps less
    for name in OPTIMIZERS:  # the user's own optimizer is never a lever
        assert name not in {lever.optimizer for lever in levers_of(name)}


def test_the_chosen_state_is_what_the_levers_are_compared_with() -> None:
    """AdamW with bf16 state (a plan's lossy lever) keeps 4 bytes per parameter: SGD's 4 saves nothing, Muon's mix
    of 4 and 8 is more; Adafactor still is less."""
    config = TrainConfig(model="gpt-tiny")
    model = ModelSpec.from_flags(config)
    levers = optimizer_levers(config, model, seq_len=32, chosen_state="bf16")
    assert [lever.optimizer for lever in levers] == ["adafactor"]
    assert levers[0].state_bytes == state_bytes(model, OptimizerSpec(name="adafactor"), seq_len=32)


def test_the_record_keeps_the_levers_and_the_users_optimizer_through_its_typed_reader() -> None:
    levers = levers_of("adamw")
    record = {"version": 1, "created": "now", "diagnosis": {}, "candidates": [], "optimizer": "adamw",
              "optimizer_levers": [lever.as_json() for lever in levers]}
    plan = PlanRecord.read(Record.parse(json.dumps(record), "plan.json"))
    assert plan.optimizer == "adamw" and plan.optimizer_levers == levers
    assert PlanRecord.read(Record.parse(json.dumps(plan.as_json()), "plan.json")) == plan
    older = PlanRecord.read(Record.parse(json.dumps({k: v for k, v in record.items() if "optimizer" not in k}), "p"))
    assert older.optimizer is None and older.optimizer_levers == []  # a plan.json from before them
    line = _optimizer_lever(levers[0], "adamw")
    assert line.startswith("adafactor would keep ") and "against adamw's 8.1 MiB" in line and "not tried" in line


@pytest.mark.slow
def test_a_plan_lists_the_levers_never_switches_the_optimizer_and_train_follows(tmp_path: Path,
                                                                                 capsys: pytest.CaptureFixture[str]
                                                                                 ) -> None:
    """`cadence plan --optimizer sgd`: every candidate is estimated with SGD's state, plan.json records sgd and lists
    Adafactor (not tried), the report says so, and train --plan trains SGD; a contradicting --optimizer is refused."""
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(200 * 32 + 1))
    out = tmp_path / "plan"
    assert main(["plan", "--data", str(data), "--seq-len", "32", "--effective-batch-size", "8", "--memory-budget",
                 "24MiB", "--trial-steps", "3", "--quality-steps", "3", "--precision", "fp32", "--optimizer", "sgd",
                 "--lr", "0.1", "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    sgd = 4 * 1_057_152  # one momentum buffer per trained parameter of gpt-tiny
    assert plan["optimizer"] == "sgd"
    assert {c["estimated_by_category"]["optimizer_state"] for c in plan["candidates"]} <= {sgd, 0}  # 0: offloaded
    assert [(lever["optimizer"], lever["tried"], lever["chosen_state_bytes"]) for lever in plan["optimizer_levers"]
            ] == [("adafactor", False, sgd)]
    assert "optimizer" not in plan["choice"]  # the decision's flags never hold an optimizer
    assert "adafactor would keep" in (out / "report.md").read_text()

    run = tmp_path / "run"
    assert main(["train", "--plan", str(out / "plan.json"), "--lr", "0.1", "--max-steps", "2", "--out",
                 str(run)]) == 0
    assert json.loads((run / "config.json").read_text())["optimizer"] == "sgd"
    capsys.readouterr()
    assert main(["train", "--plan", str(out / "plan.json"), "--optimizer", "adamw", "--max-steps", "2", "--out",
                 str(tmp_path / "other")]) == 2
    assert "--optimizer: 'adamw' contradicts the plan's 'sgd'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
