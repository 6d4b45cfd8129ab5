"""``cadence train``: build everything from a TrainConfig and run windows through the engine into a run directory.

Everything that can be wrong with the input is checked (configuration AND data files) before the run directory is
created, so bad input never leaves anything half-written.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, TypeVar

import torch
from safetensors import SafetensorError

from cadence import __version__
from cadence.config import TrainConfig
from cadence.data import iterate_micro_batches
from cadence.data.chat_store import chat_template_for
from cadence.data.hf import as_tokenizer
from cadence.data.source import Source
from cadence.data.store import StoreDamaged
from cadence.distributed.ranks import (
    SINGLE,
    Ranks,
    any_rank,
    broadcast_from_main,
    full_model_state,
    local_shard,
    max_over_ranks,
    unwrap,
    write_full_model_state,
)
from cadence.engine.precision import fp32_matmul
from cadence.engine.prefetch import Prefetcher, prefetch
from cadence.engine.step import Engine, PartialWindow, StepResult, WindowInterrupted
from cadence.engine.windows import Window, padding_micro_batch
from cadence.errors import CadenceFailure, UsageError
from cadence.formatting import format_bytes
from cadence.models.hf import save_hf
from cadence.models.lora import parameter_counts
from cadence.optim.state import optimizer_state_bytes
from cadence.training.autobatch import MicroBatchController, MicroBatchTooLarge
from cadence.training.checkpoint import Checkpointer
from cadence.training.components import Components, build_components
from cadence.training.lock import RunDirectoryLock, claim_run_directory
from cadence.training.noise_scale import noise_scale_announcement, noise_scale_fields
from cadence.training.prepare import Prepared, checked_run_directory, prepare
from cadence.training.progress import TrainProgress
from cadence.training.restart import (
    LAUNCH_FIELD,
    RESTART_LOCK_WAIT_S,
    Launch,
    last_recorded_step,
    restart_line,
    this_launch,
)
from cadence.training.resume import ResumePoint, StopOnSignal, restore, schedule_note
from cadence.training.run_dir import (
    BEST_DIR,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    NoWriter,
    RunDirectoryWriteFailed,
    RunWriter,
    export_files,
    exported_before,
    read_summary,
    writing,
)
from cadence.training.same_data import check_same_data

T = TypeVar("T")


class TrainingFailed(CadenceFailure):
    """Training could not continue (not a usage problem): the CLI exits with status 1 and this message.

    ``every_rank_agrees``: every rank reached the same decision (divergence), so rank 0 alone reports it; otherwise
    the failing rank reports it with its rank."""

    label = "training failed"


@dataclass(kw_only=True)
class _Totals:
    """What the summary adds up over the whole run (a resumed run's earlier rows included)."""

    tokens: int = 0
    targets: int = 0
    samples: int = 0
    padded_positions: int = 0
    timed_tokens: int = 0
    timed_s: float = 0.0
    peak_memory: int | None = None
    oom_retries: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    last_val: float | None = None
    segment_tokens: int = 0
    """This process's own (a resumed run's earlier segments excluded), for the segments in summary.json."""
    segment_step_s: float = 0.0

    def add(self, result: StepResult, *, timed: bool) -> None:
        self.segment_tokens += result.tokens
        self.segment_step_s += result.step_time_s
        self.tokens += result.tokens
        self.targets += result.targets
        self.samples += result.samples
        self.padded_positions += result.padded_positions
        if timed:  # steps slowed by the profiler do not count towards throughput
            self.timed_tokens += result.tokens
            self.timed_s += result.step_time_s
        if result.peak_memory_bytes is not None:
            self.peak_memory = max(self.peak_memory or 0, result.peak_memory_bytes)

    def add_row(self, row: dict[str, Any]) -> None:
        """A metrics row of the run before a resume (so that the summary covers the whole run)."""
        self.tokens += int(row["tokens"])
        self.targets += int(row["targets"])
        self.samples += int(row["samples"])
        self.padded_positions += int(row.get("padded_positions") or 0)
        self.oom_retries += int(row.get("oom_retries") or 0)
        if row.get("peak_memory_bytes"):
            self.peak_memory = max(self.peak_memory or 0, int(row["peak_memory_bytes"]))
        elif not row.get("compile_time_s"):  # a step that compiled (--compile) is not steady state either
            self.timed_tokens += int(row["tokens"])
            self.timed_s += float(row["step_time_s"])
        if not row.get("skipped"):
            self.last = row
        if row.get("val_loss") is not None:
            self.last_val = row["val_loss"]


def train(config: TrainConfig, *, stream: IO[str] | None = None, live: bool | None = None,
          ranks: Ranks = SINGLE) -> dict[str, Any]:
    """Train as configured; returns the summary (also written to summary.json).

    Under torchrun every rank calls this with its ``ranks``; rank 0 alone prints and writes the run directory.
    The shape of torchtune's recipes: set up (``TrainingRun``), then window after window the engine's step
    (``run_window``) and what follows it (``after_step``), then the final save and summary (``finish``)."""
    stream = (stream or sys.stderr) if ranks.is_main else _Discard()
    # Started by torchrun's elastic agent: a restart after a rank died takes its own run directory back (--resume).
    launch = this_launch(config, ranks)
    config = launch.configured(config) if launch is not None else config
    out = _on_every_rank(lambda: checked_run_directory(config, ranks=ranks), ranks)
    # One run at a time in a run directory: claimed before any data is read, held until the end. The check that
    # --out may be written is made under the lock, so a second run started meanwhile can never have filled it.
    lock = claim_run_directory(out, resume=config.resume, ranks=ranks,
                               wait_s=RESTART_LOCK_WAIT_S if launch is not None and launch.own_run else 0.0)
    run = TrainingRun(_prepared_under(lock, lambda: prepare(config, ranks=ranks, out=out), ranks), lock=lock,
                      stream=stream, live=live, launch=launch)
    try:
        with run.stop, run.progress, fp32_matmul(config.fp32_matmul), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for place in run.windows_across_epochs():
                outcome = run.run_window(place)
                # Stopped mid-window (its checkpoint is saved), --max-steps reached, or every rank agreed to stop.
                if outcome is None or run.after_step(place, outcome, caught):
                    break
        run.close_metrics()
        return run.finish()
    finally:
        run.close()  # the metrics (if a failure left them open), then the run directory's lock


class EpochWindow(NamedTuple):
    """One window of the data order and where it sits: ``window_in_epoch`` counts from 1 within ``epoch``."""

    epoch: int
    window_in_epoch: int
    window: Window


class StepOutcome(NamedTuple):
    """A window the engine finished: its result, the out-of-memory retries it took (--micro-batch-size auto), and
    whether the profiler measured (and so slowed) it."""

    result: StepResult
    oom_retries: int
    profiled: bool


def batch_words(prep: Prepared, micro: int | str) -> str:
    """The banner's batch line, from what the cut really does: rows as given, or (packing, a token budget) the
    window's sequences and the bound on each micro-batch, whose number per window follows the lengths."""
    cut = prep.cut
    window = (f"{prep.effective_batch_size} sequences of up to {prep.seq_len} tokens per optimizer step = {micro} rows x "
              f"{prep.grad_accum_steps} accumulation x {prep.world_size} process(es)")
    if cut.pack_length is None and cut.micro_batch_tokens is None:
        return (f"effective batch = {micro} micro-batch x {prep.grad_accum_steps} accumulation x "
                f"{prep.world_size} process(es) = {prep.effective_batch_size} sequences of {prep.seq_len} tokens")
    bound = (f"micro-batches of at most {cut.micro_batch_tokens:,} positions" if cut.micro_batch_tokens is not None
             else f"micro-batches of {cut.micro_batch_size} rows")
    how = f"packed into rows of {cut.pack_length}, " if cut.pack_length is not None else ""
    return f"effective batch = {window}; each window {how}cut into {bound} (as many as its lengths need)"


class TrainingRun:
    """One training run and everything its loop mutates, built from the prepared configuration.

    ``__init__`` sets up (components, resume point, run directory, console banner); ``windows_across_epochs`` yields
    the windows to run, ``run_window`` runs one through the engine, ``after_step`` does what follows each optimizer
    step, and ``finish`` saves the model and writes the summary. Every rank builds one and walks the same windows."""

    def __init__(self, prep: Prepared, *, lock: RunDirectoryLock | None, stream: IO[str], live: bool | None,
                 launch: Launch | None = None) -> None:
        """Build the components, restore the --resume checkpoint (if any), open the run directory and announce.
        ``lock``: rank 0's hold on the run directory (:func:`claim_run_directory`), released by :meth:`close`;
        ``launch``: torchrun's launch and attempt (:func:`this_launch`), recorded in config.json."""
        self.lock: RunDirectoryLock | None = lock
        self.launch: Launch | None = launch
        self.metrics_open = False
        self.checkpointer = Checkpointer(prep.out, prep.ranks, keep=prep.config.keep_checkpoints,
                                         background=prep.config.async_checkpoint)
        """Every checkpoint this run writes, in its format (sharded under FSDP2), and the one it resumes from."""
        self.prefetcher: Prefetcher[EpochWindow] | None = None
        """The thread preparing the next windows once ``windows_across_epochs`` has started (--prefetch-windows)."""
        try:
            self._set_up(prep, stream=stream, live=live)
        except BaseException:
            self.close()
            raise

    def _set_up(self, prep: Prepared, *, stream: IO[str], live: bool | None) -> None:
        config = prep.config
        self.prep, self.config, self.ranks, self.stream = prep, config, prep.ranks, stream
        self.parts: Components = build_components(prep)
        self.engine: Engine = self.parts.engine
        self.val_batches, self.val_examples = _validation_batches(prep)
        """The micro-batches every evaluation runs (this rank's share), and how many validation examples all ranks
        hold together: the figure --keep-best and --early-stop-after decide on, and the console states."""
        self.trained, self.frozen = parameter_counts(self.parts.model)  # --lora-rank freezes the base
        # Counted as weights, not as stored elements: an nf4 base packs two weights in each byte it holds.
        self.parameters: int = self.trained + self.frozen
        self.resolved: dict[str, Any] = _resolved_config(prep, self.parameters, self.launch)
        # What the failed attempt had done, before the resume drops the rows after its checkpoint (rank 0 says it).
        self.recorded_before: int = (last_recorded_step(prep.out) if self.launch is not None and self.launch.own_run
                                     and self.ranks.is_main else 0)
        # Before the writer opens metrics.jsonl.
        self.start: ResumePoint | None = restore(prep.out, self.resolved, self.parts, self.checkpointer,
                                                 prep.micro_batch_size, prep.cut.flags()) if config.resume else None
        if self.start is not None:
            self.checkpointer.intact.add(self.start.checkpoint)
        # Before summary.json is written again: what the earlier processes of a resumed run did.
        self.earlier_segments: list[dict[str, Any]] = earlier_segments(prep.out, self.start)
        kept_rows = self.start.kept_rows if self.start else []
        self.best = BestEvaluation.from_rows(kept_rows)
        """The lowest validation loss so far and the evaluations since (--keep-best, --early-stop-after); a resumed
        run counts its kept rows' evaluations."""
        self.early_stopped = bool(self.start and config.early_stop_after and self.best.since >= config.early_stop_after)
        """True once --early-stop-after stopped the run: also when the run resumed had already stopped early (it
        trains no further step, as it would not have had it run on)."""
        ended = self.start is not None and (self.engine.steps >= config.max_steps or self.early_stopped)
        # Every check has passed: only now is anything in the run directory written (nothing new for a run that had
        # already ended: no TensorBoard file, its config.json as it is).
        self.writer: RunWriter = (RunWriter(prep.out, tensorboard=not ended, config=None if ended else self.resolved)
                                  if self.ranks.is_main else NoWriter())
        self.metrics_open = True
        self._announce()
        self.started: float = time.perf_counter()
        self.totals = _Totals()
        for row in self.start.kept_rows if self.start else []:
            self.totals.add_row(row)
        self.consecutive_skips: int = 0
        self.stopped_elsewhere: bool = False
        self.epoch: int = self.start.epoch if self.start else 0
        """The epoch ``windows_across_epochs`` is in (the summary counts the epochs from it)."""
        self.partial: PartialWindow | None = self.start.partial if self.start else None
        """The window a mid-window checkpoint interrupted, continued by the first ``run_window``."""
        self.stop = StopOnSignal()
        self.windows_at_start: int = self.engine.windows
        """The windows done before this process (a resumed run's): none done since means nothing was trained."""
        self.saved_at: int = self.engine.windows if self.start else -1
        """The window count at the last checkpoint, so that one window is never checkpointed twice."""
        self.progress = TrainProgress(total_steps=config.max_steps, grad_accum_steps=prep.grad_accum_steps,
                                      log_every=config.log_every, stream=stream, live=live)
        self.progress.resumed(self.start.kept_rows if self.start else [])
        # With a token budget, auto halves the budget (positions per micro-batch) rather than the rows.
        self.controller = MicroBatchController(
            cut=prep.cut, grow_after=config.auto_grow_after,
            log=lambda text: self.progress.message(f"auto micro-batch: {text}"))
        self.budget_on_cpu: bool = prep.memory_budget_bytes is not None and prep.device.type == "cpu"

    def close_metrics(self) -> None:
        """Close metrics.jsonl and TensorBoard (once)."""
        if self.metrics_open:
            self.writer.close()
            self.metrics_open = False

    def close(self) -> None:
        """Stop the prefetch thread, close the metrics if still open, then release the run directory; safe to call
        more than once. (The window generator stops the thread too when it is closed or collected; this does not
        count on when that happens.)"""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.checkpointer.close()  # a checkpoint still being written is finished first
        self.close_metrics()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _announce(self) -> None:
        """The console banner: model, precision, batch arithmetic, data, run directory (and the resume point)."""
        config, prep, stream = self.config, self.prep, self.stream
        micro = "auto, starting at " + str(prep.micro_batch_size) if config.auto_micro_batch else prep.micro_batch_size
        print(
            f"cadence {__version__}: {config.model} ({self.parameters:,} parameters"
            + (f": {self.trained:,} trained, {self.frozen:,} frozen" if self.frozen else "") + f") on {prep.device}, "
            f"{config.precision}, recompute {config.activation_checkpointing}, offload {config.offload}\n"
            + batch_words(prep, micro) + "\n"
            f"data: {prep.data.description}\nrun directory: {prep.out}",
            file=stream, flush=True,
        )
        # Which optimizer, and what each of its groups holds (Muon: the orthogonalised matrices and the AdamW rest).
        print(f"optimizer: {prep.optimizer.describe()}: {prep.optimizer.describe_groups(self.parts.model)}",
              file=stream, flush=True)
        noise_scale = noise_scale_announcement(self.engine, prep.grad_accum_steps)
        if noise_scale is not None:
            print(noise_scale, file=stream, flush=True)
        if self.val_batches:
            whole = len(prep.data.val) if prep.data.val is not None else 0
            print(f"evaluation: every {config.eval_every} steps on {self.val_examples:,} validation examples"
                  + (f" (the first {config.eval_batches} micro-batches of {whole:,}: --eval-batches)"
                     if self.val_examples < whole else " (all of them)"), file=stream, flush=True)
        if prep.hf is not None and prep.hf.pending is not None:
            print(f"weights: loaded once, each of the {prep.world_size} ranks reading only its own shard of "
                  f"{config.model}'s safetensors", file=stream, flush=True)
        length_note = prep.data.long_examples.note() if prep.data.long_examples else None
        if length_note:  # --too-long: how many examples were skipped or truncated, and what the truncated ones lost
            print(f"note: {length_note}", file=stream)
        restart = restart_line(self.launch, prep.out, out_given=config.out is not None, start=self.start,
                               recorded=self.recorded_before)
        if restart is not None:
            print(restart, file=stream, flush=True)
        elif self.start is not None:
            print(f"resuming from {self.start.checkpoint} (step {self.start.step})", file=stream, flush=True)
        if self.start is not None:
            note = schedule_note(self.start.saved_config, self.resolved, self.start.step)
            if note:
                print(f"note: {note}", file=stream, flush=True)

    def windows_across_epochs(self) -> Iterator[EpochWindow]:
        """This rank's windows, epoch after epoch, while fewer than --max-steps optimizer steps are done (the loop
        stops at --max-steps; this only refuses to start past it), prepared --prefetch-windows ahead in a thread."""
        if self.engine.steps >= self.config.max_steps or self.early_stopped:
            return
        # Pinned on CUDA, so that the engine's non_blocking copy of each micro-batch is really asynchronous.
        self.prefetcher = prefetch(self._cut_windows(), depth=self.config.prefetch_windows,
                                   pin_memory=self.prep.device.type == "cuda")
        try:
            for place in self.prefetcher:
                # The producer may already be in the next epoch: the epoch is the window's, taken as it is run.
                self.epoch = place.epoch
                yield place
        except StoreDamaged as damaged:
            # The store was verified when the run opened it: it changed under the run (truncated, rewritten).
            raise TrainingFailed(f"{damaged}; the checkpoints so far are intact: restore the data (a cached store "
                                 f"is rebuilt from its source), then --resume") from None
        finally:
            self.prefetcher.close()

    def _cut_windows(self) -> Iterator[EpochWindow]:
        """Every window from the resume point on, epoch after epoch, without end. It runs in the prefetch thread, so
        it reads nothing the loop changes (the step count, ``self.epoch``): the windows are a function of the
        configuration and the resume point alone."""
        epoch = self.start.epoch if self.start else 0
        skip = self.start.windows_done_in_epoch if self.start else 0
        while True:
            # This rank's share of each window (all of it with one process); the same windows for any split.
            windows = self.prep.windows(epoch)
            # A resumed run skips the windows its checkpoint had done: same permutation, same windows after.
            for window_in_epoch, window in enumerate(itertools.islice(windows, skip, None), start=skip + 1):
                yield EpochWindow(epoch, window_in_epoch, window)
            epoch, skip = epoch + 1, 0  # the epoch's windows ran out: the next epoch

    def run_window(self, place: EpochWindow) -> StepOutcome | None:
        """One optimizer step over ``place``'s window (with --micro-batch-size auto, halving on out-of-memory);
        None when a stop request interrupted it mid-window (--checkpoint-mid-window), after checkpointing it."""
        config, engine, prep = self.config, self.engine, self.prep
        # On CPU memory is measured by the profiler, which is as slow as a step: measure the first steady-state
        # window (the second: the first also allocates the optimizer state) only, unless a budget is enforced,
        # which needs every step measured.
        profiled = prep.device.type == "cpu" and (self.budget_on_cpu or engine.windows + 1 == min(2, config.max_steps))
        step_options: dict[str, Any] = {
            "measure_memory": profiled,
            # The window's own micro-batches: packing and token budgets cut windows into different numbers.
            "on_micro_batch": lambda index: self.progress.micro_step(engine.steps, index + 1,
                                                                     len(place.window.micro_batches)),
        }
        if config.checkpoint_mid_window:
            step_options["stop_requested"] = self._agree_on_stop  # every rank stops after the same micro-batch
        if self.partial is not None:  # continue the window a mid-window checkpoint interrupted
            step_options["resume"], self.partial = self.partial, None
        try:
            if config.auto_micro_batch:
                result, retries = self.controller.step(engine, place.window, **step_options)
            else:
                result, retries = engine.step(place.window, **step_options), 0
        except WindowInterrupted as interrupted:
            self._checkpoint_mid_window(interrupted, place)
            self.saved_at = engine.windows
            return None
        except MicroBatchTooLarge as err:
            # With several ranks every rank got here together (the engine agrees on out-of-memory).
            raise TrainingFailed(str(err), every_rank_agrees=True) from err
        except torch.OutOfMemoryError as err:
            raise TrainingFailed(
                f"out of memory at micro-batch {prep.micro_batch_size} ({str(err).splitlines()[0]}); "
                f"use --micro-batch-size auto, a smaller --micro-batch-size, or --activation-checkpointing full"
            ) from err
        return StepOutcome(result, retries, profiled)

    def after_step(self, place: EpochWindow, outcome: StepOutcome, caught: list[warnings.WarningMessage]) -> bool:
        """What follows an optimizer step, in the same order on every rank: the metrics row (with the evaluation when
        due), the divergence stop, the agreement on a stop signal, the checkpoint when due. True when the run ends
        after this window (--max-steps reached, or a signal reached some rank)."""
        result, engine, totals = outcome.result, self.engine, self.totals
        row = {**result.as_metrics(), "epoch": place.epoch, "oom_retries": outcome.oom_retries}
        clock = self.parts.compile_clock
        if clock is not None:  # --compile: the part of step_time_s spent compiling (first steps, new shapes)
            row["compile_time_s"] = clock.lap()
        totals.oom_retries += outcome.oom_retries
        for item in caught:
            self.progress.message(f"warning: {item.message}")
        caught.clear()
        # Steps slowed by the profiler or by compiling are not steady state: they do not count towards tokens/s.
        totals.add(result, timed=not outcome.profiled and not row.get("compile_time_s"))
        done = engine.steps >= self.config.max_steps
        if not result.skipped and self.val_batches and (done or engine.steps % self.config.eval_every == 0):
            with self.prep.optimizer.evaluation_weights(self.parts.optimizer):  # schedule-free: its averaged weights
                totals.last_val = row["val_loss"] = engine.evaluate(self.val_batches)
            # Perplexity: exp of the per-token validation loss (capped: a diverged model's would overflow).
            row["val_perplexity"] = math.exp(min(row["val_loss"], 700.0))
            if clock is not None:
                clock.lap()  # evaluation compiles a no-grad graph of its own: not the next step's compile time
            if self.best.evaluated(engine.steps, row["val_loss"]) and self.config.keep_best:
                self._save_best(row)
            if self.config.early_stop_after and self.best.since >= self.config.early_stop_after and not done:
                self.early_stopped = done = True
        self.writer.log_step(row)
        self.progress.update(row)
        if not result.skipped:
            totals.last = row
        self._stop_if_diverged(result)
        stopping = self._agree_on_stop()
        self._checkpoint_if_due(place, result, done=done, stopping=stopping)
        return done or stopping

    def _stop_if_diverged(self, result: StepResult) -> None:
        """Raise TrainingFailed once --max-skipped-steps optimizer steps in a row were skipped."""
        # Skips are decided from all-reduced gradients, so every rank counts the same ones.
        self.consecutive_skips = self.consecutive_skips + 1 if result.skipped else 0
        if self.consecutive_skips >= self.config.max_skipped_steps:
            raise TrainingFailed(
                f"{self.consecutive_skips} optimizer steps in a row were skipped (last reason: "
                f"{result.skip_reason}); the run has diverged. Lower --lr or use bf16/fp32. The last "
                f"good checkpoint is kept.", every_rank_agrees=True,
            )

    def _agree_on_stop(self) -> bool:
        """Whether a stop signal reached any rank (the same answer on every rank)."""
        # A signal may reach some ranks only: all stop at the same window boundary, or one would wait
        # in the next window's all-reduce for a rank that left (one tiny collective per window).
        stopping = any_rank(self.stop.requested is not None, self.ranks)
        self.stopped_elsewhere = stopping and self.stop.requested is None
        return stopping

    def _checkpoint_if_due(self, place: EpochWindow, result: StepResult, *, done: bool, stopping: bool) -> None:
        """Checkpoint after this window when it is due, unless this window is checkpointed already."""
        config = self.config
        periodic = config.checkpoint_every and self.engine.steps % config.checkpoint_every == 0
        # At a window boundary: periodically, at the end, and when a signal asked to stop.
        wanted = (periodic and not result.skipped) or (done and config.checkpoint_every) or stopping
        if wanted and self.saved_at != self.engine.windows:
            # Schedule-free: the checkpoint's weights are the averaged ones, its optimizer state keeps the training
            # weights (a resume continues from them, bitwise).
            with self.prep.optimizer.evaluation_weights(self.parts.optimizer):
                self.checkpointer.save(self.parts,
                                       data_position={"epoch": place.epoch, "window_in_epoch": place.window_in_epoch},
                                       info={"loss": result.loss, "config": config.to_json_dict(),
                                             "resolved_config": self.resolved})
            self.saved_at = self.engine.windows

    def _checkpoint_mid_window(self, interrupted: WindowInterrupted, place: EpochWindow) -> None:
        """A checkpoint inside a window: the state before it, plus the gradients of the micro-batches it has done."""
        # Under FSDP2 (--sync-every-micro-step) each rank's shard of the window's gradient so far, in its own file.
        grads = {name: local_shard(p.grad).detach().to("cpu").clone()
                 for name, p in unwrap(self.parts.model).named_parameters() if p.grad is not None}
        with self.prep.optimizer.evaluation_weights(self.parts.optimizer):  # as in _checkpoint_if_due
            self.checkpointer.save(
                self.parts,
                # This window is continued: the position is the window before it.
                data_position={"epoch": place.epoch, "window_in_epoch": place.window_in_epoch - 1},
                info={"loss": None, "config": self.config.to_json_dict(), "resolved_config": self.resolved,
                      "mid_window": True},
                partial_window={"micro_batches_done": interrupted.partial.micro_batches_done,
                                "loss_sum": interrupted.partial.loss_sum,
                                "micro_batch_size": self.prep.micro_batch_size, **self.prep.cut.flags(),
                                "grads": grads},
            )

    def finish(self) -> dict[str, Any]:
        """Save the final weights, write summary.json, then --save-hf, and print the closing lines; the summary.

        The run's own end (final weights, summary) is written before the export, so that an export that fails (a
        full disk) costs the export alone. A resumed run that had already ended (--max-steps reached, or stopped
        early) trains nothing and rewrites none of its files: it only exports, when asked to and not done before."""
        config, engine, prep, ranks = self.config, self.engine, self.prep, self.ranks
        self.checkpointer.wait()  # --async-checkpoint: the last checkpoint is complete before the run ends
        wall = time.perf_counter() - self.started
        # The run ends on the weights to save (schedule-free: the averaged ones), for model.safetensors and --save-hf.
        prep.optimizer.end_training(self.parts.optimizer)
        # Under FSDP2 nothing is gathered whole: the final weights are streamed into model.safetensors a tensor at a
        # time (_save_final) and --save-hf copies them from there.
        weights = {} if self._streams_weights else full_model_state(self.parts.model, ranks)
        peak_memory = max_over_ranks(self.totals.peak_memory, ranks)
        # Read before summary.json is written again: whether --save-hf holds exactly this run's earlier export.
        replace = bool(self.start is not None and config.save_hf is not None
                       and exported_before(prep.out, config.save_hf))
        kept = self._summary_kept() if self.start is not None else None
        if self.start is not None and engine.windows == self.windows_at_start:
            # Removed since: the checkpoint's weights are the final ones (rank 0's answer: every rank writes).
            if broadcast_from_main(not (prep.out / WEIGHTS_FILE).is_file(), ranks):
                self._save_final(weights)
            summary = kept or self._summary(wall, peak_memory)
            print(f"nothing to train: the run had already ended at step {engine.steps}"
                  + (f" ({summary['stopped_by']})" if summary.get("stopped_by") else "")
                  + f"; its final weights and summary in {prep.out} are unchanged", file=self.stream, flush=True)
            if not (replace and summary.get("save_hf_step") == engine.steps):  # else: exported, and untouched since
                self._export(weights, summary, replace=replace)
            return summary
        self._save_final(weights)
        summary = self._summary(wall, peak_memory)
        if replace:
            # The earlier export stays recorded until the new one replaces it: if this export fails, that one is
            # still the run's (intact), and exporting again replaces it.
            summary.update({name: (kept or {}).get(name) for name in ("save_hf", "save_hf_files", "save_hf_step")})
        self.writer.write_summary(summary)
        self._export(weights, summary, replace=replace)
        print(
            f"done: {engine.steps} steps ({engine.skipped_steps} skipped), final loss {_fmt(summary['final_loss'])}, "
            + (f"val loss {_fmt(self.totals.last_val)} (perplexity {summary['final_val_perplexity']:,.2f}), "
               if self.totals.last_val is not None else "")
            + f"{_fmt(summary['tokens_per_s'], '.0f')} tokens/s, "
            + (f"compiling {summary['compile_time_s']:.1f} s ({_count(summary['compiled_graphs'], 'graph')}, not in "
               f"tokens/s), " if summary.get("compile_time_s") is not None else "")
            + f"peak memory {format_bytes(peak_memory)}, {wall:.1f} s"
            + (f" (this segment, resumed from step {self.start.step})" if self.start else "") + f" -> {prep.out}",
            file=self.stream, flush=True,
        )
        if self.early_stopped:
            print(f"stopped after step {engine.steps}: {summary['stopped_by']}"
                  + (f"; its weights are in {prep.out / BEST_DIR}" if config.keep_best else ""),
                  file=self.stream, flush=True)
        elif summary["stopped_by"]:
            print(f"stopped by {summary['stopped_by']} after step {engine.steps} (checkpoint saved); continue with "
                  f"--resume", file=self.stream, flush=True)
        return summary

    @property
    def _streams_weights(self) -> bool:
        """Under FSDP2 the final weights are written a tensor at a time, never gathered whole onto one rank."""
        return self.ranks.launched and self.ranks.strategy == "fsdp"

    def _save_final(self, weights: dict[str, torch.Tensor]) -> None:
        """OUT/model.safetensors, the final weights: ``weights`` as gathered, or (FSDP2) streamed by every rank
        together, rank 0 writing one gathered tensor at a time."""
        metadata = {"model": self.config.model, "step": str(self.engine.steps)}
        if not self._streams_weights:
            self.writer.save_model(weights, metadata=metadata)
            return
        path = self.prep.out / WEIGHTS_FILE
        with writing(str(path), then="the checkpoints so far are intact: free space, then --resume"):
            write_full_model_state(self.parts.model, self.ranks, path if self.ranks.is_main else None, metadata)

    def _export(self, weights: dict[str, torch.Tensor], summary: dict[str, Any], *, replace: bool) -> None:
        """--save-hf (rank 0), after the run's own files: recorded in summary.json (where, and what it wrote) once
        complete, so that a resume replaces this export and nothing else (``replace``: the directory holds exactly
        this run's earlier export)."""
        config, prep = self.config, self.prep
        if config.save_hf is None or not self.ranks.is_main:
            return
        # A byte-level model gets cadence's byte tokenizer (as_tokenizer(None)), so that it loads and stops; a model
        # trained on chat data, the template its conversations were rendered with.
        tokenizer = prep.hf.tokenizer if prep.hf else None
        chat_template = None
        if Source.from_flags(config).kind == "chat":
            chat_template = chat_template_for(tokenizer, config.chat_template)[0].source
        try:
            # Under FSDP2 the weights come from the final model.safetensors, a tensor at a time.
            streamed = self._streams_weights
            save_hf(unwrap(self.parts.model), config.save_hf, as_tokenizer(tokenizer),
                    weights=None if streamed else weights, weights_file=prep.out / WEIGHTS_FILE if streamed else None,
                    replace=replace, chat_template=chat_template)
        except (OSError, SafetensorError, UsageError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).splitlines()[0]
            raise RunDirectoryWriteFailed(
                f"cannot write the --save-hf export {config.save_hf}: {reason}. The run itself finished: its final "
                f"weights and summary.json are in {prep.out}, and nothing was left half-written at "
                f"{config.save_hf}. To export again: cadence train --resume --out {prep.out} --save-hf "
                f"{config.save_hf}") from None
        summary.update(save_hf=str(config.save_hf), save_hf_files=export_files(config.save_hf),
                       save_hf_step=self.engine.steps)
        self.writer.write_summary(summary)

    def _summary_kept(self) -> dict[str, Any] | None:
        """The summary.json a run that had already ended wrote (None when it is missing or not a JSON object)."""
        try:
            kept = json.loads((self.prep.out / SUMMARY_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        return kept if isinstance(kept, dict) else None

    def _compile_summary(self, untimed: bool) -> dict[str, Any]:
        """With --compile: what compiling cost this process since the run (or its resume) started, apart from
        tokens/s, which leaves out the steps that compiled unless no other step was timed."""
        clock = self.parts.compile_clock
        if clock is None:
            return {"compile_time_s": None, "compiled_graphs": None, "graph_breaks": None,
                    "tokens_per_s_includes_compile": False}
        compiled = clock.total()
        return {"compile_time_s": compiled.seconds, "compiled_graphs": compiled.graphs,
                "graph_breaks": compiled.graph_breaks, "tokens_per_s_includes_compile": untimed}

    def _summary(self, wall: float, peak_memory: int | None) -> dict[str, Any]:
        """summary.json: the whole run's counts (a resumed run's included), throughput, memory and how it ended."""
        config, engine, prep, totals = self.config, self.engine, self.prep, self.totals
        return {
            "steps": engine.steps,
            "skipped": engine.skipped_steps,
            # Where --save-hf exported this run's model and what it wrote there (set once the export is complete:
            # a resumed run replaces its own export, nothing else).
            "save_hf": None,
            "save_hf_files": None,
            "save_hf_step": None,
            "windows": engine.windows,
            "epochs": self.epoch + 1,
            "tokens": totals.tokens,
            "targets": totals.targets,
            "samples": totals.samples,
            "padded_positions": totals.padded_positions,
            # The share of computed positions that were padding: what --micro-batch-order by-length and
            # --micro-batch-tokens reduce (0 for packed text, whose sequences are all full).
            "padding_fraction": (totals.padded_positions / (totals.padded_positions + totals.tokens)
                                 if totals.tokens else None),
            "wall_time_s": wall,
            # Throughput excludes profiler-slowed steps; when every step was measured (a CPU budget), it is all
            # there is.
            "tokens_per_s": (totals.timed_tokens / totals.timed_s if totals.timed_s > 0
                             else totals.tokens / wall if wall > 0 else None),
            "tokens_per_s_includes_profiler": totals.timed_s == 0,
            **self._compile_summary(totals.timed_s == 0),
            "peak_memory_bytes": peak_memory,
            "peak_memory_of": "the busiest rank" if self.ranks.world_size > 1 else "the process",
            "peak_memory_source": _memory_source(prep.device, self.budget_on_cpu),
            "max_rss_bytes": _max_rss_bytes(),
            "final_loss": totals.last.get("loss"),
            "final_val_loss": totals.last_val,
            "effective_batch_size": prep.effective_batch_size,
            "final_micro_batch_size": (self.controller.current if config.auto_micro_batch
                                       and self.controller.unit == "rows" else prep.micro_batch_size),
            "final_micro_batch_tokens": (self.controller.current if config.auto_micro_batch
                                         and self.controller.unit == "tokens" else config.micro_batch_tokens),
            "oom_retries": totals.oom_retries,
            # The noise scale's moving average after the last window, and how many windows it is over.
            **noise_scale_fields(engine),
            "parameters": self.parameters,
            "trainable_parameters": self.trained,
            "frozen_parameters": self.frozen,
            # This process's (a shard's, under FSDP2): what --optimizer-state shrinks.
            "optimizer_state_bytes": optimizer_state_bytes(self.parts.optimizer),
            "stopped_by": self._stopped_by(),
            "final_val_perplexity": math.exp(min(totals.last_val, 700.0)) if totals.last_val is not None else None,
            "best_val_loss": self.best.loss,
            "best_val_step": self.best.step,
            "resumed_from_step": self.start.step if self.start else None,
            **self._segments(wall),
        }

    def _stopped_by(self) -> str | None:
        if self.early_stopped:
            return (f"early stop: {self.best.since} evaluations without a lower validation loss than step "
                    f"{self.best.step}'s {self.best.loss:.4f} (--early-stop-after {self.config.early_stop_after})")
        return self.stop.requested or ("a signal to another rank" if self.stopped_elsewhere else None)

    def _save_best(self, row: dict[str, Any]) -> None:
        """--keep-best: this evaluation's weights into OUT/best (every rank gathers its part, rank 0 writes; under
        FSDP2 one tensor at a time)."""
        record = {"step": int(row["step"]), "val_loss": row["val_loss"], "val_perplexity": row["val_perplexity"]}
        with self.prep.optimizer.evaluation_weights(self.parts.optimizer):  # the weights evaluated (schedule-free)
            if self._streams_weights:
                self.writer.save_best_streamed(
                    lambda path: write_full_model_state(self.parts.model, self.ranks, path), record)
                return
            weights = full_model_state(self.parts.model, self.ranks)
            self.writer.save_best(weights, record)

    def _segments(self, wall: float) -> dict[str, Any]:
        """The run's segments (one per process that trained it: a resumed run has several), each with its steps,
        tokens, the time its steps took and its wall time (None for one that ended without a summary: killed), and
        the whole run's wall time when every segment's is known."""
        current = {"from_step": self.start.step if self.start else 0, "to_step": self.engine.steps,
                   "tokens": self.totals.segment_tokens, "step_time_s": self.totals.segment_step_s,
                   "wall_time_s": wall,
                   "stopped_by": self._stopped_by()}
        segments = [*self.earlier_segments, current]
        walls = [segment["wall_time_s"] for segment in segments]
        return {"segments": segments,
                "run_wall_time_s": sum(walls) if all(isinstance(w, (int, float)) for w in walls) else None}


@dataclass
class BestEvaluation:
    """The lowest validation loss of the run so far, its step, and the evaluations since it."""

    loss: float | None = None
    step: int | None = None
    since: int = 0

    def evaluated(self, step: int, loss: float) -> bool:
        """Count an evaluation; True when it is a new best (strictly lower)."""
        if self.loss is None or loss < self.loss:
            self.loss, self.step, self.since = loss, step, 0
            return True
        self.since += 1
        return False

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]]) -> BestEvaluation:
        best = cls()
        for row in rows:
            if row.get("val_loss") is not None:
                best.evaluated(int(row["step"]), float(row["val_loss"]))
        return best


