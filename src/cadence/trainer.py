"""``cadence train``: build everything from a TrainConfig and run windows through the engine into a run directory.

Everything that can be wrong with the input is checked (configuration AND data files) before the run directory is
created, so bad input never leaves anything half-written.
"""

from __future__ import annotations

import platform
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import torch

from cadence import __version__
from cadence.checkpoint import save_checkpoint
from cadence.config import TrainConfig, resolve_device, validate
from cadence.data import DataSplits, iterate_micro_batches, load_data
from cadence.engine import Engine
from cadence.errors import UsageError
from cadence.models import build_model, model_context_length
from cadence.progress import TrainProgress, format_bytes
from cadence.run_dir import RunWriter
from cadence.schedules import build_lr_scheduler
from cadence.windows import iter_windows

MAX_CONSECUTIVE_SKIPS = 50
"""Windows in a row whose step was skipped before training stops: fp16 backs its scale off by 2x per skip, so 50 in a
row means the gradients are non-finite at any scale, i.e. the run has diverged."""


class TrainingFailed(RuntimeError):
    """Training could not continue (not a usage problem): the CLI exits with status 1 and this message."""


@dataclass(kw_only=True)
class Prepared:
    """A validated configuration with its data loaded: everything needed before anything is written."""

    config: TrainConfig
    device: torch.device
    seq_len: int
    grad_accum_steps: int
    effective_batch_size: int
    world_size: int
    data: DataSplits
    out: Path


def prepare(config: TrainConfig, *, world_size: int = 1) -> Prepared:
    """Validate the configuration and load the data; raises UsageError naming every problem. Writes nothing."""
    validate(config, world_size=world_size)
    seq_len = config.seq_len or model_context_length(config.model)
    data = load_data(config.data, seq_len, config.val_fraction)
    grad_accum_steps = config.resolved_grad_accum_steps(world_size)
    effective = config.micro_batch_size * grad_accum_steps * world_size
    if config.last_window == "drop" and len(data.train) < effective:
        raise UsageError.single(
            "--last-window",
            f"drop leaves nothing to train on: the training split has {len(data.train)} sequences, fewer than one "
            f"window of {effective}; use --last-window step or a smaller --effective-batch-size",
        )
    out = config.out or Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    if config.out is None and out.exists():
        raise UsageError.single("--out", f"default {out} already exists; give --out")
    return Prepared(
        config=config, device=resolve_device(config.device), seq_len=seq_len, grad_accum_steps=grad_accum_steps,
        effective_batch_size=effective, world_size=world_size, data=data, out=out,
    )


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only; decaying biases and norm gains only hurts."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for param in model.parameters():  # parameters() yields a tied weight once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2))


