"""Issue 44 item 5: a run's config.json given as --config is a record cadence reads back, checked like user input: a
value of the wrong type for a field is refused naming the file and the field (it used to fall back to the default
silently, and the run went on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import sample_text, train_args

from cadence.cli import main

RUN_CONFIG: dict[str, Any] = {"effective_batch_size": 8, "grad_accum_steps": 2, "world_size": 1,
                              "data_fingerprint": "sha256:0", "versions": {"cadence": "0.1.0"}}
"""What makes a config.json a run's (``is_cadence_config``)."""


@pytest.mark.parametrize(("field", "value", "words"), [
    ("lr", "fast", "'fast', not a number"),
    ("warmup_steps", "2", "'2', not an integer"),
    ("warmup_steps", 2.5, "2.5, not an integer"),
    ("model", ["gpt-tiny"], "['gpt-tiny'], not a string"),
    ("packing", "yes", "'yes', not true or false"),
    ("lora_targets", [1, 2], "[1, 2], not a list of strings"),
    ("data", "", "'', not a path string"),
])
def test_a_run_config_with_a_value_of_the_wrong_type_is_refused_naming_the_field(tmp_path: Path, capsys, field,
                                                                                 value, words):
    (tmp_path / "saved").mkdir()
    config = tmp_path / "saved" / "config.json"
    config.write_text(json.dumps({**RUN_CONFIG, field: value}))
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(400 * 32 + 1))
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), *train_args(data, out, steps=2)[1:]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"cadence: error: --config {config}: field '{field}' is {words}"]
    assert not out.exists()
