"""Opening ``--data``: which kind of source it names, the byte-level recipes, and the splits read from a store.

Every byte-level source is read through a token store (tokenised once, reopened in milliseconds); a directory holding
a store.json is a store built by ``cadence prepare-data``. :mod:`cadence.data.hf` opens datasets sources the same way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import IO

from cadence.data.cache import Recipe, open_or_build
from cadence.data.choices import TooLong
from cadence.data.sources import BYTES_TOKENIZER, corpus_recipe, jsonl_recipe, text_recipe
from cadence.data.splits import DataSplits, splits_from_store
from cadence.data.store import META_FILE, StoreDamaged, TokenStore
from cadence.errors import UsageError

_ALLOWED_DATA = ("a .txt file, a directory of text files, a .jsonl file ({\"text\"} or {\"prompt\", \"completion\"} per "
                 "line), a .parquet, .csv or .json file, hf:DIR (a datasets save_to_disk directory), or a token store "
                 "directory from cadence prepare-data (omit --data for the built-in corpus)")
"""Every form --data takes (what the message says when a file is none of them; schema.TrainConfig.data lists the
same). Kept whole: a message listing only some of them sends users looking for converters they do not need."""


def is_store(path: Path | None) -> bool:
    """Whether ``--data`` names a token store directory (one with a store.json)."""
    return path is not None and path.is_dir() and (path / META_FILE).is_file()


def open_prepared_store(path: Path, *, expected_tokenizer: str) -> TokenStore:
    """A store given as ``--data``: it must be complete and tokenised the way the model reads tokens."""
    try:
        store = TokenStore.open(path)
    except StoreDamaged as error:
        raise UsageError.single("--data", str(error)) from None
    if store.meta.get("tokenizer") != expected_tokenizer:
        made = store.meta.get("tokenizer_name") or store.meta.get("tokenizer")
        raise UsageError.single("--data", (
            f"{path} was tokenised with {made}, but the model reads {expected_tokenizer.split(':')[0]} tokens; "
            f"build the store with the same --model: cadence prepare-data --data SOURCE --model MODEL --out DIR"))
    return store


def byte_recipe(data: Path | None, *, progress: IO[str] | None = None, workers: int | None = None) -> Recipe:
    """How the byte-level source ``--data`` becomes a store (None: the built-in corpus)."""
    if data is None:
        return corpus_recipe(progress)
    if not data.exists():
        raise UsageError.single("--data", f"{data} does not exist; give {_ALLOWED_DATA}")
    if data.is_dir() or data.suffix.lower() == ".txt":
        return text_recipe(data, progress)
    if data.suffix.lower() == ".jsonl":
        return jsonl_recipe(data, progress, workers=workers)
    suffix = data.suffix or "no suffix"
    raise UsageError.single("--data", f"{data} has {suffix!r}; --data takes {_ALLOWED_DATA}")


def load_data(
    data: Path | None,
    seq_len: int,
    val_fraction: float,
    max_corpus_bytes: int | None = None,
    *,
    cache_dir: Path | None = None,
    progress: IO[str] | None = None,
    workers: int | None = None,
    too_long: TooLong = "skip",
) -> DataSplits:
    """Load ``--data`` (None: the built-in corpus) into training and validation examples of at most ``seq_len``.

    ``.txt`` files and directories are packed into sequences of exactly ``seq_len``; ``.jsonl`` examples keep
    their own length and are padded per micro-batch by :func:`collate`, those longer than ``seq_len`` skipped,
    truncated or refused as ``too_long`` says (:mod:`cadence.data.too_long`); a directory holding a
    store.json is a token store built by ``cadence prepare-data``. Every source is read through a token store in
    ``cache_dir`` (tokenised once, then opened in milliseconds); ``cache_dir`` None builds a private store that
    lives as long as the returned datasets. ``max_corpus_bytes`` limits only the built-in corpus (tests and quick
    runs do not need all of it). ``progress``: where to show a long build's progress (None: nowhere).
    """
    if data is not None and is_store(data):
        store = open_prepared_store(data, expected_tokenizer=BYTES_TOKENIZER)
        return splits_from_store(store, seq_len=seq_len, val_fraction=val_fraction, from_cache=False,
                                 too_long=too_long)
    recipe = byte_recipe(data, progress=progress, workers=workers)
    opened = open_or_build(recipe, cache_dir)
    source = None if data is None else f"{'directory' if data.is_dir() else 'text file'} {data}"
    if data is not None and data.suffix.lower() == ".jsonl" and not data.is_dir():
        source = f"JSONL file {data}"
    return splits_from_store(opened.store, seq_len=seq_len, val_fraction=val_fraction,
                             from_cache=not opened.built and cache_dir is not None,
                             max_stream_tokens=max_corpus_bytes if data is None else None,
                             source=source, lines_of=data, too_long=too_long)


def bytes_fingerprint(content: bytes) -> str:
    """``sha256:HEX`` of a source's bytes."""
    return "sha256:" + hashlib.sha256(content).hexdigest()


def files_fingerprint(path: Path) -> str:
    """``sha256:HEX`` over a file's bytes, or over every regular file of a directory (relative path, then bytes,
    in path order): the content, whatever the path is called."""
    digest = hashlib.sha256()
    files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix()) \
        if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(file.relative_to(path).as_posix().encode("utf-8", "surrogateescape") + b"\0")
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()
