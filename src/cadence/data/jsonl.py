"""JSON Lines sources: one variable-length example per line, plain text or prompt + completion.

Every bad line is reported (not just the first), each naming ``file:line``, so a user fixes a file in one pass.
A prompt + completion ends with :data:`cadence.data.batching.BYTE_EOS_ID`, so a model learns to stop.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cadence.data.batching import BYTE_EOS_ID, IGNORE_INDEX, Example, make_example
from cadence.data.choices import TOO_LONG_CHOICES, TooLong
from cadence.data.too_long import tail_shift, too_long_message
from cadence.errors import Problem, UsageError
from cadence.input_files import read_regular_file, read_regular_file_chunks, regular_file_problem

MAX_REPORTED_PROBLEMS = 20
"""Bad lines listed one by one; beyond this, a single "and N more" line keeps the output readable."""

_FORMATS = 'each line must be a JSON object with a "text" string, or "prompt" and "completion" strings'


class LineError(Exception):
    """A problem with one line; carries the message for its :class:`Problem`."""


def _utf8(value: str, key: str) -> bytes:
    """A JSON string as UTF-8 bytes. JSON can spell a lone surrogate (``"\\ud800"``), which is no Unicode text."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        raise LineError(f'"{key}" holds a lone surrogate (\\u{code:04x}), which is not valid Unicode text') from None


