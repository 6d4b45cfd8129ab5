"""Reading back what cadence wrote (checkpoints, metrics, summaries, configurations) as untrusted input.

A run directory outlives the process that wrote it: it is copied, edited, damaged, or crafted by someone else, and a
manifest recomputed over edited files verifies. So every record cadence reads back is checked like user input, by one
typed reader instead of an ``isinstance`` at each use: a :class:`Record` wraps a JSON object (or a state dict) and
hands out its fields as the type and range the caller states (:meth:`Record.take` with a :class:`Kind`), and anything
else is one :class:`RecordInvalid` naming the file and the field::

    run/summary.json: field 'segments[0].tokens' is 'x', not a count

Each JSON file cadence writes and reads back has one :class:`RecordFile` here, its typed reader and writer: config.json
(:data:`RUN_CONFIG`), metrics.jsonl's rows (:data:`METRICS_ROW`), summary.json (:data:`SUMMARY`), best.json
(:data:`BEST`), a checkpoint's checkpoint.json and manifest.json (:data:`CHECKPOINT_INFO`, :data:`MANIFEST`) and
profile.json (:data:`PROFILE`). A file is read as the user's inputs are (``input_files``: a regular file only, bounded)
and parsed here (:func:`parse_json`, :func:`read_json`, :func:`read_object`), never with a ``json.loads`` of its own.
The caller decides what a refusal means (a resume offers an older checkpoint, a report stops); the reader only says
what is wrong, in one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadence.errors import Problem, UsageError
from cadence.input_files import read_regular_file
from cadence.output_files import atomic_write_json


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
        return cls.of(parse_json(text, source), source)

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
        return self.take(key, COUNT, default)

    def number(self, key: Any, default: Any = REQUIRED) -> float:
        return self.take(key, NUMBER, default)

    def text(self, key: Any, default: Any = REQUIRED) -> str:
        return self.take(key, TEXT, default)

    def flag(self, key: Any, default: Any = REQUIRED) -> bool:
        return self.take(key, FLAG, default)

    def record(self, key: Any, default: Any = REQUIRED) -> Record:
        """A nested object as a record of its own (its fields named from here)."""
        if not self.has(key) and default is not REQUIRED:
            return default
        self.take(key, Kind("an object", lambda value: value if isinstance(value, Mapping) else _refuse()))
        return Record(self.data[key], self.source, self.name(key))

    def records(self, key: Any, default: Any = REQUIRED) -> list[Record]:
        """A list of objects, each a record."""
        if not self.has(key) and default is not REQUIRED:
            return default
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


# ---------------------------------------------------------------------------------------------- record files
class NotJson(RecordInvalid):
    """Text that is not JSON at all (a torn last line of a .jsonl, for instance), apart from JSON of the wrong
    shape."""


def parse_json(text: str | bytes, source: str | Path) -> Any:
    """The JSON value of ``text`` (one file, or one line of a .jsonl); :class:`NotJson` naming ``source`` otherwise."""
    try:
        return json.loads(text)
    except UnicodeDecodeError:
        raise NotJson(source, "", "is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise NotJson(source, "", f"is not valid JSON ({err.msg})") from None
    except RecursionError:
        raise NotJson(source, "", "is nested too deeply") from None


RECORD_LIMIT = 256 << 20
"""The most bytes of a record file read back (a few kilobytes when cadence wrote it; a profile's top operators and a
plan's candidates a few megabytes)."""


def read_json(path: Path, *, where: str, limit: int | None = RECORD_LIMIT) -> Any:
    """The JSON value of the file ``path``, read as the user's other inputs are: a regular file only (a named pipe or
    a link to a device is refused, not read), at most ``limit`` bytes. Any problem is a UsageError naming ``where``
    (the flag or argument that named the file) and the file."""
    content = read_regular_file(path, where=where, limit=limit)
    try:
        return json.loads(content.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UsageError.single(where, f"{path} cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise UsageError.single(where, f"{path} is not valid JSON ({err.msg}, line {err.lineno})") from None
    except RecursionError:
        raise UsageError.single(where, f"{path} is not valid JSON (nested too deeply)") from None


def read_object(path: Path, *, where: str, limit: int | None = RECORD_LIMIT) -> Record:
    """:func:`read_json` of a file that must hold a JSON object, as a record."""
    value = read_json(path, where=where, limit=limit)
    if not isinstance(value, dict):
        raise UsageError.single(where, f"{path} should hold a JSON object, not {type(value).__name__}")
    return Record(value, path)


@dataclass(frozen=True, kw_only=True)
class RecordFile:
    """One JSON file cadence writes and reads back, with its one typed reader and writer: the fields cadence reads
    back, each of its :class:`Kind` (absent or null unless required), the ``marks`` that a file cadence wrote always
    holds (how it is told from another tool's file of the same name), and the most bytes read."""

    name: str
    fields: Mapping[str, Kind]
    marks: tuple[str, ...] = ()
    lists: Mapping[str, Mapping[str, Kind]] = field(default_factory=dict)
    """Lists of objects (summary.json's segments), each item's fields of their kinds."""
    limit: int | None = RECORD_LIMIT

    def check(self, record: Record, *, required: Collection[str] = ()) -> Record:
        """``record`` with every field of its kind (``required`` ones present and not null); RecordInvalid naming the
        file and the first field that is not."""
        for name, kind in self.fields.items():
            record.take(name, kind, default=REQUIRED if name in required else None)
        for name, item_fields in self.lists.items():
            for item in record.records(name, default=[]):
                for item_name, kind in item_fields.items():
                    item.take(item_name, kind, default=None)
        return record

    def parse(self, text: str | bytes, source: str | Path) -> Record:
        """The record in ``text``, checked."""
        return self.check(Record.of(parse_json(text, source), source))

    def read(self, path: Path, *, where: str | None = None) -> Record:
        """The record in the file ``path``, checked. ``where``: the flag or argument that named the file, which
        leads the line of a file that cannot be read or is not a JSON object (else the file itself does)."""
        if where is not None:
            return self.check(read_object(path, where=where, limit=self.limit))
        return self.parse(read_regular_file(path, where=str(path), limit=self.limit), path)

    def missing(self, record: Record) -> list[str]:
        """The marks ``record`` lacks or holds as another kind: a file of this name that cadence did not write."""
        wrong = []
        for name in self.marks:
            try:
                record.take(name, self.fields[name])
            except RecordInvalid:
                wrong.append(name)
        return wrong

    def holds(self, path: Path) -> bool:
        """Whether ``path`` is a file of this record that cadence wrote (readable, an object, every mark there)."""
        try:
            if not path.is_file():
                return False
            return not self.missing(Record.of(parse_json(read_regular_file(path, where=str(path), limit=self.limit),
                                                         path), path))
        except (UsageError, OSError):
            return False

    def write(self, path: Path, value: Mapping[str, Any]) -> None:
        """``value`` as this record's file, written whole or not at all (non-finite numbers as null)."""
        atomic_write_json(path, dict(value))


def _with_text(key: str) -> Kind:
    """An object holding a string under ``key`` (config.json's ``versions``, with cadence's own)."""
    def check(value: Any) -> Any:
        if not isinstance(value, Mapping) or not isinstance(value.get(key), str):
            raise ValueError
        return value
    return Kind(f"an object with a {key!r} string", check)


NUMBERS = list_of(Kind("a finite number or null", lambda value: None if value is None else NUMBER.check(value)))

RUN_CONFIG = RecordFile(
    name="config.json",
    fields={**dict.fromkeys(("effective_batch_size", "grad_accum_steps", "world_size", "seq_len", "model_parameters",
                             "memory_budget_bytes", "train_sequences", "val_sequences"), COUNT),
            "data_fingerprint": TEXT, "model": TEXT, "plan": TEXT, "versions": _with_text("cadence")},
    marks=("effective_batch_size", "grad_accum_steps", "world_size", "data_fingerprint", "versions"),
    limit=1 << 20,
)
"""A run's config.json (``training.run_record``): the resolved configuration. Its marks are the resolved batch, the
data's fingerprint and cadence's version, by which --resume, ``cadence sample`` and ``cadence report`` know a run
cadence trained; the flags' own values are read by their types (``config.sources.recorded_values``)."""

METRICS_ROW = RecordFile(
    name="metrics.jsonl",
    fields={**dict.fromkeys(("window", "tokens", "targets", "samples", "micro_steps", "micro_batch_size",
                             "padded_positions", "epoch", "oom_retries", "peak_memory_bytes"), COUNT),
            **dict.fromkeys(("loss", "val_loss", "val_perplexity", "grad_norm", "lr", "loss_scale", "step_time_s",
                             "tokens_per_s", "grad_noise_scale", "grad_noise_scale_tokens", "compile_time_s"), NUMBER),
            # A preference objective's window-wide metrics (cadence.engine.preference), under TRL's names.
            **dict.fromkeys((prefix + name for prefix in ("", "val_") for name in (
                "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "kl", "nll_loss")), NUMBER),
            "skipped": FLAG, "skip_reason": TEXT},
    limit=None,
)
"""One row of metrics.jsonl (one per optimizer step attempt): the fields cadence reads back (the resume's totals, the
best evaluation, the report); other fields are passed on unread. The file's one reader is
``training.run_dir.read_metrics`` (a torn last line, the mark of a killed run, is dropped)."""

SUMMARY = RecordFile(
    name="summary.json",
    fields={**dict.fromkeys(("steps", "skipped", "windows", "epochs", "tokens", "targets", "samples",
                             "padded_positions", "peak_memory_bytes", "max_rss_bytes", "effective_batch_size",
                             "final_micro_batch_size", "oom_retries", "parameters", "trainable_parameters",
                             "frozen_parameters", "optimizer_state_bytes", "resumed_from_step", "best_val_step",
                             "save_hf_step", "grad_noise_scale_windows"), COUNT),
            **dict.fromkeys(("wall_time_s", "tokens_per_s", "padding_fraction", "final_loss", "final_val_loss",
                             "final_val_perplexity", "best_val_loss", "run_wall_time_s", "compile_time_s",
                             "grad_noise_scale", "grad_noise_scale_tokens", "grad_noise_scale_targets"), NUMBER),
            **dict.fromkeys(("stopped_by", "save_hf", "peak_memory_of", "peak_memory_source"), TEXT),
            "save_hf_files": OBJECT},
    lists={"segments": {"from_step": COUNT, "to_step": COUNT, "tokens": COUNT, "wall_time_s": NUMBER,
                        "step_time_s": NUMBER, "stopped_by": TEXT}},
    limit=64 << 20,
)
"""A run's summary.json (``training.summary``): its totals and segments, null allowed (a resume's segments, the
report, a --save-hf export replaced only while it holds what the run wrote)."""

BEST = RecordFile(name="best.json", fields={"step": COUNT, "val_loss": NUMBER, "val_perplexity": NUMBER},
                  marks=("step", "val_loss"), limit=1 << 20)
"""best/best.json beside --keep-best's weights: the step and validation loss they are of."""

CHECKPOINT_INFO = RecordFile(
    name="checkpoint.json",
    fields={"step": COUNT, "world_size": integer(1), "format": TEXT, "optimizer_format": TEXT, "mid_window": FLAG,
            "config": OBJECT, "resolved_config": OBJECT},
    marks=("step",), limit=64 << 20)
"""A checkpoint's checkpoint.json: its step, format, world size and the configuration of the run that wrote it
(``training.checkpoint.layout.check_contents`` checks the rest a resume reads)."""

MANIFEST = RecordFile(name="manifest.json", fields={"step": COUNT, "format": TEXT, "sha256": OBJECT},
                      marks=("sha256",), limit=64 << 20)
"""A checkpoint's manifest.json, written last: its format and the SHA-256 of every file it vouches for."""

PROFILE = RecordFile(
    name="profile.json",
    fields={"version": integer(), "created": TEXT, "schedule": OBJECT, "step_times_s": NUMBERS, "phases": OBJECT,
            "config": OBJECT, "world_size": integer(1), "tokens_per_s": NUMBER, "mfu": NUMBER, "peak_flops": NUMBER,
            "peak_memory_bytes": COUNT, "phase_shares_sum": NUMBER, "verdict": OBJECT, "trace": TEXT},
    marks=("version", "created", "schedule", "step_times_s", "phases"),
)
"""``cadence profile``'s profile.json (``profiling.profiler``): its marks are the fields every profile holds; the rest
may be absent or null in an older or hand-edited one, and the report shows a dash."""
