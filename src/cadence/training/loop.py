"""``cadence train``: build everything from a TrainConfig and run windows through the engine into a run directory.

Everything that can be wrong with the input is checked (configuration AND data files) before the run directory is
created, so bad input never leaves anything half-written.
"""

from __future__ import annotations

import io
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import IO, Any, NamedTuple, TypeVar

import torch
from safetensors import SafetensorError

from cadence import __version__
from cadence.config import TrainConfig
from cadence.data.chat_store import chat_template_for
from cadence.data.hf import as_tokenizer
from cadence.data.store import StoreDamaged
from cadence.distributed.ranks import (
    SINGLE,
    Ranks,
    any_rank,
    broadcast_from_main,
    local_shard,
    max_over_ranks,
    unwrap,
)
from cadence.engine.adaptive_batch import LORA_MAX_BATCH
from cadence.engine.precision import fp32_matmul
from cadence.engine.prefetch import Prefetcher, prefetch
from cadence.engine.step import Engine, PartialWindow, StepResult, WindowInterrupted
from cadence.engine.windows import Window
from cadence.errors import CadenceFailure, UsageError
from cadence.formatting import format_bytes
from cadence.models.hf import save_hf
from cadence.training.autobatch import MicroBatchController, MicroBatchTooLarge
from cadence.training.checkpoint import Checkpointer
from cadence.training.components import Components, build_components
from cadence.training.evaluation import Evaluation
from cadence.training.lock import RunDirectoryLock, claim_run_directory
from cadence.training.noise_scale import noise_scale_announcement
from cadence.training.prepare import Prepared, checked_run_directory, prepare
from cadence.training.progress import TrainProgress
from cadence.training.restart import RESTART_LOCK_WAIT_S, Launch, last_recorded_step, restart_line, this_launch
from cadence.training.resume import ResumePoint, restore, schedule_note
from cadence.training.run_dir import (
    BEST_DIR,
    WEIGHTS_FILE,
    NoWriter,
    RunDirectoryWriteFailed,
    RunWriter,
    export_files,
    exported_before,
    kept_summary,
)
from cadence.training.run_record import RunRecord
from cadence.training.same_data import check_same_data
from cadence.training.stopping import Stopping
from cadence.training.summary import Totals, budget_on_cpu, run_summary

T = TypeVar("T")


