"""JSON Lines sources: one variable-length example per line, plain text or prompt + completion.

Every bad line is reported (not just the first), each naming ``file:line``, so a user fixes a file in one pass.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from cadence.data.batching import IGNORE_INDEX, Example, make_example
from cadence.errors import Problem, UsageError
from cadence.input_files import read_regular_file, regular_file_problem

MAX_REPORTED_PROBLEMS = 20
"""Bad lines listed one by one; beyond this, a single "and N more" line keeps the output readable."""

_FORMATS = 'each line must be a JSON object with a "text" string, or "prompt" and "completion" strings'


class _LineError(Exception):
    """A problem with one line; carries the message for its :class:`Problem`."""


def _utf8(value: str, key: str) -> bytes:
    """A JSON string as UTF-8 bytes. JSON can spell a lone surrogate (``"\\ud800"``), which is no Unicode text."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        raise _LineError(f'"{key}" holds a lone surrogate (\\u{code:04x}), which is not valid Unicode text') from None


def _parse_line(line: bytes, seq_len: int) -> tuple[Example, bool]:
    """Turn one non-blank line into an example; returns (example, was_truncated) or raises :class:`_LineError`."""
    try:
        text_line = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _LineError(f"not valid UTF-8 (invalid byte at column {error.start + 1})") from None
    try:
        record = json.loads(text_line)
    except json.JSONDecodeError as error:
        raise _LineError(f"not valid JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise _LineError("nested too deeply to be an example (JSON arrays or objects thousands of levels deep)") from None
    if not isinstance(record, dict):
        raise _LineError(f"expected a JSON object, got {type(record).__name__}; {_FORMATS}")

    has_text = "text" in record
    has_pair = "prompt" in record or "completion" in record
    if has_text and has_pair:
        # Ambiguous: we would have to guess whether the loss belongs on everything or on the completion only.
        raise _LineError(f'has both "text" and "prompt"/"completion"; {_FORMATS}')
    limit = seq_len + 1
    if has_text:
        text = record["text"]
        if not isinstance(text, str):
            raise _LineError(f'"text" must be a string, got {type(text).__name__}')
        if not text:
            raise _LineError('"text" is empty; it needs at least 2 bytes (one input and one target)')
        tokens = _utf8(text, "text")
        if len(tokens) < 2:
            raise _LineError(f'"text" has {len(tokens)} byte; it needs at least 2 (one input and one target)')
        truncated = len(tokens) > limit
        tokens = tokens[:limit]
        return make_example(tokens[:-1], tokens[1:]), truncated
    if has_pair:
        missing = [key for key in ("prompt", "completion") if key not in record]
        if missing:
            raise _LineError(f'has no "{missing[0]}"; {_FORMATS}')
        prompt, completion = record["prompt"], record["completion"]
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise _LineError(f'"{key}" must be a string, got {type(value).__name__}')
        if not completion:
            raise _LineError('"completion" is empty; the loss is on the completion, so it needs at least one byte')
        prompt_bytes, completion_bytes = _utf8(prompt, "prompt"), _utf8(completion, "completion")
        full = prompt_bytes + completion_bytes
        if len(full) < 2:
            raise _LineError(
                f"prompt + completion have {len(full)} byte; an example needs at least 2 (one input and one target)"
            )
        truncated = len(full) > limit
        tokens = full[:limit]
        # Position i predicts token i + 1; it carries a loss only if token i + 1 belongs to the completion.
        start = len(prompt_bytes)
        labels = [tokens[i + 1] if i + 1 >= start else IGNORE_INDEX for i in range(len(tokens) - 1)]
        if all(label == IGNORE_INDEX for label in labels):
            raise _LineError(
                f"the completion has no target left after truncating to --seq-len {seq_len} + 1 bytes "
                f"(the prompt alone has {len(prompt_bytes)} bytes); use a larger --seq-len or a shorter prompt"
            )
        return make_example(tokens[:-1], labels), truncated
    keys = ", ".join(repr(key) for key in list(record)[:5]) or "none"
    raise _LineError(f"has neither \"text\" nor \"prompt\"+\"completion\" (keys: {keys}); {_FORMATS}")


def read_jsonl(path: Path, seq_len: int) -> tuple[list[Example], int]:
    """Read a ``.jsonl`` file into examples of at most ``seq_len`` positions.

    ``{"text": t}``: the loss is on every byte after the first. ``{"prompt": p, "completion": c}``: the loss is on
    the completion's bytes only. Other keys are ignored (records often carry ids or metadata). An example longer
    than ``seq_len + 1`` bytes is cut to that length. Returns the examples and how many were cut.

    Raises :class:`UsageError` listing every bad line as ``file:line``, or naming ``--data`` for a missing or empty
    file.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one JSON object per line")
    examples: list[Example] = []
    problems: list[Problem] = []
    truncated = 0
    # Binary split on b"\n" (not text mode) so a bad byte on one line is reported on that line, not for the file.
    # A UTF-8 byte order mark (some Windows editors write one) is not part of the first record.
    content = read_regular_file(path, where="--data").removeprefix(codecs.BOM_UTF8)
    for lineno, line in enumerate(content.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            example, was_truncated = _parse_line(line, seq_len)
        except _LineError as error:
            problems.append(Problem(where=f"{path}:{lineno}", message=str(error)))
            continue
        examples.append(example)
        truncated += was_truncated
    if problems:
        shown = problems[:MAX_REPORTED_PROBLEMS]
        if len(problems) > MAX_REPORTED_PROBLEMS:
            hidden = len(problems) - MAX_REPORTED_PROBLEMS
            shown.append(Problem(where=str(path), message=f"and {hidden} more bad lines"))
        raise UsageError(shown)
    if not examples:
        raise UsageError.single("--data", f"{path} has no examples (it is empty or only blank lines)")
    return examples, truncated
