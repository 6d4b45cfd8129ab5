"""Preference data as samples of two sequences: a pair (chosen, rejected), or a KTO example (its completion, and its
prompt followed by another example's completion), and how they reach a micro-batch.

A preference sample is never split: it is one sample of the window's cut (``--micro-batch-size`` counts samples), both
its sequences land in the same micro-batch on the same rank, ``--too-long`` applies to the sample (skip: a pair whose
either sequence is too long is left out whole), and a validation split holds whole samples.

In the token store (:mod:`cadence.data.preference_store`) a pair is two consecutive examples, chosen then rejected; an
unpaired row is one example, its label kept in store.json. The mismatched sequence of KTO example ``i`` is built when
it is read: its own prompt followed by the completion of example ``i + 1`` of the same split (the last takes the
first's), the same token ids (TRL builds it by rotating completions within each micro-batch; cadence over the split,
so that it never depends on the micro-batch size).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from cadence.data.batching import IGNORE_INDEX, PAD_TOKEN_ID, Example, TokenDataset
from cadence.data.choices import TOO_LONG_CHOICES, TooLong
from cadence.data.jsonl import MAX_REPORTED_PROBLEMS
from cadence.data.splits import DataSplits, split_validation
from cadence.data.store import TokenStore
from cadence.data.store_datasets import StoredExamples
from cadence.data.too_long import LongExamples, select_rows, too_long_message
from cadence.errors import Problem, UsageError

PreferenceFormat = Literal["pairs", "unpaired"]
PREFERENCE_FORMATS: tuple[PreferenceFormat, ...] = ("pairs", "unpaired")
DESIRABLE_KEY = "desirable"
"""A KTO micro-batch's labels, one per example (1: desirable, 0: undesirable)."""


@dataclass(frozen=True)
class PreferenceExample:
    """One sample of two sequences (see the module docstring)."""

    first: Example
    """The pair's chosen sequence, or the KTO example's prompt and completion."""
    second: Example
    """The pair's rejected sequence, or the KTO example's mismatched sequence (for its reference point)."""
    desirable: bool | None = None
    """KTO: the row's label; None for a pair."""

    @property
    def num_targets(self) -> int:
        return self.first.num_targets + self.second.num_targets

    @property
    def input_ids(self) -> torch.Tensor:
        """Both sequences' inputs one after the other (their length is what the sample costs: two rows)."""
        return torch.cat([self.first.input_ids, self.second.input_ids])


def collate_preference(samples: Sequence[PreferenceExample]) -> dict[str, torch.Tensor]:
    """``P`` samples as one micro-batch of ``2P`` right-padded rows: the first sequences, then the second ones (TRL's
    concatenated layout), and ``desirable`` ([P]) for KTO samples."""
    rows = [sample.first for sample in samples] + [sample.second for sample in samples]
    width = max(len(row.input_ids) for row in rows)
    input_ids = torch.full((len(rows), width), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, :len(row.input_ids)] = row.input_ids
        labels[index, :len(row.labels)] = row.labels
    batch = {"input_ids": input_ids, "labels": labels}
    if samples[0].desirable is not None:
        batch[DESIRABLE_KEY] = torch.tensor([bool(sample.desirable) for sample in samples], dtype=torch.long)
    return batch


def first_target(example: Example) -> int:
    """The position of an example's first target (where its completion starts being predicted)."""
    return int((example.labels != IGNORE_INDEX).nonzero()[0])


def mismatched(prompt_of: Example, completion_of: Example, seq_len: int) -> Example:
    """``prompt_of``'s prompt followed by ``completion_of``'s completion (their labels), cut to ``seq_len`` positions
    keeping its end (the completion)."""
    prompt_end, completion_start = first_target(prompt_of), first_target(completion_of)
    input_ids = torch.cat([prompt_of.input_ids[:prompt_end + 1], completion_of.input_ids[completion_start + 1:]])
    labels = torch.cat([torch.full((prompt_end,), IGNORE_INDEX, dtype=torch.long),
                        completion_of.labels[completion_start:]])
    return Example(input_ids=input_ids[-seq_len:], labels=labels[-seq_len:])


class PreferenceExamples(TokenDataset):
    """A split's preference samples over the store's examples (``stored``: a pair's two rows one after the other, or
    one row per KTO example with ``labels``)."""

    def __init__(self, stored: StoredExamples, *, seq_len: int, labels: np.ndarray | None = None) -> None:
        super().__init__(())
        self._stored = stored
        self._seq_len = seq_len
        self._labels = labels
        """KTO: each row's label (None: pairs)."""

    @property
    def unpaired(self) -> bool:
        return self._labels is not None

    def __len__(self) -> int:
        return len(self._stored) if self.unpaired else len(self._stored) // 2

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            rows = range(len(self))[index]
            if self._labels is not None:
                return PreferenceExamples(self._stored[index], seq_len=self._seq_len, labels=self._labels[index])
            if rows.step != 1:
                raise ValueError("preference pairs slice with step 1 only")
            return PreferenceExamples(self._stored[2 * rows.start:2 * rows.stop], seq_len=self._seq_len)
        if index < 0:
            index += len(self)
        if self._labels is None:
            return PreferenceExample(first=self._stored[2 * index], second=self._stored[2 * index + 1])
        example = self._stored[index]
        partner = self._stored[(index + 1) % len(self)]
        return PreferenceExample(first=example, second=mismatched(example, partner, self._seq_len),
                                 desirable=bool(self._labels[index]))

    def __iter__(self) -> Iterator[PreferenceExample]:  # type: ignore[override]  # its samples are pairs, not rows
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"PreferenceExamples({len(self)} {'examples' if self.unpaired else 'pairs'})"

    def lengths(self, indices: Sequence[int]) -> list[int]:
        """What each sample costs a micro-batch in positions when cut by length: two rows of its longer sequence's
        length (a KTO sample's mismatched sequence counted as long as its own)."""
        if self.unpaired:
            return [2 * length for length in self._stored.lengths(indices)]
        chosen = self._stored.lengths([2 * i for i in indices])
        rejected = self._stored.lengths([2 * i + 1 for i in indices])
        return [2 * max(a, b) for a, b in zip(chosen, rejected)]

    @property
    def num_targets(self) -> int:
        """The targets of the first sequences and the rejected ones (a KTO sample's mismatched one not counted)."""
        return self._stored.num_targets

    @property
    def max_length(self) -> int:
        return self._stored.max_length

    @property
    def stored(self) -> StoredExamples:
        """The store's examples the samples are made of."""
        return self._stored


