"""Tests of text sources, packing and load_data."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.data import DataSplits, TokenDataset, load_data, pack_bytes, read_text_source
from cadence.errors import UsageError


def where_and_message(error: pytest.ExceptionInfo[UsageError]) -> tuple[str, str]:
    (problem,) = error.value.problems
    return problem.where, problem.message


def test_pack_bytes_stride_and_shift() -> None:
    data = bytes(range(23))
    packed = pack_bytes(data, seq_len=5)
    # (23 - 1) // 5 = 4 full chunks of 6 bytes starting at 0, 5, 10, 15; bytes 21..22 are dropped.
    assert len(packed) == 4
    for i, example in enumerate(packed):
        assert example.input_ids.tolist() == list(range(5 * i, 5 * i + 5))
        assert example.labels.tolist() == list(range(5 * i + 1, 5 * i + 6))
    # Every byte after the first is a target exactly once (up to the dropped tail).
    targets = [t for example in packed for t in example.labels.tolist()]
    assert targets == list(range(1, 21))
    assert packed.num_targets == 20 and packed.max_length == 5


def test_pack_bytes_exact_fit_and_too_short() -> None:
    assert len(pack_bytes(b"abcdef", seq_len=5)) == 1
    with pytest.raises(UsageError) as error:
        pack_bytes(b"abcde", seq_len=5)
    where, message = where_and_message(error)
    assert where == "--data"
    assert "5 bytes" in message and "needs 6" in message and "smaller --seq-len" in message


def test_read_text_file(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("héllo\n", encoding="utf-8")
    assert read_text_source(path) == "héllo\n".encode()


def test_read_directory_sorted_skipping_binary_hidden_and_empty(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "c.txt").write_bytes(b"third")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_bytes(b"hidden")
    (tmp_path / ".notes").write_bytes(b"hidden")
    assert read_text_source(tmp_path) == b"first\nsecond\nthird"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "does not exist"),
        ("empty file", "is empty"),
        ("empty dir", "no non-empty UTF-8 text files"),
        ("binary dir", "no non-empty UTF-8 text files"),
        ("binary file", "not UTF-8"),
    ],
)
def test_text_source_errors(tmp_path: Path, case: str, expected: str) -> None:
    path = tmp_path / "source"
    if case == "empty file":
        path.write_bytes(b"")
    elif case == "binary file":
        path.write_bytes(b"ok\xff\xfe")
    elif case in ("empty dir", "binary dir"):
        path.mkdir()
        if case == "binary dir":
            (path / "x.bin").write_bytes(b"\x00\xff")
    with pytest.raises(UsageError) as error:
        read_text_source(path)
    where, message = where_and_message(error)
    assert where == "--data" and expected in message


def test_load_data_text_split(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(i % 256 for i in range(101)))
    splits = load_data(path, seq_len=10, val_fraction=0.2)
    assert isinstance(splits, DataSplits) and isinstance(splits.train, TokenDataset)
    assert splits.val is not None
    assert (len(splits.train), len(splits.val)) == (8, 2)
    # The validation set is the tail, after the training set.
    assert splits.val[0].input_ids[0].item() == 80
    assert splits.truncated == 0 and "t.txt" in splits.description


def test_load_data_val_fraction_edges(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 31)
    assert load_data(path, seq_len=10, val_fraction=0.0).val is None
    tiny = load_data(path, seq_len=10, val_fraction=0.01)  # round(3 * 0.01) = 0, but at least 1
    assert tiny.val is not None and (len(tiny.train), len(tiny.val)) == (2, 1)


def test_load_data_val_fraction_leaving_nothing(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"x" * 31)
    assert len(load_data(path, seq_len=15, val_fraction=0.5).train) == 1  # 2 examples: 1 + 1 is fine
    for fraction in (0.5, 1.0):
        with pytest.raises(UsageError) as error:
            load_data(path, seq_len=30, val_fraction=fraction)
        assert where_and_message(error)[0] == "--val-fraction"


def test_load_data_builtin_corpus() -> None:
    splits = load_data(None, seq_len=64, val_fraction=0.1, max_corpus_bytes=6401)
    assert splits.val is not None
    assert (len(splits.train), len(splits.val)) == (90, 10)
    assert splits.description.startswith("Python ") and "standard library" in splits.description


def test_load_data_jsonl_and_bad_suffix(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "abcdef"}\n{"text": "0123456789xyz"}\n', encoding="utf-8")
    splits = load_data(path, seq_len=8, val_fraction=0.0, too_long="truncate")
    assert len(splits.train) == 2 and splits.truncated == 1 and splits.val is None
    skipped = load_data(path, seq_len=8, val_fraction=0.0)  # --too-long skip, the default
    assert len(skipped.train) == 1 and skipped.truncated == 0 and skipped.long_examples.too_long == 1
    other = tmp_path / "d.csv"
    other.write_text("a,b\n")
    with pytest.raises(UsageError) as error:
        load_data(other, seq_len=8, val_fraction=0.0)
    where, message = where_and_message(error)
    assert where == "--data" and ".csv" in message and ".txt" in message and ".jsonl" in message
    with pytest.raises(UsageError) as error:
        load_data(tmp_path / "nope.jsonl", seq_len=8, val_fraction=0.0)
    where, message = where_and_message(error)
    assert where == "--data" and "does not exist" in message


def test_the_fingerprint_is_the_content_not_the_path(tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_bytes(b"some training text, long enough for a few sequences. " * 4)
    by_absolute = load_data(text, 16, 0.0).fingerprint
    monkeypatch.chdir(tmp_path)
    assert load_data(Path("t.txt"), 16, 0.0).fingerprint == by_absolute  # another spelling, the same data
    text.write_bytes(b"other training text, long enough for a few sequences. " * 4)
    assert load_data(Path("t.txt"), 16, 0.0).fingerprint != by_absolute  # the same name, other data
    jsonl = tmp_path / "e.jsonl"
    jsonl.write_text('{"text": "one example"}\n')
    first = load_data(jsonl, 16, 0.0).fingerprint
    jsonl.write_text('{"text": "one exampld"}\n')
    assert load_data(jsonl, 16, 0.0).fingerprint != first
