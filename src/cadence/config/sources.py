"""Where a configuration comes from: defaults <- a TOML file <- flags, with every problem of the file reported.

The TOML keys are TrainConfig's field names (``micro_batch_size``); flags win over the file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_type_hints

from cadence.config.schema import TrainConfig, hint_types
from cadence.config.validate import is_cadence_config, validate
from cadence.errors import Problem, UsageError
from cadence.input_files import read_regular_file
from cadence.records import Kind, Record, RecordInvalid, read_json

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


CONFIG_LIMIT_BYTES = 1 << 20
"""A configuration file is a few dozen lines; anything past 1 MiB is not one (a link to /dev/zero, a wrong file)."""


def _parse_toml(content: bytes, path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(content.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise UsageError.single("--config", f"{path} is not valid TOML: {err}") from None


def load_toml(path: Path) -> dict[str, Any]:
    """Read a TOML config, checking keys and value types against TrainConfig; every problem is reported. A run's
    config.json (written by cadence train) is read too: its recorded configuration, as --resume reads it."""
    where = f"--config {path}"
    if path.is_dir():
        raise UsageError.single("--config", f"{path} is a directory, expected a .toml file (or a run's config.json)")
    if is_cadence_config(path):
        return recorded_values(path, where="--config")
    raw = _parse_toml(read_regular_file(path, where="--config", limit=CONFIG_LIMIT_BYTES), path)
    hints = get_type_hints(TrainConfig)
    values: dict[str, Any] = {}
    problems: list[Problem] = []
    for key, value in raw.items():
        if key not in hints:
            problems.append(Problem(where=where, message=f"unknown key {key!r}; keys are the flag names with '_'"))
            continue
        converted = _convert(value, hints[key])
        if converted is _INVALID:
            problems.append(Problem(where=f"{where}: {key}", message=f"{value!r} is not a valid {_type_name(hints[key])}"))
        else:
            values[key] = converted
    if problems:
        raise UsageError(problems)
    return values


_INVALID = object()


def _type_name(hint: Any) -> str:
    args = hint_types(hint)
    if any(getattr(arg, "__origin__", None) is list for arg in args):
        return "list of strings"
    for kind, name in ((bool, "true or false"), (Path, "path string"), (int, "integer"), (float, "number"),
                       (str, "string")):
        if kind in args:
            return name
    return str(hint)


def field_kind(hint: Any) -> Kind:
    """A TrainConfig field's type as the typed reader's :class:`Kind`: what a recorded configuration (a run's
    config.json, a checkpoint's) must hold for that field; the value comes back as the field's type."""
    def check(value: Any) -> Any:
        converted = _convert(value, hint)
        if converted is _INVALID:
            raise ValueError
        return converted
    name = _type_name(hint)
    return Kind(name if name.startswith("true") else ("an " if name[0] in "aeiou" else "a ") + name, check)


def recorded_config(record: Record) -> dict[str, Any]:
    """The TrainConfig fields of a recorded configuration, each as its field's type; a value of another type (a
    string where a number belongs) is a :class:`RecordInvalid` naming the file and the field. Other keys (the
    resolved extras: fingerprints, versions) and nulls are passed over: what they mean is the reader's to say."""
    hints = get_type_hints(TrainConfig)
    return {key: record.take(key, field_kind(hints[key])) for key in record.data
            if key in hints and record.has(key)}


def _convert(value: Any, hint: Any) -> Any:
    """A TOML value as the field's type, or _INVALID. Integers are accepted for float fields, not the reverse."""
    args = hint_types(hint)
    if any(getattr(arg, "__origin__", None) is list for arg in args):
        return value if isinstance(value, list) and all(isinstance(item, str) for item in value) else _INVALID
    if bool in args:
        return value if isinstance(value, bool) else _INVALID
    if isinstance(value, bool):
        return _INVALID
    if Path in args:
        return Path(value) if isinstance(value, str) and value else _INVALID  # "" would be read as "."
    if int in args and isinstance(value, int):
        return value
    if str in args and isinstance(value, str):
        return value
    if int in args:
        return _INVALID
    if float in args:
        return float(value) if isinstance(value, (int, float)) else _INVALID
    if str in args:
        return value if isinstance(value, str) else _INVALID
    return _INVALID


def _given(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags the user gave: None (and an empty repeatable flag) means not given; repeats become a list."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in flags.items()
            if value is not None and value != ()}


def given_keys(*, toml_path: Path | None, flags: dict[str, Any]) -> set[str]:
    """The fields the user set, in the TOML file or as flags (the rest are defaults)."""
    keys = set(_given(flags))
    if toml_path is not None and toml_path.is_file():
        keys |= set(_good_toml_values(toml_path))
    return keys


