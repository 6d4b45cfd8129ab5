"""Windows: grouping micro-batches, counting targets and real tokens, the short last window."""

from __future__ import annotations

import pytest
import torch

from cadence.windows import count_targets, count_tokens, iter_windows, make_window


def batch(lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    labels = torch.full((len(lengths), width), -100)
    for row, length in enumerate(lengths):
        labels[row, :length] = 1
    return {"input_ids": torch.zeros_like(labels), "labels": labels}


def test_counts_ignore_padding():
    b = batch([3, 5, 0], width=6)
    assert count_targets(b) == 8
    assert count_tokens(b) == 3 + 5 + 6  # a row with no target was still read in full


def test_prompt_positions_count_as_tokens_not_targets():
    labels = torch.tensor([[-100, -100, 7, 8, -100]])
    b = {"input_ids": torch.zeros_like(labels), "labels": labels}
    assert count_targets(b) == 2 and count_tokens(b) == 4


def test_grouping_and_short_last_window():
    micro = [batch([2, 2], 4)] * 5 + [batch([2], 4)]  # 11 samples, micro 2
    windows = list(iter_windows(micro, 4, micro_batch_size=2))
    assert [len(w) for w in windows] == [4, 2]
    assert [w.samples for w in windows] == [8, 3]
    assert [w.short for w in windows] == [False, True]
    assert windows[1].targets == 6


def test_full_count_window_with_small_last_micro_batch_is_short():
    micro = [batch([1, 1], 2), batch([1], 2)]
    (window,) = iter_windows(micro, 2, micro_batch_size=2)
    assert window.short
    assert list(iter_windows(micro, 2, micro_batch_size=2, last_window="drop")) == []


def test_drop_discards_only_the_short_window():
    micro = [batch([1, 1], 2)] * 5
    assert [w.samples for w in iter_windows(micro, 2, micro_batch_size=2, last_window="drop")] == [4, 4]


def test_bad_arguments():
    with pytest.raises(ValueError):
        list(iter_windows([], 0))
    with pytest.raises(ValueError):
        make_window([])
