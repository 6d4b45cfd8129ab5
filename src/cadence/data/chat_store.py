"""Chat data into a token store: each conversation rendered under the model's chat template, its trained tokens
stored as spans (:mod:`cadence.data.chat` finds them; :mod:`cadence.data.store` keeps any number per example).

One route for a chat .jsonl file whatever the model: the byte tokenizer of the built-in models and a model
directory's own tokenizer both go through :func:`chat_recipe`, with the same rules:

- a row that is not a usable conversation (not an object, an unknown role, content that is not text, an empty list)
  is a problem named ``file:line``; any problem refuses the whole set and nothing is stored (as cadence's JSONL
  reader does for text rows);
- a well-formed conversation with nothing to train on is skipped and counted; a set where none is left is refused;
- a template that cannot be used (it raises, leaves the sandbox, has no end of turn to train) refuses the set,
  naming the template and the first row it failed on.

The store's key holds what changes the tokens or the spans: the template's source and its special strings, what is
trained (``--train-on``) and the messages column; the content fingerprint is the file's SHA-256.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from cadence.data.cache import BuildResult, Recipe
from cadence.data.chat import ChatTokenizer, TrainOn, tokenize_conversation
from cadence.data.chat_template import ChatTemplate
from cadence.data.conversation import ChatDataError, ChatTemplateError, NothingToTrain, parse_conversation
from cadence.data.hf import ChatRoute, Tokenizer
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS
from cadence.data.progress import BuildProgress
from cadence.data.store import StoreWriter
from cadence.errors import Problem, UsageError
from cadence.input_files import read_regular_file, read_regular_file_chunks, regular_file_problem

TEMPLATE_LIMIT = 1 << 20
"""The most bytes a --chat-template file may hold."""
MAX_LINE_BYTES = 64 << 20
"""The longest line read as one conversation: a line longer than this is refused, not read into memory whole."""


@dataclass(frozen=True, kw_only=True)
class ChatSettings:
    """How chat rows become examples (from the flags, see :class:`cadence.data.source.Source`)."""

    template: ChatTemplate
    """The chat template the conversations are rendered with."""
    template_flag: str = "--data"
    """The flag a template problem is reported under: --chat-template when the user gave the file."""
    train_on: TrainOn = "assistant"
    """assistant (every assistant turn), last (the final one), all (every token)."""
    messages_field: str | None = None
    """The column holding the messages when it is not one of the formats' own names."""

    def key(self) -> dict[str, Any]:
        """What of these settings changes the tokens or the trained spans: part of the store's key."""
        template = self.template
        return {"template_sha256": hashlib.sha256(template.source.encode("utf-8")).hexdigest(),
                "bos": template.bos_token, "eos": template.eos_token, "end_of_turn": template.end_of_turn,
                "train_on": self.train_on, "messages_field": self.messages_field}


def jsonl_rows(path: Path, digest: Any | None = None) -> Iterator[tuple[int, Any | str, int]]:
    """``(line number, record, bytes)`` for every non-blank line of a .jsonl file (``record`` is a problem, a str,
    when the line is not UTF-8 JSON); ``digest`` (a hashlib object) sees every byte as it is read."""
    pending = b""
    number = 0
    first = True
    for chunk in read_regular_file_chunks(path, where="--data"):
        if digest is not None:
            digest.update(chunk)
        if first:
            # A UTF-8 byte order mark (some Windows editors write one) is not part of the first record.
            chunk = chunk[3:] if chunk.startswith(codecs.BOM_UTF8) else chunk
            first = False
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LINE_BYTES:
            yield number + len(lines) + 1, f"is longer than {MAX_LINE_BYTES >> 20} MiB", len(pending)
            return
        for line in lines:
            number += 1
            yield from _parsed(number, line)
    if pending:
        yield from _parsed(number + 1, pending)


def _parsed(number: int, line: bytes) -> Iterator[tuple[int, Any | str, int]]:
    if not line.strip():
        return
    try:
        record: Any = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        record = f"is not UTF-8 (invalid byte at offset {error.start})"
    except json.JSONDecodeError as error:
        record = f"is not valid JSON ({error.msg} at column {error.colno})"
    except RecursionError:
        record = "is nested too deeply to read"
    yield number, record, len(line) + 1