def build_config(*, toml_path: Path | None, flags: dict[str, Any]) -> TrainConfig:
    """Defaults <- TOML file <- flags (flags whose value is None were not given).

    Problems in the TOML file and in the flags are reported together: a bad file does not hide a bad flag.
    """
    values: dict[str, Any] = {}
    file_problems: list[Problem] = []
    if toml_path is not None:
        try:
            values = load_toml(toml_path)
        except UsageError as err:
            file_problems = err.problems
            if toml_path.is_file():  # keep the file's good keys so that flag validation still runs
                values = _good_toml_values(toml_path)
    given = _given(flags)
    typed = set(given) | set(values)  # what the user wrote, in the file or as flags (not a resumed run's record)
    if {"epochs", "max_steps"} <= typed:
        file_problems.append(Problem(where="--epochs", message="and --max-steps both set the length of the run; "
                                                               "give one"))
    if given.get("resume") and given.get("out") is not None:
        # --resume --out DIR alone continues the run as it was configured: what the user did not type comes from
        # the run's config.json, not from the defaults (which would differ, and be refused as changing the math).
        values = {**recorded_train_values(Path(given["out"])), **values}
    if "max_steps" in typed and "epochs" not in typed:
        values.pop("epochs", None)  # a typed --max-steps sets the length of a run recorded with --epochs
    values.update(given)
    config = TrainConfig(**values)
    if file_problems:
        try:
            validate(config)
        except UsageError as err:
            raise UsageError(file_problems + err.problems) from None
        raise UsageError(file_problems)
    return config


RECORD_ONLY = ("out", "resume", "plan")
"""Fields of a run's config.json that a resume does not take over: the run directory and --resume are given again,
and a plan's decisions are already in the recorded fields (the plan file may be gone)."""


def recorded_train_values(out: Path) -> dict[str, Any]:
    """The TrainConfig values the run in ``out`` was started with, from its config.json (empty when there is none,
    or it is not cadence's: validation then says what is wrong with --out).

    config.json holds the resolved configuration: the micro-batch size there is the one used, so a run started with
    ``--micro-batch-size auto`` records ``auto_micro_batch`` and resumes as auto; the accumulation is left to derive
    from the recorded effective batch, so that a new --micro-batch-size alone re-splits the same batch."""
    return recorded_values(out / "config.json", where="--out")


def recorded_plan(out: Path) -> str | None:
    """The plan.json the run in ``out`` was trained with (its config.json's ``plan``), None when there is none.

    A resume does not take the plan over as a setting (its decisions are in the recorded fields, and the file may be
    gone), but keeps it on record: the run's report sets the plan's prediction beside what the run measured, before
    and after a resume alike."""
    try:
        recorded = read_json(out / "config.json", where="--out", limit=CONFIG_LIMIT_BYTES)
    except (UsageError, OSError):
        return None
    plan = recorded.get("plan") if isinstance(recorded, dict) else None
    return plan if isinstance(plan, str) and plan else None


def recorded_values(path: Path, *, where: str = "RUN_DIR", strict: bool = True) -> dict[str, Any]:
    """The TrainConfig values of a run's config.json at ``path`` (empty when it is not one); see
    :func:`recorded_train_values`.

    A config.json that is cadence's but holds a value of the wrong type for a field (edited by hand, or crafted) is
    refused naming the file and the field (``where``, the flag that named it, leads the line): taken as it is, the
    field would silently fall back to its default and the run would not be the one recorded. ``strict=False`` drops
    such fields instead (for collecting the good keys beside a problem already reported)."""
    try:
        recorded = read_json(path, where=where, limit=CONFIG_LIMIT_BYTES)
    except (UsageError, OSError):
        return {}
    if not isinstance(recorded, dict) or "effective_batch_size" not in recorded:
        return {}
    hints = get_type_hints(TrainConfig)
    record = Record(recorded, f"{where} {path}")
    values = {}
    for key in recorded:
        if key not in hints or key in RECORD_ONLY or key == "grad_accum_steps" or not record.has(key):
            continue
        try:
            values[key] = record.take(key, field_kind(hints[key]))
        except RecordInvalid:
            if strict:
                raise
    if recorded.get("auto_micro_batch"):
        values["micro_batch_size"] = "auto"
    if values.get("epochs") is not None:
        values.pop("max_steps", None)  # derived from --epochs and the data, again
    return values


def _good_toml_values(path: Path) -> dict[str, Any]:
    """The keys of a TOML file that parse and have the right type (empty if the file is not TOML at all)."""
    if is_cadence_config(path):
        return recorded_values(path, where="--config", strict=False)
    try:
        raw = _parse_toml(read_regular_file(path, where="--config", limit=CONFIG_LIMIT_BYTES), path)
    except UsageError:
        return {}
    hints = get_type_hints(TrainConfig)
    converted = {key: _convert(value, hints[key]) for key, value in raw.items() if key in hints}
    return {key: value for key, value in converted.items() if value is not _INVALID}
