"""Length-aware micro-batches (issue 15): the window's samples cut by length or by a token budget give the
gradient of the unsorted window (same samples, normalised by the whole window's targets), with less padding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_optimizer, prompt_completion_dataset, reference_loop, sigterm_at, tiny_model, write_jsonl
from safetensors.torch import load_file

from cadence import Engine
from cadence.cli import main
from cadence.data import TokenDataset
from cadence.engine.cut import Cut
from cadence.engine.schedules import build_lr_scheduler
from cadence.engine.windows import epoch_windows
from cadence.training.run_dir import read_metrics

EFFECTIVE = 8
STEPS = 4


def engine_run(dataset: TokenDataset, *, micro: int, order: str, tokens: int | None, pack: int | None = None):
    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=2, max_steps=STEPS)
    engine = Engine(model, optimizer, scheduler=scheduler, max_grad_norm=0.5)
    windows = epoch_windows(dataset,
                            cut=Cut(micro_batch_size=micro, order=order, micro_batch_tokens=tokens, pack_length=pack),
                            grad_accum_steps=EFFECTIVE // micro, seed=0, epoch=0)
    results = [engine.step(window) for window, _ in zip(windows, range(STEPS))]
    return results, model


def relative_l2(a: torch.nn.Module, b: torch.nn.Module) -> float:
    flat_a = torch.cat([p.detach().flatten() for p in a.parameters()])
    flat_b = torch.cat([p.detach().flatten() for p in b.parameters()])
    return float((flat_a - flat_b).norm() / flat_b.norm())


@pytest.mark.parametrize("micro", [8, 2, 1])
@pytest.mark.parametrize("order, tokens, pack", [("drawn", None, None), ("by-length", None, None),
                                                 ("by-length", 64, None), ("drawn", 40, None),
                                                 ("drawn", None, 40), ("drawn", 80, 40)])
def test_every_cut_gives_the_one_big_batch_gradient(micro: int, order: str, tokens: int | None,
                                                    pack: int | None) -> None:
    dataset = prompt_completion_dataset()
    expected_losses, expected_model = reference_loop(dataset, steps=STEPS, max_grad_norm=0.5)
    results, model = engine_run(dataset, micro=micro, order=order, tokens=tokens, pack=pack)
    for step, (result, expected) in enumerate(zip(results, expected_losses, strict=True), start=1):
        assert abs(result.loss - expected) <= 1e-5 * expected, (step, result.loss, expected)
    assert relative_l2(model, expected_model) < 1e-4


def test_sorting_and_a_budget_compute_less_padding() -> None:
    dataset = prompt_completion_dataset()
    padded, runs = {}, {}
    for name, order, tokens in [("drawn", "drawn", None), ("sorted", "by-length", None), ("budget", "by-length", 96)]:
        runs[name], _ = engine_run(dataset, micro=2, order=order, tokens=tokens)
        padded[name] = sum(r.padded_positions for r in runs[name])
        # The same windows: the same real tokens and targets, step by step.
        assert [(r.tokens, r.targets) for r in runs[name]] == [(r.tokens, r.targets) for r in runs["drawn"]]
    assert padded["drawn"] > padded["sorted"] > 0 and padded["budget"] < padded["drawn"]


def test_packed_rows_hold_several_examples_and_pad_less() -> None:
    dataset = prompt_completion_dataset()
    drawn, _ = engine_run(dataset, micro=8, order="drawn", tokens=None)
    packed, _ = engine_run(dataset, micro=8, order="drawn", tokens=None, pack=40)
    assert [(r.samples, r.tokens, r.targets) for r in packed] == [(r.samples, r.tokens, r.targets) for r in drawn]
    assert sum(r.padded_positions for r in packed) < 0.75 * sum(r.padded_positions for r in drawn)


def test_a_document_mask_that_leaks_would_be_caught(monkeypatch) -> None:
    """Sanity of the packing parity: let each example attend to the one packed before it (plain causal attention
    over the row, positions still restarting) and the losses move ten times beyond the parity test's 1e-5."""
    import cadence.models.gpt as gpt

    def leaky(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
        return [[(0, position_ids.shape[1])] for _ in range(position_ids.shape[0])]

    dataset = prompt_completion_dataset()
    expected_losses, _ = reference_loop(dataset, steps=STEPS, max_grad_norm=0.5)
    monkeypatch.setattr(gpt, "document_spans", leaky)
    results, _ = engine_run(dataset, micro=8, order="drawn", tokens=None, pack=40)
    assert max(abs(r.loss - e) / e for r, e in zip(results, expected_losses)) > 1e-4


def test_a_budget_cut_keeps_every_sample_once_longest_first_within_the_budget() -> None:
    dataset = prompt_completion_dataset(count=40)
    indices = list(range(40))
    lengths = dataset.lengths(indices)
    for budget in (40, 64, 100, 1000):
        groups = [[indices[row[0]] for row in rows]
                  for rows in Cut(micro_batch_size=4, micro_batch_tokens=budget).plan(lengths)]
        assert sorted(i for group in groups for i in group) == indices
        flat = [lengths[i] for group in groups for i in group]
        assert flat == sorted(flat, reverse=True)
        for group in groups:
            width = max(lengths[i] for i in group)
            assert len(group) * width <= budget or len(group) == 1


def test_ranks_agree_on_the_micro_batch_count_and_share_the_window() -> None:
    """Under a token budget each rank's slice needs its own number of micro-batches; every rank runs the largest
    (padding micro-batches fill), and the ranks' samples are exactly the one-process window's."""
    dataset = prompt_completion_dataset(count=48)
    whole = list(epoch_windows(dataset, cut=Cut(micro_batch_size=2, order="by-length", micro_batch_tokens=50),
                               grad_accum_steps=4, seed=0, epoch=0, world_size=1, rank=0))
    ranks = [list(epoch_windows(dataset, cut=Cut(micro_batch_size=2, order="by-length", micro_batch_tokens=50),
                                grad_accum_steps=2, seed=0, epoch=0, world_size=2, rank=r)) for r in range(2)]
    for one, (mine, theirs) in zip(whole, zip(*ranks, strict=True), strict=True):
        assert len(mine) == len(theirs)  # DDP pairs collectives by order
        assert mine.samples + theirs.samples == one.samples and mine.targets + theirs.targets == one.targets
    assert any(window.padding for rank in ranks for window in rank)  # the budget really made the counts differ


def test_cli_reports_padding_and_keeps_the_losses(tmp_path, capsys) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    common = ["train", "--data", str(data), "--seq-len", "48", "--micro-batch-size", "4", "--grad-accum-steps", "2",
              "--max-steps", "3", "--val-fraction", "0", "--data-cache", str(tmp_path / "cache")]
    assert main([*common, "--out", str(tmp_path / "drawn")]) == 0
    assert main([*common, "--out", str(tmp_path / "budget"), "--micro-batch-tokens", "96"]) == 0
    assert main([*common, "--out", str(tmp_path / "packed"), "--packing"]) == 0
    drawn = read_metrics(tmp_path / "drawn")
    for name in ("budget", "packed"):
        for a, b in zip(drawn, read_metrics(tmp_path / name), strict=True):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"] and a["tokens"] == b["tokens"], name
            assert b["padded_positions"] <= a["padded_positions"] and a["samples"] == b["samples"]
    summaries = {run: json.loads((tmp_path / run / "summary.json").read_text())["padding_fraction"]
                 for run in ("drawn", "budget", "packed")}
    assert 0 <= summaries["packed"] < summaries["budget"] < summaries["drawn"] < 1


@pytest.mark.parametrize("extra, flag", [
    (["--micro-batch-tokens", "0"], "--micro-batch-tokens"),
    (["--micro-batch-tokens", "20"], "--micro-batch-tokens"),  # below --seq-len 48
    (["--micro-batch-order", "shortest"], "--micro-batch-order"),
])
def test_bad_length_aware_flags_name_the_flag(tmp_path, capsys, extra: list[str], flag: str) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    argv = ["train", "--data", str(data), "--seq-len", "48", "--max-steps", "1", "--out", str(tmp_path / "run"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"cadence: error: {flag}:" in err and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--packing"], ["--micro-batch-tokens", "96"]])
def test_a_resumed_length_aware_run_is_bitwise_the_uninterrupted_one(tmp_path, extra: list[str]) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    common = ["train", "--data", str(data), "--seq-len", "48", "--micro-batch-size", "4", "--grad-accum-steps", "2",
              "--max-steps", "6", "--val-fraction", "0", "--checkpoint-every", "2",
              "--data-cache", str(tmp_path / "cache"), *extra]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--out", str(tmp_path / "cut")]) == 0
    for late in sorted((tmp_path / "cut" / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[1:]:
        shutil.rmtree(late)  # as if killed right after step 2
    assert main([*common, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    rows = {run: [(r["step"], r["loss"], r["padded_positions"]) for r in read_metrics(tmp_path / run)]
            for run in ("whole", "cut")}
    assert rows["cut"] == rows["whole"] and len(rows["whole"]) == 6
    whole, cut = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("whole", "cut"))
    assert whole.keys() == cut.keys() and all(torch.equal(whole[name], cut[name]) for name in whole)  # bitwise


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--packing"], ["--micro-batch-tokens", "96"], ["--micro-batch-order", "by-length"]])
def test_a_length_aware_window_interrupted_mid_way_resumes_bitwise(tmp_path, extra: list[str]) -> None:
    """--checkpoint-mid-window with a cut: SIGTERM lands during the first micro-batch of step 3; the checkpoint
    holds that window's first micro-batch, and the resumed run continues the same cut to the uninterrupted result."""
    from cadence.training.checkpoint import checkpoint_dirs, load_checkpoint

    data = write_jsonl(tmp_path / "data.jsonl")
    common = ["train", "--data", str(data), "--seq-len", "48", "--micro-batch-size", "2", "--grad-accum-steps", "4",
              "--max-steps", "5", "--val-fraction", "0", "--checkpoint-every", "100", "--checkpoint-mid-window",
              "--data-cache", str(tmp_path / "cache"), *extra]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    with sigterm_at(2, 1):  # the stop is honoured after this micro-batch, the window's first
        assert main([*common, "--out", str(tmp_path / "cut")]) == 0
    (checkpoint,) = checkpoint_dirs(tmp_path / "cut")
    partial = load_checkpoint(checkpoint).state["partial_window"]
    assert partial["micro_batches_done"] == 1 and checkpoint.name == "step-2"
    assert main([*common, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    rows = {run: [(r["step"], r["loss"], r["padded_positions"]) for r in read_metrics(tmp_path / run)]
            for run in ("whole", "cut")}
    assert rows["cut"] == rows["whole"] and len(rows["whole"]) == 5
    whole, cut = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("whole", "cut"))
    assert all(torch.equal(whole[name], cut[name]) for name in whole)  # bitwise


def test_an_interrupted_window_is_not_continued_with_another_cut(tmp_path, capsys) -> None:

    data = write_jsonl(tmp_path / "data.jsonl")
    common = ["train", "--data", str(data), "--seq-len", "48", "--micro-batch-size", "2", "--grad-accum-steps", "4",
              "--max-steps", "3", "--val-fraction", "0", "--checkpoint-mid-window", "--out", str(tmp_path / "run"),
              "--data-cache", str(tmp_path / "cache")]
    with sigterm_at(1, 2):
        assert main([*common, "--packing"]) == 0
    capsys.readouterr()
    assert main([*common, "--no-packing", "--resume"]) == 2  # a bare --resume continues with the recorded cut
    err = capsys.readouterr().err
    assert "cadence: error: --packing: False differs from the True of the window the checkpoint interrupted" in err
    assert main([*common, "--packing", "--resume"]) == 0


@pytest.mark.parametrize("kept", [True, False], ids=["indices kept", "built from batches"])
@pytest.mark.parametrize("source", ["drawn", "packed"])
@pytest.mark.parametrize("cut", [dict(), dict(order="by-length"), dict(micro_batch_tokens=60),
                                 dict(pack_length=40), dict(pack_length=24, micro_batch_tokens=48)])
def test_recut_recuts_any_window_to_the_same_gradient(source: str, cut: dict, kept: bool) -> None:
    """verify, plan and auto re-cut windows they are handed (unpacked or packed): from the samples' indices when
    the window was cut from a dataset, else from the examples in its batches. The same examples, targets and
    tokens, and the one-window gradient, whatever the cut."""
    import dataclasses

    from cadence.engine.windows import recut, window_examples

    dataset = prompt_completion_dataset(count=16)
    packed = 40 if source == "packed" else None
    (window,) = list(epoch_windows(dataset, cut=Cut(micro_batch_size=16, pack_length=packed), grad_accum_steps=1,
                                   seed=0, epoch=0))
    if not kept:
        window = dataclasses.replace(window, drawn=None)
    again = recut(window, Cut(micro_batch_size=3, **cut))
    assert (again.samples, again.targets, again.tokens) == (window.samples, window.targets, window.tokens)
    examples = sorted(tuple(e["input_ids"].tolist()) for e in window_examples(window))
    assert examples == sorted(tuple(e["input_ids"].tolist()) for e in window_examples(again))
    assert len(examples) == 16
    if "micro_batch_tokens" in cut:
        assert all(b["labels"].numel() <= cut["micro_batch_tokens"] or b["labels"].shape[0] == 1
                   for b in again.micro_batches)
    losses = []
    for each in (window, again):
        model = tiny_model()
        losses.append(Engine(model, make_optimizer(model), max_grad_norm=0.5).step(each).loss)
    assert abs(losses[1] - losses[0]) <= 1e-5 * losses[0]


@pytest.mark.parametrize("kept", [True, False], ids=["indices kept", "built from batches"])
def test_recut_shares_a_window_between_ranks_like_epoch_windows(kept: bool) -> None:
    import dataclasses

    from cadence.engine.windows import recut

    dataset = prompt_completion_dataset(count=16)
    (whole,) = list(epoch_windows(dataset, cut=Cut(micro_batch_size=16), grad_accum_steps=1, seed=0, epoch=0))
    whole = whole if kept else dataclasses.replace(whole, drawn=None)
    shares = [recut(whole, Cut(micro_batch_size=2, micro_batch_tokens=50), world_size=2, rank=r) for r in range(2)]
    direct = [next(epoch_windows(dataset, cut=Cut(micro_batch_size=2, micro_batch_tokens=50), grad_accum_steps=4,
                                 seed=0, epoch=0, world_size=2, rank=r)) for r in range(2)]
    for mine, theirs in zip(shares, direct, strict=True):
        assert (mine.samples, mine.targets, mine.tokens, len(mine), mine.largest_share) == (
            theirs.samples, theirs.targets, theirs.tokens, len(theirs), theirs.largest_share)
    assert len(shares[0]) == len(shares[1])


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_packing_with_recompute_and_bf16_keeps_the_gradient(recompute: str, precision: str) -> None:
    """Recompute re-runs each block's example-by-example attention in the backward; bf16 runs it under autocast:
    the packed window's gradient is the unpacked one's (fp32 to rounding; bf16 within its verify tolerance)."""
    from cadence.memory.recompute import apply_activation_checkpointing
    from cadence.verify.equivalence import GRADIENT_TOLERANCE, Setup, flat, parameter_gradients

    dataset = prompt_completion_dataset(count=16)
    (window,) = list(epoch_windows(dataset, cut=Cut(micro_batch_size=16), grad_accum_steps=1, seed=0, epoch=0))
    reference = flat(parameter_gradients(tiny_model, window, Setup(cut=Cut(micro_batch_size=16))))

    def checkpointed() -> torch.nn.Module:
        model = tiny_model()
        apply_activation_checkpointing(model, recompute)
        return model

    packed = flat(parameter_gradients(checkpointed, window, Setup(cut=Cut(micro_batch_size=2, pack_length=40),
                                                                   precision=precision)))
    error = float((packed - reference).norm() / reference.norm())
    assert error < (1e-5 if precision == "fp32" else GRADIENT_TOLERANCE["bf16"]), error
