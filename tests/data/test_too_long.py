"""--too-long: one policy for examples longer than --seq-len, the same on JSONL read by cadence's own reader and on
datasets sources, the same on a store just built and on one found in the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from cadence.data import BYTE_EOS_ID, IGNORE_INDEX, load_data
from cadence.data.too_long import LongExamples
from cadence.errors import UsageError

X = IGNORE_INDEX
SEQ_LEN = 16
# (prompt, completion): fits; a prompt too long for --seq-len 16; a completion longer than 16 on its own; fits.
ROWS = [
    ("Q: 1+1?", " 2"),
    ("Q: what is the sum of all of these numbers?", " 45"),
    ("Q:", " a completion much longer than the sequence"),
    ("", "short"),
    ("Q: 2+2?", " 4"),
]


def as_lists(dataset) -> list[tuple[list[int], list[int]]]:
    return [(example.input_ids.tolist(), example.labels.tolist()) for example in dataset]


def write_jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in ROWS))
    return path


def write_parquet(path: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"prompt": [p for p, _ in ROWS], "completion": [c for _, c in ROWS]}).to_parquet(
        str(path))
    return path


def load_parquet(path: Path, cache: Path | None, too_long: str, tokenizer: object = None):
    from cadence.data.hf import load_hf_data

    return load_hf_data(path, seq_len=SEQ_LEN, tokenizer=tokenizer, val_fraction=0.0, cache_dir=cache,
                        too_long=too_long)


@pytest.mark.parametrize("too_long", ["skip", "truncate"])
def test_jsonl_and_a_parquet_source_follow_the_policy_alike_built_or_cached(tmp_path: Path, too_long: str) -> None:
    jsonl, parquet, cache = write_jsonl(tmp_path / "d.jsonl"), write_parquet(tmp_path / "d.parquet"), tmp_path / "c"
    fresh = [load_data(jsonl, SEQ_LEN, 0.0, cache_dir=cache, too_long=too_long),
             load_parquet(parquet, cache, too_long)]
    cached = [load_data(jsonl, SEQ_LEN, 0.0, cache_dir=cache, too_long=too_long),
              load_parquet(parquet, cache, too_long)]
    assert all("from the cache" in splits.description for splits in cached)
    # Truncation counts the targets it dropped: every target the examples hold whole, less those kept.
    whole = load_data(jsonl, 1000, 0.0, cache_dir=cache).train.num_targets
    lost = whole - fresh[0].train.num_targets if too_long == "truncate" else 0
    assert too_long != "truncate" or lost > 0
    expected = LongExamples(policy=too_long, seq_len=SEQ_LEN, examples=5, too_long=2,
                            prompts_cut=1 if too_long == "truncate" else 0, ends_cut=1 if too_long == "truncate" else 0,
                            targets_lost=lost)
    for splits in fresh + cached:
        assert as_lists(splits.train) == as_lists(fresh[0].train) and splits.long_examples == expected
    assert len(fresh[0].train) == (5 if too_long == "truncate" else 3)
    # One store per source serves every policy: the other policy reads the same cached store.
    other = "skip" if too_long == "truncate" else "truncate"
    assert "from the cache" in load_data(jsonl, SEQ_LEN, 0.0, cache_dir=cache, too_long=other).description
    assert len([p for p in (cache / "stores").iterdir() if not p.name.startswith(".")]) == 2


def test_skip_counts_in_one_note() -> None:
    assert LongExamples(policy="skip", seq_len=1024, examples=3000, too_long=371).note() == (
        "371 of 3,000 examples are longer than --seq-len 1024 and were skipped (--too-long truncate keeps them, cut "
        "to fit)")
    truncated = LongExamples(policy="truncate", seq_len=16, examples=5, too_long=2, prompts_cut=1, ends_cut=1).note()
    assert truncated.startswith("2 of 5 examples are longer than --seq-len 16 and were truncated: 1 lost the start of "
                                "their prompt (the completion kept whole); 1 lost their end")
    assert LongExamples(policy="skip", seq_len=16, examples=5, too_long=0).note() is None


def test_truncate_keeps_the_completion_and_its_end_of_sequence(tmp_path: Path) -> None:
    splits = load_data(write_jsonl(tmp_path / "d.jsonl"), SEQ_LEN, 0.0, too_long="truncate")
    fits, prompt_cut, completion_cut = splits.train[0], splits.train[1], splits.train[2]
    assert fits.labels.tolist()[-3:] == [*b" 2", BYTE_EOS_ID]
    # The prompt lost its start: the inputs end with the whole completion, the targets are it and the EOS.
    prompt, completion = (text.encode() for text in ROWS[1])
    assert len(prompt_cut.input_ids) == SEQ_LEN and bytes(prompt_cut.input_ids.tolist()).endswith(completion)
    assert [t for t in prompt_cut.labels.tolist() if t != X] == [*completion, BYTE_EOS_ID]
    # The completion alone is longer: it starts right after the prompt's last byte and loses its end (and the EOS).
    prompt, completion = (text.encode() for text in ROWS[2])
    assert completion_cut.input_ids.tolist() == list((prompt + completion)[len(prompt) - 1:][:SEQ_LEN])
    assert completion_cut.labels.tolist() == list(completion[:SEQ_LEN])


def test_error_names_each_long_example_by_file_and_line_or_row(tmp_path: Path) -> None:
    jsonl, parquet = write_jsonl(tmp_path / "d.jsonl"), write_parquet(tmp_path / "d.parquet")
    with pytest.raises(UsageError) as refused:
        load_data(jsonl, SEQ_LEN, 0.0, too_long="error")
    assert [p.where for p in refused.value.problems] == [f"{jsonl}:2", f"{jsonl}:3"]
    assert "--seq-len 16" in refused.value.problems[0].message
    with pytest.raises(UsageError) as refused:
        load_parquet(parquet, None, "error")
    assert [p.where for p in refused.value.problems] == [f"{parquet} row 2", f"{parquet} row 3"]


@dataclass(frozen=True)
class BosBytes:
    """Bytes behind a BOS (id 256), with an EOS (257) after every example: a tokenizer like Llama's."""

    vocab_size: int = 258
    bos_id: int | None = 256
    eos_id: int | None = 257
    identity: str = "test-bos-bytes"
    name: str = "bos bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def encode_batch(self, texts, max_length=None):
        return [list(text.encode()[:max_length]) for text in texts]


def test_truncate_keeps_a_bos_in_front(tmp_path: Path) -> None:
    splits = load_parquet(write_parquet(tmp_path / "d.parquet"), None, "truncate", tokenizer=BosBytes())
    prompt_cut = splits.train[1]
    completion = ROWS[1][1].encode()
    assert prompt_cut.input_ids[0] == 256 and len(prompt_cut.input_ids) == SEQ_LEN
    assert [t for t in prompt_cut.labels.tolist() if t != X] == [*completion, 257]
