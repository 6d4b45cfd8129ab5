"""Preference rows through the token store (cadence.data.preference_store, cadence.data.preference): a pair is one
sample of two sequences made by the SFT rules, never split, truncated and held out whole; KTO rows keep their labels
and get their mismatched sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import write_preference_jsonl

from cadence.data.batching import IGNORE_INDEX
from cadence.data.preference import PreferenceExample, PreferenceExamples, first_target
from cadence.data.source import Source, open_source
from cadence.engine.cut import Cut
from cadence.engine.windows import epoch_windows


def open_rows(path: Path, tmp_path: Path, *, seq_len: int = 64, val_fraction: float = 0.0, too_long: str = "skip",
              template: Path | None = None):  # type: ignore[no-untyped-def]
    source = Source.from_flags({"data": str(path), "chat_template": template})
    return open_source(source, None, seq_len=seq_len, val_fraction=val_fraction, cache_dir=tmp_path / "cache",
                       too_long=too_long)  # type: ignore[arg-type]


def write_rows(path: Path, rows: list[dict]) -> Path:  # type: ignore[type-arg]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def text_of(ids: torch.Tensor) -> str:
    return bytes(int(v) for v in ids).decode()


def test_a_pair_is_two_sequences_made_as_sft_makes_a_prompt_and_completion(tmp_path):
    path = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "Q:", "chosen": "yes", "rejected": "no way"}])
    data = open_rows(path, tmp_path)
    assert Source.from_flags({"data": str(path)}).kind == "pairs" and isinstance(data.train, PreferenceExamples)
    [pair] = list(data.train)
    sft = open_rows(write_rows(tmp_path / "sft.jsonl", [{"prompt": "Q:", "completion": "yes"}]), tmp_path).train[0]
    assert torch.equal(pair.first.input_ids, sft.input_ids) and torch.equal(pair.first.labels, sft.labels)
    # The targets are the completion and its end of sequence (byte 4), the prompt none.
    assert text_of(pair.second.labels[pair.second.labels != IGNORE_INDEX]) == "no way\x04"
    assert text_of(pair.first.input_ids[:first_target(pair.first) + 1]) == "Q:"


def test_too_long_applies_to_the_pair_and_validation_holds_whole_pairs(tmp_path):
    rows = [{"prompt": "p:", "chosen": "c" * 5, "rejected": "r" * (40 if i == 3 else 5)} for i in range(10)]
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    skipped = open_rows(path, tmp_path, seq_len=20)
    assert len(skipped.train) == 9 and skipped.long_examples.too_long == 1  # the pair left out whole
    assert all(len(p.second.input_ids) <= 20 for p in skipped.train)
    truncated = open_rows(path, tmp_path, seq_len=20, too_long="truncate")
    assert len(truncated.train) == 10 and max(len(p.second.input_ids) for p in truncated.train) == 20
    split = open_rows(path, tmp_path, val_fraction=0.2)
    assert (len(split.train), len(split.val)) == (8, 2)
    assert torch.equal(split.val[1].second.input_ids, open_rows(path, tmp_path).train[9].second.input_ids)


def test_kto_rows_keep_their_labels_and_get_the_next_rows_completion_as_mismatched(tmp_path):
    path = write_preference_jsonl(tmp_path / "kto.jsonl", 6, unpaired=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    data = open_rows(path, tmp_path)
    assert Source.from_flags({"data": str(path)}).kind == "unpaired" and data.train.unpaired
    samples = list(data.train)
    assert [s.desirable for s in samples] == [row["label"] for row in rows]
    for index, sample in enumerate(samples):
        other = samples[(index + 1) % len(samples)].first
        mismatched = sample.second
        assert text_of(mismatched.input_ids[:first_target(mismatched) + 1]) == rows[index]["prompt"]
        assert torch.equal(mismatched.labels[mismatched.labels != IGNORE_INDEX], other.labels[other.labels != -100])


def test_conversational_pairs_train_the_assistant_reply_and_its_end_of_turn(tmp_path):
    prompt = [{"role": "user", "content": "Capital of France?"}]
    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "Paris"}],
                                                 "rejected": [{"role": "assistant", "content": "Rome"}]}])
    [pair] = list(open_rows(path, tmp_path, seq_len=200).train)
    assert text_of(pair.first.labels[pair.first.labels != IGNORE_INDEX]).startswith("Paris<|im_end|>")
    assert text_of(pair.second.labels[pair.second.labels != IGNORE_INDEX]).startswith("Rome<|im_end|>")
    assert "Capital of France?" in text_of(pair.first.input_ids)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_pair_is_never_split_across_micro_batches_or_ranks(tmp_path, world_size):
    data = open_rows(write_preference_jsonl(tmp_path / "pairs.jsonl", 12), tmp_path)
    seen: list[bytes] = []
    for rank in range(world_size):
        for window in epoch_windows(data.train, cut=Cut(micro_batch_size=1), grad_accum_steps=2, seed=0, epoch=0,
                                    world_size=world_size, rank=rank):
            for batch in window.micro_batches[:len(window.micro_batches) - window.padding]:
                pairs = batch["input_ids"].shape[0] // 2
                assert batch["input_ids"].shape[0] == 2 * pairs  # chosen rows then their rejected rows
                for k in range(pairs):
                    pair = next(p for p in data.train if torch.equal(
                        p.first.input_ids, batch["input_ids"][k, :len(p.first.input_ids)]))
                    assert torch.equal(batch["input_ids"][pairs + k, :len(pair.second.input_ids)],
                                       pair.second.input_ids)
                    seen.append(bytes(pair.first.input_ids.tolist()))
    assert len(seen) == len(data.train) == len(set(seen))


def test_a_preference_sample_is_one_sample_of_the_cut():
    pair = PreferenceExample(first=torch_example(3), second=torch_example(5))
    assert pair.num_targets == 2 + 4 and len(pair.input_ids) == 8


def torch_example(length: int):  # type: ignore[no-untyped-def]
    from cadence.data.batching import make_example

    return make_example(list(range(1, length + 1)), [-100] + list(range(3, length + 2)))
