"""Progress output: a rich live bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io

import pytest

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


def test_adaptive_progress_counts_windows_of_the_minimum_and_ends_at_the_total():
    """--effective-batch-size adaptive: --max-steps counts windows of the minimum batch, so the line does too (the
    optimizer step beside it), and the last line is 10/10 though only 6 optimizer steps ran; the ETA is the windows
    left at the steps per window so far."""
    stream = io.StringIO()
    ticks = iter(range(100))
    windows = [1, 2, 3, 4, 6, 8, 10]  # the batch doubled after step 3, and again after step 5 (the last stops at 10)
    with TrainProgress(total_steps=10, grad_accum_steps=2, log_every=2, stream=stream, live=False, unit="window",
                       clock=lambda: float(next(ticks))) as progress:
        for step, done in enumerate(windows, start=1):
            progress.update(row(step, minimum_windows=done, step_time_s=1.0))
    lines = stream.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "window 1/10 (step 1)", "window 2/10 (step 2)", "window 4/10 (step 4)", "window 8/10 (step 6)",
        "window 10/10 (step 7)"]
    assert lines[-1].endswith("eta 0:00")
    assert lines[-2].endswith(f"eta {format_duration(2 * 6 / 8)}")  # 2 windows left at 6/8 steps a window, 1 s each


def test_adaptive_live_bar_ends_at_the_total():
    stream = io.StringIO()
    with TrainProgress(total_steps=8, grad_accum_steps=2, log_every=1, stream=stream, live=True,
                       unit="window") as progress:
        progress.update(row(1, minimum_windows=4))
        progress.update(row(2, minimum_windows=8))
    text = stream.getvalue()
    assert "window" in text and "8/8" in text


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


def test_eta_comes_from_measured_steps_not_the_warm_up_one():
    """Step 1 pays start-up and compilation: the ETA waits for a second step and then follows the steady pace."""
    now = [0.0]
    stream = io.StringIO()
    with TrainProgress(total_steps=11, grad_accum_steps=1, log_every=1, stream=stream, live=False,
                       clock=lambda: now[0]) as progress:
        for step, seconds in enumerate([60.0, 2.0, 2.0], start=1):
            now[0] += seconds
            progress.update(row(step))
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("eta -")
    assert lines[2].endswith(f"eta {format_duration(8 * 2.0)}")  # 8 steps left at 2 s, the 60 s step left out


def test_an_evaluation_is_spread_over_the_steps_not_read_as_the_new_pace():
    """Steps of 1 s and a 10 s evaluation every 5 steps: right after the first evaluation (step 5 of 20) the time
    left is 15 steps and 3 evaluations, 45 s; the evaluation's step is not the pace of the 15 to come."""
    now = [0.0]
    stream = io.StringIO()
    with TrainProgress(total_steps=20, grad_accum_steps=1, log_every=1, stream=stream, live=False,
                       clock=lambda: now[0]) as progress:
        for step in range(1, 11):
            evaluated = step % 5 == 0
            now[0] += 1.0 + (10.0 if evaluated else 0.0)
            progress.update(row(step, step_time_s=1.0, **({"val_loss": 2.0} if evaluated else {})))
    lines = stream.getvalue().splitlines()
    assert lines[4].startswith("step 5/20") and lines[4].endswith(f"eta {format_duration(45.0)}")
    # One step later the evaluation is spread over six steps: the ETA moves a little, it does not jump.
    assert lines[5].endswith(f"eta {format_duration(14 * (1.0 + 10.0 / 6))}")
    assert lines[9].endswith(f"eta {format_duration(30.0)}")  # 10 steps and 2 evaluations left


def test_a_resumed_run_shows_the_memory_measured_before_it_and_evaluations_between_log_lines():
    stream = io.StringIO()
    with TrainProgress(total_steps=20, grad_accum_steps=1, log_every=10, stream=stream, live=False) as progress:
        progress.resumed([row(1, peak_memory_bytes=3 * 2**20), row(2, peak_memory_bytes=None)])
        progress.update(row(3, peak_memory_bytes=None))
        progress.update(row(4, peak_memory_bytes=None, val_loss=2.25))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 4/20") and "val 2.2500" in lines[0]
    assert "mem 3.0 MiB" in lines[0]


def test_the_live_bar_keeps_the_last_steps_figures_during_the_next_windows_micro_batches():
    progress = TrainProgress(total_steps=4, grad_accum_steps=4, log_every=1, stream=io.StringIO(), live=True)
    with progress:
        progress.update(row(1))
        progress.micro_step(1, 3)
        info = progress._bar.tasks[0].fields["info"]
        progress.micro_step(1, 2, 3)  # a packed window of three micro-batches counts its own
        packed = progress._bar.tasks[0].fields["info"]
    assert info.startswith("micro 3/4 | loss 2.5000 | 5,000 tok/s | mem 1.0 MiB | eta")
    assert packed.startswith("micro 2/3 | loss 2.5000")


@pytest.mark.slow
@pytest.mark.parametrize("columns", [200, 80])
def test_a_real_terminal_shows_loss_and_the_micro_batch_together(tmp_path, columns):
    """`cadence train` on a pseudo-terminal: the frames drawn while a window's micro-batches run show the
    micro-batch position and the previous step's loss side by side, and each evaluation gets a line of its own. At
    80 columns every frame fits (once cut to "st..." with no bar), with the bar, the loss and the ETA in it."""
    import os
    import pty
    import re
    import subprocess
    import sys

    leader, follower = pty.openpty()
    command = [sys.executable, "-m", "cadence", "train", "--seq-len", "128", "--micro-batch-size", "8",
               "--grad-accum-steps", "4", "--max-steps", "6", "--eval-every", "3", "--eval-batches", "2",
               "--out", str(tmp_path / "run")]
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower,
                               env={**os.environ, "COLUMNS": str(columns), "TERM": "xterm"})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=120) == 0
    os.close(leader)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))
    frames = re.split(r"[\r\n]", text)
    if columns == 80:
        drawn = [frame for frame in frames if "loss" in frame and "━" in frame]
        assert drawn and all(len(frame.rstrip()) <= 80 for frame in drawn), max(drawn, key=len)
        assert any(re.search(r"micro \d/4 \| loss \d\.\d{4} .*eta", frame) for frame in drawn), text
    else:
        assert any(re.search(r"micro \d/4 \| loss \d\.\d{4} \| [\d,]+ tok/s", frame) for frame in frames), text
    assert "step 3/6: val loss" in text and "step 6/6: val loss" in text
