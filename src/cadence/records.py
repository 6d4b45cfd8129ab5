"""Reading back what cadence wrote (checkpoints, metrics, summaries, configurations) as untrusted input.

A run directory outlives the process that wrote it: it is copied, edited, damaged, or crafted by someone else, and a
manifest recomputed over edited files verifies. So every record cadence reads back is checked like user input, by one
typed reader instead of an ``isinstance`` at each use: a :class:`Record` wraps a JSON object (or a state dict) and
hands out its fields as the type and range the caller states (:meth:`Record.take` with a :class:`Kind`), and anything
else is one :class:`RecordInvalid` naming the file and the field::

    run/summary.json: field 'segments[0].tokens' is 'x', not a count

The reader parses and checks; reading the bytes is the caller's (``input_files`` for a file named on the command
line, ``training.run_dir.read_record`` for a run directory's). The caller decides what a refusal means (a resume offers an older checkpoint, a report stops); the reader only says
what is wrong, in one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadence.errors import Problem, UsageError


class RecordInvalid(UsageError):
    """A record cadence reads back holds something it did not write: one line naming the file and the field."""

    def __init__(self, source: str | Path, field: str, what: str) -> None:
        self.source, self.field, self.what = str(source), field, what
        super().__init__([Problem(where=self.source, message=f"field '{field}' {what}") if field
                          else _WholeRecord(where=self.source, message=what)])


@dataclass(frozen=True, kw_only=True)
class _WholeRecord(Problem):
    """A problem with a record as a whole, read as a sentence: ``run/metrics.jsonl:2 is not valid JSON``."""

    def __str__(self) -> str:
        return f"{self.where} {self.message}"


class _Wrong(Exception):
    """Raised by a kind's check: the value is not of the kind."""


@dataclass(frozen=True)
class Kind:
    """A type and range a field must have: ``check`` returns the value as the caller gets it, or raises; ``words``
    is what the value should have been, for the message (``a count``)."""

    words: str
    check: Callable[[Any], Any]

    def accept(self, value: Any) -> Any:
        """The value as this kind, or ``_Wrong``."""
        try:
            return self.check(value)
        except (TypeError, ValueError, OverflowError):
            raise _Wrong from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is not the count 1


def integer(at_least: int | None = None, at_most: int | None = None, *, words: str | None = None) -> Kind:
    """A whole number (a JSON integer, never a float or a bool) within the bounds."""
    def check(value: Any) -> int:
        if not _is_int(value) or (at_least is not None and value < at_least) \
                or (at_most is not None and value > at_most):
            raise ValueError
        return int(value)
    span = ("an integer" if at_least is None else "a count" if at_least == 0 and at_most is None
            else f"an integer of at least {at_least}" if at_most is None else f"an integer from {at_least} to {at_most}")
    return Kind(words or span, check)


def number(at_least: float | None = None) -> Kind:
    """A finite number (a JSON integer or float, never a bool or a string), at least ``at_least``; as a float."""
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        result = float(value)
        if not math.isfinite(result) or (at_least is not None and result < at_least):
            raise ValueError
        return result
    return Kind("a finite number" + (f" of at least {at_least:g}" if at_least is not None else ""), check)


def one_of(choices: Collection[Any]) -> Kind:
    """One of the given values (strings, typically)."""
    def check(value: Any) -> Any:
        if isinstance(value, (dict, list)) or value not in choices:
            raise ValueError
        return value
    return Kind("one of " + ", ".join(repr(choice) for choice in choices), check)


