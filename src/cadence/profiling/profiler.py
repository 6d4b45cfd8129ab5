"""Where a step's time and memory go: phase timings, torch.profiler trace, MFU and a verdict.

Use it around your own loop::

    with StepProfiler(engine, out=Path("profile"), active=5) as profiler:
        for window in windows:
            engine.step(window)
            profiler.step()          # the step boundary; stops by itself after wait + warmup + active steps

The engine reports its phases (forward, backward, gradient sync, unscale + clip, optimizer step, zero_grad +
scheduler) to the profiler; the time from one step boundary to the next ``engine.step`` call is data wait, and
``profiler.phase("logging_checkpointing")`` marks the loop's own bookkeeping. With no profiler attached, the engine's
phase hooks are one shared no-op context: nothing is timed and nothing synchronises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from cadence.config.commands import ProfileOptions
from cadence.engine.precision import fp32_matmul
from cadence.engine.prefetch import prefetch
from cadence.engine.step import Engine
from cadence.errors import Problem, UsageError
from cadence.memory.meter import live_training_bytes, quiet_native_stderr
from cadence.models import CompileClock
from cadence.optim.spec import OPTIMIZER_REGION_PREFIX
from cadence.output_files import timestamped_directory
from cadence.profiling.flops import measured_peak_flops, spec_flops_per_token
from cadence.profiling.report import PROFILE_FILE, compile_line, profile_report
from cadence.records import PROFILE
from cadence.report.document import write_report
from cadence.training.components import build_components
from cadence.training.noise_scale import noise_scale_fields, noise_scale_line
from cadence.training.prepare import prepare

PHASES = ("data_wait", "forward", "backward", "gradient_sync", "unscale_clip", "optimizer_step",
          "zero_grad_scheduler", "logging_checkpointing")
TRACE_FILE = "trace.json"
RANGE_PREFIX = "cadence."

DATA_BOUND_SHARE = 0.20
COMMUNICATION_BOUND_SHARE = 0.20
OPTIMIZER_BOUND_SHARE = 0.25
MEMORY_BOUND_FRACTION = 0.90
PADDING_BOUND_SHARE = 0.25
"""Verdict thresholds: the share of the step wall time (or of the memory limit) past which that part is the
bottleneck. Checked in this order; compute-bound is the verdict when none is passed."""


class PhaseTimer:
    """Times the phases of each step (perf_counter; CUDA synchronised at boundaries) and marks profiler ranges."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.steps: list[dict[str, float]] = []
        self.step_times: list[float] = []
        self._current: dict[str, float] = {}
        self._boundary = time.perf_counter()
        self._waited = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels are asynchronous: without this a phase times its launch

    def step_started(self) -> None:
        if not self._waited:  # the first engine.step after a boundary: everything before it was data wait
            self._current["data_wait"] = self._current.get("data_wait", 0.0) + time.perf_counter() - self._boundary
            self._waited = True

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        started = time.perf_counter()
        with record_function(RANGE_PREFIX + name):
            yield
            self._sync()
        self._current[name] = self._current.get(name, 0.0) + time.perf_counter() - started

    def end_step(self, *, keep: bool) -> None:
        """The step boundary: record the finished step (when ``keep``) and start timing the next one."""
        self._sync()
        now = time.perf_counter()
        if keep:
            self.steps.append(self._current)
            self.step_times.append(now - self._boundary)
        self._current, self._boundary, self._waited = {}, now, False

    def restart(self) -> None:
        """Move the step boundary to now (after work that belongs to no step, such as the profiler's)."""
        self._boundary = time.perf_counter()


@dataclass(kw_only=True)
class ProfileSettings:
    wait: int = 1
    warmup: int = 1
    active: int = 5
    peak_flops: float | None = None
    tokens_per_step: float | None = None  # the median of the profiled steps: a half between two counts
    model_flops_per_token: float | None = None
    memory_limit_bytes: int | None = None
    config: dict[str, Any] | None = None
    padding_fraction: float | None = None
    compile_clock: CompileClock | None = None
    """With --compile: the clock that splits compile time between the steps before the active ones and those."""
    """The share of the computed positions that were right padding over the active steps (None: not counted)."""


