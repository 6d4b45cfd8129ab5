"""Data for training: the built-in corpus, text and JSONL sources, packing, padding and micro-batch order.

Tokens are bytes (0..255), so every source works with the byte-level built-in GPT (vocab size 256).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cadence.data.batching import (
    IGNORE_INDEX,
    PAD_TOKEN_ID,
    Example,
    TokenDataset,
    collate,
    epoch_order,
    iterate_micro_batches,
    make_example,
    micro_batch_indices,
)
from cadence.data.corpus import corpus_bytes, corpus_description, corpus_files, stdlib_root
from cadence.data.jsonl import read_jsonl
from cadence.data.text import pack_bytes, read_text_source
from cadence.errors import UsageError

_ALLOWED_DATA = "a .txt file, a directory of text files, or a .jsonl file (omit --data for the built-in corpus)"


@dataclass(frozen=True, kw_only=True)
class DataSplits:
    """Training and validation data, ready for :func:`iterate_micro_batches`."""

    train: TokenDataset
    """Examples trained on."""
    val: TokenDataset | None
    """Held-out examples (the last ones of the source), or None when ``--val-fraction`` is 0."""
    description: str
    """One line saying where the data came from and how much there is, for logs and reports."""
    truncated: int
    """Examples cut to ``--seq-len`` (JSONL only; packed text is never truncated)."""
    fingerprint: str
    """``sha256:...`` of the source's content (not of its path): a resume compares it, so that rewritten data, or
    other data under the same name, is never mixed into a run, while the same file named another way is accepted."""


def split_validation(examples: TokenDataset, val_fraction: float) -> tuple[TokenDataset, TokenDataset | None]:
    """Hold out the last ``round(len * val_fraction)`` examples (at least 1 when ``val_fraction > 0``).

    The tail (not a random sample) is held out so that, for packed text, validation text never overlaps the
    training text, and the split does not depend on a seed.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise UsageError.single("--val-fraction", f"must be at least 0 and less than 1, got {val_fraction}")
    if val_fraction == 0.0:
        return examples, None
    total = len(examples)
    num_val = max(1, round(total * val_fraction))
    if total - num_val < 1:
        raise UsageError.single(
            "--val-fraction",
            f"holding out {num_val} of {total} examples for validation leaves none to train on; "
            f"use a smaller --val-fraction (or 0), more data, or a smaller --seq-len",
        )
    return examples[: total - num_val], examples[total - num_val :]


def _load_examples(
    data: Path | None, seq_len: int, max_corpus_bytes: int | None
) -> tuple[TokenDataset, str, int, str]:
    """Read the source named by ``--data``: (examples, description, number truncated, content fingerprint)."""
    if data is None:
        raw = corpus_bytes(max_corpus_bytes)
        examples = pack_bytes(raw, seq_len)
        return (examples, f"{corpus_description()}, {len(raw):,} bytes, {len(examples)} sequences of {seq_len}", 0,
                bytes_fingerprint(raw))
    if not data.exists():
        raise UsageError.single("--data", f"{data} does not exist; give {_ALLOWED_DATA}")
    if data.is_dir() or data.suffix.lower() == ".txt":
        raw = read_text_source(data)
        examples = pack_bytes(raw, seq_len)
        kind = "directory" if data.is_dir() else "text file"
        return (examples, f"{kind} {data}, {len(raw):,} bytes, {len(examples)} sequences of {seq_len}", 0,
                bytes_fingerprint(raw))
    if data.suffix.lower() == ".jsonl":
        read, truncated = read_jsonl(data, seq_len)
        examples = TokenDataset(read)
        note = f", {truncated} truncated to {seq_len + 1} bytes" if truncated else ""
        return examples, f"JSONL file {data}, {len(examples)} examples{note}", truncated, files_fingerprint(data)
    suffix = data.suffix or "no suffix"
    raise UsageError.single("--data", f"{data} has {suffix!r}; --data takes {_ALLOWED_DATA}")


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


def load_data(
    data: Path | None,
    seq_len: int,
    val_fraction: float,
    max_corpus_bytes: int | None = None,
) -> DataSplits:
    """Load ``--data`` (None: the built-in corpus) into training and validation examples of at most ``seq_len``.

    ``.txt`` files and directories are packed into sequences of exactly ``seq_len``; ``.jsonl`` examples keep
    their own length (cut to ``seq_len``) and are padded per micro-batch by :func:`collate`.
    ``max_corpus_bytes`` limits only the built-in corpus (tests and quick runs do not need all of it).
    """
    examples, description, truncated, fingerprint = _load_examples(data, seq_len, max_corpus_bytes)
    train, val = split_validation(examples, val_fraction)
    if val is not None:
        description += f"; {len(train)} train / {len(val)} validation"
    return DataSplits(train=train, val=val, description=description, truncated=truncated, fingerprint=fingerprint)


__all__ = [
    "IGNORE_INDEX",
    "PAD_TOKEN_ID",
    "DataSplits",
    "bytes_fingerprint",
    "files_fingerprint",
    "Example",
    "TokenDataset",
    "collate",
    "corpus_bytes",
    "corpus_description",
    "corpus_files",
    "epoch_order",
    "iterate_micro_batches",
    "load_data",
    "make_example",
    "micro_batch_indices",
    "pack_bytes",
    "read_jsonl",
    "read_text_source",
    "stdlib_root",
]