def list_of(kind: Kind) -> Kind:
    """A list whose every item is of ``kind``."""
    def check(value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise ValueError
        return [kind.accept(item) for item in value]
    return Kind(f"a list, each {kind.words}", check)


def _typed(kind: type, words: str) -> Kind:
    def check(value: Any) -> Any:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError
        return value
    return Kind(words, check)


COUNT = integer(0)
"""A whole number from 0: steps, windows, tokens."""
NUMBER = number()
"""A finite number."""
TEXT = _typed(str, "a string")
FLAG = _typed(bool, "true or false")
OBJECT = _typed(dict, "an object")


def tensor_kind(*, dtypes: Collection[Any] | None = None, elements: int | None = None, words: str = "a tensor") -> Kind:
    """A torch tensor (of one of ``dtypes``, with exactly ``elements`` elements, when given). torch is imported only
    here: most records are plain JSON."""
    import torch

    def check(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or (dtypes is not None and value.dtype not in dtypes) \
                or (elements is not None and value.numel() != elements):
            raise ValueError
        return value
    return Kind(words, check)


def shown(value: Any) -> str:
    """A value as the message shows it: short, whatever it is (a tensor by its shape, a long list cut)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


REQUIRED: Any = object()
"""``default=REQUIRED``: the field must be there (and not null)."""


class Record:
    """A JSON object (or state dict) read back from ``source``, handing out typed fields; ``field`` is where it sits
    in the file (``segments[0]``), so that a nested record's messages name the whole path."""

    def __init__(self, data: Mapping[Any, Any], source: str | Path, field: str = "") -> None:
        self.data, self.source, self.field = data, str(source), field

    # ---------------------------------------------------------------------------------------------- making one
    @classmethod
    def of(cls, value: Any, source: str | Path, field: str = "") -> Record:
        """``value`` as a record: it must be an object."""
        if not isinstance(value, Mapping):
            raise RecordInvalid(source, field, f"is {shown(value)}, not an object" if field
                                else f"holds {shown(value)}, not a JSON object")
        return cls(value, source, field)

    @classmethod
    def parse(cls, text: str | bytes, source: str | Path) -> Record:
        """A record from JSON text (one file, or one line of a .jsonl)."""
        try:
            value = json.loads(text)
        except UnicodeDecodeError:
            raise RecordInvalid(source, "", "is not UTF-8 text") from None
        except json.JSONDecodeError as err:
            raise RecordInvalid(source, "", f"is not valid JSON ({err.msg})") from None
        except RecursionError:
            raise RecordInvalid(source, "", "is nested too deeply") from None
        return cls.of(value, source)

    # ---------------------------------------------------------------------------------------------- fields
    def name(self, key: Any) -> str:
        """The full name of a field of this record."""
        if isinstance(key, int):
            return f"{self.field}[{key}]"
        return f"{self.field}.{key}" if self.field else str(key)

    def invalid(self, key: Any, what: str) -> RecordInvalid:
        """The error for field ``key``: ``what`` is wrong with it."""
        return RecordInvalid(self.source, self.name(key), what)

    def has(self, key: Any) -> bool:
        return key in self.data and self.data[key] is not None

    def get(self, key: Any, default: Any = None) -> Any:
        """The raw value (unchecked): for fields passed on as they are."""
        return self.data.get(key, default)

    def take(self, key: Any, kind: Kind, default: Any = REQUIRED) -> Any:
        """Field ``key`` as ``kind``; ``default`` when it is absent or null (refused then when it is REQUIRED)."""
        if not self.has(key):
            if default is REQUIRED:
                raise self.invalid(key, "is missing" if key not in self.data else f"is null, not {kind.words}")
            return default
        value = self.data[key]
        try:
            return kind.accept(value)
        except _Wrong:
            raise self.invalid(key, f"is {shown(value)}, not {kind.words}") from None

    def count(self, key: Any, default: Any = REQUIRED) -> int:
        return self.take(key, COUNT, default)  # type: ignore[no-any-return]

    def number(self, key: Any, default: Any = REQUIRED) -> float:
        return self.take(key, NUMBER, default)  # type: ignore[no-any-return]

    def text(self, key: Any, default: Any = REQUIRED) -> str:
        return self.take(key, TEXT, default)  # type: ignore[no-any-return]

    def flag(self, key: Any, default: Any = REQUIRED) -> bool:
        return self.take(key, FLAG, default)  # type: ignore[no-any-return]

    def record(self, key: Any, default: Any = REQUIRED) -> Record:
        """A nested object as a record of its own (its fields named from here)."""
        if not self.has(key) and default is not REQUIRED:
            return default  # type: ignore[no-any-return]
        self.take(key, Kind("an object", lambda value: value if isinstance(value, Mapping) else _refuse()))
        return Record(self.data[key], self.source, self.name(key))

    def records(self, key: Any, default: Any = REQUIRED) -> list[Record]:
        """A list of objects, each a record."""
        if not self.has(key) and default is not REQUIRED:
            return default  # type: ignore[no-any-return]
        items = self.take(key, Kind("a list", lambda value: value if isinstance(value, list) else _refuse()))
        found = []
        for index, item in enumerate(items):
            where = f"{self.name(key)}[{index}]"
            if not isinstance(item, Mapping):
                raise RecordInvalid(self.source, where, f"is {shown(item)}, not an object")
            found.append(Record(item, self.source, where))
        return found


def _refuse() -> Any:
    raise ValueError