class StepProfiler:
    """torch.profiler with a wait/warmup/active schedule plus cadence's phase timings; writes profile.json,
    trace.json, report.md and report.html into ``out`` when the active steps are done (or the context exits)."""

    def __init__(self, engine: Engine, *, out: Path, settings: ProfileSettings | None = None) -> None:
        self.engine = engine
        self.out = out
        self.settings = settings or ProfileSettings()
        self.timer = PhaseTimer(engine.device)
        self._step_index = 0
        self._profiler: Any = None
        self._stack = contextlib.ExitStack()
        self.result: dict[str, Any] | None = None
        self._memory_baseline: int | None = None

    @property
    def total_steps(self) -> int:
        return self.settings.wait + self.settings.warmup + self.settings.active

    @property
    def done(self) -> bool:
        return self._step_index >= self.total_steps

    def __enter__(self) -> "StepProfiler":
        self.out.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.engine.device.type == "cuda" else [])
        self._stack.enter_context(quiet_native_stderr())
        self._profiler = self._stack.enter_context(profile(
            activities=activities, profile_memory=True, record_shapes=False,
            schedule=schedule(wait=self.settings.wait, warmup=self.settings.warmup, active=self.settings.active),
        ))
        self.engine.phases = self.timer
        self.timer.end_step(keep=False)  # the first boundary
        return self

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return self.timer.phase(name) if not self.done else contextlib.nullcontext()

    def step(self) -> None:
        """Mark the end of an optimizer step (call it after ``engine.step`` and your logging)."""
        if self.done:
            return
        active_from = self.settings.wait + self.settings.warmup
        if self._step_index == active_from - 1:
            self._memory_baseline = live_training_bytes(self.engine.model, self.engine.optimizer)
            if self.settings.compile_clock is not None:
                self.settings.compile_clock.lap()  # what compiles from here on inflates the active steps' times
        self.timer.end_step(keep=self._step_index >= active_from)
        self._profiler.step()
        self.timer.restart()  # the profiler's own bookkeeping is not part of any step
        self._step_index += 1
        if self.done:
            self._finish()

    def __exit__(self, *exc: object) -> None:
        if not self.done and self._profiler is not None:
            self._finish()

    def _finish(self) -> None:
        self.engine.phases = None
        profiler = self._profiler
        self._stack.close()  # stops the profiler; its results stay readable
        if not self.timer.steps:
            return
        profiler.export_chrome_trace(str(self.out / TRACE_FILE))
        self.result = summarize(self, profiler)
        PROFILE.write(self.out / PROFILE_FILE, self.result)
        write_report(profile_report(self.out), self.out)  # report.md and report.html, as `cadence report` writes


def summarize(profiler: StepProfiler, prof: Any) -> dict[str, Any]:
    """profile.json: per-phase times and shares, memory per phase, top operators, tokens/s, MFU and the verdict."""
    timer, settings, engine = profiler.timer, profiler.settings, profiler.engine
    step_times = timer.step_times
    wall = sum(step_times)
    phases: dict[str, dict[str, Any]] = {}
    for name in PHASES:
        per_step = [step.get(name, 0.0) for step in timer.steps]
        phases[name] = {"per_step": per_step, "mean_s": statistics.fmean(per_step), "share": sum(per_step) / wall}
    named = sum(sum(p["per_step"]) for p in phases.values())
    other = [t - sum(step.values()) for t, step in zip(step_times, timer.steps)]
    phases["other"] = {"per_step": other, "mean_s": statistics.fmean(other), "share": sum(other) / wall}
    mean_step = statistics.fmean(step_times)
    tokens_per_s = settings.tokens_per_step / mean_step if settings.tokens_per_step else None
    peak_flops, peak_source = (settings.peak_flops, "--peak-flops") if settings.peak_flops else measured_peak_flops(
        engine.precision.name, engine.device)
    mfu = (tokens_per_s * settings.model_flops_per_token / peak_flops
           if tokens_per_s and settings.model_flops_per_token else None)
    memory = phase_memory(prof, engine.device, profiler._memory_baseline or 0)
    result = {
        "version": 1,
        "created": datetime.now().isoformat(timespec="seconds"),
        "config": settings.config or {},
        "device": str(engine.device),
        "world_size": engine.collective.world_size,
        "schedule": {"wait": settings.wait, "warmup": settings.warmup, "active": settings.active},
        "step_times_s": step_times,
        "phases": phases,
        "phase_shares_sum": named / wall,
        "phase_peak_memory_bytes": memory,
        "peak_memory_bytes": max((v for v in memory.values() if v), default=None),
        "peak_memory_source": "torch.profiler memory events over the active steps, plus the bytes of parameters, "
                              "gradients and optimizer state live when they began",
        "tokens_per_step": settings.tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "padding_fraction": settings.padding_fraction,
        "model_flops_per_token": settings.model_flops_per_token,
        "flops_formula": "PaLM appendix B: 6N + 12 L H Q T",
        "peak_flops": peak_flops,
        "peak_flops_source": peak_source,
        "mfu": mfu,
        "top_operators": top_operators(prof, engine.device, wall),
        "optimizer_regions": optimizer_regions(prof, engine.device, wall),
        "trace": TRACE_FILE,
        **_compile_figures(settings.compile_clock),
        # Over every window the profile ran (the wait and warm-up ones too): a batch far above the critical one
        # wastes compute as surely as a step waiting on data.
        **noise_scale_fields(engine),
    }
    result["verdict"] = verdict(result, settings.memory_limit_bytes)
    return result


