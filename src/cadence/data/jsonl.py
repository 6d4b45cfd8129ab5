"""JSON Lines sources: one variable-length example per line, a text or a prompt + completion, read by one route
whatever the model (issue 37: a byte model's reader and datasets' used to apply different rules to the same file).

The rules, the same for every model and every route:

- which fields a row uses (:func:`row_texts`): the prompt and completion (``--prompt-field``, ``--completion-field``)
  when the row has either, else its text (``--text-field``); a row may hold other keys (ids, metadata), and rows of
  both kinds may be mixed in one file. A row holding a text and a prompt/completion trains on the completion (the
  more specific request), as a dataset with both columns does.
- how its texts become one example (:func:`append_example`): the tokenizer's BOS (if it adds one), then the text's
  ids, every one after the first a target, and its EOS where the tokenizer ends texts with it; or BOS, the prompt,
  the completion and the EOS, the loss on the completion and the EOS only (an answer must end: a model that never
  sees the EOS trained never stops).

Every bad line is reported (not just the first), each naming ``file:line``, so a user fixes a file in one pass.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cadence.data.batching import IGNORE_INDEX, Example, make_example
from cadence.data.choices import TOO_LONG_CHOICES, TooLong
from cadence.data.too_long import tail_shift, too_long_message
from cadence.errors import Problem, UsageError
from cadence.input_files import read_regular_file, read_regular_file_chunks, regular_file_problem

if TYPE_CHECKING:
    from cadence.data.tokenizer import Tokenizer

MAX_REPORTED_PROBLEMS = 20
"""Bad lines listed one by one; beyond this, a single "and N more" line keeps the output readable."""

ENCODE_BATCH_ROWS = 1024
"""Rows whose texts a tokenizer encodes in one call (a fast tokenizer encodes a batch in parallel)."""


@dataclass(frozen=True, kw_only=True)
class TextFields:
    """The keys a row's texts are under (``--text-field``, ``--prompt-field``, ``--completion-field``)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"

    def formats(self) -> str:
        """What a row must be, in words, with these keys."""
        return (f'each line must be a JSON object with a "{self.text}" string, or "{self.prompt}" and '
                f'"{self.completion}" strings')

    def is_default(self) -> bool:
        return self == TextFields()


class LineError(Exception):
    """A problem with one line; carries the message for its :class:`Problem`."""


def _checked(value: Any, key: str) -> str:
    """A JSON string that is Unicode text. JSON can spell a lone surrogate (``"\ud800"``), which no encoder takes."""
    if not isinstance(value, str):
        raise LineError(f'"{key}" must be a string, got {type(value).__name__}')
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        raise LineError(f'"{key}" holds a lone surrogate (\\u{code:04x}), which is not valid Unicode text') from None
    return value


def decode_line(line: bytes) -> Any:
    """One non-blank line's JSON value; raises :class:`LineError`."""
    try:
        text_line = line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise LineError(f"not valid UTF-8 (invalid byte at column {error.start + 1})") from None
    try:
        return json.loads(text_line)
    except json.JSONDecodeError as error:
        raise LineError(f"not valid JSON: {error.msg} at column {error.colno}") from None
    except RecursionError:
        raise LineError("nested too deeply to be an example (JSON arrays or objects thousands of levels deep)") from None