def earlier_segments(run_dir: Path, start: ResumePoint | None) -> list[dict[str, Any]]:
    """The segments of a resumed run before this process (empty for a fresh run): those its summary.json recorded
    up to the checkpoint resumed from (steps after it are done again), then, if steps before the checkpoint are in
    no recorded segment (a process killed before it wrote a summary), one segment for them with no wall time. The
    tokens and step times of each come from the kept metrics rows."""
    if start is None:
        return []
    recorded: list[dict[str, Any]] = []
    summary = read_summary(run_dir)  # its totals checked (restore refused a bad one before changing anything)
    if summary is not None:
        if isinstance(summary.get("segments"), list):
            recorded = [dict(s) for s in summary["segments"] if isinstance(s, dict)]
        elif isinstance(summary.get("steps"), int):  # a summary from before segments were recorded
            recorded = [{"from_step": summary.get("resumed_from_step") or 0, "to_step": summary["steps"],
                         "wall_time_s": summary.get("wall_time_s"), "stopped_by": summary.get("stopped_by")}]
    segments: list[dict[str, Any]] = []
    covered = 0
    for segment in recorded:
        first, last = int(segment.get("from_step") or 0), min(int(segment.get("to_step") or 0), start.step)
        if first != covered or last <= first:
            break  # not contiguous with what is kept: the rest is accounted for below
        segments.append({**segment, "to_step": last})
        covered = last
    if covered < start.step:
        segments.append({"from_step": covered, "to_step": start.step, "wall_time_s": None,
                         "stopped_by": "ended without a summary (killed?)"})
    for segment in segments:
        rows = [row for row in start.kept_rows if segment["from_step"] < int(row["step"]) <= segment["to_step"]]
        segment["tokens"] = sum(int(row["tokens"]) for row in rows)
        segment["step_time_s"] = sum(float(row.get("step_time_s") or 0.0) for row in rows)
    return segments


