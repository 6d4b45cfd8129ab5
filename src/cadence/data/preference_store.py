"""Preference rows into a token store, by TRL's conventions: ``{"prompt", "chosen", "rejected"}`` pairs and
``{"prompt", "completion", "label"}`` unpaired rows (KTO), their texts strings or message lists.

Each sequence is made exactly as supervised fine-tuning makes the same prompt and completion, so a preference run
trains on the tokens an SFT run of the chosen completions would:

- strings: the prompt/completion rule of :func:`cadence.data.jsonl.append_example` (the tokenizer's BOS, the prompt,
  the completion and the end of sequence; the targets the completion and its end);
- message lists (the conversational form): ``{"prompt": [...], "completion": [...]}`` rendered under the chat
  template with the trained spans of chat SFT (:func:`cadence.data.chat.tokenize_conversation`: the completion's
  assistant turns and their ends of turn; the prompt untrained).

A pair is stored as two consecutive examples (chosen, rejected); an unpaired row as one example, its label in
store.json (:func:`cadence.data.preference.store_labels`). Every bad row is named ``file:line`` (a row missing a
field, an empty completion, a label that is not a boolean, a conversational prompt ending with an assistant turn, a
row of the other format), all at once and before anything is kept; a pair whose chosen equals its rejected is
skipped and counted, and a file where every pair is so is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

from cadence.data.cache import BuildResult, Recipe
from cadence.data.chat import ChatTokenizer, tokenize_conversation
from cadence.data.chat_store import ChatSettings, jsonl_rows
from cadence.data.conversation import ChatDataError, ChatTemplateError, parse_conversation
from cadence.data.hf import Tokenizer
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS, append_example
from cadence.data.preference import PreferenceFormat, pack_labels
from cadence.data.progress import BuildProgress
from cadence.data.store import StoreWriter
from cadence.errors import Problem, UsageError
from cadence.input_files import regular_file_problem

FIELDS: dict[PreferenceFormat, tuple[str, ...]] = {"pairs": ("prompt", "chosen", "rejected"),
                                                   "unpaired": ("prompt", "completion", "label")}


def preference_format(record: Any) -> PreferenceFormat | None:
    """The preference format of a row (the first row of a file decides the file's), or None: ``chosen`` and
    ``rejected`` make a pair, ``completion`` with a ``label`` an unpaired row."""
    if not isinstance(record, Mapping):
        return None
    if "chosen" in record or "rejected" in record:
        return "pairs"
    if "label" in record and "completion" in record:
        return "unpaired"
    return None


class RowError(Exception):
    """A problem with one row; carries its message."""


@dataclass
class PreferenceCounts:
    """What a preference file held."""

    rows: int = 0
    samples: int = 0
    identical: int = 0
    """Pairs whose chosen equals their rejected (skipped: they carry no preference)."""
    labels: list[bool] = field(default_factory=list)
    tokens: int = 0
    trained: int = 0
    conversational: int = 0


def row_sequences(record: Any, form: PreferenceFormat, *, tokenizer: Tokenizer, settings: ChatSettings
                  ) -> tuple[list[tuple[list[int], list[tuple[int, int]]]], bool | None]:
    """A row's sequences (pairs: chosen then rejected; unpaired: one), each its ids and its trained spans, and its
    label (unpaired rows); raises :class:`RowError`."""
    if preference_format(record) != form:
        fields = ", ".join(f'"{name}"' for name in FIELDS[form])
        keys = ", ".join(repr(str(key)) for key in list(record)[:6]) if isinstance(record, Mapping) else "none"
        raise RowError(f"is not a {'preference pair' if form == 'pairs' else 'KTO row'}: the file's rows hold {fields} "
                       f"(this row's keys: {keys})")
    for name in FIELDS[form]:
        if record.get(name) is None:
            raise RowError(f'has no "{name}"; a row holds {", ".join(repr(n) for n in FIELDS[form])}')
    label = None
    if form == "unpaired":
        label = record["label"]
        if not isinstance(label, bool):
            raise RowError(f'"label" is {label!r}; it must be true (desirable) or false (undesirable)')
    completions = [record["chosen"], record["rejected"]] if form == "pairs" else [record["completion"]]
    prompt = record["prompt"]
    names = ("chosen", "rejected") if form == "pairs" else ("completion",)
    conversational = isinstance(prompt, list)
    for name, value in zip(("prompt", *names), (prompt, *completions)):
        if isinstance(value, list) != conversational or not isinstance(value, (str, list)):
            raise RowError(f'"{name}" is {type(value).__name__} and "prompt" {type(prompt).__name__}: a row\'s texts '
                           f'are all strings, or all lists of messages')
        if not value:
            raise RowError(f'"{name}" is empty' + ("" if name == "prompt" else "; a completion needs at least one "
                                                                               "token to score"))
    if conversational:
        last = prompt[-1]
        if isinstance(last, Mapping) and last.get("role") == "assistant":
            raise RowError('"prompt" ends with an assistant turn: the completions answer the prompt, so it must end '
                           'with a user (or tool) turn')
        return [_conversation(prompt, completion, tokenizer, settings) for completion in completions], label
    return [_strings(prompt, completion, tokenizer) for completion in completions], label


def _strings(prompt: str, completion: str, tokenizer: Tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    ids: list[int] = []
    start = append_example(ids, tokenizer, list(tokenizer.encode(prompt)), list(tokenizer.encode(completion)))
    return ids, [(start, len(ids))]


def _conversation(prompt: list[Any], completion: list[Any], tokenizer: Tokenizer, settings: ChatSettings
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        conversation = parse_conversation({"prompt": prompt, "completion": completion})
        # Both of cadence's tokenizers (bytes, transformers') tokenize a conversation too.
        examples = tokenize_conversation(conversation, settings.template, cast(ChatTokenizer, tokenizer),
                                         train_on="assistant")
    except ChatTemplateError:
        raise
    except ChatDataError as error:
        raise RowError(str(error)) from None
    if len(examples) != 1:
        raise RowError(f"the completion renders as {len(examples)} examples under the chat template (it rewrites "
                       f"the history of several trained turns); a preference completion is one assistant reply")
    return list(examples[0].ids), list(examples[0].trained)


def write_preferences(writer: StoreWriter, path: Path, form: PreferenceFormat, *, tokenizer: Tokenizer,
                      settings: ChatSettings, digest: Any, bar: BuildProgress) -> PreferenceCounts:
    """Every row of ``path`` into the store's train split (see the module docstring)."""
    counts = PreferenceCounts()
    problems: list[Problem] = []
    total_problems = 0
    for number, record, size in jsonl_rows(path, digest):
        bar.advance(size, 1)
        counts.rows += 1
        try:
            if isinstance(record, str):
                raise RowError(record)
            sequences, label = row_sequences(record, form, tokenizer=tokenizer, settings=settings)
        except ChatTemplateError as error:
            raise UsageError.single(settings.template_flag, (
                f"the chat template {settings.template.name} cannot be used: {error} (first at {path}:{number}); "
                f"give another with --chat-template FILE")) from None
        except RowError as error:
            total_problems += 1
            if len(problems) < MAX_REPORTED_PROBLEMS:
                problems.append(Problem(where=f"{path}:{number}", message=str(error)))
            continue
        if form == "pairs" and sequences[0] == sequences[1]:
            counts.identical += 1
            continue
        for ids, spans in sequences:
            # One run of targets to the end (a string completion) needs no spans: its start is the index's loss start.
            whole = len(spans) == 1 and spans[0][1] == len(ids)
            writer.add_example("train", ids, loss_start=spans[0][0], row=number, spans=None if whole else spans)
            counts.tokens += len(ids)
            counts.trained += sum(end - start for start, end in spans)
        counts.samples += 1
        counts.conversational += isinstance(record.get("prompt"), list)
        if label is not None:
            counts.labels.append(label)
    if total_problems:
        more = total_problems - len(problems)
        raise UsageError(problems + ([Problem(where=str(path), message=f"and {more} more bad rows")] if more else []))
    if not counts.samples:
        why = (f"every one of its {counts.identical:,} pairs has a chosen equal to its rejected: nothing to prefer"
               if counts.identical else "it holds no row (it is empty or only blank lines)")
        raise UsageError.single("--data", f"{path} has no preference {'pair' if form == 'pairs' else 'row'}: {why}")
    return counts


def preference_recipe(path: Path, form: PreferenceFormat, *, tokenizer: Tokenizer, settings: ChatSettings,
                      progress: IO[str] | None) -> Recipe:
    """How a preference .jsonl file becomes an examples store read with ``tokenizer``."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one preference row per line")

    def build(writer: StoreWriter) -> BuildResult:
        digest = hashlib.sha256()
        bar = BuildProgress(f"tokenising the preference rows of {path}", path.stat().st_size, progress)
        counts = write_preferences(writer, path, form, tokenizer=tokenizer, settings=settings, digest=digest, bar=bar)
        bar.close()
        preference: dict[str, Any] = {
            "format": form, "samples": counts.samples, "identical_skipped": counts.identical, "tokens": counts.tokens,
            "trained_tokens": counts.trained, "conversational": counts.conversational}
        if form == "unpaired":
            preference["labels"] = {"train": pack_labels(counts.labels)}
            preference["desirable"] = sum(counts.labels)
        if counts.conversational:
            preference["template"] = settings.template.name
        return BuildResult(fingerprint="sha256:" + digest.hexdigest(), meta={
            "description": f"preference JSONL file {path}", "source_format": "jsonl", "path": str(path),
            "rows": counts.rows, "preference": preference, "tokenizer_name": tokenizer.name})

    info = path.stat()
    identity = [str(path.resolve()), [["", info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]]]
    options: dict[str, Any] = {"preference": form, "chat": settings.key()}
    if tokenizer.bos_id is not None:
        options["bos_id"] = tokenizer.bos_id  # how a too-long sequence keeps its BOS in front (cadence.data.too_long)
    return Recipe(kind="examples", source=f"preference JSONL file {path.resolve()}", stat_identity=identity,
                  tokenizer=tokenizer.identity, vocab_size=tokenizer.vocab_size, options=options, build=build,
                  source_bytes=info.st_size)


__all__ = ["FIELDS", "PreferenceCounts", "preference_format", "preference_recipe", "row_sequences",
           "write_preferences"]
