"""Examples longer than ``--seq-len``: one policy (``--too-long``) for every example-shaped source.

JSONL read by cadence's own reader and every datasets source store their examples whole (one store serves every
``--seq-len``); the policy applies when the examples are read at a sequence length (:func:`select_rows`,
:func:`tail_shift`), so it acts the same on a store just built and on one reopened from the cache, and it is not part
of the store's key. It changes the examples trained on, so it is a math-changing setting (a resume compares it).

An example of L tokens fits ``--seq-len S`` when ``L <= S + 1`` (S inputs, and the last token as the last target).
Longer ones are

- ``skip`` (the default): left out and counted, one line on the console. A fine-tuning set whose few long rows
  would be cut somewhere arbitrary trains on what it says; the count tells how much was left out.
- ``truncate``: cut to ``S + 1`` tokens, keeping the part with the loss. A prompt + completion loses the start of
  its prompt (the completion, and its end of sequence, are kept whole); when the completion alone is longer, it
  starts right after the prompt's last token and loses its own end (the end of sequence with it). A text example
  loses its end. A leading BOS is kept in front of what is left.
- ``error``: refused, every such example named (``file:line`` for JSONL, ``file row N`` for datasets).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cadence.data.choices import TooLong


def tail_shift(length: int | np.ndarray, loss_start: int | np.ndarray, seq_len: int, head: int = 0) -> np.ndarray:
    """How many tokens after the first ``head`` ones a truncated example drops (0 for one that fits, or whose loss
    starts near its front): the kept tokens are ``tokens[:head] + tokens[head + shift : seq_len + 1 + shift]``.

    The shift is as large as the example's excess (so that its end, the completion's end, is kept) but never so
    large that the token predicting the first target is dropped (``loss_start - 1`` stays). Works on arrays."""
    first = np.maximum(loss_start, 1)
    return np.maximum(0, np.minimum(np.asarray(length) - (seq_len + 1), first - 1 - head))


def kept_head(head: int, seq_len: int) -> int:
    """The leading tokens (a BOS) kept in front of a truncated example: none when the rest would have fewer than
    two tokens (one input and one target)."""
    return head if seq_len + 1 - head >= 2 else 0


@dataclass(frozen=True, kw_only=True)
class LongExamples:
    """What the policy did to the examples of one source at one ``--seq-len`` (train and validation together)."""

    policy: TooLong
    seq_len: int
    examples: int
    """Examples the source holds (those it skipped as empty or without a target not counted)."""
    too_long: int
    """Examples longer than ``--seq-len``."""
    prompts_cut: int = 0
    """Truncated examples that lost the start of their prompt, their completion kept whole."""
    ends_cut: int = 0
    """Truncated examples that lost their end (a text, or a completion longer than --seq-len on its own)."""
    targets_lost: int = 0
    """Targets (trained tokens) the truncated examples lost: a text's or completion's end, a conversation's trained
    turns that did not fit."""

    def note(self) -> str | None:
        """The console's one line about them (None when every example fits)."""
        if not self.too_long:
            return None
        head = (f"{self.too_long:,} of {self.examples:,} examples are longer than --seq-len {self.seq_len} and were "
                f"{'skipped' if self.policy == 'skip' else 'truncated'}")
        if self.policy == "skip":
            return head + " (--too-long truncate keeps them, cut to fit)"
        parts = []
        if self.prompts_cut:
            parts.append(f"{self.prompts_cut:,} lost the start of their prompt (the completion kept whole)")
        if self.ends_cut:
            parts.append(f"{self.ends_cut:,} lost their end (a text, or a completion longer than --seq-len alone, "
                         f"its end of sequence with it)")
        if self.targets_lost:
            parts.append(f"{self.targets_lost:,} trained tokens were lost with what was cut")
        return head + ": " + "; ".join(parts)


def select_rows(index: np.ndarray, seq_len: int, policy: TooLong, head: int = 0) -> tuple[np.ndarray, np.ndarray, int,
                                                                                          int]:
    """(rows kept, rows longer than ``seq_len``, prompts cut, ends cut) of an index of (offset, length, loss_start,
    row): under ``skip`` the long rows are not kept, under ``truncate`` they are (and counted by what they lose);
    ``error`` keeps every row and leaves the refusal to the caller, who can name the long ones."""
    lengths = index[:, 1]
    long_rows = np.flatnonzero(lengths > seq_len + 1)
    if policy == "skip":
        return np.flatnonzero(lengths <= seq_len + 1), long_rows, 0, 0
    prompts_cut = ends_cut = 0
    if policy == "truncate" and len(long_rows):
        head = kept_head(head, seq_len)
        shift = tail_shift(lengths[long_rows], index[long_rows, 2], seq_len, head)
        loses_end = shift + seq_len + 1 < lengths[long_rows]
        ends_cut = int(loses_end.sum())
        prompts_cut = int(((shift > 0) & ~loses_end).sum())
    return np.arange(len(index)), long_rows, prompts_cut, ends_cut


def too_long_message(length: int, seq_len: int, unit: str) -> str:
    """Why ``--too-long error`` refuses an example."""
    return (f"the example has {length:,} {unit}, more than the {seq_len + 1:,} that --seq-len {seq_len} holds "
            f"({seq_len} inputs and the last target); give a larger --seq-len, or --too-long skip or truncate")


__all__ = ["LongExamples", "TooLong", "kept_head", "select_rows", "tail_shift", "too_long_message"]
