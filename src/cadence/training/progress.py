"""Progress on the console: a live bar on a terminal, plain periodic lines in logs and CI."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

from cadence.formatting import format_bytes, format_duration

WIDE = 100
"""Terminals narrower than this get a short bar and fitted figures."""
NARROW_BAR = 10


class TrainProgress:
    """Shows optimizer step, micro-step, loss, tokens/s, memory and ETA.

    On a terminal a rich live bar redraws in place; otherwise one line every ``log_every`` steps, because a log file
    full of carriage returns is unreadable.
    """

    def __init__(self, *, total_steps: int, grad_accum_steps: int, log_every: int, stream: IO[str] | None = None,
                 live: bool | None = None, clock: Callable[[], float] = time.perf_counter, unit: str = "step") -> None:
        """``unit``: what ``total_steps`` counts: optimizer steps, or (``"window"``, --effective-batch-size adaptive)
        windows of the minimum batch, read from each row's ``minimum_windows``, so that the count ends at the total
        whatever the batch grew to."""
        self.unit = unit
        self.stream = stream or sys.stderr
        self.clock = clock
        self.total_steps = total_steps
        self.grad_accum_steps = grad_accum_steps
        self.log_every = log_every
        self.live = self.stream.isatty() if live is None else live
        self.tokens = 0
        self._bar: Any = None
        self._task: Any = None
        self.peak_memory: int | None = None
        self.rate: float | None = None
        self.step_seconds: float | None = None
        """Smoothed time of one training step (the row's ``step_time_s``), from the second step of this process on:
        the first also pays start-up, compilation and allocation."""
        self.overhead_seconds = 0.0
        """Wall time outside the training steps since this process's first step: evaluations, checkpoints, metrics.
        Spread over every step seen rather than smoothed: an evaluation every 50 steps costs a fiftieth of it per
        step, where a smoothed rate would read the step that evaluated as the new pace (an ETA of an hour right after
        the demo's first evaluation, four minutes ten steps earlier)."""
        self._last_update: float | None = None
        self._steps_seen = 0
        self._last_step = "starting"
        """The last step's loss, tokens/s, memory and ETA: kept on the bar while the next window's micro-batches run."""

    def resumed(self, rows: list[dict[str, Any]]) -> None:
        """Carry the earlier part of a resumed run: its peak memory (measured once per process on CPU, so the resumed
        process may never measure it again) and its last step's figures."""
        for row in rows:
            if row.get("peak_memory_bytes"):
                self.peak_memory = max(self.peak_memory or 0, int(row["peak_memory_bytes"]))
        if rows:
            self._last_step = " | ".join(self._figures(rows[-1]))

    def __enter__(self) -> "TrainProgress":
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            console = Console(file=self.stream)
            # The figures matter more than the bar: on a narrow terminal (80 columns) the bar shrinks and the
            # figures are fitted (see _fit); the ETA is among them, so no time column is repeated.
            narrow = console.width < WIDE
            self._bar = Progress(
                TextColumn(f"[bold]{self.unit}"), MofNCompleteColumn(), BarColumn(bar_width=NARROW_BAR if narrow else 30),
                TextColumn("{task.fields[info]}"), console=console, transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total_steps, info=self._last_step)
        self._last_update = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)

    def micro_step(self, step: int, micro: int, total: int | None = None) -> None:
        """Called before each micro-batch on a terminal, so a long window shows it is alive: the position in the
        window (``total``: the window's own micro-batches, which packing and token budgets make vary; default the
        accumulation) beside the last step's figures (which stay readable during accumulation)."""
        if self._bar is not None:
            self._bar.update(self._task, info=self._fit(
                [f"micro {micro}/{total or self.grad_accum_steps}", *self._last_step.split(" | ")]))

    def _fit(self, parts: list[str]) -> str:
        """The bar's figures within the terminal: when they do not fit beside the step counter and the bar, the
        memory goes first, then the throughput; the loss, the ETA and the micro-batch stay."""
        if self._bar is None:
            return " | ".join(parts)
        width = self._bar.console.width
        used = len(f"step {self.total_steps}/{self.total_steps} ") + (NARROW_BAR if width < WIDE else 30) + 2
        kept = list(parts)
        for prefix in ("mem ", "val ", "tok/s"):
            if len(" | ".join(kept)) + used <= width:
                break
            kept = [part for part in kept if not (part.startswith(prefix) or part.endswith(prefix))]
        return " | ".join(kept)

    def update(self, row: dict[str, Any]) -> None:
        self.tokens += int(row.get("tokens") or 0)
        if row.get("peak_memory_bytes"):
            self.peak_memory = max(self.peak_memory or 0, int(row["peak_memory_bytes"]))
        # Smoothed per-step throughput: start-up, evaluation and checkpoint time would make a cumulative rate lie.
        step_rate = float(row.get("tokens_per_s") or 0.0)
        self.rate = step_rate if self.rate is None else 0.8 * self.rate + 0.2 * step_rate
        self._time_step(row)
        step = int(row["step"])
        done = int(row.get("minimum_windows") or step) if self.unit == "window" else step
        parts = self._figures(row)
        if self.step_seconds is not None:
            per_step = self.step_seconds + self.overhead_seconds / self._steps_seen
            # Adaptive: the steps left are the windows left at the steps per window so far.
            steps_left = max(0, self.total_steps - done) * step / max(1, done)
            parts.append(f"eta {format_duration(per_step * steps_left)}")
        else:
            parts.append("eta -")  # one warm-up step says nothing about the steady pace
        self._last_step = " | ".join(parts)
        evaluated = row.get("val_loss") is not None
        if self._bar is not None:
            self._bar.update(self._task, completed=done, info=self._fit(parts))
            if evaluated:  # kept in the scrollback: the bar's field is overwritten by the next micro-batch
                self._bar.console.print(f"{self._counter(step, done)}: val loss {row['val_loss']:.4f}")
            return
        if row.get("skipped") or evaluated or step % self.log_every == 0 or done >= self.total_steps or step == 1:
            print(f"{self._counter(step, done)} | {self._last_step}", file=self.stream, flush=True)

    def _counter(self, step: int, done: int) -> str:
        """``step 3/10``; adaptive: ``window 12/40 (step 5)``, the budget in the unit --max-steps counts."""
        if self.unit == "step":
            return f"step {step}/{self.total_steps}"
        return f"{self.unit} {done}/{self.total_steps} (step {step})"

    def _time_step(self, row: dict[str, Any]) -> None:
        """Fold the wall time since the last row into ``step_seconds`` (the training step) and ``overhead_seconds``
        (what came beside it); the first step of the process is left out of both."""
        now = self.clock()
        if self._last_update is not None and self._steps_seen > 0:
            seconds = now - self._last_update
            # The engine's own time for the step; a row without it (a test's) counts its whole interval as training.
            training = min(seconds, float(row.get("step_time_s") or seconds))
            self.overhead_seconds += seconds - training
            self.step_seconds = training if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * training
        self._last_update = now
        self._steps_seen += 1

    def _figures(self, row: dict[str, Any]) -> list[str]:
        """Loss, throughput, memory (and the evaluation and a skip) of a metrics row, as the bar and the lines show
        them."""
        loss = row.get("loss")
        parts = [
            f"loss {loss:.4f}" if isinstance(loss, float) else "loss -",
            f"{self.rate or float(row.get('tokens_per_s') or 0.0):,.0f} tok/s",
            f"mem {format_bytes(self.peak_memory)}",
        ]
        if row.get("effective_batch") is not None:  # --effective-batch-size adaptive: the batch of this step
            parts.insert(1, f"batch {row['effective_batch']}" + (
                f" -> {row['next_effective_batch']}" if row.get("batch_decision") in ("grow", "shrink") else ""))
        if row.get("val_loss") is not None:
            parts.append(f"val {row['val_loss']:.4f}")
        if row.get("skipped"):
            parts.append(f"SKIPPED ({row.get('skip_reason')})")
        return parts

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)
