"""Input that overlaps compute: windows prepared ahead in a thread change nothing but when they are prepared.

The same losses and weights bit for bit for any --prefetch-windows (resume included), the order kept, the queue
bounded, the producer's exceptions raised in the loop, and no thread left behind however the loop ends. On CUDA, the
micro-batch loop queues its work without a single host synchronisation.
"""

from __future__ import annotations

import gc
import itertools
import shutil
import threading
import traceback
from pathlib import Path

import pytest
import torch
from helpers import prompt_completion_dataset, sample_text, write_jsonl
from safetensors.torch import load_file

from cadence import Window, epoch_windows, prefetch
from cadence.cli import main
from cadence.engine import Engine
from cadence.engine.cut import Cut
from cadence.engine.prefetch import THREAD_NAME, pin_tensors
from cadence.models import GPT, MODEL_CONFIGS
from cadence.training.checkpoint import checkpoint_dirs, load_checkpoint
from cadence.training.loop import EpochWindow
from cadence.training.run_dir import read_metrics


def prefetch_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def windows_equal(a: Window, b: Window) -> bool:
    return (len(a) == len(b) and (a.targets, a.tokens, a.samples, a.epoch, a.short, a.padding, a.positions)
            == (b.targets, b.tokens, b.samples, b.epoch, b.short, b.padding, b.positions)
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                    for x, y in zip(a.micro_batches, b.micro_batches)))


# ------------------------------------------------------------------------------------------------ the iterator
def test_order_is_kept_at_every_depth():
    dataset = prompt_completion_dataset()
    for depth in (0, 1, 3):
        assert list(prefetch(iter(range(50)), depth=depth)) == list(range(50))
        direct = list(epoch_windows(dataset, cut=Cut(micro_batch_size=3, order="by-length"), grad_accum_steps=2,
                                    seed=5, epoch=1))
        ahead = list(prefetch(epoch_windows(dataset, cut=Cut(micro_batch_size=3, order="by-length"),
                                            grad_accum_steps=2, seed=5, epoch=1), depth=depth))
        assert len(ahead) == len(direct) == 7
        assert all(windows_equal(a, b) for a, b in zip(ahead, direct))
    assert not prefetch_threads()  # each ran out, so each joined its thread


@pytest.mark.parametrize("depth", [1, 3])
def test_the_producer_is_never_more_than_depth_items_ahead_and_does_fill_up(depth):
    total, requested, started, most_ahead = 12, [0], [0], [0]
    filled = threading.Condition()

    def source():
        for item in range(total):
            with filled:
                started[0] += 1  # item ``item`` is being prepared now
                most_ahead[0] = max(most_ahead[0], started[0] - requested[0])
                filled.notify_all()
            yield item

    with prefetch(source(), depth=depth) as ahead:
        for expected in range(total):
            with filled:
                # Counted BEFORE the request: the room it makes can only be used after it.
                requested[0] += 1
            assert next(ahead) == expected
            with filled:  # the producer runs ahead until it is depth items ahead of what was asked for
                assert filled.wait_for(lambda: started[0] >= min(requested[0] + depth, total), timeout=30)
        assert list(ahead) == []
    assert most_ahead[0] == depth  # prepared ahead of what the loop asked for: exactly depth, never more


def test_a_producer_exception_is_raised_in_the_loop_with_its_traceback():
    def failing_source():
        yield from range(3)
        raise ValueError("the dataset is broken at item 3")

    got = []
    with pytest.raises(ValueError, match="broken at item 3") as caught:
        for item in prefetch(failing_source(), depth=2):
            got.append(item)
    assert got == [0, 1, 2]  # the items before the failure come first
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert "failing_source" in frames  # where it happened, in the producer thread
    assert not prefetch_threads()


@pytest.mark.parametrize("ending", ["close", "garbage", "error", "interrupt"])
def test_no_thread_is_left_however_the_loop_ends(ending):
    source_closed = threading.Event()

    def endless():
        try:
            yield from itertools.count()
        finally:
            source_closed.set()

    if ending in ("close", "garbage"):
        ahead = prefetch(endless(), depth=2)
        assert next(ahead) == 0
        if ending == "close":
            ahead.close()
            assert next(ahead, None) is None  # a closed prefetcher is exhausted
        else:
            del ahead
            gc.collect()
    else:
        failure = RuntimeError("the loop failed") if ending == "error" else KeyboardInterrupt()
        with pytest.raises(type(failure)):
            with prefetch(endless(), depth=2) as ahead:
                for item in ahead:
                    if item == 1:
                        raise failure
    assert not prefetch_threads()
    assert source_closed.is_set()  # the source generator's finally ran (in the thread, before it ended)


def test_pinning_reaches_every_micro_batch_tensor(monkeypatch):
    pinned: list[torch.Tensor] = []

    def fake_pin(tensor: torch.Tensor) -> torch.Tensor:  # CPU builds cannot pin; record what would be
        copy = tensor.clone()
        pinned.append(copy)
        return copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    window = next(epoch_windows(prompt_completion_dataset(), cut=Cut(micro_batch_size=3), grad_accum_steps=2, seed=0,
                                epoch=0))
    place = pin_tensors(EpochWindow(0, 1, window))
    assert isinstance(place, EpochWindow) and place[:2] == (0, 1) and windows_equal(place.window, window)
    tensors = [value for batch in place.window.micro_batches for value in batch.values()]
    assert len(tensors) == 4 and all(any(t is p for p in pinned) for t in tensors)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory needs CUDA"):
            prefetch(iter([window]), depth=1, pin_memory=True)


