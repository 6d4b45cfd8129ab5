"""The data seam: what ``--data`` is and how its rows become examples, as one frozen value.

As :class:`cadence.engine.cut.Cut` is for the window, :class:`Source` is for the data: made once from the flags
(:meth:`Source.from_flags`, which reads at most the first row of a .jsonl file to tell chat rows from text and
prompt/completion rows), turned back into flags for the run's record and plan.json (:meth:`Source.flags`), said in
words (:meth:`Source.describe`), checked (:meth:`Source.problems`: a field flag that does not apply to the data is an
error, not ignored), and opened (:func:`open_source`: its token store built or found, read at a sequence length) by
every command through one dispatch (:func:`source_recipe`).

The kinds:

- ``corpus``: the built-in corpus (no --data); ``text``: a .txt file or a directory of text, packed;
- ``jsonl``: a .jsonl file of text or prompt/completion rows (the field flags name the keys), read by one route
  whatever the model (:mod:`cadence.data.jsonl`: one set of rules, every bad line named ``file:line``);
- ``chat``: a .jsonl file of conversations (``messages``, conversational prompt/completion lists, ShareGPT
  ``conversations``, or the column --messages-field names), rendered under the model's chat template with an exact
  trained-token mask (:mod:`cadence.data.chat`, :mod:`cadence.data.chat_store`), whatever the model;
- ``pairs`` and ``unpaired``: a .jsonl file of preference rows, ``{"prompt", "chosen", "rejected"}`` pairs or
  ``{"prompt", "completion", "label"}`` unpaired rows (KTO), strings or message lists under the chat template
  (:mod:`cadence.data.preference_store`), each sample two sequences (:mod:`cadence.data.preference`);
- ``datasets``: hf:DIR, .parquet, .csv and .json, read with datasets;
- ``store``: a token store directory written by ``cadence prepare-data``.

Adding a format is one function that turns a record into token ids and trained spans, and one kind here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from cadence.data.cache import Recipe, open_or_build
from cadence.data.chat import TRAIN_ON, TrainOn
from cadence.data.chat_store import ChatSettings, chat_recipe, chat_template_for, dataset_route, first_record
from cadence.data.choices import TooLong
from cadence.data.conversation import detect_chat_format
from cadence.data.hf import as_tokenizer, hf_recipe, is_hf_data
from cadence.data.jsonl import TextFields
from cadence.data.load import byte_recipe, is_store, open_prepared_store
from cadence.data.preference import preference_splits
from cadence.data.preference_store import preference_format, preference_recipe
from cadence.data.sources import BYTES_TOKENIZER, jsonl_recipe
from cadence.data.splits import DataSplits, splits_from_store
from cadence.errors import Problem, UsageError

SourceKind = Literal["corpus", "text", "jsonl", "chat", "pairs", "unpaired", "datasets", "store"]
PREFERENCE_KINDS: tuple[SourceKind, ...] = ("pairs", "unpaired")

FIELD_DEFAULTS: dict[str, Any] = {"text_field": "text", "prompt_field": "prompt", "completion_field": "completion",
                                  "messages_field": None, "chat_template": None, "train_on": "assistant"}
"""The data flags' defaults: a flag at another value was given, and must apply to the data."""