def row_texts(record: Any, fields: TextFields) -> tuple[str, str | None]:
    """A row's texts: ``(prompt, completion)``, or ``(text, None)``; raises :class:`LineError` (the rules are in the
    module docstring). A key holding null counts as absent, as a dataset's missing value does."""
    if not isinstance(record, dict):
        raise LineError(f"expected a JSON object, got {type(record).__name__}; {fields.formats()}")
    prompt, completion = record.get(fields.prompt), record.get(fields.completion)
    if prompt is not None or completion is not None:
        if prompt is None or completion is None:
            missing = fields.prompt if prompt is None else fields.completion
            raise LineError(f'has no "{missing}"; {fields.formats()}')
        prompt, completion = _checked(prompt, fields.prompt), _checked(completion, fields.completion)
        if not completion:
            raise LineError(f'"{fields.completion}" is empty; the loss is on the completion, so it needs at least '
                            f'one token')
        return prompt, completion
    text = record.get(fields.text)
    if text is None:
        keys = ", ".join(repr(key) for key in list(record)[:5]) or "none"
        raise LineError(f'has neither "{fields.text}" nor "{fields.prompt}"+"{fields.completion}" (keys: {keys}); '
                        f'{fields.formats()}')
    text = _checked(text, fields.text)
    if not text:
        raise LineError(f'"{fields.text}" is empty; it needs at least one input and one target')
    return text, None


def append_example(buffer: Any, tokenizer: Tokenizer, first: Sequence[int], completion: Sequence[int] | None) -> int:
    """Append one example's ids to ``buffer`` (a bytearray for byte ids, else a list or array of ints): BOS, the text
    (``completion`` None) or the prompt and completion, and the EOS where it belongs. Returns the position of its
    first target (position i predicts token i + 1, so targets start at 1 for a text)."""
    start = len(buffer)
    if tokenizer.bos_id is not None:
        buffer.append(tokenizer.bos_id)
    buffer += first
    if completion is None:
        if tokenizer.eos_id is not None and getattr(tokenizer, "eos_on_text", True):
            buffer.append(tokenizer.eos_id)
        return 1
    first_target = len(buffer) - start
    buffer += completion
    if tokenizer.eos_id is not None:
        buffer.append(tokenizer.eos_id)
    return first_target


def _encoder(tokenizer: Tokenizer) -> Any:
    """texts -> ids of each: bytes for the byte tokenizer (kept as bytes: a 100 MB file is not made into a list of
    ints), the tokenizer's own batch encoding otherwise."""
    if tokenizer.identity == "bytes":
        return lambda texts: [text.encode("utf-8") for text in texts]
    return lambda texts: tokenizer.encode_batch(texts, None) if texts else []  # a fast tokenizer refuses no texts


