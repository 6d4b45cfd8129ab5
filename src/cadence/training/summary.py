"""What a run adds up and summary.json, its record: the totals over every step (a resumed run's earlier rows
included), the segments (one per process that trained it), and the summary itself (counts, throughput, memory, how it
ended)."""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cadence.engine.step import StepResult
from cadence.optim.state import optimizer_state_bytes
from cadence.training.autobatch import MicroBatchController
from cadence.training.components import Components
from cadence.training.evaluation import PERPLEXITY_CAP, Evaluation
from cadence.training.noise_scale import noise_scale_fields
from cadence.training.prepare import Prepared
from cadence.training.resume import ResumePoint
from cadence.training.run_dir import read_summary


@dataclass(kw_only=True)
class Totals:
    """What the summary adds up over the whole run (a resumed run's earlier rows included), and where this process's
    segment of it started."""

    tokens: int = 0
    targets: int = 0
    samples: int = 0
    padded_positions: int = 0
    timed_tokens: int = 0
    timed_s: float = 0.0
    peak_memory: int | None = None
    oom_retries: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    """The last metrics row of a step that was not skipped."""
    last_val: float | None = None
    segment_tokens: int = 0
    """This process's own (a resumed run's earlier segments excluded), for the segments in summary.json."""
    segment_step_s: float = 0.0
    epoch: int = 0
    """The epoch the run is in (the summary counts the epochs from it)."""
    resumed_from: int | None = None
    """The step of the checkpoint this process resumed from (None: it started the run)."""
    windows_at_start: int = 0
    """The windows done before this process (a resumed run's): none done since means nothing was trained."""
    earlier_segments: list[dict[str, Any]] = field(default_factory=list)
    """The segments of the processes before this one (a resumed run's)."""
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def of_run(cls, run_dir: Path, start: ResumePoint | None, windows: int) -> Totals:
        """A run's totals as it starts: empty, or a resumed run's kept rows and earlier segments (read before
        summary.json is written again); ``windows``: the windows done so far."""
        if start is None:
            return cls(windows_at_start=windows)
        totals = cls(epoch=start.epoch, resumed_from=start.step, windows_at_start=windows,
                     earlier_segments=earlier_segments(run_dir, start))
        for row in start.kept_rows:
            totals.add_row(row)
        return totals

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

    def wall(self) -> float:
        """This process's wall time so far."""
        return time.perf_counter() - self.started

    def fields(self, wall: float) -> dict[str, Any]:
        """summary.json's counts and throughput."""
        return {
            "tokens": self.tokens,
            "targets": self.targets,
            "samples": self.samples,
            "padded_positions": self.padded_positions,
            # The share of computed positions that were padding: what --micro-batch-order by-length and
            # --micro-batch-tokens reduce (0 for packed text, whose sequences are all full).
            "padding_fraction": (self.padded_positions / (self.padded_positions + self.tokens)
                                 if self.tokens else None),
            "wall_time_s": wall,
            # Throughput excludes profiler-slowed steps; when every step was measured (a CPU budget), it is all
            # there is.
            "tokens_per_s": (self.timed_tokens / self.timed_s if self.timed_s > 0
                             else self.tokens / wall if wall > 0 else None),
            "tokens_per_s_includes_profiler": self.timed_s == 0,
        }

    def segments(self, wall: float, to_step: int, stopped_by: str | None) -> dict[str, Any]:
        """The run's segments (one per process that trained it: a resumed run has several), each with its steps,
        tokens, the time its steps took and its wall time (None for one that ended without a summary: killed), and
        the whole run's wall time when every segment's is known."""
        current = {"from_step": self.resumed_from or 0, "to_step": to_step, "tokens": self.segment_tokens,
                   "step_time_s": self.segment_step_s, "wall_time_s": wall, "stopped_by": stopped_by}
        segments = [*self.earlier_segments, current]
        walls = [segment["wall_time_s"] for segment in segments]
        return {"segments": segments,
                "run_wall_time_s": sum(walls) if all(isinstance(w, (int, float)) for w in walls) else None}


def run_summary(*, prep: Prepared, parts: Components, totals: Totals, evaluation: Evaluation,
                controller: MicroBatchController, parameters: tuple[int, int], stopped_by: str | None,
                wall: float, peak_memory: int | None) -> dict[str, Any]:
    """summary.json: the whole run's counts (a resumed run's included), throughput, memory and how it ended.
    ``parameters``: the model's trained and frozen parameters."""
    config, engine = prep.config, parts.engine
    trained, frozen = parameters
    auto = controller.current if config.auto_micro_batch else None
    return {
        "steps": engine.steps,
        "skipped": engine.skipped_steps,
        # Where --save-hf exported this run's model and what it wrote there (set once the export is complete: a
        # resumed run replaces its own export, nothing else).
        "save_hf": None,
        "save_hf_files": None,
        "save_hf_step": None,
        "windows": engine.windows,
        "epochs": totals.epoch + 1,
        **totals.fields(wall),
        **compile_fields(parts, untimed=totals.timed_s == 0),
        "peak_memory_bytes": peak_memory,
        "peak_memory_of": "the busiest rank" if prep.ranks.world_size > 1 else "the process",
        "peak_memory_source": memory_source(prep.device, every_step=budget_on_cpu(prep)),
        "max_rss_bytes": max_rss_bytes(),
        "final_loss": totals.last.get("loss"),
        "final_val_loss": totals.last_val,
        "effective_batch_size": prep.effective_batch_size,
        "final_micro_batch_size": auto if auto is not None and controller.unit == "rows" else prep.micro_batch_size,
        "final_micro_batch_tokens": (auto if auto is not None and controller.unit == "tokens"
                                     else config.micro_batch_tokens),
        "oom_retries": totals.oom_retries,
        # The noise scale's moving average after the last window, and how many windows it is over.
        **noise_scale_fields(engine),
        "parameters": trained + frozen,
        "trainable_parameters": trained,
        "frozen_parameters": frozen,
        # This process's (a shard's, under FSDP2): what --optimizer-state shrinks.
        "optimizer_state_bytes": optimizer_state_bytes(parts.optimizer),
        "stopped_by": stopped_by,
        "final_val_perplexity": (math.exp(min(totals.last_val, PERPLEXITY_CAP)) if totals.last_val is not None
                                 else None),
        **evaluation.summary_fields(),
        "resumed_from_step": totals.resumed_from,
        **totals.segments(wall, engine.steps, stopped_by),
    }


def compile_fields(parts: Components, *, untimed: bool) -> dict[str, Any]:
    """With --compile: what compiling cost this process since the run (or its resume) started, apart from tokens/s,
    which leaves out the steps that compiled unless no other step was timed (``untimed``)."""
    clock = parts.compile_clock
    if clock is None:
        return {"compile_time_s": None, "compiled_graphs": None, "graph_breaks": None,
                "tokens_per_s_includes_compile": False}
    compiled = clock.total()
    return {"compile_time_s": compiled.seconds, "compiled_graphs": compiled.graphs,
            "graph_breaks": compiled.graph_breaks, "tokens_per_s_includes_compile": untimed}


def budget_on_cpu(prep: Prepared) -> bool:
    """A --memory-budget on CPU is enforced by measuring every step with the profiler."""
    return prep.memory_budget_bytes is not None and prep.device.type == "cpu"


def memory_source(device: torch.device, *, every_step: bool) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated, every step"
    if every_step:
        return "torch.profiler allocation events, every step (memory budget enforced)"
    return "torch.profiler allocation events, first steady-state step (window 2)"


def max_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


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