def train(config: TrainConfig, *, stream: IO[str] | None = None, live: bool | None = None) -> dict[str, Any]:
    """Train as configured; returns the summary (also written to summary.json)."""
    stream = stream or sys.stderr
    prep = prepare(config)
    torch.manual_seed(config.seed)
    model = build_model(config.model).to(prep.device)
    optimizer = build_optimizer(model, config)
    scheduler = build_lr_scheduler(
        optimizer, schedule=config.lr_schedule, warmup_steps=config.warmup_steps,  # type: ignore[arg-type]
        max_steps=config.max_steps, min_lr_ratio=config.min_lr_ratio,
    )
    engine = Engine(
        model, optimizer, scheduler=scheduler, precision=config.precision,  # type: ignore[arg-type]
        max_grad_norm=config.max_grad_norm,
    )
    val_batches = _validation_batches(prep, config)
    parameters = sum(p.numel() for p in model.parameters())

    writer = RunWriter(prep.out)
    writer.write_config(_resolved_config(prep, parameters))
    print(
        f"cadence {__version__}: {config.model} ({parameters:,} parameters) on {prep.device}, {config.precision}\n"
        f"effective batch = {config.micro_batch_size} micro-batch x {prep.grad_accum_steps} accumulation x "
        f"{prep.world_size} process(es) = {prep.effective_batch_size} sequences of {prep.seq_len} tokens\n"
        f"data: {prep.data.description}\nrun directory: {prep.out}",
        file=stream, flush=True,
    )
    if prep.data.truncated:
        print(f"note: {prep.data.truncated} examples were longer than --seq-len and were truncated", file=stream)

    started = time.perf_counter()
    totals = {"tokens": 0, "targets": 0, "samples": 0, "timed_tokens": 0, "timed_s": 0.0}
    peak_memory: int | None = None
    last: dict[str, Any] = {}
    last_val: float | None = None
    consecutive_skips = 0
    epoch = 0
    progress = TrainProgress(total_steps=config.max_steps, grad_accum_steps=prep.grad_accum_steps,
                             log_every=config.log_every, stream=stream, live=live)
    try:
        with progress, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while engine.steps < config.max_steps:
                windows = iter_windows(
                    iterate_micro_batches(prep.data.train, config.micro_batch_size, config.seed, epoch),
                    prep.grad_accum_steps, micro_batch_size=config.micro_batch_size,
                    last_window=config.last_window, epoch=epoch,  # type: ignore[arg-type]
                )
                for window_in_epoch, window in enumerate(windows, start=1):
                    # On CPU memory is measured by the profiler, which is as slow as a step: measure the first
                    # steady-state window (the second: the first also allocates the optimizer state) only.
                    profiled = prep.device.type == "cpu" and engine.windows + 1 == min(2, config.max_steps)
                    result = engine.step(
                        window, measure_memory=profiled,
                        on_micro_batch=lambda index: progress.micro_step(engine.steps, index + 1),
                    )
                    row = {**result.as_metrics(), "epoch": epoch}
                    for item in caught:
                        progress.message(f"warning: {item.message}")
                    caught.clear()
                    if result.peak_memory_bytes is not None:
                        peak_memory = max(peak_memory or 0, result.peak_memory_bytes)
                    totals["tokens"] += result.tokens
                    totals["targets"] += result.targets
                    totals["samples"] += result.samples
                    if not profiled:
                        totals["timed_tokens"] += result.tokens
                        totals["timed_s"] += result.step_time_s
                    done = engine.steps >= config.max_steps
                    if not result.skipped and val_batches and (done or engine.steps % config.eval_every == 0):
                        last_val = row["val_loss"] = engine.evaluate(val_batches)
                    writer.log_step(row)
                    progress.update(row)
                    if not result.skipped:
                        last = row
                    consecutive_skips = consecutive_skips + 1 if result.skipped else 0
                    if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                        raise TrainingFailed(
                            f"{consecutive_skips} optimizer steps in a row were skipped (last reason: "
                            f"{result.skip_reason}); the run has diverged. Lower --lr or use bf16/fp32."
                        )
                    if config.checkpoint_every and not result.skipped and engine.steps % config.checkpoint_every == 0:
                        save_checkpoint(
                            prep.out, step=engine.steps, model=model, optimizer=optimizer, scheduler=scheduler,
                            engine_state=engine.state_dict(), data_position={"epoch": epoch, "window_in_epoch": window_in_epoch},
                            info={"loss": result.loss, "config": config.to_json_dict()},
                        )
                    if done:
                        break
                else:
                    epoch += 1  # the epoch's windows ran out before max_steps: start the next epoch
    finally:
        writer.close()

    wall = time.perf_counter() - started
    writer.save_model(model, metadata={"model": config.model, "step": str(engine.steps)})
    summary = {
        "steps": engine.steps,
        "skipped": engine.skipped_steps,
        "windows": engine.windows,
        "epochs": epoch + 1,
        "tokens": totals["tokens"],
        "targets": totals["targets"],
        "samples": totals["samples"],
        "wall_time_s": wall,
        "tokens_per_s": totals["timed_tokens"] / totals["timed_s"] if totals["timed_s"] > 0 else None,
        "peak_memory_bytes": peak_memory,
        "peak_memory_source": _memory_source(prep.device),
        "max_rss_bytes": _max_rss_bytes(),
        "final_loss": last.get("loss"),
        "final_val_loss": last_val,
        "effective_batch_size": prep.effective_batch_size,
        "parameters": parameters,
    }
    writer.write_summary(summary)
    print(
        f"done: {engine.steps} steps ({engine.skipped_steps} skipped), final loss {_fmt(summary['final_loss'])}, "
        f"val loss {_fmt(last_val)}, {_fmt(summary['tokens_per_s'], '.0f')} tokens/s, "
        f"peak memory {format_bytes(peak_memory)}, {wall:.1f} s -> {prep.out}",
        file=stream, flush=True,
    )
    return summary


def _validation_batches(prep: Prepared, config: TrainConfig) -> list[dict[str, torch.Tensor]]:
    """The same first --eval-batches validation micro-batches every time, so evaluations are comparable."""
    if config.eval_every <= 0 or prep.data.val is None:
        return []
    batches = []
    for batch in iterate_micro_batches(prep.data.val, config.micro_batch_size, config.seed, 0, shuffle=False):
        batches.append(batch)
        if len(batches) == config.eval_batches:
            break
    return batches


def _resolved_config(prep: Prepared, parameters: int) -> dict[str, Any]:
    return {
        **prep.config.to_json_dict(),
        "seq_len": prep.seq_len,
        "grad_accum_steps": prep.grad_accum_steps,
        "effective_batch_size": prep.effective_batch_size,
        "world_size": prep.world_size,
        "out": str(prep.out),
        "resolved_device": str(prep.device),
        "model_parameters": parameters,
        "data_description": prep.data.description,
        "train_sequences": len(prep.data.train),
        "val_sequences": 0 if prep.data.val is None else len(prep.data.val),
        "versions": {"cadence": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def _memory_source(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, every step"
    return "torch.profiler allocation events, first steady-state step (window 2)"


def _max_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
