"""Issue 41 item 2: the flag reference is generated from the schema, and the checked-in one is what the code says."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cadence.config import TrainConfig, flag
from cadence.config.reference import reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_reference_is_what_the_schema_generates():
    assert (ROOT / "docs" / "FLAGS.md").read_text() == reference(), "run `make flags` and commit docs/FLAGS.md"


def test_the_reference_has_every_flag_its_default_and_its_choices():
    text = reference()
    for field in dataclasses.fields(TrainConfig):
        assert f"| `{flag(field.name)}` |" in text, flag(field.name)
    assert "| `--precision` | fp32 | fp32, bf16, fp16 | fixed |" in text
    assert "| `--train-on` | assistant | assistant, last, all | fixed |" in text
