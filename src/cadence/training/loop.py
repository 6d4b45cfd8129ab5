"""``cadence train``: build everything from a TrainConfig and run windows through the engine into a run directory.

Everything that can be wrong with the input is checked (configuration AND data files) before the run directory is
created, so bad input never leaves anything half-written.
"""

from __future__ import annotations

import itertools
import platform
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from cadence import __version__
from cadence.config import TrainConfig
from cadence.data import iterate_micro_batches
from cadence.distributed.ranks import (
    SINGLE,
    Ranks,
    any_rank,
    broadcast_from_main,
    full_model_state,
    full_optimizer_state,
    max_over_ranks,
    optimizer_state_format,
    unwrap,
)
from cadence.engine.step import StepResult, WindowInterrupted
from cadence.engine.windows import epoch_windows, padding_micro_batch
from cadence.errors import CadenceFailure, UsageError
from cadence.models.hf import save_hf
from cadence.training.autobatch import MicroBatchController, MicroBatchTooLarge
from cadence.training.checkpoint import save_checkpoint
from cadence.training.components import Components, build_components
from cadence.training.prepare import Prepared, adopt_token_cache, prepare
from cadence.training.progress import TrainProgress, format_bytes
from cadence.training.resume import StopOnSignal, restore
from cadence.training.run_dir import NoWriter, RunWriter


class TrainingFailed(CadenceFailure):
    """Training could not continue (not a usage problem): the CLI exits with status 1 and this message.

    ``every_rank_agrees``: every rank reached the same decision (divergence), so rank 0 alone reports it; otherwise
    the failing rank reports it with its rank."""

    label = "training failed"


@dataclass(kw_only=True)
class _Totals:
    tokens: int = 0
    targets: int = 0
    samples: int = 0
    timed_tokens: int = 0
    timed_s: float = 0.0
    peak_memory: int | None = None
    oom_retries: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    last_val: float | None = None

    def add(self, result: StepResult, *, timed: bool) -> None:
        self.tokens += result.tokens
        self.targets += result.targets
        self.samples += result.samples
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
        self.oom_retries += int(row.get("oom_retries") or 0)
        if row.get("peak_memory_bytes"):
            self.peak_memory = max(self.peak_memory or 0, int(row["peak_memory_bytes"]))
        else:
            self.timed_tokens += int(row["tokens"])
            self.timed_s += float(row["step_time_s"])
        if not row.get("skipped"):
            self.last = row
        if row.get("val_loss") is not None:
            self.last_val = row["val_loss"]


