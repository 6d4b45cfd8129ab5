"""Issue 37 item 1: the data seam. A Source is made from the flags (its kind from the path and a .jsonl's first
row), turned back into them, said in words, and refuses the data flags that do not apply to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.data.source import FIELD_DEFAULTS, Source


def _jsonl(path: Path, row: dict) -> Path:
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.parametrize("row, kind", [
    ({"text": "a"}, "jsonl"), ({"prompt": "a", "completion": "b"}, "jsonl"),
    ({"messages": [{"role": "user", "content": "a"}]}, "chat"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": "b"}]}, "chat"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "chat"),
])
def test_the_kind_of_a_jsonl_file_comes_from_its_first_row(tmp_path: Path, row: dict, kind: str) -> None:
    assert Source.from_flags({"data": _jsonl(tmp_path / "d.jsonl", row)}).kind == kind


def test_other_kinds_and_the_round_trip_through_the_flags(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("text")
    assert Source.from_flags({}).kind == "corpus"
    assert Source.from_flags({"data": tmp_path / "t.txt"}).kind == "text"
    assert Source.from_flags({"data": tmp_path / "x.parquet"}).kind == "datasets"
    chat = _jsonl(tmp_path / "c.jsonl", {"dialog": [{"role": "user", "content": "a"}]})
    source = Source.from_flags({"data": chat, "messages_field": "dialog", "train_on": "last",
                                "chat_template": str(tmp_path / "t.jinja")})
    assert source.kind == "chat" and source.chat_template == tmp_path / "t.jinja"
    assert Source.from_flags(source.flags()) == source
    assert set(source.flags()) == {"data", *FIELD_DEFAULTS}
    assert source.describe() == f"chat JSONL file {chat} under {tmp_path / 't.jinja'}, trained on the last assistant turn"


@pytest.mark.parametrize("row, flags, byte_level, refused", [
    ({"text": "a"}, {"train_on": "last"}, False, ["--train-on"]),
    # Issue 37: the field flags apply to a .jsonl file whatever the model (one route, one set of rules).
    ({"text": "a"}, {"text_field": "body"}, True, []),
    ({"text": "a"}, {"text_field": "body"}, False, []),
    ({"messages": [{"role": "user", "content": "a"}]}, {"prompt_field": "q", "completion_field": "a"}, False,
     ["--completion-field", "--prompt-field"]),
    ({"messages": [{"role": "user", "content": "a"}]}, {"train_on": "all"}, True, []),
])
def test_a_data_flag_that_does_not_apply_is_named(tmp_path: Path, row, flags, byte_level, refused) -> None:
    source = Source.from_flags({"data": _jsonl(tmp_path / "d.jsonl", row), **flags})
    assert [problem.where for problem in source.problems(byte_level=byte_level)] == refused