def first_record(path: Path) -> Any | None:
    """The first non-blank line of a .jsonl file as JSON (None when there is none, or it is not JSON): what tells
    chat data from text and prompt/completion rows."""
    if regular_file_problem(path) is not None:
        return None
    for _, record, _ in jsonl_rows(path):
        return None if isinstance(record, str) else record
    return None


@dataclass
class ChatCounts:
    """What :func:`write_conversations` wrote and skipped."""

    conversations: int = 0
    skipped: int = 0
    examples: int = 0
    turns: int = 0
    tokens: int = 0
    trained: int = 0
    first_skipped: int | None = None


def write_conversations(writer: StoreWriter, split: str, rows: Iterable[tuple[int, Any] | tuple[int, Any, int]], *,
                        tokenizer: Tokenizer, settings: ChatSettings, where: Callable[[int], str],
                        advance: Callable[[int], None] = lambda size: None) -> ChatCounts:
    """Write each row of ``rows`` (``(number, record)``; a str record is a problem found while reading it) into
    ``split`` as the examples of its conversation, with their trained spans. A bad row is a problem named
    ``where(number)``: all of them refuse the set (a UsageError, nothing kept); a template that cannot be used refuses
    it at the first row it fails on; a conversation with nothing to train is skipped and counted."""
    counts = ChatCounts()
    problems: list[Problem] = []
    total_problems = 0
    for number, record, *size in rows:
        advance(size[0] if size else 0)
        message = record if isinstance(record, str) else None
        examples: list[Any] = []
        if message is None:
            try:
                conversation = parse_conversation(record, messages_field=settings.messages_field)
                # Both of cadence's tokenizers (bytes, transformers') tokenize a conversation too.
                examples = tokenize_conversation(conversation, settings.template, cast(ChatTokenizer, tokenizer),
                                                 train_on=settings.train_on)
            except NothingToTrain:
                examples = []
            except ChatTemplateError as error:
                raise UsageError.single(settings.template_flag, (
                    f"the chat template {settings.template.name} cannot be used: {error} (first at {where(number)}); "
                    f"give another with --chat-template FILE")) from None
            except ChatDataError as error:
                message = str(error)
        if message is not None:
            total_problems += 1
            if len(problems) < MAX_REPORTED_PROBLEMS:
                problems.append(Problem(where=where(number), message=message))
            continue
        counts.conversations += 1
        if not examples:
            counts.skipped += 1
            counts.first_skipped = counts.first_skipped or number
            continue
        counts.turns += sum(1 for m in conversation.messages if m["role"] == "assistant")
        for example in examples:
            writer.add_example(split, list(example.ids), loss_start=0, row=number, spans=example.trained)
            counts.examples += 1
            counts.tokens += len(example.ids)
            counts.trained += example.trained_tokens
    if total_problems:
        shown = problems + ([Problem(where=where(-1), message=f"and {total_problems - len(problems)} more bad rows")]
                            if total_problems > len(problems) else [])
        raise UsageError(shown)
    return counts


def _no_examples(what: str, counts: ChatCounts, settings: ChatSettings) -> UsageError:
    why = (f"none of its {counts.conversations:,} conversations has a token to train on (first: line "
           f"{counts.first_skipped}; --train-on {settings.train_on})") if counts.conversations \
        else "it holds no conversation (it is empty or only blank lines)"
    return UsageError.single("--data", f"{what} has no examples: {why}")


def _chat_meta(counts: ChatCounts, settings: ChatSettings) -> dict[str, Any]:
    return {"conversations": counts.conversations, "examples": counts.examples, "assistant_turns": counts.turns,
            "tokens": counts.tokens, "trained_tokens": counts.trained, "template": settings.template.name,
            "train_on": settings.train_on}


