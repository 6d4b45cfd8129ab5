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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cadence.data.cache import BuildResult, Recipe
from cadence.data.chat import (
    ChatDataError,
    ChatTemplate,
    ChatTemplateError,
    NothingToTrain,
    TrainOn,
    parse_conversation,
    tokenize_conversation,
)
from cadence.data.hf import Tokenizer
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS, problems_error
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
class _Counts:
    conversations: int = 0
    skipped: int = 0
    examples: int = 0
    turns: int = 0
    tokens: int = 0
    trained: int = 0
    first_skipped: int | None = None


def chat_recipe(path: Path, *, tokenizer: Tokenizer, settings: ChatSettings, progress: IO[str] | None) -> Recipe:
    """How a chat .jsonl file becomes an examples store read with ``tokenizer`` (see the module docstring)."""
    problem = regular_file_problem(path)
    if problem is not None:
        raise UsageError.single("--data", f"{problem}; give a .jsonl file with one conversation per line")

    def build(writer: StoreWriter) -> BuildResult:
        digest = hashlib.sha256()
        counts = _Counts()
        problems: list[Problem] = []
        total_problems = 0
        bar = BuildProgress(f"rendering the conversations of {path}", path.stat().st_size, progress)
        for number, record, size in jsonl_rows(path, digest):
            bar.advance(size, 1)
            where = f"{path}:{number}"
            message = record if isinstance(record, str) else None
            examples = []
            if message is None:
                try:
                    conversation = parse_conversation(record, messages_field=settings.messages_field)
                    examples = tokenize_conversation(conversation, settings.template, tokenizer,
                                                     train_on=settings.train_on)
                except NothingToTrain:
                    examples = []
                except ChatTemplateError as error:
                    raise UsageError.single(settings.template_flag, (
                        f"the chat template {settings.template.name} cannot be used: {error} (first at {where}); "
                        f"give another with --chat-template FILE")) from None
                except ChatDataError as error:
                    message = str(error)
            if message is not None:
                total_problems += 1
                if len(problems) < MAX_REPORTED_PROBLEMS:
                    problems.append(Problem(where=where, message=message))
                continue
            counts.conversations += 1
            if not examples:
                counts.skipped += 1
                counts.first_skipped = counts.first_skipped or number
                continue
            counts.turns += sum(1 for m in conversation.messages if m["role"] == "assistant")
            for example in examples:
                writer.add_example("train", list(example.ids), loss_start=0, row=number, spans=example.trained)
                counts.examples += 1
                counts.tokens += len(example.ids)
                counts.trained += example.trained_tokens
        bar.close()
        if total_problems:
            raise problems_error(path, problems, total_problems)
        if not counts.examples:
            why = (f"none of its {counts.conversations:,} conversations has a token to train on (first: line "
                   f"{counts.first_skipped}; --train-on {settings.train_on})") if counts.conversations \
                else "it holds no conversation (it is empty or only blank lines)"
            raise UsageError.single("--data", f"{path} has no examples: {why}")
        return BuildResult(fingerprint="sha256:" + digest.hexdigest(), meta={
            "description": f"chat JSONL file {path}", "source_format": "chat", "path": str(path),
            "rows": counts.conversations, "skipped_rows": {"train": counts.skipped},
            "chat": {"conversations": counts.conversations, "examples": counts.examples,
                     "assistant_turns": counts.turns, "tokens": counts.tokens, "trained_tokens": counts.trained,
                     "template": settings.template.name, "train_on": settings.train_on},
            "tokenizer_name": tokenizer.name})

    info = path.stat()
    identity = [str(path.resolve()), [["", info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]]]
    options: dict[str, Any] = {"chat": settings.key()}
    return Recipe(kind="examples", source=f"chat JSONL file {path.resolve()}", stat_identity=identity,
                  tokenizer=tokenizer.identity, vocab_size=tokenizer.vocab_size, options=options, build=build,
                  source_bytes=info.st_size)


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


__all__ = ["ChatSettings", "MAX_LINE_BYTES", "TEMPLATE_LIMIT", "chat_recipe", "chat_template_for", "first_record", "jsonl_rows",
           "trained_share"]