# ------------------------------------------------------------------------------------------------ cadence train
def train_args(data: Path, out: Path, prefetch_windows: int, *extra: str, steps: int = 6) -> list[str]:
    return ["train", "--data", str(data), "--seq-len", "32", "--micro-batch-size", "4", "--grad-accum-steps", "2",
            "--max-steps", str(steps), "--val-fraction", "0", "--prefetch-windows", str(prefetch_windows),
            "--too-long", "truncate",  # all 24 of write_jsonl's examples (about half longer than 32), cut to fit
            "--log-every", "100", "--out", str(out), *extra]


def run_record(out: Path) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    rows = [(r["step"], r["window"], r["epoch"], r["loss"], r["grad_norm"], r["lr"]) for r in read_metrics(out)]
    return rows, load_file(str(out / "model.safetensors"))


def assert_same_run(a: Path, b: Path) -> None:
    rows_a, weights_a = run_record(a)
    rows_b, weights_b = run_record(b)
    assert rows_a == rows_b  # losses bitwise
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_train_gives_bitwise_the_same_run_for_any_prefetch_depth_and_resumes(tmp_path, one_thread):
    # 24 variable-length examples, 8 per window: 3 windows an epoch, so 6 steps end exactly at the end of epoch 1,
    # while a producer 3 windows ahead is already in epoch 2. The default cut (--micro-batch-order by-length).
    data = write_jsonl(tmp_path / "data.jsonl", count=24)
    runs = {depth: tmp_path / f"prefetch-{depth}" for depth in (0, 1, 3)}
    for depth, out in runs.items():
        assert main(train_args(data, out, depth, "--checkpoint-every", "2")) == 0
        assert not prefetch_threads()  # cadence train never leaves its thread behind
    for depth in (1, 3):
        assert_same_run(runs[depth], runs[0])
    assert [row[2] for row in run_record(runs[3])[0]] == [0, 0, 0, 1, 1, 1]
    for depth, out in runs.items():
        summary = (out / "summary.json").read_text()
        assert '"epochs": 2,' in summary, depth  # the epoch the loop ran, not the one the producer reached
        positions = [load_checkpoint(path).state["data_position"] for path in checkpoint_dirs(out)]
        assert positions == [{"epoch": 0, "window_in_epoch": 2}, {"epoch": 1, "window_in_epoch": 1},
                             {"epoch": 1, "window_in_epoch": 3}], depth

    # Resume with prefetch on after step 2 (as if killed then): the skipped windows are cut in the thread too.
    for late in checkpoint_dirs(runs[3])[1:]:
        shutil.rmtree(late)
    assert main(train_args(data, runs[3], 3, "--checkpoint-every", "2", "--resume")) == 0
    assert_same_run(runs[3], runs[0])
    assert not prefetch_threads()


def test_train_on_packed_text_is_the_same_with_prefetch(tmp_path, one_thread):
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(60 * 32 + 1))
    for depth in (0, 2):
        assert main(train_args(data, tmp_path / f"text-{depth}", depth, steps=3)) == 0
    assert_same_run(tmp_path / "text-2", tmp_path / "text-0")


def test_a_failing_step_leaves_no_thread_behind(tmp_path, monkeypatch, one_thread):
    real_step = Engine.step

    def step_then_fail(engine: Engine, window, **options):
        if engine.windows == 1:
            raise RuntimeError("a bug in the step")
        return real_step(engine, window, **options)

    monkeypatch.setattr(Engine, "step", step_then_fail)
    data = write_jsonl(tmp_path / "data.jsonl", count=24)
    with pytest.raises(RuntimeError, match="a bug in the step"):
        main(train_args(data, tmp_path / "run", 2))
    assert not prefetch_threads()  # stopped as the failure left the loop, not when the traceback is collected


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_micro_batch_loop_never_synchronises_the_host(precision):
    torch.manual_seed(0)
    model = GPT(MODEL_CONFIGS["gpt-tiny"]).cuda()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision=precision, max_grad_norm=1.0)
    windows = epoch_windows(prompt_completion_dataset(count=64), cut=Cut(micro_batch_size=4), grad_accum_steps=4,
                            seed=0, epoch=0)
    with prefetch(windows, depth=2, pin_memory=True) as ahead:
        engine.step(next(ahead))  # warm-up: lazy initialisations (cuBLAS, the optimizer state) are not the loop's
        window = next(ahead)
        assert len(window) == 4 and all(t.is_pinned() for b in window.micro_batches for t in b.values())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation now raises
        try:
            loss_sum = engine.accumulate(window, window.targets)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    engine.apply_gradients()  # its per-step syncs (the grad norm) are allowed
    assert torch.isfinite(loss_sum) and float(loss_sum) > 0
