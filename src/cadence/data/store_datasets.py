"""The datasets a token store is read as: examples made only when indexed, never held as Python objects.

:class:`PackedSequences` cuts fixed-length sequences from a ``stream`` store's one token stream by arithmetic, so one
store serves every ``--seq-len``; :class:`StoredExamples` reads an ``examples`` store's rows through its memory-mapped
index, truncating an example longer than ``--seq-len`` as :mod:`cadence.data.too_long` decides and training exactly
its spans where the store lists them. The store's files and their checks are :mod:`cadence.data.store`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from cadence.data.batching import IGNORE_INDEX, Example, TokenDataset
from cadence.data.store import SPAN_COLUMNS, TokenFile
from cadence.data.too_long import kept_head, tail_shift


def _as_long(tokens: np.ndarray) -> torch.Tensor:
    # A copy as int64: the model's embedding wants int64, and the memory map must never be written through.
    return torch.from_numpy(np.asarray(tokens, dtype=np.int64))


class PackedSequences(TokenDataset):
    """Fixed-length sequences cut from one token stream, made into examples only when indexed.

    Chunks of ``seq_len + 1`` tokens start every ``seq_len`` tokens, so consecutive chunks share one token (the last
    label of one is the first input of the next) and every token after the first is a target exactly once. The
    stream may be a memory map of gigabytes: nothing but index arithmetic happens until an example is read."""

    def __init__(self, tokens: np.ndarray | torch.Tensor | TokenFile, seq_len: int, chunks: range | None = None) -> None:
        super().__init__(())
        self._tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        self._seq_len = seq_len
        self._chunks = chunks if chunks is not None else range(0, max(0, (len(tokens) - 1) // seq_len))

    def __len__(self) -> int:
        return len(self._chunks)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return PackedSequences(self._tokens, self._seq_len, self._chunks[index])
        start = self._chunks[index] * self._seq_len
        chunk = _as_long(self._tokens[start : start + self._seq_len + 1])
        return Example(input_ids=chunk[:-1], labels=chunk[1:])

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    @property
    def num_targets(self) -> int:
        return len(self) * self._seq_len

    def lengths(self, indices: Sequence[int]) -> list[int]:
        return [self._seq_len] * len(indices)

    @property
    def max_length(self) -> int:
        return self._seq_len if len(self) else 0


class StoredExamples(TokenDataset):
    """Examples of an ``examples`` store, cut to ``seq_len + 1`` tokens when read.

    ``rows`` are the index rows in use (an int64 array: the only per-example state in memory). An example longer than
    that keeps its end, the part with the loss (:func:`cadence.data.too_long.tail_shift`: a prompt loses its start,
    after ``head`` leading tokens such as a BOS). Counts over the whole dataset (targets, longest example) are
    computed from the index, never by reading tokens."""

    def __init__(self, tokens: np.ndarray | TokenFile, index: np.ndarray, seq_len: int, rows: np.ndarray,
                 head: int = 0, spans: np.ndarray | None = None) -> None:
        super().__init__(())
        self._tokens = tokens
        self._index = index
        self._seq_len = seq_len
        self._rows = rows
        self._head = kept_head(head, seq_len)
        self._spans = spans if spans is not None else np.zeros((0, SPAN_COLUMNS), dtype=np.int64)
        """(example, start, end) rows, sorted by example: the trained tokens of the examples listed there."""

    def _spans_of(self, row: int) -> np.ndarray:
        """The (start, end) spans of index row ``row`` (none: it trains from its loss_start to its end)."""
        first, last = np.searchsorted(self._spans[:, 0], [row, row + 1])
        return self._spans[first:last, 1:]

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return StoredExamples(self._tokens, self._index, self._seq_len, self._rows[index], self._head, self._spans)
        row = int(self._rows[index])
        offset, length, loss_start, _ = (int(v) for v in self._index[row])
        shift = int(tail_shift(length, loss_start, self._seq_len, self._head))
        kept = min(length, self._seq_len + 1)
        if shift:
            head = self._head
            ids = _as_long(np.concatenate([self._tokens[offset : offset + head],
                                           self._tokens[offset + head + shift : offset + kept + shift]]))
        else:
            ids = _as_long(self._tokens[offset : offset + kept])
        labels = ids[1:].clone()
        spans = self._spans_of(row) if len(self._spans) else self._spans[:0, 1:]
        if len(spans):
            # Token k of the example is a target (of the position before it) when a span holds it; the kept tokens
            # are the example's first ``head`` and then those from ``head + shift`` on.
            trained = np.zeros(length, dtype=bool)
            for start, end in spans:
                trained[start:end] = True
            kept_positions = np.concatenate([np.arange(min(self._head, kept) if shift else 0),
                                             np.arange(self._head + shift if shift else 0, kept + shift)])
            labels[~torch.from_numpy(trained[kept_positions[1:]])] = IGNORE_INDEX
            return Example(input_ids=ids[:-1], labels=labels)
        # Position j predicts token j + 1, a target only from loss_start on (the completion, after BOS, ...).
        labels[: max(max(loss_start, 1) - shift - 1, 0)] = IGNORE_INDEX
        return Example(input_ids=ids[:-1], labels=labels)

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    def _kept_lengths(self) -> np.ndarray:
        return np.minimum(self._index[self._rows, 1], self._seq_len + 1)

    def lengths(self, indices: Sequence[int]) -> list[int]:
        """Input lengths from the index alone (no token is read)."""
        rows = self._rows[np.asarray(indices, dtype=np.int64)]
        return (np.minimum(self._index[rows, 1], self._seq_len + 1) - 1).tolist()

    @property
    def num_targets(self) -> int:
        if not len(self):
            return 0
        index = self._index[self._rows]
        shift = tail_shift(index[:, 1], index[:, 2], self._seq_len, self._head)
        starts = np.maximum(index[:, 2], 1) - shift
        per_row = np.maximum(0, self._kept_lengths() - starts)
        if len(self._spans):
            # Examples with spans: count the targets each keeps, span by span (a chat store's few rows per example).
            listed = np.isin(self._rows, self._spans[:, 0])
            per_row[listed] = [self._kept_targets(int(row)) for row in self._rows[listed]]
        return int(per_row.sum())

    def targets_lost(self, index_rows: np.ndarray) -> int:
        """The targets that truncation to this --seq-len drops from these index rows (all of an example's targets,
        less those its kept tokens still hold)."""
        lost = 0
        for row in (int(r) for r in index_rows):
            _, length, loss_start, _ = (int(v) for v in self._index[row])
            spans = self._spans_of(row) if len(self._spans) else self._spans[:0, 1:]
            whole = int((spans[:, 1] - spans[:, 0]).sum()) if len(spans) else max(0, length - max(loss_start, 1))
            if len(spans):
                kept = self._kept_targets(row)
            else:
                shift = int(tail_shift(length, loss_start, self._seq_len, self._head))
                kept = max(0, min(length, self._seq_len + 1) - (max(loss_start, 1) - shift))
            lost += whole - kept
        return lost

    def _kept_targets(self, row: int) -> int:
        """How many of index row ``row``'s span tokens are targets once it is read at this --seq-len."""
        _, length, loss_start, _ = (int(v) for v in self._index[row])
        shift = int(tail_shift(length, loss_start, self._seq_len, self._head))
        kept = min(length, self._seq_len + 1)
        # Targets are the kept tokens after the first kept one: [1, head) and [head + shift, kept + shift) when
        # shifted behind a kept head, [shift + 1, kept + shift) otherwise.
        ranges = [(1, self._head), (self._head + shift, kept + shift)] if shift and self._head \
            else [(shift + 1, kept + shift)]
        return sum(max(0, min(end, b) - max(start, a)) for start, end in self._spans_of(row) for a, b in ranges)

    @property
    def max_length(self) -> int:
        return int(self._kept_lengths().max()) - 1 if len(self) else 0

    @property
    def source_rows(self) -> np.ndarray:
        """The source line or row number of each example (for messages)."""
        return self._index[self._rows, 3]


__all__ = ["PackedSequences", "StoredExamples"]
