"""Hugging Face ``datasets`` sources and tokenizers: ``--data hf:DIR`` (``save_to_disk``), .parquet, .csv, .json(l).

Each row is one example (never packed): a text row puts the loss on every token after the first; a prompt +
completion row puts it on the completion (and the end of sequence after it) only. Rows whose text is empty or
missing, or that have no target at all, are skipped and counted (real datasets have them, and one bad row in 100,000
should not stop a run); rows longer than ``--seq-len`` follow ``--too-long`` (:mod:`cadence.data.too_long`), as
JSONL read by cadence's own reader does.

Tokens: :class:`ByteTokenizer` (bytes 0..255, what the built-in data uses) or :class:`HFTokenizer` over a
transformers tokenizer. Rows are tokenised once into a token store (:mod:`cadence.data.cache`), keyed by the data's
content, the tokenizer and the field names, so a changed input never reuses a stale store.
``datasets`` and ``transformers`` are optional dependencies, imported only when used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from cadence.data.batching import BYTE_EOS_ID, PAD_TOKEN_ID
from cadence.data.cache import BuildResult, Recipe, open_or_build
from cadence.data.chat import detect_chat_format
from cadence.data.choices import TooLong
from cadence.data.load import files_fingerprint
from cadence.data.progress import BuildProgress
from cadence.data.splits import DataSplits, splits_from_store
from cadence.data.store import StoreWriter
from cadence.errors import UsageError

HF_DATA_PREFIX = "hf:"
"""``--data hf:DIR`` names a dataset written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``)."""

FILE_FORMATS: dict[str, str] = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
"""File suffixes read with ``datasets.load_dataset(<format>, data_files=...)``."""

VALIDATION_SPLITS = ("validation", "valid", "val", "test")
"""Splits of a saved DatasetDict used as the validation set, first found wins."""

_BATCH_ROWS = 1024  # rows tokenised per call: enough for a fast tokenizer's parallelism, little memory
_ALLOWED = "hf:DIR (a datasets.save_to_disk directory), or a .parquet, .csv, .json or .jsonl file"


# ------------------------------------------------------------------------------------------------ tokenizers
@runtime_checkable
class Tokenizer(Protocol):
    """Text to ids. Each example gets ``bos_id`` in front and ``eos_id`` at the end, when they are not None (a
    tokenizer whose ``eos_on_text`` attribute is False, as :class:`ByteTokenizer`'s, ends only completions with it)."""

    vocab_size: int  # every id is below this
    bos_id: int | None
    eos_id: int | None

    @property
    def identity(self) -> str: ...  # changes whenever the ids of some text could change (the cache key uses it)

    @property
    def name(self) -> str: ...  # short, for descriptions

    def encode(self, text: str) -> list[int]: ...  # without special tokens

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]: ...


