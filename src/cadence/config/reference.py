"""The flag reference (docs/FLAGS.md), generated from the schema: every TrainConfig field by section, with its flag,
default, choices, the commands that take it, whether a resume must find it unchanged, and its help text (the field's
docstring). ``python -m cadence.config.reference > docs/FLAGS.md`` (``make flags``) writes it; a test fails when the
checked-in file differs from what this module generates, so the reference cannot drift from the code."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Literal, get_args, get_origin, get_type_hints

from cadence.config.schema import SECTIONS, Section, TrainConfig, flag, read_field_docs

COMMANDS = ("plan", "profile", "verify", "prepare-data")
"""The commands besides train that take some of train's flags (a section names them)."""


def _choices(hint: Any) -> tuple[str, ...]:
    """A Literal's values (inside an Optional too); empty for other types."""
    if get_origin(hint) is Literal:
        return tuple(str(value) for value in get_args(hint))
    return tuple(choice for arg in get_args(hint) for choice in _choices(arg))


def _default(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def reference() -> str:
    """The whole reference, as markdown."""
    hints = get_type_hints(TrainConfig)
    docs = read_field_docs(TrainConfig)
    fields = dataclasses.fields(TrainConfig)
    lines = ["# cadence train: every flag", "",
             "Generated from the schema (`src/cadence/config/schema.py`) by `make flags`; do not edit by hand. Every",
             "flag is also a TOML key with `_` (`micro_batch_size = 4`) and a key of a run's config.json. A section's",
             "flags are taken by `cadence train` and by the commands the section lists. *Resume*: a resume refuses",
             "another value (it changes the gradient, the update or the data).", ""]
    for section in SECTIONS:
        members = [f for f in fields if f.metadata["section"] is section]
        if not members:
            continue
        lines += [f"## {section.title}", "", _taken_by(section), "",
                  "| flag | default | choices | resume | meaning |", "| --- | --- | --- | --- | --- |"]
        for field in members:
            choices = ", ".join(_choices(hints[field.name])) or ""
            lines.append(f"| `{flag(field.name)}` | {_default(field.default)} | {choices} | "
                         f"{'fixed' if field.metadata['changes_math'] else ''} | {_one_line(docs.get(field.name, ''))} |")
        lines.append("")
    return "\n".join(lines)


def _taken_by(section: Section) -> str:
    others = [command for command in COMMANDS if command in section.commands]
    return "Taken by `cadence train`" + (" and " + ", ".join(f"`cadence {c}`" for c in others) if others else "") + "."


def main() -> None:
    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
