"""The typed reader of what cadence reads back (issue 44): one error type, one line naming the file and the field."""

from __future__ import annotations

import json
import os
import re

import pytest

from cadence.errors import UsageError
from cadence.records import (
    COUNT,
    METRICS_ROW,
    NUMBER,
    PROFILE,
    RUN_CONFIG,
    SUMMARY,
    NotJson,
    Record,
    RecordInvalid,
    integer,
    list_of,
    one_of,
)


@pytest.mark.parametrize(("value", "kind", "message"), [
    ("x", COUNT, "run/summary.json: field 'step' is 'x', not a count"),
    (-1, COUNT, "run/summary.json: field 'step' is -1, not a count"),
    (True, COUNT, "run/summary.json: field 'step' is True, not a count"),
    (1.5, COUNT, "run/summary.json: field 'step' is 1.5, not a count"),
    ("1.0", NUMBER, "run/summary.json: field 'step' is '1.0', not a finite number"),
    (float("nan"), NUMBER, "run/summary.json: field 'step' is nan, not a finite number"),
    (9, integer(1, 8), "run/summary.json: field 'step' is 9, not an integer from 1 to 8"),
    ("c", one_of(("a", "b")), "run/summary.json: field 'step' is 'c', not one of 'a', 'b'"),
    ([1, "x"], list_of(COUNT), "run/summary.json: field 'step' is [1, 'x'], not a list, each a count"),
])
def test_a_field_of_the_wrong_type_or_range_is_one_line_naming_file_and_field(value, kind, message):
    with pytest.raises(RecordInvalid) as refused:
        Record({"step": value}, "run/summary.json").take("step", kind)
    assert isinstance(refused.value, UsageError) and refused.value.lines() == [f"error: {message}"]


def test_fields_come_back_typed_with_defaults_and_nested_names():
    record = Record.parse('{"step": 3, "loss": 2, "segments": [{"tokens": 5}, {"tokens": "x"}]}', "s.json")
    assert record.count("step") == 3 and record.number("loss") == 2.0 and isinstance(record.number("loss"), float)
    assert record.number("val_loss", default=None) is None
    with pytest.raises(RecordInvalid, match="s.json: field 'tokens' is missing"):
        record.count("tokens")
    first, second = record.records("segments")
    assert first.count("tokens") == 5
    with pytest.raises(RecordInvalid, match=r"field 'segments\[1\].tokens' is 'x', not a count"):
        second.count("tokens")


@pytest.mark.parametrize(("text", "message"), [("[1]", "holds [1], not a JSON object"),
                                               ("{", "is not valid JSON"), (b"\xff", "is not UTF-8 text")])
def test_text_that_is_no_json_object_is_refused(text, message):
    with pytest.raises(RecordInvalid, match=re.escape(message)):
        Record.parse(text, "f.json")


def test_each_record_file_has_one_typed_reader_and_writer(tmp_path):
    """Issue 50 item 6: a record file is written whole (non-finite numbers as null) and read back with every field
    of its kind, nested lists included; another kind is one line naming the file and the field."""
    path = tmp_path / "summary.json"
    SUMMARY.write(path, {"steps": 3, "wall_time_s": float("nan"), "segments": [{"from_step": 0, "to_step": 3}]})
    record = SUMMARY.read(path)
    assert record.count("steps") == 3 and record.get("wall_time_s") is None
    path.write_text(json.dumps({"steps": "3"}))
    with pytest.raises(RecordInvalid, match=r"summary.json: field 'steps' is '3', not a count"):
        SUMMARY.read(path)
    path.write_text(json.dumps({"segments": [{"tokens": -1}]}))
    with pytest.raises(RecordInvalid, match=r"field 'segments\[0\].tokens' is -1, not a count"):
        SUMMARY.read(path)
    line = '{"step": 1, "tokens": 8, "loss": "low"}'
    with pytest.raises(RecordInvalid, match="metrics.jsonl:1: field 'loss' is 'low', not a finite number"):
        METRICS_ROW.parse(line, "metrics.jsonl:1")
    with pytest.raises(NotJson, match="is not valid JSON"):
        METRICS_ROW.parse('{"step": 1, "tok', "metrics.jsonl:2")  # a torn line is told apart from a wrong row


def test_a_record_named_by_an_argument_leads_its_line_with_it(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    with pytest.raises(UsageError) as refused:
        PROFILE.read(path, where="RUN_DIR")
    assert refused.value.problems[0].where == "RUN_DIR" and "not valid JSON" in str(refused.value)
    path.write_text("[1, 2]")
    with pytest.raises(UsageError, match="should hold a JSON object, not list"):
        PROFILE.read(path, where="RUN_DIR")
    path.write_text(json.dumps({"version": 1, "step_times_s": [0.1, None, "slow"]}))
    with pytest.raises(RecordInvalid, match=r"field 'step_times_s' is \[0.1, None, 'slow'\], not a list"):
        PROFILE.read(path, where="RUN_DIR")


def test_the_marks_tell_a_file_cadence_wrote_from_another_tools(tmp_path):
    config = tmp_path / "config.json"
    ours = {"effective_batch_size": 8, "grad_accum_steps": 2, "world_size": 1, "data_fingerprint": "sha256:0",
            "versions": {"cadence": "0.1.0"}}
    RUN_CONFIG.write(config, ours)
    assert RUN_CONFIG.holds(config) and RUN_CONFIG.missing(RUN_CONFIG.read(config)) == []
    config.write_text(json.dumps({**ours, "versions": {"torch": "2"}, "world_size": "1"}))
    assert not RUN_CONFIG.holds(config)
    assert RUN_CONFIG.missing(Record(json.loads(config.read_text()), config)) == ["world_size", "versions"]
    config.unlink()
    os.mkfifo(config)  # never opened for reading: a pipe would block
    assert not RUN_CONFIG.holds(config)