@dataclass(frozen=True, kw_only=True)
class Source:
    """What --data names and how its rows become examples (see the module docstring)."""

    path: Path | None
    """The --data path; None for the built-in corpus."""
    kind: SourceKind
    """What the path holds (decided from its form, and for a .jsonl file from its first row)."""
    text_field: str = "text"
    """The column (or JSONL key) holding a text."""
    prompt_field: str = "prompt"
    """The column holding a prompt (no loss on it)."""
    completion_field: str = "completion"
    """The column holding a completion (the loss is on it)."""
    messages_field: str | None = None
    """Chat data: the column holding the messages list when it is not "messages" (or ShareGPT's "conversations")."""
    chat_template: Path | None = None
    """Chat data: a Jinja chat template file instead of the model's own (or cadence's ChatML default)."""
    train_on: TrainOn = "assistant"
    """Chat data: assistant (every assistant turn), last (only the final assistant turn), all (every token)."""

    # ------------------------------------------------------------------------------------------------ flags
    @classmethod
    def from_flags(cls, flags: Any) -> Source:
        """The source of train's flags (a TrainConfig, or a record's mapping with the same names)."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        raw = get("data", None)
        path = Path(raw) if raw is not None else None
        fields = {name: get(name, default) for name, default in FIELD_DEFAULTS.items()}
        if fields["chat_template"] is not None:
            fields["chat_template"] = Path(fields["chat_template"])
        return cls(path=path, kind=_kind(path, fields["messages_field"]), **fields)

    def flags(self) -> dict[str, Any]:
        """The source as train's flags (the run record's and plan.json's keys)."""
        return {"data": None if self.path is None else str(self.path), "text_field": self.text_field,
                "prompt_field": self.prompt_field, "completion_field": self.completion_field,
                "messages_field": self.messages_field,
                "chat_template": None if self.chat_template is None else str(self.chat_template),
                "train_on": self.train_on}

    def text_fields(self) -> TextFields:
        """The keys a text or prompt/completion row's texts are under."""
        return TextFields(text=self.text_field, prompt=self.prompt_field, completion=self.completion_field)

    def describe(self) -> str:
        """In words, for the console and the report."""
        if self.kind == "corpus":
            return "the built-in corpus"
        if self.kind == "chat":
            trained = {"assistant": "every assistant turn", "last": "the last assistant turn",
                       "all": "every token"}[self.train_on]
            template = f" under {self.chat_template}" if self.chat_template else ""
            return f"chat JSONL file {self.path}{template}, trained on {trained}"
        if self.kind in PREFERENCE_KINDS:
            what = "preference pairs" if self.kind == "pairs" else "unpaired preference rows (KTO)"
            template = f" under {self.chat_template}" if self.chat_template else ""
            return f"JSONL file of {what} {self.path}{template}"
        return {"text": "text", "jsonl": "JSONL file", "datasets": "dataset", "store": "token store"}[self.kind] \
            + f" {self.path}"

    def problems(self, *, byte_level: bool) -> list[Problem]:
        """The data flags that do not apply to this source, each naming its flag (``byte_level``: the model reads
        bytes, whose JSONL reader takes the fields text, prompt and completion as they are named)."""
        given = {name for name, default in FIELD_DEFAULTS.items() if getattr(self, name) != default}
        chat_flags = {"messages_field", "chat_template", "train_on"}
        column_flags = {"text_field", "prompt_field", "completion_field"}
        if self.kind == "chat":
            wrong = given & column_flags
            why = "chat data holds conversations, not text or prompt/completion columns"
        elif self.kind in PREFERENCE_KINDS:
            # Preference rows have TRL's fixed names; a completion is always what is trained (the chat template
            # still renders conversational rows).
            wrong = given - {"chat_template"}
            why = ("preference rows hold TRL's fields (prompt, chosen, rejected; or prompt, completion, label) and "
                   "train on their completions")
        elif self.kind in ("jsonl", "datasets", "store"):
            # A dataset's rows are seen only when it is read: chat flags are checked then (hf_recipe's ChatRoute).
            wrong = given & chat_flags if self.kind != "datasets" else set()
            if self.kind == "store":
                wrong |= given & column_flags
            why = ("applies to chat data (rows holding 'messages', a conversational prompt/completion or ShareGPT "
                   "'conversations'; --messages-field names another column)" if wrong & chat_flags else
                   "a token store's examples are already made")
            if self.messages_field is not None and self.kind == "jsonl":
                why = f"the data's first row has no list of messages in {self.messages_field!r}"
        else:
            wrong = given
            why = f"{self.describe()} is packed text: it has no fields"
        return [Problem(where="--" + name.replace("_", "-"), message=why) for name in sorted(wrong)]


def _kind(path: Path | None, messages_field: str | None) -> SourceKind:
    if path is None:
        return "corpus"
    if is_store(path):
        return "store"
    if is_hf_data(str(path)):
        return "datasets"
    if path.suffix.lower() == ".jsonl" and not path.is_dir():
        record = first_record(path)
        # Before chat: an unpaired row of message lists is a conversational prompt/completion row with a label.
        if messages_field is None and (form := preference_format(record)) is not None:
            return form
        if isinstance(record, Mapping) and detect_chat_format(record, messages_field=messages_field) is not None:
            return "chat"
        return "jsonl"
    return "text"


# ------------------------------------------------------------------------------------------------ opening
def source_recipe(source: Source, tokenizer: Any | None, *, progress: IO[str] | None = None) -> Recipe:
    """How ``source`` becomes a token store read with ``tokenizer`` (None: bytes; a transformers tokenizer): the one
    dispatch every command uses. A store given as --data has no recipe (:func:`open_source` opens it)."""
    if source.kind == "store" or source.path is None and source.kind != "corpus":
        raise ValueError(f"a {source.kind} source is opened, not built")
    if source.kind in ("chat", "datasets", *PREFERENCE_KINDS):
        assert source.path is not None
        template, flag = chat_template_for(getattr(as_tokenizer(tokenizer), "hf_tokenizer", None)
                                           if tokenizer is not None else None, source.chat_template)
        settings = ChatSettings(template=template, template_flag=flag, train_on=source.train_on,
                                messages_field=source.messages_field)
        if source.kind == "chat":
            return chat_recipe(source.path, tokenizer=as_tokenizer(tokenizer), settings=settings, progress=progress)
        if source.kind in PREFERENCE_KINDS:
            return preference_recipe(source.path, "pairs" if source.kind == "pairs" else "unpaired",
                                     tokenizer=as_tokenizer(tokenizer), settings=settings, progress=progress)
        # Parquet, json and saved datasets: conversations when the first row is one (seen only when it is read).
        given = [name for name in ("messages_field", "chat_template", "train_on")
                 if getattr(source, name) != FIELD_DEFAULTS[name]]
        route = dataset_route(as_tokenizer(tokenizer), settings, description=source.describe(),
                              required_by="--" + given[0].replace("_", "-") if given else None)
        return hf_recipe(str(source.path), tokenizer=tokenizer, text_field=source.text_field,
                         prompt_field=source.prompt_field, completion_field=source.completion_field,
                         progress=progress, chat=route)
    if source.kind == "jsonl":  # one route whatever the model (bytes: the byte tokenizer)
        assert source.path is not None
        return jsonl_recipe(source.path, progress, tokenizer=as_tokenizer(tokenizer), fields=source.text_fields())
    if tokenizer is not None:
        raise UsageError.single("--data", "a model with its own tokenizer needs a .jsonl, .parquet, .csv, .json or "
                                          "hf:PATH dataset (packing text is byte-level)")
    return byte_recipe(source.path, progress=progress)


