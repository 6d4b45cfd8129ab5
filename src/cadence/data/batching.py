"""Examples, datasets, padding and the deterministic order in which micro-batches are drawn."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, overload

import torch

IGNORE_INDEX = -100
"""Label value meaning "no loss at this position" (the default ``ignore_index`` of ``F.cross_entropy``)."""

PAD_TOKEN_ID = 0
"""Input id used for padding. Its value never matters: right pads are never attended to by real tokens."""

BYTE_EOS_ID = 0x04
"""The end of sequence of byte-level data: appended to every prompt + completion as its last target, so that a
fine-tuned model learns to stop. A vocabulary of 256 bytes has no spare id, and a 257th would change every byte-level
model's size and the stores' one byte per token; 0x04 is ASCII's End of Transmission (Ctrl-D ends a terminal's
input), a control byte UTF-8 text practically never holds, and not the pad id (0), so a pad and the end stay apart in
a tokenizer (the one ``--save-hf`` writes says ``eos_token_id`` 4). Text that does hold byte 4 reads it as the end,
as any tokenizer reads its EOS's spelling."""


@dataclass(frozen=True)
class Example:
    """One training example: inputs and next-token labels of the same length."""

    input_ids: torch.Tensor
    """int64 [T] token ids (bytes, 0..255)."""
    labels: torch.Tensor
    """int64 [T]; ``labels[i]`` is the target predicted at position i, or ``IGNORE_INDEX`` for no loss."""

    def __post_init__(self) -> None:
        # Internal invariant: every reader builds examples itself, so this is a programming error, not user input.
        if self.input_ids.shape != self.labels.shape or self.input_ids.dim() != 1:
            raise ValueError(
                f"input_ids and labels must be 1-D of the same length, got {tuple(self.input_ids.shape)} "
                f"and {tuple(self.labels.shape)}"
            )

    @property
    def num_targets(self) -> int:
        """Number of loss-bearing positions."""
        return int((self.labels != IGNORE_INDEX).sum())


def make_example(input_ids: Sequence[int] | bytes, labels: Sequence[int] | bytes) -> Example:
    """Build an :class:`Example` from Python ints or bytes (as int64 tensors)."""
    return Example(
        input_ids=torch.tensor(list(input_ids), dtype=torch.long),
        labels=torch.tensor(list(labels), dtype=torch.long),
    )


class TokenDataset(Sequence[Example]):
    """An immutable, indexable list of :class:`Example`."""

    def __init__(self, examples: Sequence[Example]) -> None:
        self._examples: tuple[Example, ...] = tuple(examples)

    def __len__(self) -> int:
        return len(self._examples)

    @overload
    def __getitem__(self, index: int) -> Example: ...

    @overload
    def __getitem__(self, index: slice) -> TokenDataset: ...

    def __getitem__(self, index: int | slice) -> Example | TokenDataset:
        # Slices give a TokenDataset so that splitting off a validation set keeps the type.
        if isinstance(index, slice):
            return TokenDataset(self._examples[index])
        return self._examples[index]

    def __repr__(self) -> str:
        return f"TokenDataset({len(self)} examples, {self.num_targets} targets)"

    @cached_property
    def num_targets(self) -> int:
        """Total number of labels that are not ``IGNORE_INDEX``, over all examples.

        Cached on the instance (examples are immutable): it is a pass over every example, and reports ask often.
        """
        return sum(example.num_targets for example in self._examples)

    def lengths(self, indices: Sequence[int]) -> list[int]:
        """Input length of each example of ``indices`` (what length-aware micro-batch cuts sort by)."""
        return [len(self._examples[i].input_ids) for i in indices]

    @property
    def max_length(self) -> int:
        """Length of the longest example (0 for an empty dataset)."""
        return max((len(example.input_ids) for example in self._examples), default=0)


def collate(examples: Sequence[Example]) -> dict[str, torch.Tensor]:
    """Stack examples into ``{"input_ids": [B, Tmax], "labels": [B, Tmax]}``, right-padded to the longest.

    Right padding with a causal model means real tokens never attend to pads (pads only come after them), so each
    real position's logits and loss are the same whatever the example is batched with. Pads carry
    ``IGNORE_INDEX`` labels, so they add no loss and no targets. Hence the loss is independent of how examples are
    grouped into micro-batches, which is what makes every micro x accum split equivalent.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    t_max = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), t_max), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((len(examples), t_max), IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        input_ids[row, :length] = example.input_ids
        labels[row, :length] = example.labels
    return {"input_ids": input_ids, "labels": labels}


def epoch_order(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """A permutation of ``range(num_examples)``: the same for a given (seed, epoch), different across epochs.

    A local generator (not the global RNG) keeps the order independent of whatever else consumed random numbers,
    which is what makes resumed runs and different micro-batch splits see the same samples.
    """
    generator = torch.Generator()
    # A large odd multiplier keeps (seed, epoch) pairs from colliding for any realistic number of epochs.
    # The mask keeps huge or negative user seeds inside the 64-bit range manual_seed accepts.
    generator.manual_seed((seed * 1_000_003 + epoch) & 0xFFFF_FFFF_FFFF_FFFF)
    # int32 while it fits: the same permutation as int64 (randperm's values do not depend on the dtype; a test checks
    # it), at half the memory. It is the one per-example array each rank holds: 50 MB instead of 100 for 12M examples.
    dtype = torch.int32 if num_examples < 2**31 else torch.int64
    return torch.randperm(num_examples, generator=generator, dtype=dtype)


def micro_batch_indices(
    num_examples: int, micro_batch_size: int, seed: int, epoch: int, shuffle: bool = True
) -> list[list[int]]:
    """The dataset indices of each micro-batch of one epoch, as :func:`iterate_micro_batches` draws them."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    order = epoch_order(num_examples, seed, epoch) if shuffle else torch.arange(num_examples)
    indices = order.tolist()
    return [indices[start : start + micro_batch_size] for start in range(0, num_examples, micro_batch_size)]


def iterate_micro_batches(
    dataset: TokenDataset,
    micro_batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    *,
    collate_fn: Callable[[list[Any]], dict[str, torch.Tensor]] = collate,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield collated micro-batches of one epoch, in consecutive groups of ``micro_batch_size``.

    The last micro-batch may be smaller and is never dropped: the caller groups micro-batches into accumulation
    windows and needs every sample, so that micro 8 x accum 1, micro 2 x accum 4 and micro 1 x accum 8 see exactly
    the same samples in each window. ``shuffle=False`` walks the dataset in index order (validation). ``collate_fn``
    makes a micro-batch of the drawn samples (preference samples: :func:`cadence.engine.windows.collate_samples`).
    """
    # Computed eagerly (not inside the generator) so that a bad micro_batch_size fails at the call, not later.
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    order = epoch_order(len(dataset), seed, epoch) if shuffle else torch.arange(len(dataset))
    # One int64 tensor for the epoch; each micro-batch's indices become Python ints only when it is collated.
    return (collate_fn([dataset[i] for i in order[start:start + micro_batch_size].tolist()])
            for start in range(0, len(dataset), micro_batch_size))
