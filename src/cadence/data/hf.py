"""Hugging Face ``datasets`` sources: ``--data hf:DIR`` (``save_to_disk``), .parquet, .csv and .json files (a .jsonl file
is cadence's own route whatever the model: :mod:`cadence.data.jsonl`).

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
import logging
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cadence.data.cache import BuildResult, Recipe, open_or_build
from cadence.data.choices import TooLong
from cadence.data.conversation import detect_chat_format
from cadence.data.jsonl import TextFields, append_example
from cadence.data.load import files_fingerprint
from cadence.data.progress import BuildProgress
from cadence.data.sources import jsonl_recipe
from cadence.data.splits import DataSplits, splits_from_store
from cadence.data.store import StoreWriter
from cadence.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, as_tokenizer, byte_level_hf_tokenizer
from cadence.errors import UsageError

HF_DATA_PREFIX = "hf:"
"""``--data hf:DIR`` names a dataset written by ``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``)."""

FILE_FORMATS: dict[str, str] = {".parquet": "parquet", ".csv": "csv", ".json": "json"}
"""File suffixes read with ``datasets.load_dataset(<format>, data_files=...)``."""

VALIDATION_SPLITS = ("validation", "valid", "val", "test")
"""Splits of a saved DatasetDict used as the validation set, first found wins."""

_BATCH_ROWS = 1024  # rows tokenised per call: enough for a fast tokenizer's parallelism, little memory
_ALLOWED = "hf:DIR (a datasets.save_to_disk directory), or a .parquet, .csv or .json file"


# ------------------------------------------------------------------------------------------------ sources
def is_hf_data(spec: str | Path) -> bool:
    """True when ``--data`` is read with ``datasets``: ``hf:...`` or a .parquet / .csv / .json file (a .jsonl file is
    cadence's own route, :func:`cadence.data.jsonl.read_jsonl`'s rules, whatever the model)."""
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
    rows = skipped = 0
    for batch in dataset.select_columns(list(fields.values())).iter(batch_size=_BATCH_ROWS):
        # The same example as a JSONL row with these texts (cadence.data.jsonl.append_example); a row JSONL would
        # refuse (a missing or empty text, an empty completion) is skipped here and counted.
        if "--text-field" in fields:
            firsts = _encode(tokenizer, batch[fields["--text-field"]], allow_empty=False)
            completions: list[list[int] | None] = [None] * len(firsts)
        else:  # an empty prompt is allowed (the completion alone), as in cadence.data.jsonl
            firsts = _encode(tokenizer, batch[fields["--prompt-field"]], allow_empty=True)
            completions = _encode(tokenizer, batch[fields["--completion-field"]], allow_empty=False)
        for first, completion in zip(firsts, completions):
            rows += 1
            if first is None or ("--text-field" not in fields and completion is None):
                skipped += 1
                continue
            ids: list[int] = []
            first_target = append_example(ids, tokenizer, first, completion)
            # Position i predicts token i + 1, a target from max(first, 1) on: at least one must exist.
            if len(ids) - 1 < max(first_target, 1):
                skipped += 1
                continue
            writer.add_example(split, ids, loss_start=max(first_target, 1), row=rows)
        progress.advance(len(firsts), len(firsts))
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
    if str(spec).lower().endswith(".jsonl") and not str(spec).startswith(HF_DATA_PREFIX):
        # The one route of a .jsonl file, whatever the model (the rules of cadence.data.jsonl).
        path = Path(spec)
        fields = TextFields(text=text_field, prompt=prompt_field, completion=completion_field)
        recipe = jsonl_recipe(path, progress, tokenizer=as_tokenizer(tokenizer), fields=fields)
        where, lines_of = f"JSONL file {path}", path
    else:
        recipe = hf_recipe(spec, tokenizer=tokenizer, text_field=text_field, prompt_field=prompt_field,
                           completion_field=completion_field, progress=progress)
        where, lines_of = _resolve(spec).describe(), None
    opened = open_or_build(recipe, cache_dir)
    return splits_from_store(opened.store, seq_len=seq_len, val_fraction=val_fraction,
                             from_cache=not opened.built and cache_dir is not None, source=where, lines_of=lines_of,
                             too_long=too_long)


__all__ = [
    "ByteTokenizer", "ChatRoute", "ChatRows", "FILE_FORMATS", "HFTokenizer", "HF_DATA_PREFIX", "Tokenizer",
    "VALIDATION_SPLITS", "as_tokenizer", "byte_level_hf_tokenizer", "hf_recipe", "is_hf_data", "load_hf_data",
]