def _compile_figures(clock: CompileClock | None) -> dict[str, Any]:
    """With --compile: compile time over the whole profile (the wait step compiles), the part inside the active
    steps (a new shape recompiles; their step times include it) and the graphs compiled; None without --compile."""
    if clock is None:
        return {"compile_time_s": None, "compile_time_in_active_steps_s": None, "compiled_graphs": None}
    in_active = clock.lap()
    total = clock.total()
    return {"compile_time_s": total.seconds, "compile_time_in_active_steps_s": in_active,
            "compiled_graphs": total.graphs}


def phase_memory(prof: Any, device: torch.device, baseline: int) -> dict[str, int | None]:
    """Peak bytes live during each phase: the baseline plus the running sum of allocations, event by event."""
    ranges: list[tuple[int, int, str]] = []
    allocations: list[tuple[int, int]] = []
    wanted = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if name.startswith(RANGE_PREFIX):
            ranges.append((event.start_ns(), event.end_ns(), name[len(RANGE_PREFIX):]))
        elif name == "[memory]" and event.device_type() == wanted:
            allocations.append((event.start_ns(), int(event.nbytes())))
    allocations.sort()
    ranges.sort()
    peaks: dict[str, int | None] = {name: None for name in PHASES if name != "data_wait"}
    running = 0
    index = 0
    for at, nbytes in allocations:
        running += nbytes
        while index < len(ranges) and ranges[index][1] < at:
            index += 1
        for start, end, name in ranges[index:index + 4]:  # phases do not nest deeply: a few candidates suffice
            if start <= at <= end and name in peaks:
                peaks[name] = max(peaks[name] or 0, baseline + running)
    return peaks


def top_operators(prof: Any, device: torch.device, wall: float, limit: int = 15) -> list[dict[str, Any]]:
    """The operators with the most self time (device time on CUDA) over the active steps."""
    rows = []
    for item in prof.key_averages():
        if item.key.startswith(RANGE_PREFIX) or item.key.startswith("ProfilerStep"):
            continue
        self_us = item.self_device_time_total if device.type == "cuda" else item.self_cpu_time_total
        total_us = item.device_time_total if device.type == "cuda" else item.cpu_time_total
        rows.append({"name": item.key, "calls": int(item.count), "self_time_s": self_us / 1e6,
                     "total_time_s": total_us / 1e6, "share": self_us / 1e6 / wall if wall else 0.0})
    rows.sort(key=lambda row: -row["self_time_s"])
    return rows[:limit]