def _prepared_under(lock: RunDirectoryLock | None, prepare_run: Callable[[], Prepared], ranks: Ranks) -> Prepared:
    """``prepare_run()`` on every rank while rank 0 holds the run directory, then the check that every rank holds the
    same data (each node may have built its own store); on bad input the lock is released, which removes the
    directory the claim created, so that bad input leaves nothing behind."""
    try:
        prep = _on_every_rank(prepare_run, ranks)
        check_same_data(prep.data, ranks)  # after every rank has prepared: a collective no rank may miss
        return prep
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _on_every_rank(check: Callable[[], T], ranks: Ranks) -> T:
    """``check()`` on every rank, then all learn whether any rank found a problem (so none goes on alone): rank 0's
    problem is raised on every rank, another rank's on that rank alone."""
    try:
        value, error = check(), None
    except UsageError as err:
        if not ranks.launched:
            raise
        value, error = None, err
    main_failed = broadcast_from_main(error is not None, ranks)
    anyone_failed = any_rank(error is not None, ranks)
    if error is not None:
        # Rank 0's problem is every rank's (they all check the same input); another rank's alone is its own to say.
        raise UsageError(error.problems, every_rank_agrees=main_failed) from None
    if anyone_failed:
        raise UsageError.single("another rank", "found a problem with the input (its message is above)")
    return value  # type: ignore[return-value]


