"""Training and validation datasets over a token store, at one ``--seq-len``."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cadence.data.batching import TokenDataset
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS, no_target_message
from cadence.data.store import StoredExamples, TokenStore, usable_rows
from cadence.data.text import pack_tokens
from cadence.errors import Problem, UsageError


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
    """Examples cut to ``--seq-len`` (packed text is never truncated)."""
    fingerprint: str
    """``sha256:...`` of the source's content (not of its path): a resume compares it, so that rewritten data, or
    other data under the same name, is never mixed into a run, while the same file named another way is accepted."""
    store: Path | None = None
    """The token store the examples are read from (None for examples built in memory)."""
    store_digest: str | None = None
    """The store's :attr:`TokenStore.digest` (which tokens exactly), for a resume to compare."""
    vocab_size: int | None = None
    """Every token id is below this (the store verified it): the model's vocabulary must hold it."""


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


def splits_from_store(store: TokenStore, *, seq_len: int, val_fraction: float, from_cache: bool,
                      max_stream_tokens: int | None = None, source: str | None = None,
                      lines_of: Path | None = None) -> DataSplits:
    """The store's examples at ``seq_len``, split into training and validation.

    A stream is cut into sequences of exactly ``seq_len``; ``max_stream_tokens`` keeps only its start (quick runs
    and tests on the built-in corpus). Examples are cut to ``seq_len + 1`` tokens; one left without a target (a
    prompt longer than the sequence) is an error naming its line for JSONL, and skipped and counted for datasets,
    whose real-world rows often have such outliers. ``source`` (the description's start) and ``lines_of`` (the file
    that ``file:line`` messages name) default to what the store recorded; callers pass the user's own spelling."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    meta = store.meta
    source = source or meta.get("description") or str(store.path)
    cache_note = "; tokens from the cache" if from_cache else ""
    if store.kind == "stream":
        tokens = store.tokens if max_stream_tokens is None else store.tokens.prefix(max_stream_tokens)
        fingerprint = store.fingerprint if max_stream_tokens is None or max_stream_tokens >= len(store.tokens) \
            else "sha256:" + hashlib.sha256(tokens[:].tobytes()).hexdigest()
        examples = pack_tokens(tokens, seq_len)
        description = f"{source}, {len(tokens):,} bytes, {len(examples)} sequences of " \
                      f"{seq_len}"
        train, val = split_validation(examples, val_fraction)
        if val is not None:
            description += f"; {len(train)} train / {len(val)} validation"
        return DataSplits(train=train, val=val, description=description + cache_note, truncated=0,
                          fingerprint=fingerprint, store=store.path, store_digest=store.digest,
                          vocab_size=int(meta["vocab_size"]))

    strict = meta.get("source_format") == "jsonl"
    parts: dict[str, tuple[StoredExamples, int]] = {}
    skipped = 0
    in_use = [split for split in store.indexes if split == "train" or (split == "val" and val_fraction > 0)]
    for split in in_use:
        index = store.indexes[split]
        skipped += int((meta.get("skipped_rows") or {}).get(split, 0))
        usable, unusable, truncated = usable_rows(index, seq_len)
        if len(unusable) and strict:
            where = str(lines_of or meta.get("path") or store.path)
            problems = [Problem(where=f"{where}:{int(index[row, 3])}",
                                message=no_target_message(seq_len, int(index[row, 2])))
                        for row in unusable[:MAX_REPORTED_PROBLEMS]]
            if len(unusable) > MAX_REPORTED_PROBLEMS:
                problems.append(Problem(where=where, message=f"and {len(unusable) - MAX_REPORTED_PROBLEMS} more bad "
                                                             f"lines"))
            raise UsageError(problems)
        skipped += len(unusable)
        parts[split] = (StoredExamples(store.tokens, index, seq_len, usable), truncated)
    train_all, truncated = parts["train"]
    if not len(train_all):
        rows = int(meta.get("rows", 0))
        why = f" (all {rows} rows were empty or had no target)" if rows else ""
        raise UsageError.single("--data", f"{source} has no examples{why}")
    description = f"{source}, {len(train_all)} examples"
    if meta.get("tokenizer_name") and meta.get("tokenizer") != "bytes":
        description += f", {meta['tokenizer_name']} tokens"
    if "val" in parts and val_fraction > 0:
        train, (val, val_truncated) = train_all, parts["val"]
        truncated += val_truncated
        description += f"; {len(train)} train / {len(val)} validation ({meta.get('val_split', 'validation')} split)"
    else:
        train, val = split_validation(train_all, val_fraction)
        if val is not None:
            description += f"; {len(train)} train / {len(val)} validation (last {val_fraction:g})"
    unit = "bytes" if meta.get("tokenizer") == "bytes" else "tokens"
    if truncated:
        description += f"; {truncated} truncated to {seq_len + 1} {unit}"
    if skipped:
        description += f"; {skipped} rows skipped (empty, or no target left)"
    return DataSplits(train=train, val=val or None, description=description + cache_note, truncated=truncated,
                      fingerprint=store.fingerprint, store=store.path,
                      store_digest=store.digest, vocab_size=int(meta["vocab_size"]))


__all__ = ["DataSplits", "split_validation", "splits_from_store"]