class TrainingFailed(CadenceFailure):
    """Training could not continue (not a usage problem): the CLI exits with status 1 and this message.

    ``every_rank_agrees``: every rank reached the same decision (divergence), so rank 0 alone reports it; otherwise
    the failing rank reports it with its rank."""

    label = "training failed"


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
        with run.stops, run.progress, fp32_matmul(config.fp32_matmul), warnings.catch_warnings(record=True) as caught:
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
    """One window of the data order and where it sits: ``window_in_epoch`` counts from 1 within ``epoch``;
    ``continued``: the part of it a mid-window checkpoint had done (the first window of a resumed run only)."""

    epoch: int
    window_in_epoch: int
    window: Window
    continued: PartialWindow | None = None


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
    """One training run, built from the prepared configuration; what its loop mutates has owners of its own: the
    totals (``Totals``), the evaluations (``Evaluation``), the checkpoints (``Checkpointer``), the stop signals and
    skips (``Stopping``), the auto micro-batch (``MicroBatchController``), the console (``TrainProgress``).

    ``__init__`` sets up (components, resume point, run directory, console banner); ``windows_across_epochs`` yields
    the windows to run, ``run_window`` runs one through the engine, ``after_step`` does what follows each optimizer
    step, and ``finish`` saves the model and writes the summary. Every rank builds one and walks the same windows."""

    def __init__(self, prep: Prepared, *, lock: RunDirectoryLock | None, stream: IO[str], live: bool | None,
                 launch: Launch | None = None) -> None:
        """Build the components, restore the --resume checkpoint (if any), open the run directory and announce.
        ``lock``: rank 0's hold on the run directory (:func:`claim_run_directory`), released by :meth:`close`;
        ``launch``: torchrun's launch and attempt (:func:`this_launch`), recorded in config.json."""
        self.prep, self.stream, self.lock = prep, stream, lock
        self.writer: RunWriter = NoWriter()
        """The run directory (rank 0's; the other ranks write nothing), opened once every check has passed."""
        self.checkpointer = Checkpointer(prep.out, prep.ranks, keep=prep.config.keep_checkpoints,
                                         background=prep.config.async_checkpoint)
        """Every checkpoint this run writes, in its format (sharded under FSDP2), the one it resumes from, and the
        final and best weights."""
        self.prefetcher: Prefetcher[EpochWindow] | None = None
        """The thread preparing the next windows once ``windows_across_epochs`` has started (--prefetch-windows)."""
        try:
            self._set_up(live=live, launch=launch)
        except BaseException:
            self.close()
            raise

    def _set_up(self, *, live: bool | None, launch: Launch | None) -> None:
        prep, config = self.prep, self.prep.config
        self.parts: Components = build_components(prep)
        self.record = RunRecord.of(prep, self.parts.model, launch)
        # What the failed attempt had done, before the resume drops the rows after its checkpoint (rank 0 says it).
        recorded = last_recorded_step(prep.out) if launch is not None and launch.own_run and prep.ranks.is_main else 0
        # Before the writer opens metrics.jsonl.
        self.start: ResumePoint | None = restore(prep.out, self.record.resolved, self.parts, self.checkpointer,
                                                 prep.micro_batch_size, prep.cut.flags()) if config.resume else None
        if self.start is not None:
            self.checkpointer.resumed_from(self.start.checkpoint, windows=self.engine.windows)
        kept_rows = self.start.kept_rows if self.start else []
        self.evaluation = Evaluation(prep, kept_rows, resumed=self.start is not None)
        ended = self.start is not None and (self.reached_max_steps() or self.evaluation.early_stopped)
        # Every check has passed: only now is anything in the run directory written (nothing new for a run that had
        # already ended: no TensorBoard file, its config.json as it is).
        if prep.ranks.is_main:
            self.writer = RunWriter(prep.out, tensorboard=not ended, config=None if ended else self.record.resolved)
        self._announce(launch, recorded)
        # Before summary.json is written again: what the earlier processes of a resumed run did.
        self.totals = Totals.of_run(prep.out, self.start, self.engine.windows)
        self.stops = Stopping(prep.ranks)
        self.progress = TrainProgress(total_steps=config.max_steps, grad_accum_steps=prep.grad_accum_steps,
                                      log_every=config.log_every, stream=self.stream, live=live,
                                      # adaptive: --max-steps counts windows of the minimum batch, and so does this
                                      unit="window" if self.parts.batch is not None else "step")
        self.progress.resumed(kept_rows)
        # With a token budget, auto halves the budget (positions per micro-batch) rather than the rows.
        self.controller = MicroBatchController(
            cut=prep.cut, grow_after=config.auto_grow_after,
            log=lambda text: self.progress.message(f"auto micro-batch: {text}"))

    @property
    def engine(self) -> Engine:
        return self.parts.engine

    def reached_max_steps(self) -> bool:
        """--max-steps optimizer steps done; with an adaptive batch, --max-steps windows of the minimum batch
        consumed (the examples of that many minimum steps, whatever the batch grew to)."""
        batch = self.parts.batch
        return (batch.clock if batch is not None else self.engine.steps) >= self.prep.config.max_steps

    def close_metrics(self) -> None:
        """Close metrics.jsonl and TensorBoard (once)."""
        self.writer.close()

    def close(self) -> None:
        """Stop the prefetch thread, close the metrics if still open, then release the run directory; safe to call
        more than once. (The window generator stops the thread too when it is closed or collected; this does not
        count on when that happens.)"""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.checkpointer.close()  # a checkpoint still being written is finished first
        self.writer.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _announce(self, launch: Launch | None, recorded: int) -> None:
        """The console banner: model, precision, batch arithmetic, data, run directory (and the resume point);
        ``launch`` and ``recorded``: a restart's, for the line saying which steps it does again."""
        config, prep, stream = self.prep.config, self.prep, self.stream
        micro = "auto, starting at " + str(prep.micro_batch_size) if config.auto_micro_batch else prep.micro_batch_size
        lines = [f"cadence {__version__}: {config.model} ({self.record.describe()}) on {prep.device}, "
                 f"{config.precision}, recompute {config.activation_checkpointing}, offload {config.offload}\n"
                 + batch_words(prep, micro) + f"\ndata: {prep.data.description}\nrun directory: {prep.out}",
                 noise_scale_announcement(self.engine, prep.grad_accum_steps), self.evaluation.announcement(prep)]
        # Which optimizer, and what each of its groups holds (Muon: the orthogonalised matrices and the AdamW rest).
        lines.insert(1, f"optimizer: {prep.optimizer.describe()}: {prep.optimizer.describe_groups(self.parts.model)}")
        if self.parts.batch is not None:
            lines.insert(1, f"batch: {self.parts.batch.describe()}" + (
                f" (LoRA: at most {LORA_MAX_BATCH} unless --max-effective-batch-size is given, as LoRA loses above "
                f"it)" if config.lora_rank and config.max_effective_batch_size is None else ""))
        if self.engine.objective.name != "sft":  # a preference objective: what is minimised, against what
            lines.insert(1, f"objective: {self.engine.objective.describe()}")
        if prep.built.pending is not None:
            lines.append(f"weights: loaded once, each of the {prep.world_size} ranks reading only its own shard of "
                         f"{config.model}'s safetensors")
        for line in lines:
            if line is not None:
                print(line, file=stream, flush=True)
        length_note = prep.data.long_examples.note() if prep.data.long_examples else None
        if length_note:  # --too-long: how many examples were skipped or truncated, and what the truncated ones lost
            print(f"note: {length_note}", file=stream)
        restart = restart_line(launch, prep.out, out_given=config.out is not None, start=self.start,
                               recorded=recorded)
        if restart is not None:
            print(restart, file=stream, flush=True)
        elif self.start is not None:
            print(f"resuming from {self.start.checkpoint} (step {self.start.step})", file=stream, flush=True)
        if self.start is not None:
            note = schedule_note(self.start.saved_config, self.record.resolved, self.start.step)
            if note:
                print(f"note: {note}", file=stream, flush=True)

    def windows_across_epochs(self) -> Iterator[EpochWindow]:
        """This rank's windows, epoch after epoch, while fewer than --max-steps optimizer steps are done (the loop
        stops at --max-steps; this only refuses to start past it), prepared --prefetch-windows ahead in a thread."""
        if self.reached_max_steps() or self.evaluation.early_stopped:
            return
        # Pinned on CUDA, so that the engine's non_blocking copy of each micro-batch is really asynchronous.
        self.prefetcher = prefetch(self._cut_windows(), depth=self.prep.config.prefetch_windows,
                                   pin_memory=self.prep.device.type == "cuda")
        places: Iterator[EpochWindow] = iter(self.prefetcher)
        if self.parts.batch is not None:  # the minimum's windows, grouped as the adaptive batch says
            places = self.parts.batch.group(places)
        try:
            for place in places:
                # The producer may already be in the next epoch: the epoch is the window's, taken as it is run.
                self.totals.epoch = place.epoch
                yield place
        except StoreDamaged as damaged:
            # The store was verified when the run opened it: it changed under the run (truncated, rewritten).
            raise TrainingFailed(f"{damaged}; the checkpoints so far are intact: restore the data (a cached store "
                                 f"is rebuilt from its source), then --resume") from None
        finally:
            self.prefetcher.close()

    def _cut_windows(self) -> Iterator[EpochWindow]:
        """Every window from the resume point on, epoch after epoch, without end; the first continues the window a
        mid-window checkpoint interrupted, if any. It runs in the prefetch thread, so it reads nothing the loop
        changes (the step count, the totals): the windows are a function of the configuration and the resume point
        alone."""
        epoch = self.start.epoch if self.start else 0
        skip = self.start.windows_done_in_epoch if self.start else 0
        continued = self.start.partial if self.start else None
        while True:
            # This rank's share of each window (all of it with one process); the same windows for any split.
            windows = self.prep.windows(epoch)
            # A resumed run skips the windows its checkpoint had done: same permutation, same windows after.
            for window_in_epoch, window in enumerate(itertools.islice(windows, skip, None), start=skip + 1):
                yield EpochWindow(epoch, window_in_epoch, window, continued)
                continued = None
            epoch, skip = epoch + 1, 0  # the epoch's windows ran out: the next epoch

    def run_window(self, place: EpochWindow) -> StepOutcome | None:
        """One optimizer step over ``place``'s window (with --micro-batch-size auto, halving on out-of-memory);
        None when a stop request interrupted it mid-window (--checkpoint-mid-window), after checkpointing it."""
        config, engine, prep = self.prep.config, self.engine, self.prep
        # On CPU memory is measured by the profiler, which is as slow as a step: measure the first steady-state
        # window (the second: the first also allocates the optimizer state) only, unless a budget is enforced,
        # which needs every step measured.
        profiled = prep.device.type == "cpu" and (budget_on_cpu(prep) or engine.windows + 1 == min(2, config.max_steps))
        step_options: dict[str, Any] = {
            "measure_memory": profiled,
            # The window's own micro-batches: packing and token budgets cut windows into different numbers.
            "on_micro_batch": lambda index: self.progress.micro_step(engine.steps, index + 1,
                                                                     len(place.window.micro_batches)),
        }
        if config.checkpoint_mid_window:
            step_options["stop_requested"] = self.stops.agreed  # every rank stops after the same micro-batch
        if place.continued is not None:  # continue the window a mid-window checkpoint interrupted
            step_options["resume"] = place.continued
        try:
            if config.auto_micro_batch:
                result, retries = self.controller.step(engine, place.window, **step_options)
            else:
                result, retries = engine.step(place.window, **step_options), 0
        except WindowInterrupted as interrupted:
            self._checkpoint_mid_window(interrupted, place)
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
        after this window (--max-steps reached, an early stop, or a signal reached some rank)."""
        result, engine, totals, config = outcome.result, self.engine, self.totals, self.prep.config
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
        if self.parts.batch is not None:  # grow, hold or shrink from the next window on (before the checkpoint)
            row.update(self.parts.batch.after_step(result, engine.steps))
        done = self.reached_max_steps()
        # An adaptive batch evaluates every --eval-every windows of the minimum (the examples seen), as its schedule.
        batch = self.parts.batch
        counted, advanced = (batch.clock, batch.last_group) if batch is not None else (engine.steps, 1)
        if self.evaluation.due(counted, done=done, skipped=result.skipped, advanced=advanced):
            with self.prep.optimizer.evaluation_weights(self.parts.optimizer):  # schedule-free: its averaged weights
                new_best = self.evaluation.run(engine, row)
            totals.last_val = row["val_loss"]
            if clock is not None:
                clock.lap()  # evaluation compiles a no-grad graph of its own: not the next step's compile time
            if new_best and config.keep_best:
                with self.prep.optimizer.evaluation_weights(self.parts.optimizer):  # the weights evaluated
                    self.checkpointer.save_best(self.parts, self.writer, Evaluation.best_record(row))
            done = self.evaluation.stops(done=done) or done
        self.writer.log_step(row)
        self.progress.update(row)
        if not result.skipped:
            totals.last = row
        self._stop_if_diverged(result)
        stopping = self.stops.agreed()
        self._checkpoint_if_due(place, result, done=done, stopping=stopping)
        return done or stopping

    def _stop_if_diverged(self, result: StepResult) -> None:
        """Raise TrainingFailed once --max-skipped-steps optimizer steps in a row were skipped."""
        skipped = self.stops.count_skip(result.skipped)
        if skipped >= self.prep.config.max_skipped_steps:
            raise TrainingFailed(
                f"{skipped} optimizer steps in a row were skipped (last reason: {result.skip_reason}); the run has "
                f"diverged. Lower --lr or use bf16/fp32. The last good checkpoint is kept.", every_rank_agrees=True,
            )

    def _checkpoint_if_due(self, place: EpochWindow, result: StepResult, *, done: bool, stopping: bool) -> None:
        """Checkpoint after this window when it is due, unless this window is checkpointed already."""
        config = self.prep.config
        periodic = config.checkpoint_every and self.engine.steps % config.checkpoint_every == 0
        # At a window boundary: periodically, at the end, and when a signal asked to stop.
        wanted = (periodic and not result.skipped) or (done and config.checkpoint_every) or stopping
        if wanted and self.checkpointer.saved_windows != self.engine.windows:
            # Schedule-free: the checkpoint's weights are the averaged ones, its optimizer state keeps the training
            # weights (a resume continues from them, bitwise).
            with self.prep.optimizer.evaluation_weights(self.parts.optimizer):
                self.checkpointer.save(self.parts,
                                       data_position={"epoch": place.epoch, "window_in_epoch": place.window_in_epoch},
                                       info={"loss": result.loss, "config": config.to_json_dict(),
                                             "resolved_config": self.record.resolved})

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
                info={"loss": None, "config": self.prep.config.to_json_dict(), "resolved_config": self.record.resolved,
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
        config, engine, prep, ranks = self.prep.config, self.engine, self.prep, self.prep.ranks
        self.checkpointer.wait()  # --async-checkpoint: the last checkpoint is complete before the run ends
        wall = self.totals.wall()
        # The run ends on the weights to save (schedule-free: the averaged ones), for model.safetensors and --save-hf.
        prep.optimizer.end_training(self.parts.optimizer)
        # Under FSDP2 nothing is gathered whole: the final weights are streamed into model.safetensors a tensor at a
        # time (Checkpointer.save_final) and --save-hf copies them from there.
        weights = self.checkpointer.gathered_weights(self.parts)
        peak_memory = max_over_ranks(self.totals.peak_memory, ranks)
        # Read before summary.json is written again: whether --save-hf holds exactly this run's earlier export.
        replace = bool(self.start is not None and config.save_hf is not None
                       and exported_before(prep.out, config.save_hf))
        kept = kept_summary(prep.out) if self.start is not None else None
        if self.start is not None and engine.windows == self.totals.windows_at_start:
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
        self._say_done(summary, wall, peak_memory)
        return summary

    def _say_done(self, summary: dict[str, Any], wall: float, peak_memory: int | None) -> None:
        """The closing lines: the run's figures, and how it stopped when it stopped early."""
        engine, out, start = self.engine, self.prep.out, self.start
        print(
            f"done: {engine.steps} steps ({engine.skipped_steps} skipped), final loss {_fmt(summary['final_loss'])}, "
            + (f"val loss {_fmt(self.totals.last_val)} (perplexity {summary['final_val_perplexity']:,.2f}), "
               if self.totals.last_val is not None else "")
            + f"{_fmt(summary['tokens_per_s'], '.0f')} tokens/s, "
            + (f"compiling {summary['compile_time_s']:.1f} s ({_count(summary['compiled_graphs'], 'graph')}, not in "
               f"tokens/s), " if summary.get("compile_time_s") is not None else "")
            + f"peak memory {format_bytes(peak_memory)}, {wall:.1f} s"
            + (f" (this segment, resumed from step {start.step})" if start else "") + f" -> {out}",
            file=self.stream, flush=True,
        )
        if self.evaluation.early_stopped:
            print(f"stopped after step {engine.steps}: {summary['stopped_by']}"
                  + (f"; its weights are in {out / BEST_DIR}" if self.prep.config.keep_best else ""),
                  file=self.stream, flush=True)
        elif summary["stopped_by"]:
            print(f"stopped by {summary['stopped_by']} after step {engine.steps} (checkpoint saved); continue with "
                  f"--resume", file=self.stream, flush=True)

    def _summary(self, wall: float, peak_memory: int | None) -> dict[str, Any]:
        summary = self._run_summary(wall, peak_memory)
        if self.parts.batch is not None:
            summary.update(self.parts.batch.summary())
        return summary

    def _run_summary(self, wall: float, peak_memory: int | None) -> dict[str, Any]:
        return run_summary(prep=self.prep, parts=self.parts, totals=self.totals, evaluation=self.evaluation,
                           controller=self.controller, parameters=(self.record.trained, self.record.frozen),
                           stopped_by=self.evaluation.stopped_by() or self.stops.stopped_by(), wall=wall,
                           peak_memory=peak_memory)

    def _save_final(self, weights: dict[str, torch.Tensor]) -> None:
        """OUT/model.safetensors, the final weights (gathered, or streamed under FSDP2: the Checkpointer's)."""
        self.checkpointer.save_final(self.parts, self.writer, weights,
                                     {"model": self.prep.config.model, "step": str(self.engine.steps)})

    def _export(self, weights: dict[str, torch.Tensor], summary: dict[str, Any], *, replace: bool) -> None:
        """--save-hf (rank 0), after the run's own files: recorded in summary.json (where, and what it wrote) once
        complete, so that a resume replaces this export and nothing else (``replace``: the directory holds exactly
        this run's earlier export)."""
        config, prep = self.prep.config, self.prep
        if config.save_hf is None or not prep.ranks.is_main:
            return
        # A byte-level model gets cadence's byte tokenizer (as_tokenizer(None)), so that it loads and stops; a model
        # trained on chat data, the template its conversations were rendered with.
        tokenizer = prep.built.tokenizer
        chat_template = None
        if prep.source.kind == "chat":
            chat_template = chat_template_for(tokenizer, config.chat_template)[0].source
        try:
            # Under FSDP2 the weights come from the final model.safetensors, a tensor at a time.
            streamed = self.checkpointer.streams_weights
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
    error: UsageError | None = None
    try:
        value = check()  # returned below only when no rank failed, so only when this one did not
    except UsageError as err:
        if not ranks.launched:
            raise
        error = err
    main_failed = broadcast_from_main(error is not None, ranks)
    anyone_failed = any_rank(error is not None, ranks)
    if error is not None:
        # Rank 0's problem is every rank's (they all check the same input); another rank's alone is its own to say.
        raise UsageError(error.problems, every_rank_agrees=main_failed) from None
    if anyone_failed:
        raise UsageError.single("another rank", "found a problem with the input (its message is above)")
    return value


class _Discard(io.StringIO):
    """The output stream of ranks other than 0: they print nothing (and it keeps nothing)."""

    def write(self, text: str) -> int:
        return len(text)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