def train(config: TrainConfig, *, stream: IO[str] | None = None, live: bool | None = None,
          ranks: Ranks = SINGLE) -> dict[str, Any]:
    """Train as configured; returns the summary (also written to summary.json).

    Under torchrun every rank calls this with its ``ranks``; rank 0 alone prints and writes the run directory."""
    stream = (stream or sys.stderr) if ranks.is_main else _Discard()
    prep = _prepare_on_every_rank(config, ranks)
    parts = build_components(prep)
    engine = parts.engine
    val_batches = _validation_batches(prep)
    parameters = sum(p.numel() for p in parts.model.parameters())

    resolved = _resolved_config(prep, parameters)
    start = restore(prep.out, resolved, parts) if config.resume else None  # before the writer opens metrics.jsonl
    writer = RunWriter(prep.out) if ranks.is_main else NoWriter()
    adopt_token_cache(prep)
    writer.write_config(resolved)
    micro = "auto, starting at " + str(prep.micro_batch_size) if config.auto_micro_batch else prep.micro_batch_size
    print(
        f"cadence {__version__}: {config.model} ({parameters:,} parameters) on {prep.device}, {config.precision}, "
        f"recompute {config.activation_checkpointing}, offload {config.offload}\n"
        f"effective batch = {micro} micro-batch x {prep.grad_accum_steps} accumulation x "
        f"{prep.world_size} process(es) = {prep.effective_batch_size} sequences of {prep.seq_len} tokens\n"
        f"data: {prep.data.description}\nrun directory: {prep.out}",
        file=stream, flush=True,
    )
    if prep.data.truncated:
        print(f"note: {prep.data.truncated} examples were longer than --seq-len and were truncated", file=stream)

    if start is not None:
        print(f"resuming from {start.checkpoint} (step {start.step})", file=stream, flush=True)
    started = time.perf_counter()
    totals = _Totals()
    for row in start.kept_rows if start else []:
        totals.add_row(row)
    consecutive_skips = 0
    stopped_elsewhere = False
    epoch, skip = (start.epoch, start.windows_done_in_epoch) if start else (0, 0)
    partial = start.partial if start else None
    if partial is not None and start.partial_micro_batch_size != prep.micro_batch_size:
        raise UsageError.single("--micro-batch-size", f"{prep.micro_batch_size} differs from the "
                                f"{start.partial_micro_batch_size} of the window the checkpoint interrupted")
    stop = StopOnSignal()
    saved_at = engine.windows if start else -1
    progress = TrainProgress(total_steps=config.max_steps, grad_accum_steps=prep.grad_accum_steps,
                             log_every=config.log_every, stream=stream, live=live)
    controller = MicroBatchController(start=prep.micro_batch_size, grow_after=config.auto_grow_after,
                                      log=lambda text: progress.message(f"auto micro-batch: {text}"))
    budget_on_cpu = prep.memory_budget_bytes is not None and prep.device.type == "cpu"
    try:
        with stop, progress, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while engine.steps < config.max_steps:
                # This rank's share of each window (all of it with one process); the same windows for any split.
                windows = epoch_windows(
                    prep.data.train, micro_batch_size=prep.micro_batch_size, grad_accum_steps=prep.grad_accum_steps,
                    seed=config.seed, epoch=epoch, world_size=ranks.world_size, rank=ranks.rank,
                    last_window=config.last_window,  # type: ignore[arg-type]
                )
                # A resumed run skips the windows its checkpoint had done: same permutation, same windows after.
                for window_in_epoch, window in enumerate(itertools.islice(windows, skip, None), start=skip + 1):
                    # On CPU memory is measured by the profiler, which is as slow as a step: measure the first
                    # steady-state window (the second: the first also allocates the optimizer state) only, unless
                    # a budget is enforced, which needs every step measured.
                    profiled = prep.device.type == "cpu" and (
                        budget_on_cpu or engine.windows + 1 == min(2, config.max_steps)
                    )
                    step_options: dict[str, Any] = {
                        "measure_memory": profiled,
                        "on_micro_batch": lambda index: progress.micro_step(engine.steps, index + 1),
                    }
                    if config.checkpoint_mid_window:
                        step_options["stop_requested"] = lambda: stop.requested is not None
                    if partial is not None:  # continue the window a mid-window checkpoint interrupted
                        step_options["resume"], partial = partial, None
                    try:
                        if config.auto_micro_batch:
                            result, retries = controller.step(engine, window, **step_options)
                        else:
                            result, retries = engine.step(window, **step_options), 0
                    except WindowInterrupted as interrupted:
                        _save_mid_window(prep, parts, interrupted, epoch, window_in_epoch, resolved)
                        saved_at = engine.windows
                        break
                    except MicroBatchTooLarge as err:
                        # With several ranks every rank got here together (the engine agrees on out-of-memory).
                        raise TrainingFailed(str(err), every_rank_agrees=True) from err
                    except torch.OutOfMemoryError as err:
                        raise TrainingFailed(
                            f"out of memory at micro-batch {prep.micro_batch_size} ({str(err).splitlines()[0]}); "
                            f"use --micro-batch-size auto, a smaller --micro-batch-size, or "
                            f"--activation-checkpointing full"
                        ) from err
                    row = {**result.as_metrics(), "epoch": epoch, "oom_retries": retries}
                    totals.oom_retries += retries
                    for item in caught:
                        progress.message(f"warning: {item.message}")
                    caught.clear()
                    totals.add(result, timed=not profiled)
                    done = engine.steps >= config.max_steps
                    if not result.skipped and val_batches and (done or engine.steps % config.eval_every == 0):
                        totals.last_val = row["val_loss"] = engine.evaluate(val_batches)
                    writer.log_step(row)
                    progress.update(row)
                    if not result.skipped:
                        totals.last = row
                    # Skips are decided from all-reduced gradients, so every rank counts the same ones.
                    consecutive_skips = consecutive_skips + 1 if result.skipped else 0
                    if consecutive_skips >= config.max_skipped_steps:
                        raise TrainingFailed(
                            f"{consecutive_skips} optimizer steps in a row were skipped (last reason: "
                            f"{result.skip_reason}); the run has diverged. Lower --lr or use bf16/fp32. The last "
                            f"good checkpoint is kept.", every_rank_agrees=True,
                        )
                    # A signal may reach some ranks only: all stop at the same window boundary, or one would wait
                    # in the next window's all-reduce for a rank that left (one tiny collective per window).
                    stopping = any_rank(stop.requested is not None, ranks)
                    stopped_elsewhere = stopping and stop.requested is None
                    periodic = config.checkpoint_every and engine.steps % config.checkpoint_every == 0
                    # At a window boundary: periodically, at the end, and when a signal asked to stop.
                    wanted = (periodic and not result.skipped) or (done and config.checkpoint_every) or stopping
                    if wanted and saved_at != engine.windows:
                        _checkpoint(prep, parts, data_position={"epoch": epoch, "window_in_epoch": window_in_epoch},
                                    info={"loss": result.loss, "config": config.to_json_dict(),
                                          "resolved_config": resolved})
                        saved_at = engine.windows
                    if done or stopping:
                        break
                else:
                    epoch, skip = epoch + 1, 0  # the epoch's windows ran out before max_steps: the next epoch
                    continue
                break
    finally:
        writer.close()

    wall = time.perf_counter() - started
    weights = full_model_state(parts.model, ranks)  # a collective under FSDP2: every rank takes part
    writer.save_model(weights, metadata={"model": config.model, "step": str(engine.steps)})
    if config.save_hf is not None and ranks.is_main:
        save_hf(unwrap(parts.model), config.save_hf, prep.hf.tokenizer if prep.hf else None, weights=weights)
    peak_memory = max_over_ranks(totals.peak_memory, ranks)
    summary = {
        "steps": engine.steps,
        "skipped": engine.skipped_steps,
        "windows": engine.windows,
        "epochs": epoch + 1,
        "tokens": totals.tokens,
        "targets": totals.targets,
        "samples": totals.samples,
        "wall_time_s": wall,
        # Throughput excludes profiler-slowed steps; when every step was measured (a CPU budget), it is all there is.
        "tokens_per_s": (totals.timed_tokens / totals.timed_s if totals.timed_s > 0
                         else totals.tokens / wall if wall > 0 else None),
        "tokens_per_s_includes_profiler": totals.timed_s == 0,
        "peak_memory_bytes": peak_memory,
        "peak_memory_of": "the busiest rank" if ranks.world_size > 1 else "the process",
        "peak_memory_source": _memory_source(prep.device, budget_on_cpu),
        "max_rss_bytes": _max_rss_bytes(),
        "final_loss": totals.last.get("loss"),
        "final_val_loss": totals.last_val,
        "effective_batch_size": prep.effective_batch_size,
        "final_micro_batch_size": controller.current if config.auto_micro_batch else prep.micro_batch_size,
        "oom_retries": totals.oom_retries,
        "parameters": parameters,
        "stopped_by": stop.requested or ("a signal to another rank" if stopped_elsewhere else None),
        "resumed_from_step": start.step if start else None,
    }
    writer.write_summary(summary)
    print(
        f"done: {engine.steps} steps ({engine.skipped_steps} skipped), final loss {_fmt(summary['final_loss'])}, "
        f"val loss {_fmt(totals.last_val)}, {_fmt(summary['tokens_per_s'], '.0f')} tokens/s, "
        f"peak memory {format_bytes(peak_memory)}, {wall:.1f} s -> {prep.out}",
        file=stream, flush=True,
    )
    if summary["stopped_by"]:
        print(f"stopped by {summary['stopped_by']} after step {engine.steps} (checkpoint saved); continue with "
              f"--resume", file=stream, flush=True)
    return summary


