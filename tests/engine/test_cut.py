"""The Cut: one value for how a window is cut, from the flags and back, in words, resized, planned."""

from __future__ import annotations

import pytest

from cadence.config import TrainConfig
from cadence.engine.cut import CUT_FLAG_DEFAULTS, Cut, pack_rows, rank_bounds

LENGTHS = [5, 30, 12, 30, 7, 20, 3, 18]


@pytest.mark.parametrize("flags", [
    {"micro_batch_order": "drawn", "micro_batch_tokens": None, "packing": False},
    {"micro_batch_order": "by-length", "micro_batch_tokens": None, "packing": False},
    {"micro_batch_order": "by-length", "micro_batch_tokens": 256, "packing": False},
    {"micro_batch_order": "drawn", "micro_batch_tokens": 128, "packing": True},
])
def test_a_cut_goes_from_the_flags_to_the_record_and_back(flags) -> None:
    cut = Cut.from_flags(TrainConfig(**flags), micro_batch_size=4, seq_len=64)
    assert cut.flags() == flags and set(cut.flags()) == set(CUT_FLAG_DEFAULTS)
    assert Cut.from_flags(cut.flags(), micro_batch_size=4, seq_len=64) == cut  # a record's mapping reads the same
    assert cut.pack_length == (64 if flags["packing"] else None)


def test_a_record_without_the_cut_flags_means_drawn_rows() -> None:
    assert Cut.from_flags({}, micro_batch_size=2, seq_len=8) == Cut(micro_batch_size=2)


def test_the_cut_in_words_and_as_a_command_line() -> None:
    assert Cut(micro_batch_size=4).describe() == "" and not Cut(micro_batch_size=4).by_length
    cut = Cut(micro_batch_size=4, order="by-length", micro_batch_tokens=512, pack_length=64)
    assert cut.describe() == "order by-length, budget 512 positions, packed into rows of 64" and cut.by_length
    assert cut.command_line() == ["--micro-batch-order", "by-length", "--micro-batch-tokens", "512", "--packing"]
    assert cut.command_line(default_order="by-length") == ["--micro-batch-tokens", "512", "--packing"]


def test_resizing_halves_the_rows_or_the_budget_and_packs_shorter_rows_below_it() -> None:
    assert Cut(micro_batch_size=8, order="by-length").resized(4) == Cut(micro_batch_size=4, order="by-length")
    budget = Cut(micro_batch_size=8, micro_batch_tokens=256, pack_length=64)
    assert budget.size == 256 and budget.resized(128).pack_length == 64
    assert budget.resized(32) == Cut(micro_batch_size=8, micro_batch_tokens=32, pack_length=32)
    with pytest.raises(ValueError):
        budget.resized(0)


@pytest.mark.parametrize("bad", [dict(micro_batch_size=0), dict(micro_batch_size=1, order="sorted"),
                                 dict(micro_batch_size=1, micro_batch_tokens=0), dict(micro_batch_size=1, pack_length=0)])
def test_a_cut_that_cannot_be_is_refused(bad) -> None:
    with pytest.raises(ValueError):
        Cut(**bad)


@pytest.mark.parametrize("cut", [Cut(micro_batch_size=3), Cut(micro_batch_size=3, order="by-length"),
                                 Cut(micro_batch_size=3, micro_batch_tokens=60),
                                 Cut(micro_batch_size=2, pack_length=40),
                                 Cut(micro_batch_size=2, pack_length=40, micro_batch_tokens=80)],
                         ids=["drawn", "by-length", "budget", "packed", "packed-budget"])
def test_a_plan_holds_every_sample_once_within_its_limits(cut: Cut) -> None:
    plan = cut.plan(LENGTHS)
    samples = [k for rows in plan for row in rows for k in row]
    assert sorted(samples) == list(range(len(LENGTHS)))
    for rows in plan:
        widths = [sum(LENGTHS[k] for k in row) for row in rows]
        if cut.pack_length is not None:
            assert all(w <= cut.pack_length or len(row) == 1 for w, row in zip(widths, rows))
        if cut.micro_batch_tokens is not None:
            assert len(rows) * max(widths) <= cut.micro_batch_tokens or len(rows) == 1
        else:
            assert len(rows) <= cut.micro_batch_size
    if not cut.by_length:
        assert samples == list(range(len(LENGTHS)))  # drawn order: consecutive slices


def test_pack_rows_and_rank_bounds() -> None:
    assert pack_rows([30, 10, 25, 5], 40) == [[0, 1], [2, 3]]  # first fit, longest first
    assert rank_bounds(10, 3) == [0, 4, 7, 10] and rank_bounds(8, 2) == [0, 4, 8]