def open_source(source: Source, tokenizer: Any | None, *, seq_len: int, val_fraction: float, cache_dir: Path | None,
                progress: IO[str] | None = None, too_long: TooLong = "skip",
                max_corpus_bytes: int | None = None) -> DataSplits:
    """The training and validation examples of ``source`` at ``seq_len``, through its token store in ``cache_dir``
    (built once, reopened in milliseconds while the source's content is the same)."""
    problems = source.problems(byte_level=tokenizer is None)
    if problems:
        raise UsageError(problems)
    if source.kind == "store":
        assert source.path is not None
        identity = as_tokenizer(tokenizer).identity if tokenizer is not None else BYTES_TOKENIZER
        store = open_prepared_store(source.path, expected_tokenizer=identity)
        if store.meta.get("preference"):
            return preference_splits(store, seq_len=seq_len, val_fraction=val_fraction, from_cache=False,
                                     source=f"token store {source.path}", too_long=too_long)
        return splits_from_store(store, seq_len=seq_len, val_fraction=val_fraction, from_cache=False,
                                 source=f"token store {source.path} ({store.meta.get('description', '')})",
                                 too_long=too_long)
    hf_pad, hf_eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if source.kind in ("chat", "jsonl", "datasets") and hf_pad is not None and hf_pad == hf_eos:
        # trl#1623: tools that mask labels by the pad id then never train the EOS, and the model never stops.
        warnings.warn(f"the tokenizer's pad token is its end of sequence ({getattr(tokenizer, 'eos_token', hf_eos)}): "
                      f"cadence masks padding by position, so every real end of sequence is still trained, but a "
                      f"tool that masks labels by the pad id would not train it", stacklevel=2)
    recipe = source_recipe(source, tokenizer, progress=progress)
    opened = open_or_build(recipe, cache_dir)
    from_cache = not opened.built and cache_dir is not None
    if source.kind in PREFERENCE_KINDS:
        return preference_splits(opened.store, seq_len=seq_len, val_fraction=val_fraction, from_cache=from_cache,
                                 source=source.describe(), too_long=too_long, lines_of=source.path)
    # Messages name file:line for cadence's own readers (text, JSONL, chat), the row for datasets'.
    lines_of = source.path if source.kind in ("text", "jsonl", "chat") else None
    return splits_from_store(opened.store, seq_len=seq_len, val_fraction=val_fraction, from_cache=from_cache,
                             max_stream_tokens=max_corpus_bytes if source.kind == "corpus" else None,
                             source=_described(source, opened.store.meta, byte_level=tokenizer is None),
                             lines_of=lines_of, too_long=too_long)


def _described(source: Source, meta: Mapping[str, Any], *, byte_level: bool) -> str | None:
    """What the console says the data is (None: the store's own description)."""
    if source.kind == "chat":
        chat = meta.get("chat") or {}
        share = (chat.get("trained_tokens", 0) / chat["tokens"]) if chat.get("tokens") else 0.0
        return (f"{source.describe()} ({chat.get('conversations', 0):,} conversations, "
                f"{chat.get('assistant_turns', 0):,} assistant turns, {share:.0%} of tokens trained, template "
                f"{chat.get('template')})")
    if source.kind == "text":
        return f"{'directory' if source.path is not None and source.path.is_dir() else 'text file'} {source.path}"
    if source.kind == "jsonl":
        return source.describe() + ("" if byte_level else f" ({meta.get('tokenizer_name')})")
    # The built-in corpus, and datasets' sources: as their store describes them.
    return None if source.kind == "corpus" else str(meta.get("description") or source.describe())


__all__ = ["FIELD_DEFAULTS", "PREFERENCE_KINDS", "Source", "SourceKind", "TRAIN_ON", "open_source", "source_recipe"]
