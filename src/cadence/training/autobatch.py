"""``--micro-batch-size auto``: on out-of-memory, halve the micro-batch (or the token budget) and retry the window.

With ``--micro-batch-tokens`` the controller halves the token budget instead of the row count: the window's samples
are re-cut longest first into micro-batches of at most that many padded positions. With ``--packing`` too, a budget
below the packed row length packs the examples into shorter rows, so a window of long packed rows can still shrink
down to one example per micro-batch. Under several processes each rank re-cuts its own share, and the ranks agree on
the largest micro-batch count (one small all-reduce) so that their collectives stay paired.

The window (the samples of one optimizer step) never changes, only how it is cut into micro-batches: halving the
micro-batch doubles the accumulation, so the effective batch and, by the engine's window-target normalisation, the
gradient stay exactly the same. The failed attempt's partial gradients are dropped by the engine before the retry.

After ``grow_after`` good steps at a reduced size the controller tries twice the size again (never above the size
it started with); a growth that runs out of memory falls back and waits twice as long before the next try, so a
size that does not fit is not retried every few steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from cadence.engine.cut import Cut
from cadence.engine.step import Engine, StepResult
from cadence.engine.windows import Window, count_examples, pad_to_micro_batches, recut


class MicroBatchTooLarge(RuntimeError):
    """Even a micro-batch of one sequence runs out of memory."""


class MicroBatchController:
    """Chooses the micro-batch size of each window; see the module docstring."""

    def __init__(self, *, cut: Cut, grow_after: int, log: Callable[[str], None] = print) -> None:
        self.cut = cut
        """The run's cut, at the size it starts with (its windows come cut so)."""
        self.start = cut.size
        self.current = cut.size
        """The size the next window is cut at (:meth:`Cut.resized`): rows, or a token budget."""
        self.grow_after = grow_after
        self._wait = grow_after
        self._good_steps = 0
        self._growing = False
        self.log = log
        self.halvings = 0
        """Out-of-memory retries so far."""

    def step(self, engine: Engine, window: Window, **step_kwargs: Any) -> tuple[StepResult, int]:
        """Run ``window`` through ``engine`` at the current size, halving on out-of-memory; (result, retries)."""
        retries = 0
        while True:
            attempt = self._cut(engine, window)
            try:
                result = engine.step(attempt, **step_kwargs)
            except torch.OutOfMemoryError as err:
                # Under several processes every rank gets here in the same micro-batch (the engine's out-of-memory
                # agreement), so every rank's controller takes the same decisions and the ranks stay in step.
                self._after_oom(engine, err, window, attempt)
                retries += 1
                continue
            self._after_success()
            return result, retries

    @property
    def unit(self) -> Literal["rows", "tokens"]:
        """What ``start`` and ``current`` count: rows per micro-batch, or padded positions (a token budget)."""
        return "tokens" if self.cut.micro_batch_tokens is not None else "rows"

    def _cut(self, engine: Engine, window: Window) -> Window:
        if self.current >= self.start:  # the window came cut at the starting size
            return window
        smaller = self.cut.resized(self.current)
        if window.largest_share is None:
            if self.unit == "rows" and self.current >= _largest_micro_batch(window):
                return window  # every micro-batch is already small enough (an epoch's short last window)
            return recut(window, smaller, counter=engine.counter)
        # Several ranks: every rank re-cuts its own share (the same decision on every rank, since what follows is a
        # collective), then runs as many micro-batches as the rank that needs the most.
        cut = recut(window, smaller, counter=engine.counter)
        return pad_to_micro_batches(cut, _most_micro_batches(engine, len(cut) - cut.padding, window.largest_share))

    def _after_oom(self, engine: Engine, err: torch.OutOfMemoryError, window: Window, attempt: Window) -> None:
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the failed attempt's cached blocks back before the smaller retry
        if self.unit == "tokens":
            if _one_example_per_micro_batch(attempt):
                raise MicroBatchTooLarge(
                    f"out of memory even with one sequence per micro-batch ({str(err).splitlines()[0]}); try "
                    f"--activation-checkpointing full, --offload optimizer, bf16, a smaller --seq-len or a larger "
                    f"--memory-budget") from err
            smaller = max(1, self.current // 2)
            self.log(f"out of memory at a budget of {self.current} positions per micro-batch: retrying the window "
                     f"at {smaller} (same {window.samples} samples)")
            self._shrunk_to(smaller)
            return
        if self.current == 1:
            raise MicroBatchTooLarge(
                f"out of memory even at micro-batch 1 ({str(err).splitlines()[0]}); the model, its gradients and "
                f"optimizer state do not fit: try --activation-checkpointing full, --offload optimizer, bf16, or a "
                f"larger --memory-budget"
            ) from err
        smaller = max(1, self.current // 2)
        rows = sum(int(batch["labels"].shape[0]) for batch in window.micro_batches[:len(window) - window.padding])
        self.log(
            f"out of memory at micro-batch {self.current}: retrying the window as {smaller} x {-(-rows // smaller)} "
            f"(same {window.samples} samples)"
        )
        self._shrunk_to(smaller)

    def _shrunk_to(self, smaller: int) -> None:
        if self._growing:  # the size we grew to does not fit: wait longer before trying it again
            self._wait *= 2
            self._growing = False
        self.current = smaller
        self.halvings += 1
        self._good_steps = 0

    def _after_success(self) -> None:
        self._growing = False
        if self.current >= self.start:
            return
        self._good_steps += 1
        if self._good_steps >= self._wait:
            self.current = min(self.start, self.current * 2)
            self._good_steps = 0
            self._growing = True
            what = "a budget of" if self.unit == "tokens" else "micro-batch"
            self.log(f"{self._wait} good steps: trying {what} {self.current} again")


def _largest_micro_batch(window: Window) -> int:
    return max(int(batch["labels"].shape[0]) for batch in window.micro_batches)


def _one_example_per_micro_batch(window: Window) -> bool:
    """No budget can cut ``window`` finer: every micro-batch is one row holding one example (a packed row's filler,
    which has no target, is not an example)."""
    return all(int(batch["labels"].shape[0]) == 1 and count_examples(batch) <= 1
               for batch in window.micro_batches[:len(window) - window.padding])


def _most_micro_batches(engine: Engine, mine: int, bound: int) -> int:
    """The most micro-batches any rank's re-cut share needs (every rank calls this with the same ``bound``, its
    upper limit: one micro-batch per sample of the largest share). A one-hot vector summed over ranks names every
    rank's count without needing to know which rank is which."""
    counts = torch.zeros(max(bound, mine) + 1, dtype=torch.float64)
    counts[mine] = 1.0
    present = engine.collective.all_reduce_sum(counts).nonzero()
    return int(present.max()) if len(present) else mine