@dataclass(frozen=True, kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: the built-in data's tokens, for models without a tokenizer.

    No BOS: 256 ids leave no room for special tokens. The end of sequence is the control byte
    :data:`cadence.data.batching.BYTE_EOS_ID`, after each completion only (``eos_on_text`` False), which keeps
    examples byte-identical to what :func:`cadence.data.read_jsonl` makes from the same records.
    """

    vocab_size: int = 256
    bos_id: int | None = None
    eos_id: int | None = BYTE_EOS_ID
    eos_on_text: bool = False
    """A text row gets no end of sequence (it is a document, continued as packed text is); a completion does."""
    identity: str = "bytes"
    name: str = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        return [list(text.encode("utf-8")[:max_length]) for text in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """The bytes of ``text`` and, for each, the index of the character it belongs to (a chat template's
        rendering is cut into turns by characters: :mod:`cadence.data.chat`)."""
        ids = list(text.encode("utf-8"))
        if len(ids) == len(text):  # ASCII: one byte per character
            return ids, list(range(len(text)))
        offsets = [index for index, char in enumerate(text) for _ in range(len(char.encode("utf-8")))]
        return ids, offsets

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Strings kept whole as one token: none (every id is a byte)."""
        return ()

    @property
    def hf_tokenizer(self) -> Any:
        """These bytes as a transformers tokenizer (``save_pretrained`` writes it; ``AutoTokenizer`` loads it back),
        for a byte-level model exported with ``--save-hf``: see :func:`byte_level_hf_tokenizer`."""
        return byte_level_hf_tokenizer()

    @property
    def config_token_ids(self) -> dict[str, int | None]:
        """The special-token ids an exported byte-level model's config must carry: a family's defaults (llama's BOS 1
        and EOS 2) mean nothing in bytes, and ``generate`` would stop at byte 0x02."""
        return {"bos_token_id": None, "eos_token_id": self.eos_id, "pad_token_id": PAD_TOKEN_ID}


def byte_level_hf_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` whose ids are the UTF-8 bytes of the text, exactly as cadence reads byte-level
    data: ``encode(text) == list(text.encode())`` for every text, ``decode`` the inverse; EOS is
    :data:`BYTE_EOS_ID` and the pad token :data:`PAD_TOKEN_ID`, no BOS.

    The ``tokenizers`` library (a dependency of transformers) describes it as a BPE without merges whose vocabulary
    holds the 128 ASCII characters as themselves (ids 0..127) and ``<0x80>``..``<0xFF>`` (ids 128..255), with byte
    fallback: every non-ASCII character becomes the bytes of its UTF-8 encoding, all of them 0x80 or above. No
    normaliser and no pre-tokenizer, so no byte is ever changed or dropped. The special tokens are the control
    characters themselves, so they take the ids of their bytes (text holding byte 4 reads it as the end, the same
    id cadence trained on)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {(chr(byte) if byte < 0x80 else f"<0x{byte:02X}>"): byte for byte in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])

    def special(byte: int) -> Any:
        return AddedToken(chr(byte), special=True, normalized=False)

    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=special(BYTE_EOS_ID),
                                   pad_token=special(PAD_TOKEN_ID), clean_up_tokenization_spaces=False)


class HFTokenizer:
    """A transformers tokenizer, encoding without special tokens; cadence adds BOS/EOS itself, per example.

    EOS is appended to every example (and so is a target) when the tokenizer has one: a model fine-tuned without it
    never learns where a text or completion ends. BOS is prepended only when the tokenizer itself adds it by default
    (Llama-style tokenizers), so examples start the way the model saw text in pretraining; gpt2 and qwen2 add none.
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.eos_id: int | None = hf_tokenizer.eos_token_id
        bos = hf_tokenizer.bos_token_id
        with_special, without = (hf_tokenizer.encode("a", add_special_tokens=flag) for flag in (True, False))
        self.bos_id: int | None = bos if bos is not None and with_special[:1] == [bos] != without[:1] else None
        # The serialised fast tokenizer is the whole vocabulary, merges and normalisation: hashing it catches a
        # retrained tokenizer saved under the same name.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        digest = hashlib.sha256(backend.to_str().encode()).hexdigest()[:16] if backend is not None else "slow"
        self.identity = (f"{type(hf_tokenizer).__name__}:{hf_tokenizer.name_or_path}:{self.vocab_size}:{digest}"
                         f":bos={self.bos_id}:eos={self.eos_id}")
        self.name = f"{hf_tokenizer.name_or_path or type(hf_tokenizer).__name__} ({self.vocab_size} tokens)"

    def encode(self, text: str) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
        # Truncating inside the tokenizer keeps a 10 MB document from being tokenised in full to keep 512 tokens.
        limits = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        return [list(ids) for ids in self.hf_tokenizer(list(texts), add_special_tokens=False, **limits)["input_ids"]]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """The ids of ``text`` without special tokens added, and the index of each token's first character (a chat
        template's rendering is cut into turns by characters: :mod:`cadence.data.chat`). Needs a fast tokenizer."""
        if not getattr(self.hf_tokenizer, "is_fast", False):
            raise ValueError(f"{self.name}: chat data needs a fast tokenizer (character offsets of its tokens)")
        encoded = self.hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The strings the tokenizer keeps whole as one token: its added tokens (``<|im_end|>``, ``<tool_call>``)
        and its special tokens (BOS, EOS, ...); where a chat template's turn ends is among them."""
        decoder = getattr(self.hf_tokenizer, "added_tokens_decoder", {})
        added = [getattr(token, "content", str(token)) for token in decoder.values()]
        names = [*added, *getattr(self.hf_tokenizer, "all_special_tokens", [])]
        return tuple(name for name in dict.fromkeys(names) if name)


def as_tokenizer(tokenizer: Any | None) -> Tokenizer:
    """None -> :class:`ByteTokenizer`; a cadence tokenizer as is; a transformers tokenizer -> :class:`HFTokenizer`."""
    if tokenizer is None:
        return ByteTokenizer()
    return tokenizer if isinstance(tokenizer, Tokenizer) else HFTokenizer(tokenizer)


# ------------------------------------------------------------------------------------------------ sources
def is_hf_data(spec: str | Path) -> bool:
    """True when ``--data`` is for :func:`load_hf_data`: ``hf:...`` or a .parquet / .csv / .json file.

    ``.jsonl`` is read by :func:`cadence.data.load_data` for byte-level models; with a real tokenizer, pass it here.
    """
    text = str(spec)
    return text.startswith(HF_DATA_PREFIX) or Path(text).suffix.lower() in (".parquet", ".csv", ".json")


@dataclass(frozen=True, kw_only=True)
class _Source:
    path: Path
    format: str  # "saved" (save_to_disk) or a load_dataset builder name

    def identity(self) -> list[Any]:
        """Path, size, times and inode of every file: cheap, and any rewrite changes it."""
        files = sorted(p for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else [self.path]
        stats = [(p.relative_to(self.path).as_posix() if self.path.is_dir() else "", p.stat()) for p in files]
        return [str(self.path.resolve()), self.format,
                [(name, s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for name, s in stats]]

    def describe(self) -> str:
        return f"{'saved dataset' if self.format == 'saved' else self.format + ' file'} {self.path}"


def _resolve(spec: Path | str) -> _Source:
    text = str(spec)
    prefixed = text.startswith(HF_DATA_PREFIX)
    path = Path(text[len(HF_DATA_PREFIX):] if prefixed else text)
    if not path.exists():
        raise UsageError.single("--data", f"{path} does not exist; give {_ALLOWED}")
    if path.is_dir() and prefixed:
        return _Source(path=path, format="saved")
    if path.is_file() and path.suffix.lower() in FILE_FORMATS:
        return _Source(path=path, format=FILE_FORMATS[path.suffix.lower()])
    raise UsageError.single("--data", f"{text} is not {_ALLOWED}")


class _Captured(logging.Handler):
    """Keeps the error lines datasets logs while it loads: the cause of a failure that its exception only calls
    "An error occurred while generating the dataset", for cadence's one line instead of a line of its own."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[_Captured]:
    """No progress bars or logs from datasets while loading (its errors are captured, not printed), then restore
    its (process-wide) settings."""
    import datasets.utils.logging as ds_logging

    verbosity, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity_error()
    ds_logging.disable_progress_bar()
    library_logger = logging.getLogger("datasets")
    handlers, propagate = list(library_logger.handlers), library_logger.propagate
    captured = _Captured()
    for handler in handlers:
        library_logger.removeHandler(handler)
    library_logger.addHandler(captured)
    library_logger.propagate = False
    try:
        yield captured
    finally:
        library_logger.removeHandler(captured)
        for handler in handlers:
            library_logger.addHandler(handler)
        library_logger.propagate = propagate
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


def _open(source: _Source, arrow_cache: Path) -> dict[str, Any]:
    """``{"train": Dataset}``, plus ``"val"`` and its split name ``"val_name"`` for a saved DatasetDict that has one."""
    try:
        import datasets
    except ImportError:
        raise UsageError.single("--data", "this data needs the datasets package: pip install 'cadence[hf]'") from None
    captured = None
    try:
        with _quiet_datasets() as captured:
            if source.format != "saved":
                # Our own cache_dir: load_dataset would otherwise write Arrow copies under the user's home directory.
                return {"train": datasets.load_dataset(source.format, data_files=str(source.path.resolve()),
                                                       split="train", cache_dir=str(arrow_cache))}
            loaded = datasets.load_from_disk(str(source.path))
    except Exception as error:  # noqa: BLE001 - malformed files raise pyarrow, json and datasets errors alike
        # datasets fails on files without rows with messages that do not say so ("StopIteration").
        empty = source.path.is_file() and source.path.stat().st_size == 0 or "corresponds to no data" in str(error)
        why = "it has no rows" if empty else " ".join(str(error).split())[:300] or type(error).__name__
        if not empty and "error occurred while generating the dataset" in why and captured and captured.lines:
            # datasets logged the real cause ("Failed to read file ... with error <class ...>: ..."): say that.
            cause = re.sub(r"^<class '[\w.]+'>: ", "", captured.lines[-1].split(" with error ", 1)[-1])
            why = " ".join(cause.split())[:300]
        raise UsageError.single("--data", f"could not read {source.describe()}: {why}") from None
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    names = list(loaded)
    train = "train" if "train" in loaded else (names[0] if len(names) == 1 else None)
    if train is None:
        raise UsageError.single("--data", f"{source.path} has splits {', '.join(names)} but no 'train' split")
    splits = {"train": loaded[train]}
    val = next((name for name in VALIDATION_SPLITS if name in loaded and name != train), None)
    if val is not None:
        splits.update(val=loaded[val], val_name=val)
    return splits


# ------------------------------------------------------------------------------------------------ fields
def _choose_fields(dataset: Any, text: str, prompt: str, completion: str) -> dict[str, str]:
    """``{flag: column}``: prompt + completion when both columns exist (the more specific request), else text.

    A dataset often carries both (alpaca has "text" next to its parts); asking for prompt/completion fields that
    exist is taken as wanting the loss on the completion only. Columns must hold strings.
    """
    columns = list(dataset.column_names)
    existing = ", ".join(repr(c) for c in columns) or "none"
    if prompt in columns and completion in columns:
        fields = {"--prompt-field": prompt, "--completion-field": completion}
    elif text in columns:
        fields = {"--text-field": text}
    elif prompt in columns or completion in columns:
        flag, missing = ("--completion-field", completion) if prompt in columns else ("--prompt-field", prompt)
        raise UsageError.single(flag, f"the data has no field {missing!r}; its fields are {existing}")
    else:
        raise UsageError.single("--text-field", (
            f"the data has no field {text!r} (nor {prompt!r} + {completion!r} for --prompt-field/--completion-field); "
            f"its fields are {existing}"))
    for flag, name in fields.items():
        feature = dataset.features[name]
        if getattr(feature, "dtype", None) not in ("string", "large_string", "null"):
            raise UsageError.single(flag, f"field {name!r} holds {feature}, not text")
    return fields


# ------------------------------------------------------------------------------------------------ tokenising
def _encode(tokenizer: Tokenizer, texts: list[Any], allow_empty: bool) -> list[list[int] | None]:
    """Encode the usable texts in one call; None for a missing (null) value, or an empty one unless allowed."""
    usable = [i for i, t in enumerate(texts) if isinstance(t, str) and (allow_empty or t)]
    result: list[list[int] | None] = [None] * len(texts)
    if usable:
        for i, ids in zip(usable, tokenizer.encode_batch([texts[i] for i in usable], None)):
            result[i] = ids
    return result


def _tokenize_into(writer: StoreWriter, split: str, dataset: Any, fields: dict[str, str], tokenizer: Tokenizer,
                   progress: BuildProgress) -> tuple[int, int]:
    """Write every usable row of ``dataset`` as one example of ``split``, untruncated (the store serves every
    ``--seq-len``); returns (rows, rows skipped because they were empty or had no target at all)."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    text_eos = eos if getattr(tokenizer, "eos_on_text", True) else []  # bytes end completions only
    rows = skipped = 0
    for batch in dataset.select_columns(list(fields.values())).iter(batch_size=_BATCH_ROWS):
        if "--text-field" in fields:
            # Every token after the first is a target (with a BOS, the text's first token is predicted from it).
            encoded = _encode(tokenizer, batch[fields["--text-field"]], allow_empty=False)
            pieces = [(bos + ids + text_eos, 1) if ids is not None else None for ids in encoded]
        else:  # an empty prompt is allowed (the completion alone), as in cadence.data.jsonl
            prompts = _encode(tokenizer, batch[fields["--prompt-field"]], allow_empty=True)
            completions = _encode(tokenizer, batch[fields["--completion-field"]], allow_empty=True)
            pieces = [(bos + p + c + eos, len(bos) + len(p)) if p is not None and c is not None else None
                      for p, c in zip(prompts, completions)]
        for piece in pieces:
            rows += 1
            # Position i predicts token i + 1, a target from max(first, 1) on: at least one must exist.
            if piece is None or len(piece[0]) - 1 < max(piece[1], 1):
                skipped += 1
                continue
            writer.add_example(split, piece[0], loss_start=max(piece[1], 1), row=rows)
        progress.advance(len(pieces), len(pieces))
    return rows, skipped


def _holds_conversations(dataset: Any, messages_field: str | None) -> bool:
    """Whether the dataset's rows are chat rows (its first row in one of the chat formats)."""
    return len(dataset) > 0 and detect_chat_format(dataset[0], messages_field=messages_field) is not None


# ------------------------------------------------------------------------------------------------ entry point
ChatRows = Callable[[StoreWriter, str, Any, BuildProgress], tuple[int, int]]
"""Writes a split's rows as conversations (:func:`cadence.data.chat_store.dataset_conversations`): (rows, skipped)."""


@dataclass(frozen=True, kw_only=True)
class ChatRoute:
    """How hf_recipe writes a dataset whose rows are conversations (decided from its first row)."""

    write: ChatRows
    """Writes a split's rows as conversations."""
    key: dict[str, Any]
    """The chat settings that change the tokens (part of the store's key)."""
    messages_field: str | None = None
    """The column --messages-field names, if any."""
    required_by: str | None = None
    """A chat flag the user gave: a dataset that is not chat data is then refused naming it."""


def hf_recipe(spec: Path | str, *, tokenizer: Any | None, text_field: str = "text", prompt_field: str = "prompt",
              completion_field: str = "completion", progress: IO[str] | None = None,
              chat: ChatRoute | None = None) -> Recipe:
    """How a datasets source (``hf:DIR``, .parquet, .csv, .json, .jsonl) becomes a store with ``tokenizer``; with
    ``chat``, a dataset whose rows are conversations is written by it (the chat formats, detected from the first
    row)."""
    source = _resolve(spec)
    tok = as_tokenizer(tokenizer)

    def build(writer: StoreWriter) -> BuildResult:
        fingerprint = files_fingerprint(source.path)
        counts: dict[str, dict[str, int]] = {}
        with tempfile.TemporaryDirectory(prefix="cadence-data-") as arrow_cache:
            # load_dataset's Arrow copies live only until the rows are tokenised: the store is what is kept.
            splits = _open(source, Path(arrow_cache))
            val_name = splits.get("val_name")
            for role in ["train"] + (["val"] if val_name else []):
                dataset = splits[role]
                bar = BuildProgress(f"tokenising {source.describe()} ({role})", len(dataset), progress, unit="rows")
                if chat is not None and _holds_conversations(dataset, chat.messages_field):
                    rows, skipped = chat.write(writer, role, dataset, bar)
                else:
                    if chat is not None and chat.required_by is not None:
                        raise UsageError.single(chat.required_by, (
                            f"applies to chat data; {source.describe()} holds no conversations (its first row has "
                            f"no list of messages)"))
                    fields = _choose_fields(dataset, text_field, prompt_field, completion_field)
                    rows, skipped = _tokenize_into(writer, role, dataset, fields, tok, bar)
                bar.close()
                counts[role] = {"rows": rows, "skipped": skipped}
                if role == "train" and rows == skipped:
                    why = f" (all {rows} rows were empty or had no target)" if rows else ""
                    raise UsageError.single("--data", f"{source.describe()} has no examples{why}")
        return BuildResult(fingerprint=fingerprint, meta={
            "description": source.describe(), "path": str(source.path), "rows": counts["train"]["rows"],
            "skipped_rows": {role: c["skipped"] for role, c in counts.items()}, "val_split": val_name,
            "tokenizer_name": tok.name})

    options: dict[str, Any] = {"format": source.format, "fields": [text_field, prompt_field, completion_field]}
    if chat is not None:
        options["chat"] = chat.key
    if tok.eos_id is not None and not getattr(tok, "eos_on_text", True):
        # Bytes end only completions with their EOS: part of the tokens, so of the key (a tokenizer's own EOS and
        # BOS are in its identity already).
        options["completion_eos"] = tok.eos_id
    if tok.bos_id is not None:
        options["bos_id"] = tok.bos_id  # how splits_from_store knows that examples start with a BOS to keep
    return Recipe(kind="examples", source=source.describe(), stat_identity=source.identity(), tokenizer=tok.identity,
                  vocab_size=tok.vocab_size, options=options, build=build,
                  source_bytes=sum(entry[1] for entry in source.identity()[2]))


def load_hf_data(
    spec: Path | str,
    *,
    seq_len: int,
    tokenizer: Any | None,
    text_field: str = "text",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    val_fraction: float,
    cache_dir: Path | None,
    progress: IO[str] | None = None,
    too_long: TooLong = "skip",
) -> DataSplits:
    """Load ``--data`` through ``datasets`` into tokenised training and validation examples.

    ``tokenizer``: None (bytes), a transformers tokenizer, or a :class:`Tokenizer`. A saved DatasetDict trains on
    "train" and validates on "validation"/"valid"/"val"/"test" when present (``val_fraction`` > 0 asks for
    validation; its value then does not matter); otherwise the last ``val_fraction`` of the examples is held out.
    The tokens go through a token store in ``cache_dir`` (see :mod:`cadence.data.cache`), reused while the data's
    content, the tokenizer and the field names stay the same; ``cache_dir`` None keeps a private store. Rows longer
    than ``seq_len`` are skipped, truncated or refused as ``too_long`` says (:mod:`cadence.data.too_long`).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError.single("--val-fraction", f"must be at least 0 and less than 1, got {val_fraction}")
    recipe = hf_recipe(spec, tokenizer=tokenizer, text_field=text_field, prompt_field=prompt_field,
                       completion_field=completion_field, progress=progress)
    opened = open_or_build(recipe, cache_dir)
    return splits_from_store(opened.store, seq_len=seq_len, val_fraction=val_fraction,
                             from_cache=not opened.built and cache_dir is not None,
                             source=_resolve(spec).describe(), too_long=too_long)


__all__ = [
    "ByteTokenizer", "ChatRoute", "ChatRows", "FILE_FORMATS", "HFTokenizer", "HF_DATA_PREFIX", "Tokenizer",
    "VALIDATION_SPLITS", "as_tokenizer", "byte_level_hf_tokenizer", "hf_recipe", "is_hf_data", "load_hf_data",
]
