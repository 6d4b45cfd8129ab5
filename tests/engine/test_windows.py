"""Windows: grouping micro-batches, counting targets and real tokens, the short last window."""

from __future__ import annotations

import pytest
import torch

from cadence.engine.cut import Cut
from cadence.engine.windows import count_targets, count_tokens, iter_windows, make_window


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


# ---------------------------------------------------------------------------------------------------- rank shares
def _ids(window_or_batches) -> list[tuple[int, ...]]:
    """Each real sample as its token tuple (targets > 0), to compare windows by content."""
    batches = window_or_batches.micro_batches if hasattr(window_or_batches, "micro_batches") else window_or_batches
    rows = []
    for b in batches:
        for ids, labels in zip(b["input_ids"], b["labels"]):
            targets = (labels != -100).nonzero()
            if len(targets):  # padding micro-batches hold no target; right padding is cut off
                rows.append(tuple(ids[: int(targets[-1]) + 1].tolist()))
    return rows


@pytest.mark.parametrize("last_window", ["step", "drop"])
@pytest.mark.parametrize(("micro", "accum"), [(8, 1), (2, 4), (3, 2), (1, 8)])
def test_one_rank_shares_are_the_single_process_windows(variable_dataset, micro, accum, last_window):
    from cadence.data import iterate_micro_batches
    from cadence.engine.windows import epoch_windows

    expected = list(iter_windows(iterate_micro_batches(variable_dataset, micro, seed=5, epoch=2), accum,
                                 micro_batch_size=micro, last_window=last_window))
    got = list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=micro), grad_accum_steps=accum, seed=5,
                             epoch=2, last_window=last_window))
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert (mine.targets, mine.tokens, mine.samples, mine.short, mine.padding) == (
            theirs.targets, theirs.tokens, theirs.samples, theirs.short, 0)
        for a, b in zip(mine.micro_batches, theirs.micro_batches, strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


@pytest.mark.parametrize("world", [2, 3, 5])
def test_rank_shares_are_disjoint_and_their_union_is_the_single_process_window(variable_dataset, world):
    """40 examples, windows of 2 x 2 x world: the last window is short (for world 3 and 5, shorter than the
    number of ranks times a micro-batch), so some ranks run padding micro-batches."""
    from cadence.engine.windows import epoch_windows

    single = list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=2 * 2 * world), grad_accum_steps=1, seed=1,
                                epoch=0))
    shares = [list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=2), grad_accum_steps=2, seed=1, epoch=0,
                                 world_size=world, rank=rank)) for rank in range(world)]
    assert all(len(rank_windows) == len(single) for rank_windows in shares)
    for index, whole in enumerate(single):
        windows = [rank_windows[index] for rank_windows in shares]
        assert len({len(w.micro_batches) for w in windows}) == 1, "every rank runs the same number of micro-batches"
        union = [row for w in windows for row in _ids(w)]
        assert sorted(union) == sorted(_ids(whole)) and len(union) == len(set(union)) == whole.samples
        assert sum(w.targets for w in windows) == whole.targets and sum(w.samples for w in windows) == whole.samples
        assert sum(w.tokens for w in windows) == whole.tokens
        sizes = [w.samples for w in windows]
        assert max(sizes) - min(sizes) <= 1  # balanced, also in the short last window


def test_a_rank_with_fewer_samples_in_the_short_last_window_runs_padding(variable_dataset):
    from cadence.engine.windows import epoch_windows

    # 40 examples in windows of 1 x 2 x 3 = 6: the last holds 4, shared 2 / 1 / 1.
    last = [list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=1), grad_accum_steps=2, seed=0, epoch=0,
                               world_size=3, rank=rank))[-1] for rank in range(3)]
    assert [(w.samples, len(w.micro_batches), w.padding) for w in last] == [(2, 2, 0), (1, 2, 1), (1, 2, 1)]
    assert all(int((w.micro_batches[-1]["labels"] != -100).sum()) == 0 for w in last[1:])


