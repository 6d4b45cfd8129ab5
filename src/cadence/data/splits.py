"""Training and validation datasets over a token store, at one ``--seq-len``."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cadence.data.batching import TokenDataset
from cadence.data.choices import TOO_LONG_CHOICES, TooLong
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS, no_examples_message
from cadence.data.store import TokenStore
from cadence.data.store_datasets import StoredExamples
from cadence.data.text import pack_tokens
from cadence.data.too_long import LongExamples, select_rows, too_long_message
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
    """Examples cut to ``--seq-len`` (``--too-long truncate``; packed text is never truncated)."""
    fingerprint: str
    """``sha256:...`` of the source's content (not of its path): a resume compares it, so that rewritten data, or
    other data under the same name, is never mixed into a run, while the same file named another way is accepted."""
    store: Path | None = None
    """The token store the examples are read from (None for examples built in memory)."""
    store_digest: str | None = None
    """The store's :attr:`TokenStore.digest` (which tokens exactly), for a resume to compare."""
    vocab_size: int | None = None
    """Every token id is below this (the store verified it): the model's vocabulary must hold it."""
    long_examples: LongExamples | None = None
    """What ``--too-long`` did to the examples longer than ``--seq-len`` (None for packed text, which has none)."""


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
                      lines_of: Path | None = None, too_long: TooLong = "skip") -> DataSplits:
    """The store's examples at ``seq_len``, split into training and validation.

    A stream is cut into sequences of exactly ``seq_len``; ``max_stream_tokens`` keeps only its start (quick runs
    and tests on the built-in corpus). An example longer than ``seq_len + 1`` tokens is skipped, truncated or refused
    as ``too_long`` says (:mod:`cadence.data.too_long`), the same for JSONL and datasets, and the same whether the
    store was just built or found in the cache (the store holds every example whole). ``source`` (the description's
    start) and ``lines_of`` (the file that ``file:line`` messages name) default to what the store recorded; callers
    pass the user's own spelling."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if too_long not in TOO_LONG_CHOICES:
        raise ValueError(f"too_long must be one of {', '.join(TOO_LONG_CHOICES)}, got {too_long!r}")
    meta = store.meta
    source = source or meta.get("description") or str(store.path)
    cache_note = "; tokens from the cache" if from_cache else ""
    if store.kind == "stream":
        return _stream_splits(store, seq_len=seq_len, val_fraction=val_fraction, max_stream_tokens=max_stream_tokens,
                              description=source, cache_note=cache_note)
    unit = "bytes" if meta.get("tokenizer") == "bytes" else "tokens"
    parts, long_examples, empty_rows = _stored_parts(store, seq_len=seq_len, val_fraction=val_fraction,
                                                     too_long=too_long, source=source, lines_of=lines_of, unit=unit)
    train_all = parts["train"]
    if not len(train_all):
        stored_rows = int(meta.get("rows", 0))
        if len(store.indexes["train"]):
            raise UsageError.single("--data", no_examples_message(source, len(store.indexes["train"]), seq_len))
        why = f" (all {stored_rows} rows were empty or had no target)" if stored_rows else ""
        raise UsageError.single("--data", f"{source} has no examples{why}")
    description = f"{source}, {len(train_all)} examples"
    if meta.get("tokenizer_name") and meta.get("tokenizer") != "bytes":
        description += f", {meta['tokenizer_name']} tokens"
    train: TokenDataset
    val: TokenDataset | None
    if "val" in parts and val_fraction > 0:
        train, val = train_all, parts["val"]
        description += f"; {len(train)} train / {len(val)} validation ({meta.get('val_split', 'validation')} split)"
    else:
        train, val = split_validation(train_all, val_fraction)
        if val is not None:
            description += f"; {len(train)} train / {len(val)} validation (last {val_fraction:g})"
    longer = long_examples.too_long
    truncated = longer if too_long == "truncate" else 0
    if truncated:
        description += f"; {truncated} truncated to {seq_len + 1} {unit}"
    if longer and too_long == "skip":
        description += f"; {longer} longer than --seq-len skipped"
    if empty_rows:
        description += f"; {empty_rows} rows skipped (empty, or without a target)"
    return DataSplits(train=train, val=val or None, description=description + cache_note, truncated=truncated,
                      fingerprint=store.fingerprint, store=store.path,
                      store_digest=store.digest, vocab_size=int(meta["vocab_size"]), long_examples=long_examples)


def _stream_splits(store: TokenStore, *, seq_len: int, val_fraction: float, max_stream_tokens: int | None,
                   description: str, cache_note: str) -> DataSplits:
    """A stream store cut into sequences of exactly ``seq_len`` (only its first ``max_stream_tokens`` when given)."""
    tokens = store.tokens if max_stream_tokens is None else store.tokens.prefix(max_stream_tokens)
    fingerprint = store.fingerprint if max_stream_tokens is None or max_stream_tokens >= len(store.tokens) \
        else "sha256:" + hashlib.sha256(tokens[:].tobytes()).hexdigest()
    sequences = pack_tokens(tokens, seq_len)
    description = f"{description}, {len(tokens):,} bytes, {len(sequences)} sequences of {seq_len}"
    train, val = split_validation(sequences, val_fraction)
    if val is not None:
        description += f"; {len(train)} train / {len(val)} validation"
    return DataSplits(train=train, val=val, description=description + cache_note, truncated=0,
                      fingerprint=fingerprint, store=store.path, store_digest=store.digest,
                      vocab_size=int(store.meta["vocab_size"]))


def _stored_parts(store: TokenStore, *, seq_len: int, val_fraction: float, too_long: TooLong, source: str,
                  lines_of: Path | None, unit: str) -> tuple[dict[str, StoredExamples], LongExamples, int]:
    """Each split in use of an examples store as :class:`StoredExamples` at ``seq_len``, what ``too_long`` did to
    the longer examples, and how many source rows the build skipped; under ``too_long="error"`` a
    :class:`UsageError` naming each example longer than ``seq_len`` (up to the reporting limit)."""
    meta = store.meta
    # A leading BOS (a tokenizer that adds one) stays in front of a truncated example: see cadence.data.too_long.
    head = 0 if (meta.get("options") or {}).get("bos_id") is None else 1
    in_use = [split for split in store.indexes if split == "train" or (split == "val" and val_fraction > 0)]
    parts: dict[str, StoredExamples] = {}
    empty_rows = examples = longer = prompts_cut = ends_cut = targets_lost = 0
    problems: list[Problem] = []
    for split in in_use:
        index = store.indexes[split]
        empty_rows += int((meta.get("skipped_rows") or {}).get(split, 0))
        rows, long_rows, split_prompts_cut, split_ends_cut = select_rows(index, seq_len, too_long, head)
        examples, longer = examples + len(index), longer + len(long_rows)
        prompts_cut, ends_cut = prompts_cut + split_prompts_cut, ends_cut + split_ends_cut
        if too_long == "error":
            problems += [Problem(where=_where(store, split, int(index[row, 3]), lines_of),
                                 message=too_long_message(int(index[row, 1]), seq_len, unit))
                         for row in long_rows[:MAX_REPORTED_PROBLEMS - len(problems)]]
        parts[split] = StoredExamples(store.tokens, index, seq_len, rows, head, store.spans.get(split))
        if too_long == "truncate" and len(long_rows):
            # What the truncated examples lost of their targets (a chat's earlier turns, a long completion's end).
            targets_lost += parts[split].targets_lost(long_rows)
    if problems:
        if longer > len(problems):
            problems.append(Problem(where=str(lines_of or meta.get("path") or source),
                                    message=f"and {longer - len(problems)} more examples longer than --seq-len"))
        raise UsageError(problems)
    long_examples = LongExamples(policy=too_long, seq_len=seq_len, examples=examples, too_long=longer,
                                 prompts_cut=prompts_cut, ends_cut=ends_cut, targets_lost=targets_lost)
    return parts, long_examples, empty_rows


def _where(store: TokenStore, split: str, row: int, lines_of: Path | None) -> str:
    """Where a message about one example points: ``file:line`` for JSONL, ``file row N`` for a datasets source."""
    meta = store.meta
    if meta.get("source_format") == "jsonl":
        return f"{lines_of or meta.get('path') or store.path}:{row}"
    named = str(meta.get("path") or meta.get("description") or store.path)
    return f"{named} row {row}" if split == "train" else f"{named} ({meta.get('val_split')} split) row {row}"


__all__ = ["DataSplits", "split_validation", "splits_from_store"]
