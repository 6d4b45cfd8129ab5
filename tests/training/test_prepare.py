"""Issue 50 item 4: one assembly carries the run's concepts. ``Prepared`` holds the ``Source`` (built once per
command: a .jsonl file's first row is read to tell chat rows from text) and a built ``Cut`` (a field, rebuilt by
``variant`` for its settings, never on each use)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_jsonl

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.data.source import Source
from cadence.engine.cut import Cut
from cadence.training.prepare import prepare

LLAMA = ["--model", "hf:llama", *(f"--model-config={key}={value}" for key, value in (
    ("hidden_size", 32), ("intermediate_size", 64), ("num_hidden_layers", 1), ("num_attention_heads", 4),
    ("num_key_value_heads", 2), ("vocab_size", 256), ("max_position_embeddings", 256)))]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every ``Source.from_flags`` call's flags, in order."""
    calls: list[object] = []
    original = Source.from_flags.__func__  # type: ignore[attr-defined]  # the classmethod's function

    def counting(cls: type[Source], flags: object) -> Source:
        calls.append(flags)
        return original(cls, flags)  # type: ignore[no-any-return]

    monkeypatch.setattr(Source, "from_flags", classmethod(counting))
    return calls


def _chat(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {index}?"},
                          {"role": "assistant", "content": f"answer {index}"}]} for index in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_train_builds_its_source_once(tmp_path: Path, counted: list[object]) -> None:
    """A chat run exported with --save-hf (whose chat template follows the source's kind) reads the data's first row
    once: before, the export built the source a second time."""
    pytest.importorskip("transformers")
    data = _chat(tmp_path / "chat.jsonl")
    assert main(["train", *LLAMA, "--data", str(data), "--seq-len", "64", "--too-long", "truncate",
                 "--micro-batch-size", "4", "--grad-accum-steps", "1", "--max-steps", "1", "--val-fraction", "0",
                 "--save-hf", str(tmp_path / "export"), "--out", str(tmp_path / "run"),
                 "--data-cache", str(tmp_path / "cache")]) == 0
    assert len(counted) == 1
    assert (tmp_path / "export" / "tokenizer_config.json").is_file()


def test_eval_data_is_a_source_of_its_own_built_once(tmp_path: Path, counted: list[object]) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", 16)
    held = write_jsonl(tmp_path / "held.jsonl", 8)
    prep = prepare(TrainConfig(data=data, eval_data=held, eval_every=1, seq_len=48, too_long="truncate",
                               micro_batch_size=2, grad_accum_steps=2, max_steps=1, out=tmp_path / "run",
                               data_cache=tmp_path / "cache"))
    assert [getattr(flags, "data", None) for flags in counted] == [data, held]
    assert prep.source == Source.from_flags(prep.config) and prep.source.path == data


def test_the_cut_is_built_once_and_again_for_a_variant(tmp_path: Path) -> None:
    prep = prepare(TrainConfig(data=write_jsonl(tmp_path / "d.jsonl", 16), seq_len=48, too_long="truncate",
                               micro_batch_size=2, grad_accum_steps=2, max_steps=1, val_fraction=0.0,
                               out=tmp_path / "run", data_cache=tmp_path / "cache"))
    assert prep.cut is prep.cut and prep.cut == Cut.from_flags(prep.config, micro_batch_size=2, seq_len=48)
    variant = prep.variant(micro_batch_size=4, grad_accum_steps=1, micro_batch_order="drawn")
    assert variant.cut == Cut.from_flags(variant.config, micro_batch_size=4, seq_len=48)
    assert prep.cut.by_length and not variant.cut.by_length  # by length: the default for variable lengths


COMMANDS = {
    "verify": ["--micro-batch-size", "2", "--grad-accum-steps", "2", "--steps", "1"],
    "profile": ["--micro-batch-size", "2", "--grad-accum-steps", "2", "--steps", "1"],
    "plan": ["--effective-batch-size", "4", "--memory-budget", "512MiB", "--max-trials", "1", "--trial-steps", "3",
             "--quality-steps", "2"],
}
"""Each command that prepares a run, with flags that keep it short."""


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_builds_its_source_once(tmp_path: Path, counted: list[object], command: str) -> None:
    """Issue 50: the Source is built once per command and handed on (``Prepared.source``); before, ``cadence plan``
    built it a second time for plan.json's record."""
    data = write_jsonl(tmp_path / "d.jsonl", 16)
    out = [] if command == "verify" else ["--out", str(tmp_path / "out")]
    assert main([command, "--data", str(data), "--seq-len", "48", "--too-long", "truncate",
                 "--data-cache", str(tmp_path / "cache"), *out, *COMMANDS[command]]) == 0
    assert [getattr(flags, "data", None) for flags in counted] == [data]
