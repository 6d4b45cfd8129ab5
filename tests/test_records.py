"""The typed reader of what cadence reads back (issue 44): one error type, one line naming the file and the field."""

from __future__ import annotations

import re

import pytest

from cadence.errors import UsageError
from cadence.records import COUNT, NUMBER, Record, RecordInvalid, integer, list_of, one_of


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
