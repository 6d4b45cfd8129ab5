"""plan.json's typed record (cadence.config.plan_file): one writer, one reader, every field checked, old plans read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cadence.config.plan_file import (
    DECISION_DEFAULTS,
    DECISION_FIELDS,
    PLAN_FILE,
    PlanRecord,
    read_plan,
    write_plan,
)
from cadence.plan.trials import TrialSetup
from cadence.records import RecordInvalid

FIXTURE_PLAN = Path(__file__).resolve().parents[1] / "fixtures" / "plan" / "plan.json"


def test_the_decision_fields_are_the_trial_setup_s() -> None:
    """What a plan decides is every field of the setup it measures (but its cut, recorded as the cut flags, and
    targets_only, derived from the model): a new lever of TrialSetup is recorded and read back too."""
    fields = {f.name: f for f in dataclasses.fields(TrialSetup)}
    setup_fields = [name for name in fields if name not in ("cut", "grad_accum_steps", "targets_only")]
    assert DECISION_FIELDS == ("micro_batch_size", "grad_accum_steps", *setup_fields)
    assert DECISION_DEFAULTS == {name: fields[name].default for name in setup_fields}


def test_an_old_plan_reads_with_defaults_and_writes_back_the_same_figures(tmp_path: Path) -> None:
    """The fixture is a plan.json from before the cut flags, the prediction, LoRA and the data were recorded."""
    plan = read_plan(FIXTURE_PLAN, where="RUN_DIR")
    raw = json.loads(FIXTURE_PLAN.read_text())
    assert plan.choice is not None and plan.choice.id == raw["choice"]["id"]
    assert plan.choice.flags["micro_batch_order"] == "drawn" and plan.choice.flags["loss_chunk_tokens"] == 0
    assert plan.prediction is None and plan.source is None and plan.cuts == []
    assert [row.id for row in plan.candidates] == [c["id"] for c in raw["candidates"]]
    first = plan.candidates[0]
    assert first.decision["micro_batch_size"] == raw["candidates"][0]["micro_batch_size"]
    assert first.measured is not None and first.measured.peak_bytes == raw["candidates"][0]["measured"]["peak_bytes"]
    write_plan(tmp_path / PLAN_FILE, plan)
    again = read_plan(tmp_path / PLAN_FILE, where="RUN_DIR")
    assert again == plan  # the writer and the reader agree, field by field
    written = json.loads((tmp_path / PLAN_FILE).read_text())
    for key in ("model", "seq_len", "memory_budget_bytes", "notes", "diagnosis"):
        assert written[key] == raw[key]


@pytest.mark.parametrize(("change", "field"), [
    (lambda plan: plan["candidates"][0].update(estimated_peak_bytes="big"), "candidates[0].estimated_peak_bytes"),
    (lambda plan: plan["candidates"][1]["measured"].update(fits="yes"), "candidates[1].measured.fits"),
    (lambda plan: plan["choice"].update(micro_batch_size="eight"), "choice.micro_batch_size"),
    (lambda plan: plan["choice"].pop("grad_accum_steps"), "choice.grad_accum_steps"),
    (lambda plan: plan.update(notes=[1]), "notes"),
    (lambda plan: plan.update(prediction={"tokens_per_s": "fast"}), "prediction.tokens_per_s"),
    (lambda plan: plan.update(model=" "), "model"),
])
def test_a_field_of_the_wrong_type_is_one_line_naming_the_file_and_the_field(tmp_path: Path, change,
                                                                              field: str) -> None:
    plan = json.loads(FIXTURE_PLAN.read_text())
    change(plan)
    path = tmp_path / PLAN_FILE
    path.write_text(json.dumps(plan))
    with pytest.raises(RecordInvalid) as refused:
        read_plan(path, where="--plan")
    assert refused.value.lines() == [line for line in refused.value.lines() if f"field '{field}'" in line]
    assert str(path) in refused.value.lines()[0]


def test_a_record_holds_what_a_plan_writes() -> None:
    """Every key plan.json has comes from the record (one writer): no field is written beside it."""
    plan = read_plan(FIXTURE_PLAN, where="RUN_DIR")
    assert set(plan.as_json()) == {f.name for f in dataclasses.fields(PlanRecord)}


def test_a_plan_records_the_objective_it_measured_and_train_plan_reads_it_back() -> None:
    """The objective's flags, each of its TrainConfig type (a decision field, the reference's mode, is the choice's;
    a key that is not train's is left out)."""
    from cadence.config.plan_file import PlanRecord
    from cadence.records import Record

    recorded = {"objective": "dpo", "beta": 0.2, "reference_model": "/models/ref", "reference_logprobs": "precomputed",
                "not_a_flag": 1}
    plan = PlanRecord.read(Record.parse(json.dumps({"objective": recorded}), "plan.json"))
    assert plan.objective == {"objective": "dpo", "beta": 0.2, "reference_model": Path("/models/ref")}
    assert PlanRecord.read(Record.parse("{}", "plan.json")).objective is None  # an older plan: sft