def test_resplitting_a_rank_share_keeps_every_rank_in_step(variable_dataset):
    """--micro-batch-size auto re-cuts a window after an out-of-memory: each rank re-cuts its own share (the same
    samples and targets) and pads to the most micro-batches any rank needs, so every rank runs as many."""
    from cadence.engine.windows import epoch_windows, pad_to_micro_batches, recut

    world = 3
    last = [list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=4), grad_accum_steps=1, seed=0, epoch=0,
                               world_size=world, rank=rank))[-1] for rank in range(world)]
    assert [w.samples for w in last] == [2, 1, 1]  # 40 = 3 x 12 + 4: the short last window
    for size in (2, 1):
        mine = [recut(w, Cut(micro_batch_size=size)) for w in last]
        most = max(len(w) - w.padding for w in mine)
        cut = [pad_to_micro_batches(w, most) for w in mine]
        assert len({len(w.micro_batches) for w in cut}) == 1, size
        assert [len(w) - w.padding for w in mine] == [-(-2 // size), 1, 1]
        assert [w.targets for w in cut] == [w.targets for w in last]
        assert [w.samples for w in cut] == [2, 1, 1]


def test_a_share_of_a_whole_window_is_what_epoch_windows_gives_that_rank(variable_dataset):
    from cadence.engine.windows import epoch_windows, recut

    whole = list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=12), grad_accum_steps=1, seed=4, epoch=0))
    for rank in range(3):
        shares = list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=2), grad_accum_steps=2, seed=4,
                                    epoch=0, world_size=3, rank=rank))
        for window, expected in zip(whole, shares, strict=True):
            got = recut(window, Cut(micro_batch_size=2), world_size=3, rank=rank)
            assert (got.targets, got.samples, got.padding, len(got.micro_batches)) == (
                expected.targets, expected.samples, expected.padding, len(expected.micro_batches))
            assert sorted(_ids(got)) == sorted(_ids(expected))


def test_merged_windows_keep_the_order_and_give_the_one_big_batch_gradient(variable_dataset):
    """An adaptive batch's larger window is the minimum's windows grouped: the same samples in the same order, and
    one step over it is the gradient of one big batch of them (fp32, 1e-6), at a switch as anywhere."""
    import torch.nn.functional as F

    from cadence.data.batching import collate, epoch_order
    from cadence.engine.step import Engine
    from cadence.engine.windows import epoch_windows, merge_windows
    from tests.helpers import tiny_model

    small = list(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=2), grad_accum_steps=2, seed=5, epoch=0))
    merged = merge_windows(small[1:3])  # the second and third windows of 4 samples: one of 8
    assert _ids(merged) == _ids(small[1]) + _ids(small[2])
    assert (merged.targets, merged.samples, len(merged)) == (small[1].targets + small[2].targets, 8, 4)
    order = epoch_order(len(variable_dataset), 5, 0).tolist()
    big = collate([variable_dataset[i] for i in order[4:12]])
    assert sorted(_ids(merged)) == sorted(_ids([big]))

    model = tiny_model()
    reference = tiny_model()
    loss = F.cross_entropy(reference(big["input_ids"]).flatten(0, 1), big["labels"].flatten(), ignore_index=-100)
    loss.backward()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=1.0))
    result = engine.step(merged)
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach() - q.grad, rtol=0, atol=1e-6, msg=name)


def test_merge_windows_refuses_windows_of_two_epochs(variable_dataset):
    from cadence.engine.windows import epoch_windows, merge_windows

    first = next(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=2), grad_accum_steps=2, seed=5, epoch=0))
    second = next(epoch_windows(variable_dataset, cut=Cut(micro_batch_size=2), grad_accum_steps=2, seed=5, epoch=1))
    with pytest.raises(ValueError, match="epochs"):
        merge_windows([first, second])
    assert merge_windows([first]) is first