def chat_recipe(path: Path, *, tokenizer: Tokenizer, settings: ChatSettings, progress: IO[str] | None) -> Recipe:
    """How a chat .jsonl file becomes an examples store read with ``tokenizer`` (see the module docstring)."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one conversation per line")

    def build(writer: StoreWriter) -> BuildResult:
        digest = hashlib.sha256()
        bar = BuildProgress(f"rendering the conversations of {path}", path.stat().st_size, progress)
        counts = write_conversations(writer, "train", jsonl_rows(path, digest), tokenizer=tokenizer,
                                     settings=settings, where=lambda n: f"{path}:{n}" if n > 0 else str(path),
                                     advance=lambda size: bar.advance(size, 1))
        bar.close()
        if not counts.examples:
            raise _no_examples(str(path), counts, settings)
        return BuildResult(fingerprint="sha256:" + digest.hexdigest(), meta={
            "description": f"chat JSONL file {path}", "source_format": "chat", "path": str(path),
            "rows": counts.conversations, "skipped_rows": {"train": counts.skipped},
            "chat": _chat_meta(counts, settings), "tokenizer_name": tokenizer.name})

    info = path.stat()
    identity = [str(path.resolve()), [["", info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]]]
    options: dict[str, Any] = {"chat": settings.key()}
    return Recipe(kind="examples", source=f"chat JSONL file {path.resolve()}", stat_identity=identity,
                  tokenizer=tokenizer.identity, vocab_size=tokenizer.vocab_size, options=options, build=build,
                  source_bytes=info.st_size)


def dataset_route(tokenizer: Tokenizer, settings: ChatSettings, *, description: str,
                  required_by: str | None) -> ChatRoute:
    """How :func:`cadence.data.hf.hf_recipe` writes a dataset (parquet, json, hf:DIR) whose rows are conversations:
    each split's rows through :func:`write_conversations`, problems named by the split's row."""

    def write(writer: StoreWriter, split: str, dataset: Any, bar: BuildProgress) -> tuple[int, int]:
        rows = ((number, row) for number, row in enumerate(dataset, start=1))
        counts = write_conversations(writer, split, rows, tokenizer=tokenizer, settings=settings,
                                     where=lambda n: f"{description} ({split}) row {n}" if n > 0 else description,
                                     advance=lambda size: bar.advance(1, 1))
        if split == "train" and not counts.examples:
            raise _no_examples(description, counts, settings)
        return counts.conversations, counts.skipped

    return ChatRoute(write=write, key=settings.key(), messages_field=settings.messages_field, required_by=required_by)


def chat_template_for(tokenizer_hf: Any | None, template_file: Path | None) -> tuple[ChatTemplate, str]:
    """The template chat data is rendered with, and the flag its problems are reported under: ``--chat-template
    FILE`` when given; else the model's own tokenizer's template; else the ChatML default (a built-in byte model, or
    a tokenizer without a template), whose turns end with ``<|im_end|>``."""
    bos = getattr(tokenizer_hf, "bos_token", None) or ""
    eos = getattr(tokenizer_hf, "eos_token", None) or ""
    bos, eos = (value if isinstance(value, str) else str(value) for value in (bos, eos))
    if template_file is not None:
        # A regular file of at most 1 MiB (a pipe or a device is refused, not read): real templates are a few KB.
        content = read_regular_file(template_file, where="--chat-template", limit=TEMPLATE_LIMIT)
        try:
            source = content.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UsageError.single("--chat-template", f"{template_file} is not UTF-8 text (invalid byte at offset "
                                                       f"{error.start})") from None
        if not source.strip():
            raise UsageError.single("--chat-template", f"{template_file} is empty; give a Jinja chat template")
        return ChatTemplate(source=source, name=str(template_file), bos_token=bos, eos_token=eos), "--chat-template"
    own = ChatTemplate.from_tokenizer(tokenizer_hf) if tokenizer_hf is not None else None
    if own is not None:
        return own, "--data"
    return ChatTemplate.chatml(bos_token=bos, eos_token=eos), "--data"


def trained_share(meta: Mapping[str, Any]) -> float | None:
    """The share of a chat store's tokens that are trained (None for other stores)."""
    chat = meta.get("chat")
    if not isinstance(chat, Mapping) or not chat.get("tokens"):
        return None
    return float(chat["trained_tokens"]) / float(chat["tokens"])


__all__ = ["ChatCounts", "ChatSettings", "MAX_LINE_BYTES", "TEMPLATE_LIMIT", "chat_recipe", "chat_template_for",
           "dataset_route", "first_record", "jsonl_rows", "trained_share", "write_conversations"]