def records(content: bytes, fields: TextFields) -> Iterator[tuple[int, tuple[str, str | None] | LineError]]:
    """(line number, :func:`row_texts`'s result or its error) for every non-blank line of ``content``.

    Split on b"\\n" (not text mode), so a bad byte on one line is reported on that line, not for the file."""
    for lineno, line in enumerate(content.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, row_texts(decode_line(line), fields)
        except LineError as error:
            yield lineno, error


def examples(content: bytes, fields: TextFields, tokenizer: Tokenizer, unit: str) -> Iterator[
        tuple[int, tuple[Sequence[int], int] | LineError]]:
    """(line number, (the example's ids, its first target) or the line's error) for every non-blank line, the texts
    encoded a batch of rows at a time. An example with no target (a one-token text) is an error of its line."""
    encode = _encoder(tokenizer)
    pending: list[tuple[int, tuple[str, str | None]]] = []

    def flush() -> Iterator[tuple[int, tuple[Sequence[int], int] | LineError]]:
        firsts = encode([texts[0] for _, texts in pending])
        completions = iter(encode([texts[1] for _, texts in pending if texts[1] is not None]))
        for (lineno, texts), first in zip(pending, firsts):
            ids: Any = bytearray() if isinstance(first, bytes) else []
            first_target = append_example(ids, tokenizer, first, next(completions) if texts[1] is not None else None)
            if len(ids) - 1 < max(first_target, 1):
                yield lineno, LineError(f'"{fields.text}" has {len(ids)} {unit}; it needs at least 2 (one input '
                                        f'and one target)')
            else:
                yield lineno, (ids, first_target)
        pending.clear()

    for lineno, parsed in records(content, fields):
        if isinstance(parsed, LineError):
            yield from flush()
            yield lineno, parsed
            continue
        pending.append((lineno, parsed))
        if len(pending) >= ENCODE_BATCH_ROWS:
            yield from flush()
    yield from flush()


def example_at(tokens: Sequence[int], first_target: int, seq_len: int) -> Example:
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


def parse_range(path: Path, start: int, end: int, part: Path, fields: TextFields, tokenizer: Tokenizer,
                dtype: str) -> RangeResult:
    """Parse the lines of ``path[start:end]`` (cut at line breaks) into ``part.tok`` (ids in ``dtype``) and
    ``part.idx`` (int64 rows: offset within the part, length, first target, line within the range)."""
    content = b"".join(read_regular_file_chunks(path, where="--data", start=start, end=end))
    # Bytes stay bytes; a tokenizer's ids go into a list (an array of 32-bit ints would not take a list).
    tokens: Any = bytearray() if np.dtype(dtype) == np.uint8 else []
    rows: list[tuple[int, int, int, int]] = []
    problems: list[tuple[int, str]] = []
    count = 0
    for lineno, parsed in examples(content, fields, tokenizer, _unit(tokenizer)):
        if isinstance(parsed, LineError):
            count += 1
            if len(problems) <= MAX_REPORTED_PROBLEMS:
                problems.append((lineno, str(parsed)))
            continue
        example, first_target = parsed
        rows.append((len(tokens), len(example), first_target, lineno))
        tokens += example
    if not problems:
        np.asarray(tokens, dtype=dtype).tofile(part.with_suffix(".tok"))
        np.asarray(rows, dtype="<i8").reshape(-1, 4).tofile(part.with_suffix(".idx"))
    return RangeResult(newlines=content.count(b"\n"), examples=len(rows), tokens=len(tokens), problems=problems,
                       problem_count=count)


def _unit(tokenizer: Tokenizer) -> str:
    return "byte" if tokenizer.identity == "bytes" else "token"


def read_jsonl(path: Path, seq_len: int, too_long: TooLong = "skip", *, fields: TextFields | None = None,
               tokenizer: Tokenizer | None = None) -> tuple[list[Example], int]:
    """Read a ``.jsonl`` file into examples of at most ``seq_len`` positions, by the rules of the module docstring
    (``tokenizer`` None: bytes, the built-in models' tokens).

    An example longer than ``seq_len + 1`` tokens is handled as ``too_long`` says (:mod:`cadence.data.too_long`):
    skipped, truncated (keeping the completion), or an error naming its line. Returns the examples and how many were
    longer (skipped or truncated).

    Raises :class:`UsageError` listing every bad line as ``file:line``, or naming ``--data`` for a missing or empty
    file.
    """
    from cadence.data.tokenizer import ByteTokenizer

    fields = fields or TextFields()
    tokenizer = tokenizer or ByteTokenizer()
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if too_long not in TOO_LONG_CHOICES:
        raise ValueError(f"too_long must be one of {', '.join(TOO_LONG_CHOICES)}, got {too_long!r}")
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one JSON object per line")
    found: list[Example] = []
    problems: list[Problem] = []
    longer = 0
    # A UTF-8 byte order mark (some Windows editors write one) is not part of the first record.
    content = read_regular_file(path, where="--data").removeprefix(codecs.BOM_UTF8)
    unit = _unit(tokenizer)
    for lineno, parsed in examples(content, fields, tokenizer, unit):
        if isinstance(parsed, LineError):
            problems.append(Problem(where=f"{path}:{lineno}", message=str(parsed)))
            continue
        tokens, first_target = parsed
        if len(tokens) > seq_len + 1:
            longer += 1
            if too_long == "error":
                problems.append(Problem(where=f"{path}:{lineno}", message=too_long_message(len(tokens), seq_len,
                                                                                           unit + "s")))
            if too_long != "truncate":
                continue
        found.append(example_at(tokens, first_target, seq_len))
    if problems:
        raise problems_error(path, problems, len(problems))
    if not found:
        raise UsageError.single("--data", no_examples_message(path, longer, seq_len) if longer else
                                f"{path} has no examples (it is empty or only blank lines)")
    return found, longer