class _Discard:
    """The output stream of ranks other than 0: they print nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _validation_batches(prep: Prepared) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The validation micro-batches every evaluation runs (the whole validation set, or its first --eval-batches),
    always the same ones, so evaluations are comparable; and how many examples they hold.

    With several processes each rank evaluates every world-th of them (the engine sums over ranks), padded so that
    all ranks run the same number of forwards (FSDP2 gathers parameters in each)."""
    config = prep.config
    if config.eval_every <= 0 or prep.data.val is None:
        return [], 0
    batches = []
    for batch in iterate_micro_batches(prep.data.val, prep.micro_batch_size, config.seed, 0, shuffle=False):
        batches.append(batch)
        if len(batches) == config.eval_batches:
            break
    examples = sum(int(batch["input_ids"].shape[0]) for batch in batches)
    world, rank = prep.ranks.world_size, prep.ranks.rank
    per_rank = -(-len(batches) // world)
    mine = batches[rank::world]
    return mine + [padding_micro_batch() for _ in range(per_rank - len(mine))], examples


def _resolved_config(prep: Prepared, parameters: int, launch: Launch | None = None) -> dict[str, Any]:
    return {
        **prep.config.to_json_dict(),
        "seq_len": prep.seq_len,
        "micro_batch_size": prep.micro_batch_size,
        "auto_micro_batch": prep.config.auto_micro_batch,
        "grad_accum_steps": prep.grad_accum_steps,
        "effective_batch_size": prep.effective_batch_size,
        "world_size": prep.world_size,
        "memory_budget_bytes": prep.memory_budget_bytes,
        "out": str(prep.out),
        "resolved_device": str(prep.device),
        "model_parameters": parameters,
        "data_description": prep.data.description,
        "data_fingerprint": prep.data.fingerprint,
        "data_store": str(prep.data.store) if prep.data.store else None,
        "data_store_digest": prep.data.store_digest,
        "train_sequences": len(prep.data.train),
        "val_sequences": 0 if prep.data.val is None else len(prep.data.val),
        "versions": {"cadence": __version__, "torch": torch.__version__, "python": platform.python_version()},
        **({LAUNCH_FIELD: launch.record()} if launch is not None else {}),
    }


def _memory_source(device: torch.device, every_step: bool) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, every step"
    if every_step:
        return "torch.profiler allocation events, every step (memory budget enforced)"
    return "torch.profiler allocation events, first steady-state step (window 2)"


def _max_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
