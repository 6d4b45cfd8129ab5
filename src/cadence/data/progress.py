"""Progress of a token-store build: bytes and examples per second and the time left, once it takes a moment.

Silent for the first ``delay`` seconds (a small file should not flash a bar); then, on a terminal, one line redrawn
in place; in a log, a plain line every ``log_every`` seconds (a log full of carriage returns is unreadable).
"""

from __future__ import annotations

import time
from typing import IO

from cadence.formatting import format_duration


class BuildProgress:
    """``advance(bytes, examples)`` as work completes; ``close()`` at the end (prints the total if it showed)."""

    def __init__(self, label: str, total_bytes: int, stream: IO[str] | None, *, delay: float = 1.0,
                 log_every: float = 10.0, unit: str = "bytes") -> None:
        self.label = label
        self.unit = unit
        self.total_bytes = max(1, total_bytes)
        self.stream = stream
        self.delay = delay
        self.log_every = log_every
        self.live = bool(stream is not None and stream.isatty())
        self.started = time.perf_counter()
        self.done_bytes = 0
        self.examples = 0
        self._shown_at: float | None = None

    def advance(self, nbytes: int, examples: int = 0) -> None:
        self.done_bytes += nbytes
        self.examples += examples
        now = time.perf_counter()
        if self.stream is None or now - self.started < self.delay:
            return
        if self._shown_at is not None and now - self._shown_at < (0.2 if self.live else self.log_every):
            return
        self._shown_at = now
        self._show(now, final=False)

    def _show(self, now: float, *, final: bool) -> None:
        if self.stream is None:
            return
        elapsed = max(now - self.started, 1e-9)
        rate = self.done_bytes / elapsed
        left = (self.total_bytes - self.done_bytes) / rate if rate > 0 else 0.0
        if self.unit == "bytes":
            line = f"{self.label}: {self.done_bytes / 1e6:,.1f}/{self.total_bytes / 1e6:,.1f} MB, {rate / 1e6:,.1f} MB/s"
        else:
            line = f"{self.label}: {self.done_bytes:,}/{self.total_bytes:,} {self.unit}, {rate:,.0f} {self.unit}/s"
        if self.examples and self.unit == "bytes":
            line += f", {self.examples:,} examples ({self.examples / elapsed:,.0f}/s)"
        line += f", {format_duration(elapsed)} elapsed" if final else f", ETA {format_duration(left)}"
        if self.live:
            self.stream.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._shown_at is not None:
            self._show(time.perf_counter(), final=True)