def optimizer_regions(prof: Any, device: torch.device, wall: float) -> dict[str, dict[str, Any]]:
    """The regions the optimizer names inside its step (Muon's newton_schulz), each with its calls and its whole time
    (children included: the matmuls it runs) over the active steps, and its share of their wall time."""
    regions = {}
    for item in prof.key_averages():
        if item.key.startswith(OPTIMIZER_REGION_PREFIX):
            total_us = item.device_time_total if device.type == "cuda" else item.cpu_time_total
            regions[item.key.removeprefix(OPTIMIZER_REGION_PREFIX)] = {
                "calls": int(item.count), "total_time_s": total_us / 1e6, "share": total_us / 1e6 / wall if wall else 0.0}
    return regions


def verdict(result: dict[str, Any], memory_limit: int | None) -> dict[str, str]:
    """data-, communication-, memory-, optimizer- or compute-bound, with the figure that decided it."""
    share = {name: phase["share"] for name, phase in result["phases"].items()}
    optimizer = share["unscale_clip"] + share["optimizer_step"] + share["zero_grad_scheduler"]
    compute = share["forward"] + share["backward"]
    peak = result.get("peak_memory_bytes")
    if share["data_wait"] >= DATA_BOUND_SHARE:
        return {"kind": "data-bound", "figure": f"waiting for data takes {share['data_wait']:.0%} of the step",
                "advice": "load ahead of the step: DataLoader workers with pin_memory, pre-tokenized data, a "
                          "faster dataset; the accelerator idles meanwhile"}
    if result["world_size"] > 1 and share["gradient_sync"] >= COMMUNICATION_BOUND_SHARE:
        return {"kind": "communication-bound", "figure": f"gradient sync takes {share['gradient_sync']:.0%}",
                "advice": "accumulate more micro-batches per sync (the sync happens once per window), bucket "
                          "gradients, or use a faster interconnect"}
    if memory_limit and peak and peak >= MEMORY_BOUND_FRACTION * memory_limit:
        return {"kind": "memory-bound", "figure": f"the peak is {peak / memory_limit:.0%} of the memory limit",
                "advice": "the step runs at the edge of memory (allocator retries, no room to grow the micro-"
                          "batch): cadence plan, recompute (--activation-checkpointing) or bf16"}
    padding = result.get("padding_fraction")
    if padding is not None and padding >= PADDING_BOUND_SHARE:
        config = result.get("config") or {}
        if config.get("packing"):
            fix = "a token budget, --micro-batch-tokens N (fewer, fuller rows per micro-batch)"
        elif config.get("micro_batch_order") == "by-length":
            fix = ("--packing (several examples per row of --seq-len, attention kept apart), or a token budget, "
                   "--micro-batch-tokens N (many short rows or few long ones)")
        else:
            fix = ("--micro-batch-order by-length (the default), --packing, or a token budget, "
                   "--micro-batch-tokens N")
        return {"kind": "padding-bound", "figure": f"{padding:.0%} of the positions computed are padding",
                "advice": f"cut each window by length: {fix}; the window's samples and its gradient stay the same, "
                          f"only the padding goes"}
    if optimizer >= OPTIMIZER_BOUND_SHARE:
        return {"kind": "optimizer-bound", "figure": f"unscale + clip + optimizer step + zero_grad take "
                                                    f"{optimizer:.0%} of the step",
                "advice": "do more work per optimizer step: a larger micro-batch or more accumulation at the same "
                          "effective batch; a fused/foreach optimizer; offload costs host time"}
    mfu = result.get("mfu")
    mfu_text = f"; MFU {mfu:.1%}" if mfu else ""
    config = result.get("config") or {}
    levers = ["a larger micro-batch for better kernel efficiency"]
    if config.get("precision") != "bf16":
        levers.insert(0, "bf16 on hardware with fast bf16 matmuls")
    if not config.get("compile"):
        levers.append("--compile (fused kernels)")
    if config.get("activation_checkpointing") not in (None, "none"):  # only a run that recomputes can recompute less
        levers.append(f"less recompute than {config['activation_checkpointing']} if memory allows")
    return {"kind": "compute-bound", "figure": f"forward + backward take {compute:.0%} of the step{mfu_text}",
            "advice": "the math is the bottleneck: " + (f"{', '.join(levers[:-1])}, or " if levers[1:] else "")
                      + levers[-1]}


