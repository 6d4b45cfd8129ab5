"""Tests of JSONL sources: masking, the end of sequence, --too-long, and every error reported with its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.data import BYTE_EOS_ID, IGNORE_INDEX, read_jsonl
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS
from cadence.errors import UsageError

X = IGNORE_INDEX
EOS = BYTE_EOS_ID


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


def test_prompt_completion_masks_the_prompt_and_ends_with_eos(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({"prompt": "Q:", "completion": "ab", "id": 7}))
    (example,), _ = read_jsonl(path, seq_len=16)
    # tokens "Q:ab" + EOS: position 0 predicts ':' (prompt), 1 predicts 'a', 2 'b', and 3 the end of sequence.
    assert example.input_ids.tolist() == list(b"Q:ab")
    assert example.labels.tolist() == [X, ord("a"), ord("b"), EOS]
    assert example.num_targets == 3


def test_empty_prompt_and_multibyte(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({"prompt": "", "completion": "é!"}), json.dumps({"prompt": "", "completion": "a"}))
    example, one_byte = read_jsonl(path, seq_len=16)[0]
    tokens = list("é!".encode()) + [EOS]  # the first byte has nothing to predict it
    assert example.input_ids.tolist() == tokens[:-1]
    assert example.labels.tolist() == tokens[1:]
    # One byte of completion is an example: it predicts the end of sequence.
    assert one_byte.input_ids.tolist() == [ord("a")] and one_byte.labels.tolist() == [EOS]


LONG_LINES = [
    json.dumps({"text": "0123456789"}),  # line 1: 10 bytes > seq_len + 1 = 5
    "",
    "   ",
    json.dumps({"text": "01234"}),  # line 4: exactly 5, fits
    json.dumps({"prompt": "abcdef", "completion": "xy"}),  # line 5: 9 bytes with the EOS; completion fits
    json.dumps({"prompt": "ab", "completion": "cdefgh"}),  # line 6: the completion alone is longer than 4
    json.dumps({"prompt": "a", "completion": "b"}),  # line 7: 3 bytes, fits
]


def test_too_long_skip_is_the_default_and_counts(tmp_path: Path) -> None:
    examples, longer = read_jsonl(write(tmp_path, *LONG_LINES), seq_len=4)
    assert longer == 3 and [e.input_ids.tolist() for e in examples] == [list(b"0123"), list(b"ab")]


def test_too_long_truncate_keeps_the_completion(tmp_path: Path) -> None:
    examples, longer = read_jsonl(write(tmp_path, *LONG_LINES), seq_len=4, too_long="truncate")
    assert longer == 3 and [len(e.input_ids) for e in examples] == [4, 4, 4, 4, 2]
    text, _, prompt_cut, completion_cut, _ = examples
    assert text.labels.tolist() == list(b"1234")  # a text loses its end
    # "abcdef" + "xy" + EOS: the prompt loses its start; the completion and its end of sequence are whole.
    assert prompt_cut.input_ids.tolist() == list(b"efxy") and prompt_cut.labels.tolist() == [X, ord("x"), ord("y"), EOS]
    # "ab" + "cdefgh" + EOS: the completion alone is too long; it starts after the prompt's last byte, loses its end.
    assert completion_cut.input_ids.tolist() == list(b"bcde")
    assert completion_cut.labels.tolist() == list(b"cdef")


def test_too_long_error_names_every_long_line(tmp_path: Path) -> None:
    path = write(tmp_path, *LONG_LINES)
    with pytest.raises(UsageError) as error:
        read_jsonl(path, seq_len=4, too_long="error")
    assert [p.where for p in error.value.problems] == [f"{path}:1", f"{path}:5", f"{path}:6"]
    assert "--seq-len 4" in error.value.problems[0].message and "--too-long" in error.value.problems[0].message


def test_all_too_long_is_no_examples(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as error:
        read_jsonl(write(tmp_path, json.dumps({"text": "0123456789"})), seq_len=4)
    (problem,) = error.value.problems
    assert problem.where == "--data" and "--too-long truncate" in problem.message


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
    ('{"text": "ab", "prompt": "a"}', 'has no "completion"'),
    ('{"prompt": "a", "completion": null}', 'has no "completion"'),
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
