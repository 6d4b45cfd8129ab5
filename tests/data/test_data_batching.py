"""Tests of examples, datasets, padding and micro-batch order."""

from __future__ import annotations

import pytest
import torch

from cadence.data import (
    IGNORE_INDEX,
    Example,
    TokenDataset,
    collate,
    epoch_order,
    iterate_micro_batches,
    make_example,
    micro_batch_indices,
)


def numbered(n: int) -> TokenDataset:
    """Example i has length i + 1 and holds its own index in input_ids[0], so batches can be traced back."""
    return TokenDataset(
        [make_example([i] + [7] * i, [IGNORE_INDEX] + [8] * i) for i in range(n)]
    )


def test_example_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        Example(input_ids=torch.zeros(3, dtype=torch.long), labels=torch.zeros(4, dtype=torch.long))


def test_dataset_properties() -> None:
    data = numbered(4)
    assert len(data) == 4
    assert data.max_length == 4
    assert data.num_targets == 0 + 1 + 2 + 3
    assert isinstance(data[1:], TokenDataset) and len(data[1:]) == 3
    assert TokenDataset([]).max_length == 0 and TokenDataset([]).num_targets == 0


def test_collate_right_pads() -> None:
    a = make_example([1, 2, 3], [2, 3, 4])
    b = make_example([5], [IGNORE_INDEX])
    batch = collate([a, b])
    assert batch["input_ids"].dtype == torch.long and batch["labels"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    # Padded only to the longest example of this micro-batch, not of the dataset.
    assert collate([b])["input_ids"].shape == (1, 1)


def test_epoch_order_is_deterministic_and_changes_per_epoch() -> None:
    first = epoch_order(50, seed=3, epoch=0)
    assert sorted(first.tolist()) == list(range(50))
    assert torch.equal(first, epoch_order(50, seed=3, epoch=0))
    assert not torch.equal(first, epoch_order(50, seed=3, epoch=1))
    assert not torch.equal(first, epoch_order(50, seed=4, epoch=0))
    # Independent of the global RNG.
    torch.manual_seed(123)
    torch.rand(10)
    assert torch.equal(first, epoch_order(50, seed=3, epoch=0))


def test_micro_batches_cover_every_index_once_with_short_last() -> None:
    data = numbered(10)
    batches = list(iterate_micro_batches(data, micro_batch_size=4, seed=0, epoch=2))
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 2]
    seen = [row for b in batches for row in b["input_ids"][:, 0].tolist()]
    assert sorted(seen) == list(range(10))
    assert seen == epoch_order(10, seed=0, epoch=2).tolist()
    # Each batch is padded to its own longest example (example i has length i + 1).
    for b in batches:
        assert b["input_ids"].shape[1] == max(b["input_ids"][:, 0].tolist()) + 1


@pytest.mark.parametrize("micro", [1, 2, 3, 8, 20])
def test_splits_see_the_same_samples(micro: int) -> None:
    # Consecutive groups of the same order: micro 8 x accum 1 == micro 2 x accum 4 == micro 1 x accum 8.
    groups = micro_batch_indices(20, micro, seed=5, epoch=0)
    assert [i for g in groups for i in g] == epoch_order(20, seed=5, epoch=0).tolist()
    assert all(len(g) == micro for g in groups[:-1]) and 1 <= len(groups[-1]) <= micro


@pytest.mark.parametrize("count", [1, 97, 100_000, 3_000_001])
def test_the_int32_order_is_the_int64_permutation_of_earlier_runs(count: int) -> None:
    """epoch_order holds int32 (half the memory per example) and must stay the order runs had with int64, or
    every checkpoint written before would resume on other data."""
    generator = torch.Generator()
    generator.manual_seed((11 * 1_000_003 + 2) & 0xFFFF_FFFF_FFFF_FFFF)
    reference = torch.randperm(count, generator=generator)  # int64, what epoch_order returned before
    order = epoch_order(count, seed=11, epoch=2)
    assert order.dtype == torch.int32 and torch.equal(order.long(), reference)


def test_no_shuffle_is_index_order() -> None:
    batches = list(iterate_micro_batches(numbered(5), micro_batch_size=2, seed=9, epoch=3, shuffle=False))
    assert [row for b in batches for row in b["input_ids"][:, 0].tolist()] == [0, 1, 2, 3, 4]


def test_bad_micro_batch_size_fails_at_call() -> None:
    with pytest.raises(ValueError):
        iterate_micro_batches(numbered(3), micro_batch_size=0, seed=0, epoch=0)