def _prepare_on_every_rank(config: TrainConfig, ranks: Ranks) -> Prepared:
    """``prepare`` on every rank, then all learn whether any rank found a problem (so none goes on alone), before
    rank 0 creates the run directory (--out is still empty while the others check it)."""
    try:
        prep, error = prepare(config, ranks=ranks), None
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
    return prep


def _checkpoint(prep: Prepared, parts: Components, *, data_position: dict[str, int], info: dict[str, Any],
                partial_window: dict[str, Any] | None = None) -> None:
    """Every rank gathers its part of the state (FSDP2 shards it); rank 0 writes the checkpoint."""
    weights = full_model_state(parts.model, parts.ranks)
    optimizer_state = full_optimizer_state(parts.model, parts.optimizer, parts.ranks)
    if not parts.ranks.is_main:
        return
    save_checkpoint(
        prep.out, step=parts.engine.steps, weights=weights, optimizer_state=optimizer_state,
        scheduler=parts.scheduler, engine_state=parts.engine.state_dict(), data_position=data_position,
        info={**info, "optimizer_format": optimizer_state_format(parts.ranks)}, keep=prep.config.keep_checkpoints,
        partial_window=partial_window,
    )


class _Discard:
    """The output stream of ranks other than 0: they print nothing."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _save_mid_window(prep: Prepared, parts: Components, interrupted: WindowInterrupted, epoch: int,
                     window_in_epoch: int, resolved: dict[str, Any]) -> None:
    """A checkpoint inside a window: the state before it, plus the gradients of the micro-batches it has done."""
    grads = {name: p.grad.detach().to("cpu").clone() for name, p in unwrap(parts.model).named_parameters()
             if p.grad is not None}
    _checkpoint(
        prep, parts,
        data_position={"epoch": epoch, "window_in_epoch": window_in_epoch - 1},  # this window is continued
        info={"loss": None, "config": prep.config.to_json_dict(), "resolved_config": resolved, "mid_window": True},
        partial_window={"micro_batches_done": interrupted.partial.micro_batches_done,
                        "loss_sum": interrupted.partial.loss_sum, "micro_batch_size": prep.micro_batch_size,
                        "grads": grads},
    )


def _validation_batches(prep: Prepared) -> list[dict[str, torch.Tensor]]:
    """The same first --eval-batches validation micro-batches every time, so evaluations are comparable.

    With several processes each rank evaluates every world-th of them (the engine sums over ranks), padded so that
    all ranks run the same number of forwards (FSDP2 gathers parameters in each)."""
    config = prep.config
    if config.eval_every <= 0 or prep.data.val is None:
        return []
    batches = []
    for batch in iterate_micro_batches(prep.data.val, prep.micro_batch_size, config.seed, 0, shuffle=False):
        batches.append(batch)
        if len(batches) == config.eval_batches:
            break
    world, rank = prep.ranks.world_size, prep.ranks.rank
    per_rank = -(-len(batches) // world)
    mine = batches[rank::world]
    return mine + [padding_micro_batch() for _ in range(per_rank - len(mine))]


def _resolved_config(prep: Prepared, parameters: int) -> dict[str, Any]:
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
        "train_sequences": len(prep.data.train),
        "val_sequences": 0 if prep.data.val is None else len(prep.data.val),
        "versions": {"cadence": __version__, "torch": torch.__version__, "python": platform.python_version()},
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


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
