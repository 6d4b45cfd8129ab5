"""Progress output: a rich live bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

from cadence.formatting import format_bytes, format_duration
from cadence.training.progress import TrainProgress


def row(step: int, **extra):
    return {"step": step, "loss": 2.5, "tokens": 1000, "tokens_per_s": 5000.0, "peak_memory_bytes": 2**20, **extra}


def test_plain_lines_every_log_every_steps():
    stream = io.StringIO()
    with TrainProgress(total_steps=6, grad_accum_steps=2, log_every=3, stream=stream, live=False) as progress:
        for step in range(1, 7):
            progress.update(row(step))
        progress.update(row(6, skipped=True, skip_reason="fp16 overflow"))
    lines = stream.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/6", "step 3/6", "step 6/6", "step 6/6"]
    assert "SKIPPED (fp16 overflow)" in lines[-1] and "1.0 MiB" in lines[0] and "\r" not in stream.getvalue()


def test_live_bar_shows_step_micro_step_loss_and_memory():
    stream = io.StringIO()
    with TrainProgress(total_steps=2, grad_accum_steps=4, log_every=1, stream=stream, live=True) as progress:
        progress.micro_step(0, 3)
        progress.update(row(1, val_loss=2.0))
        progress.update(row(2))
    text = stream.getvalue()
    assert "2/2" in text and "loss 2.5000" in text and "tok/s" in text and "MiB" in text


def test_formatting():
    assert format_bytes(None) == "-" and format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05"