def run_profile(config: Any, options: ProfileOptions, *, stream: Any = None) -> dict[str, Any]:
    """Profile ``options.steps`` training steps of ``config`` (a TrainConfig) into OUT (profile.json, trace.json,
    report.md, report.html)."""
    import sys


    stream = stream or sys.stderr
    problems = []
    if options.steps < 1:
        problems.append(Problem(where="--steps", message=f"must be at least 1, got {options.steps}"))
    if options.peak_flops is not None and not options.peak_flops > 0:
        problems.append(Problem(where="--peak-flops", message="must be a positive number of FLOP/s, e.g. 3.1e14"))
    if problems:
        raise UsageError(problems)
    if config.out is None:
        config = dataclasses.replace(config, out=timestamped_directory(Path("profiles"), datetime.now()))
    prep = prepare(config)
    if prep.config.auto_micro_batch:
        raise UsageError.single("--micro-batch-size", "profile a fixed micro-batch size (auto changes it mid-run)")
    # The CPU budget guard runs its own profiler sessions, which cannot nest inside this one.
    parts = build_components(dataclasses.replace(prep, memory_budget_bytes=None))
    settings = ProfileSettings(
        active=options.steps, peak_flops=options.peak_flops,
        tokens_per_step=None,
        model_flops_per_token=spec_flops_per_token(prep.model, prep.seq_len),
        memory_limit_bytes=prep.memory_budget_bytes or (
            torch.cuda.get_device_properties(prep.device).total_memory if prep.device.type == "cuda" else None),
        config={**config.to_json_dict(), "seq_len": prep.seq_len, "micro_batch_size": prep.micro_batch_size,
                "grad_accum_steps": prep.grad_accum_steps, "effective_batch_size": prep.effective_batch_size},
        compile_clock=parts.compile_clock,
    )

    def windows() -> Iterator[Any]:
        epoch = 0
        while True:
            # Cut as cadence train cuts them (the length-aware orders included), so the profile is the run's.
            yield from prep.windows(epoch)
            epoch += 1

    print(f"profiling {config.model} on {prep.device}: 1 wait + 1 warm-up + {options.steps} profiled steps",
          file=stream, flush=True)
    tokens, padded = [], []
    profiling = StepProfiler(parts.engine, out=prep.out, settings=settings)
    # Prepared ahead as cadence train prepares them (--prefetch-windows), so the data wait measured is the run's.
    ahead = prefetch(windows(), depth=config.prefetch_windows, pin_memory=prep.device.type == "cuda")
    with ahead, fp32_matmul(config.fp32_matmul), profiling as profiler:
        for window in ahead:
            result = parts.engine.step(window)
            with profiler.phase("logging_checkpointing"):
                tokens.append(result.tokens)
                padded.append(result.padded_positions)
                print(f"step {len(tokens)}/{profiler.total_steps}: loss {result.loss:.4f}", file=stream, flush=True)
            if profiler._step_index >= settings.wait + settings.warmup:
                settings.tokens_per_step = statistics.median(tokens[settings.wait + settings.warmup:] or tokens)
                active = slice(settings.wait + settings.warmup, None)
                computed = sum(tokens[active]) + sum(padded[active])
                settings.padding_fraction = sum(padded[active]) / computed if computed else None
            profiler.step()
            if profiler.done:
                break
    summary = profiler.result or {}
    verdict_ = summary.get("verdict", {})
    mfu = summary.get("mfu")
    print(f"{verdict_.get('kind')}: {verdict_.get('figure')}. {verdict_.get('advice')}\n"
          f"tokens/s {summary.get('tokens_per_s') or 0:,.0f}, MFU {mfu:.2%} "
          f"(peak {summary.get('peak_flops', 0):.3g} FLOP/s, {summary.get('peak_flops_source')})\n"
          + (compile_line(summary) + "\n" if summary.get("compile_time_s") is not None else "")
          + noise_scale_line(summary, prep.effective_batch_size) + "\n"
          + f"profile: {prep.out / PROFILE_FILE}, trace: {prep.out / TRACE_FILE}, report: {prep.out / 'report.html'}",
          file=stream, flush=True)
    return summary