def store_labels(meta: dict[str, Any], split: str) -> np.ndarray:
    """A KTO store's labels of ``split`` (store.json keeps them as a bitmap in hex, one bit per row)."""
    preference = meta.get("preference") or {}
    packed = bytes.fromhex(str((preference.get("labels") or {}).get(split, "")))
    count = int((meta.get("splits") or {}).get(split, 0))
    labels = np.unpackbits(np.frombuffer(packed, dtype=np.uint8))[:count]
    if len(labels) != count:
        raise UsageError.single("--data", f"the token store's labels of its {split} split are incomplete; build it again")
    return labels.astype(bool)


def pack_labels(labels: Sequence[bool]) -> str:
    """:func:`store_labels`' bitmap."""
    return np.packbits(np.asarray(labels, dtype=np.uint8)).tobytes().hex()


def preference_splits(store: TokenStore, *, seq_len: int, val_fraction: float, from_cache: bool,
                      source: str, too_long: TooLong = "skip", lines_of: Any = None) -> DataSplits:
    """A preference store's samples at ``seq_len``, split into training and validation (the last samples):
    ``--too-long`` applied to each sample whole (see the module docstring)."""
    if too_long not in TOO_LONG_CHOICES:
        raise ValueError(f"too_long must be one of {', '.join(TOO_LONG_CHOICES)}, got {too_long!r}")
    meta = store.meta
    form = (meta.get("preference") or {}).get("format")
    index = store.indexes["train"]
    head = 0 if (meta.get("options") or {}).get("bos_id") is None else 1
    rows, long_rows, prompts_cut, ends_cut = select_rows(index, seq_len, too_long, head)
    width = 2 if form == "pairs" else 1
    long_samples = np.unique(long_rows // width)
    unit = "bytes" if meta.get("tokenizer") == "bytes" else "tokens"
    if too_long == "error" and len(long_samples):
        where = lines_of or meta.get("path") or source
        problems = [Problem(where=f"{where}:{int(index[sample * width, 3])}",
                            message=too_long_message(int(index[sample * width:(sample + 1) * width, 1].max()),
                                                     seq_len, unit))
                    for sample in long_samples[:MAX_REPORTED_PROBLEMS]]
        if len(long_samples) > len(problems):
            problems.append(Problem(where=str(where), message=f"and {len(long_samples) - len(problems)} more "
                                                              f"examples longer than --seq-len"))
        raise UsageError(problems)
    if too_long == "skip":
        # A sample is kept only whole: a pair whose either sequence is too long is left out with its other one.
        kept_samples = np.setdiff1d(np.arange(len(index) // width), long_samples)
        rows = (kept_samples[:, None] * width + np.arange(width)).reshape(-1)
    stored = StoredExamples(store.tokens, index, seq_len, rows, head, store.spans.get("train"))
    labels = store_labels(meta, "train")[rows] if form == "unpaired" else None
    samples = PreferenceExamples(stored, seq_len=seq_len, labels=labels)
    if not len(samples):
        raise UsageError.single("--data", f"{source} has no preference sample that fits --seq-len {seq_len}: all "
                                          f"{len(long_samples):,} are longer and --too-long skip left them out; give a "
                                          f"larger --seq-len, or --too-long truncate")
    train, val = split_validation(samples, val_fraction)
    what = "pairs" if form == "pairs" else "examples"
    description = f"{source}, {len(samples):,} preference {what}"
    if val is not None:
        description += f"; {len(train):,} train / {len(val):,} validation (last {val_fraction:g})"
    if len(long_samples):
        description += f"; {len(long_samples):,} longer than --seq-len {'skipped' if too_long == 'skip' else 'truncated'}"
    long_examples = LongExamples(policy=too_long, seq_len=seq_len, examples=len(index) // width,
                                 too_long=len(long_samples), prompts_cut=prompts_cut, ends_cut=ends_cut)
    return DataSplits(train=train, val=val, description=description + ("; tokens from the cache" if from_cache else ""),
                      truncated=len(long_samples) if too_long == "truncate" else 0, fingerprint=store.fingerprint,
                      store=store.path, store_digest=store.digest, vocab_size=int(meta["vocab_size"]),
                      long_examples=long_examples)


__all__ = ["DESIRABLE_KEY", "PREFERENCE_FORMATS", "PreferenceExample", "PreferenceExamples", "PreferenceFormat",
           "collate_preference", "first_target", "mismatched", "pack_labels", "preference_splits", "store_labels"]
