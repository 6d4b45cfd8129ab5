"""Tests of JSONL sources: masking, truncation, and every error reported with its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.data import IGNORE_INDEX, read_jsonl
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS
from cadence.errors import UsageError

X = IGNORE_INDEX


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8"))
    return path


def test_text_example(tmp_path: Path) -> None:
    examples, truncated = read_jsonl(write(tmp_path, json.dumps({"text": "abcd"})), seq_len=16)
    (example,) = examples
    assert example.input_ids.tolist() == list(b"abc")
    assert example.labels.tolist() == list(b"bcd")
    assert truncated == 0


def test_prompt_completion_masks_the_prompt(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({"prompt": "Q:", "completion": "ab", "id": 7}))
    (example,), _ = read_jsonl(path, seq_len=16)
    # tokens "Q:ab": position 0 predicts ':' (prompt), 1 predicts 'a', 2 predicts 'b'.
    assert example.input_ids.tolist() == list(b"Q:a")
    assert example.labels.tolist() == [X, ord("a"), ord("b")]
    assert example.num_targets == 2


def test_empty_prompt_and_multibyte(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({"prompt": "", "completion": "é!"}))
    (example,), _ = read_jsonl(path, seq_len=16)
    tokens = list("é!".encode())  # 3 bytes; the first has nothing to predict it
    assert example.input_ids.tolist() == tokens[:-1]
    assert example.labels.tolist() == tokens[1:]


def test_truncation_is_counted(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps({"text": "0123456789"}),  # 10 bytes > seq_len + 1 = 5: truncated
        "",
        "   ",
        json.dumps({"text": "01234"}),  # exactly 5: kept whole
        json.dumps({"prompt": "ab", "completion": "cdefgh"}),  # truncated, completion keeps targets
    )
    examples, truncated = read_jsonl(path, seq_len=4)
    assert truncated == 2
    assert [len(e.input_ids) for e in examples] == [4, 4, 4]
    assert examples[0].labels.tolist() == list(b"1234")
    assert examples[2].labels.tolist() == [X, ord("c"), ord("d"), ord("e")]


def test_crlf_and_bom_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "ab"}\r\n{"text": "cd"}\r\n')
    examples, _ = read_jsonl(path, seq_len=8)
    assert [e.input_ids.tolist() for e in examples] == [[ord("a")], [ord("c")]]


BAD_LINES: list[tuple[str, str]] = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('"text"', "expected a JSON object, got str"),
    ('{"content": "abc"}', 'neither "text" nor "prompt"+"completion"'),
    ('{"text": 5}', '"text" must be a string'),
    ('{"text": ""}', '"text" is empty'),
    ('{"text": "a"}', "needs at least 2"),
    ('{"prompt": "a"}', 'has no "completion"'),
    ('{"completion": "a"}', 'has no "prompt"'),
    ('{"prompt": 1, "completion": "a"}', '"prompt" must be a string'),
    ('{"prompt": "a", "completion": ""}', '"completion" is empty'),
    ('{"prompt": "", "completion": "a"}', "at least 2"),
    ('{"prompt": "abcdefgh", "completion": "xy"}', "larger --seq-len"),
    ('{"text": "ab", "prompt": "a", "completion": "b"}', 'both "text" and "prompt"'),
]


def test_every_bad_line_is_reported_with_its_line(tmp_path: Path) -> None:
    # Good lines in between, so line numbers are not simply 1..n.
    lines: list[str] = []
    expected: list[tuple[int, str]] = []
    for bad, message in BAD_LINES:
        lines.append(json.dumps({"text": "fine"}))
        lines.append(bad)
        expected.append((len(lines), message))
    path = write(tmp_path, *lines)
    with pytest.raises(UsageError) as error:
        read_jsonl(path, seq_len=4)
    problems = error.value.problems
    assert len(problems) == len(BAD_LINES)
    for problem, (lineno, message) in zip(problems, expected):
        assert problem.where == f"{path}:{lineno}"
        assert message in problem.message, (problem.message, message)


def test_invalid_utf8_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(UsageError) as error:
        read_jsonl(path, seq_len=4)
    (problem,) = error.value.problems
    assert problem.where == f"{path}:2" and "UTF-8" in problem.message


def test_many_bad_lines_are_capped(tmp_path: Path) -> None:
    path = write(tmp_path, *(["oops"] * (MAX_REPORTED_PROBLEMS + 5)))
    with pytest.raises(UsageError) as error:
        read_jsonl(path, seq_len=4)
    problems = error.value.problems
    assert len(problems) == MAX_REPORTED_PROBLEMS + 1
    assert problems[-2].where == f"{path}:{MAX_REPORTED_PROBLEMS}"
    assert problems[-1].message == "and 5 more bad lines"


@pytest.mark.parametrize("content", [b"", b"\n  \n\n"])
def test_empty_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    with pytest.raises(UsageError) as error:
        read_jsonl(path, seq_len=4)
    (problem,) = error.value.problems
    assert problem.where == "--data" and "no examples" in problem.message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as error:
        read_jsonl(tmp_path / "absent.jsonl", seq_len=4)
    (problem,) = error.value.problems
    assert problem.where == "--data" and "does not exist" in problem.message
