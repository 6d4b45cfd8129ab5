"""How a run stops before --max-steps, apart from evaluation's early stop: a signal, to any rank (every rank stops at
the same window boundary, after its checkpoint), and divergence (--max-skipped-steps optimizer steps skipped in a
row)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from cadence.distributed.ranks import Ranks, any_rank


class StopOnSignal:
    """SIGTERM / SIGINT ask the loop to stop after the current window (it checkpoints and exits 0); the handler is
    removed at the first signal, so a second one acts at once (terminates / interrupts)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.requested = signal.Signals(number).name
        signal.signal(number, signal.SIG_DFL if number == signal.SIGTERM else signal.default_int_handler)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


class Stopping(StopOnSignal):
    """A run's signal handler (a context manager: installed while the loop runs), with what the ranks agreed on and
    the optimizer steps skipped in a row."""

    def __init__(self, ranks: Ranks) -> None:
        super().__init__()
        self.ranks = ranks
        self.elsewhere = False
        """A signal reached another rank, not this one (every rank stops all the same)."""
        self.skipped_in_a_row = 0

    def agreed(self) -> bool:
        """Whether a stop signal reached any rank (the same answer on every rank)."""
        # A signal may reach some ranks only: all stop at the same window boundary, or one would wait in the next
        # window's all-reduce for a rank that left (one tiny collective per window).
        stopping = any_rank(self.requested is not None, self.ranks)
        self.elsewhere = stopping and self.requested is None
        return stopping

    def count_skip(self, skipped: bool) -> int:
        """Count an optimizer step (skipped or not); the steps skipped in a row up to it. Skips are decided from
        all-reduced gradients, so every rank counts the same ones."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        return self.skipped_in_a_row

    def stopped_by(self) -> str | None:
        """The signal that stopped the run, for summary.json (None when none did)."""
        return self.requested or ("a signal to another rank" if self.elsewhere else None)