def parse_record(line: bytes) -> tuple[bytes, int]:
    """One non-blank line as (its example's bytes, the position of its first target); raises :class:`LineError`.

    ``{"text": t}``: every byte after the first is a target (first target 1). ``{"prompt": p, "completion": c}``:
    the bytes of p + c + :data:`BYTE_EOS_ID`, with the first target at ``len(p)``: position i predicts byte i + 1,
    a loss only on the completion and the end of sequence after it (a text is a document, continued like packed
    text; an answer must end). Nothing here depends on ``--seq-len``: the length limit applies when the example is
    read (:mod:`cadence.data.too_long`).
    """
    try:
        text_line = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LineError(f"not valid UTF-8 (invalid byte at column {error.start + 1})") from None
    try:
        record = json.loads(text_line)
    except json.JSONDecodeError as error:
        raise LineError(f"not valid JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise LineError("nested too deeply to be an example (JSON arrays or objects thousands of levels deep)") from None
    if not isinstance(record, dict):
        raise LineError(f"expected a JSON object, got {type(record).__name__}; {_FORMATS}")

    has_text = "text" in record
    has_pair = "prompt" in record or "completion" in record
    if has_text and has_pair:
        # Ambiguous: we would have to guess whether the loss belongs on everything or on the completion only.
        raise LineError(f'has both "text" and "prompt"/"completion"; {_FORMATS}')
    if has_text:
        text = record["text"]
        if not isinstance(text, str):
            raise LineError(f'"text" must be a string, got {type(text).__name__}')
        if not text:
            raise LineError('"text" is empty; it needs at least 2 bytes (one input and one target)')
        tokens = _utf8(text, "text")
        if len(tokens) < 2:
            raise LineError(f'"text" has {len(tokens)} byte; it needs at least 2 (one input and one target)')
        return tokens, 1
    if has_pair:
        missing = [key for key in ("prompt", "completion") if key not in record]
        if missing:
            raise LineError(f'has no "{missing[0]}"; {_FORMATS}')
        prompt, completion = record["prompt"], record["completion"]
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise LineError(f'"{key}" must be a string, got {type(value).__name__}')
        if not completion:
            raise LineError('"completion" is empty; the loss is on the completion, so it needs at least one byte')
        prompt_bytes, completion_bytes = _utf8(prompt, "prompt"), _utf8(completion, "completion")
        # At least 2 bytes (the completion's and the end's): one input and one target, even with an empty prompt.
        return prompt_bytes + completion_bytes + bytes([BYTE_EOS_ID]), len(prompt_bytes)
    keys = ", ".join(repr(key) for key in list(record)[:5]) or "none"
    raise LineError(f"has neither \"text\" nor \"prompt\"+\"completion\" (keys: {keys}); {_FORMATS}")


def example_at(tokens: bytes, first_target: int, seq_len: int) -> Example:
    """The example of ``tokens`` at ``seq_len``: whole when it fits ``seq_len + 1`` bytes, else truncated as
    ``--too-long truncate`` does (:func:`cadence.data.too_long.tail_shift`: the loss-bearing end is kept)."""
    shift = int(tail_shift(len(tokens), first_target, seq_len))
    kept = tokens[shift : shift + seq_len + 1]
    first = max(first_target, 1) - shift
    labels = [kept[i + 1] if i + 1 >= first else IGNORE_INDEX for i in range(len(kept) - 1)]
    return make_example(kept[:-1], labels)


def no_examples_message(source: object, longer: int, seq_len: int) -> str:
    """Why a source whose every example was skipped as too long has none to train on."""
    return (f"{source} has no example that fits --seq-len {seq_len}: all {longer:,} are longer and --too-long skip "
            f"left them out; give a larger --seq-len, or --too-long truncate")


def problems_error(path: Path, problems: list[Problem], total: int) -> UsageError:
    """Every bad line (the first ``MAX_REPORTED_PROBLEMS``, then one "and N more" line)."""
    shown = problems[:MAX_REPORTED_PROBLEMS]
    if total > MAX_REPORTED_PROBLEMS:
        shown.append(Problem(where=str(path), message=f"and {total - MAX_REPORTED_PROBLEMS} more bad lines"))
    return UsageError(shown)


@dataclass(frozen=True, kw_only=True)
class RangeResult:
    """What one worker found in its byte range of a JSONL file (its tokens and index rows are in part files)."""

    newlines: int
    """Line breaks in the range: where the next range's line numbers start."""
    examples: int
    tokens: int
    problems: list[tuple[int, str]]
    """(line within the range, 1-based; message), at most MAX_REPORTED_PROBLEMS + 1 of them."""
    problem_count: int


def records(content: bytes) -> Iterator[tuple[int, tuple[bytes, int] | LineError]]:
    """(line number, :func:`parse_record`'s result or its error) for every non-blank line of ``content``.

    Split on b"\\n" (not text mode), so a bad byte on one line is reported on that line, not for the file."""
    for lineno, line in enumerate(content.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, parse_record(line)
        except LineError as error:
            yield lineno, error


def parse_range(path: Path, start: int, end: int, part: Path) -> RangeResult:
    """Parse the lines of ``path[start:end]`` (cut at line breaks) into ``part.tok`` (bytes) and ``part.idx``
    (int64 rows: offset within the part, length, first target, line within the range)."""
    content = b"".join(read_regular_file_chunks(path, where="--data", start=start, end=end))
    tokens = bytearray()
    rows: list[tuple[int, int, int, int]] = []
    problems: list[tuple[int, str]] = []
    count = 0
    for lineno, parsed in records(content):
        if isinstance(parsed, LineError):
            count += 1
            if len(problems) <= MAX_REPORTED_PROBLEMS:
                problems.append((lineno, str(parsed)))
            continue
        example, first_target = parsed
        rows.append((len(tokens), len(example), first_target, lineno))
        tokens += example
    if not problems:
        part.with_suffix(".tok").write_bytes(tokens)
        np.asarray(rows, dtype="<i8").reshape(-1, 4).tofile(part.with_suffix(".idx"))
    return RangeResult(newlines=content.count(b"\n"), examples=len(rows), tokens=len(tokens), problems=problems,
                       problem_count=count)


def read_jsonl(path: Path, seq_len: int, too_long: TooLong = "skip") -> tuple[list[Example], int]:
    """Read a ``.jsonl`` file into examples of at most ``seq_len`` positions.

    ``{"text": t}``: the loss is on every byte after the first. ``{"prompt": p, "completion": c}``: the loss is on
    the completion's bytes and the end of sequence after them (:data:`cadence.data.BYTE_EOS_ID`). Other keys are
    ignored (records often carry ids or metadata). An example longer than ``seq_len + 1`` bytes is handled as
    ``too_long`` says (:mod:`cadence.data.too_long`): skipped, truncated (keeping the completion), or an error naming
    its line. Returns the examples and how many were longer (skipped or truncated).

    Raises :class:`UsageError` listing every bad line as ``file:line``, or naming ``--data`` for a missing or empty
    file.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if too_long not in TOO_LONG_CHOICES:
        raise ValueError(f"too_long must be one of {', '.join(TOO_LONG_CHOICES)}, got {too_long!r}")
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one JSON object per line")
    examples: list[Example] = []
    problems: list[Problem] = []
    longer = 0
    # A UTF-8 byte order mark (some Windows editors write one) is not part of the first record.
    content = read_regular_file(path, where="--data").removeprefix(codecs.BOM_UTF8)
    for lineno, parsed in records(content):
        if isinstance(parsed, LineError):
            problems.append(Problem(where=f"{path}:{lineno}", message=str(parsed)))
            continue
        tokens, first_target = parsed
        if len(tokens) > seq_len + 1:
            longer += 1
            if too_long == "error":
                problems.append(Problem(where=f"{path}:{lineno}", message=too_long_message(len(tokens), seq_len,
                                                                                           "bytes")))
            if too_long != "truncate":
                continue
        examples.append(example_at(tokens, first_target, seq_len))
    if problems:
        raise problems_error(path, problems, len(problems))
    if not examples:
        raise UsageError.single("--data", no_examples_message(path, longer, seq_len) if longer else
                                f"{path} has no examples (it is empty or only blank lines)")
    return examples, longer
