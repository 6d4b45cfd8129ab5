"""Progress on the console: a live bar on a terminal, plain periodic lines in logs and CI."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from cadence.formatting import format_bytes, format_duration


class TrainProgress:
    """Shows optimizer step, micro-step, loss, tokens/s, memory and ETA.

    On a terminal a rich live bar redraws in place; otherwise one line every ``log_every`` steps, because a log file
    full of carriage returns is unreadable.
    """

    def __init__(self, *, total_steps: int, grad_accum_steps: int, log_every: int, stream: IO[str] | None = None,
                 live: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total_steps = total_steps
        self.grad_accum_steps = grad_accum_steps
        self.log_every = log_every
        self.live = self.stream.isatty() if live is None else live
        self.started = time.perf_counter()
        self.tokens = 0
        self._bar: Any = None
        self._task: Any = None
        self.peak_memory: int | None = None
        self.rate: float | None = None

    def __enter__(self) -> "TrainProgress":
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"), console=Console(file=self.stream), transient=False,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total_steps, info="starting")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)

    def micro_step(self, step: int, micro: int) -> None:
        """Called before each micro-batch on a terminal, so a long window shows it is alive."""
        if self._bar is not None:
            self._bar.update(self._task, info=f"micro {micro}/{self.grad_accum_steps} of step {step + 1}")

    def update(self, row: dict[str, Any]) -> None:
        self.tokens += int(row.get("tokens") or 0)
        if row.get("peak_memory_bytes"):
            self.peak_memory = max(self.peak_memory or 0, int(row["peak_memory_bytes"]))
        elapsed = time.perf_counter() - self.started
        step = int(row["step"])
        # Smoothed per-step throughput: start-up, evaluation and checkpoint time would make a cumulative rate lie.
        step_rate = float(row.get("tokens_per_s") or 0.0)
        self.rate = step_rate if self.rate is None else 0.8 * self.rate + 0.2 * step_rate
        rate = self.rate
        eta = elapsed / step * (self.total_steps - step) if step else 0.0
        loss = row.get("loss")
        parts = [
            f"loss {loss:.4f}" if isinstance(loss, float) else "loss -",
            f"{rate:,.0f} tok/s",
            f"mem {format_bytes(self.peak_memory)}",
        ]
        if row.get("val_loss") is not None:
            parts.append(f"val {row['val_loss']:.4f}")
        if row.get("skipped"):
            parts.append(f"SKIPPED ({row.get('skip_reason')})")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=" | ".join(parts))
            return
        if row.get("skipped") or step % self.log_every == 0 or step == self.total_steps or step == 1:
            print(
                f"step {step}/{self.total_steps} | " + " | ".join(parts) + f" | eta {format_duration(eta)}",
                file=self.stream, flush=True,
            )

    def message(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(text, file=self.stream, flush=True)
