"""Benchmark: everything the CUDA path must show, in one command on one GPU (issue 16, `make bench-gpu`).

Sections, in this order (each in its own try/except: one that fails records its error and the next one runs):

1. ``peak_flops``: the bf16 matmul peak of this device, measured (the best of a few sizes and two input kinds);
2. ``paired_base``: the paired comparison of ``overhead.py`` (hand-written loop, cadence's engine, Accelerate,
   Fabric; alternating rounds from the same weights on the same windows), gpt-base seq 1024 bf16;
3. ``paired_1b``: the same on a ~1B GPT built in code at seq 2048, with each implementation's MFU against (1);
4. ``verify``: ``cadence verify --precision fp16`` and ``bf16`` (PASS/FAIL and the gradient's relative error);
5. ``memory_estimate``: the analytic estimate against the measured peak of a step (``max_memory_allocated`` on
   CUDA) for {fp32, bf16} x {none, selective, full} x {accum 1, 4} (``memory_estimate.estimate_grid``);
6. ``train_vs_engine``: ``cadence train`` tokens/s (steady steps) against the engine alone from (2);
7. ``compile``: ``cadence train --compile`` against (6) and against the hand-written eager loop of (2);
8. ``plan``: ``cadence plan`` under a 6 GiB budget (offload candidates included on a GPU);
9. ``auto_oom``: ``--micro-batch-size auto`` hitting real out-of-memory errors under ``--memory-budget``;
10. ``pytest_gpu``: the tests marked ``gpu``.

The issue's GPU acceptance figures are judged after every section (``acceptance`` in the JSON: value, threshold,
pass/fail, or why not judged). The JSON is rewritten after every section, progress lines are flushed, and a time
budget (default 450 s, counted from the start of the process, inside the issue's 8 minutes) skips, with the reason
recorded, a section whose expected cost no longer fits, so a timeout still leaves every finished result.

It needs no installation: ``src/`` and ``benchmarks/`` are put on ``sys.path`` here, and ``cadence`` commands run as
``python -m cadence`` with ``src/`` on ``PYTHONPATH`` (on the GPU machine: ``python3 benchmarks/gpu.py --out
$OUT/gpu.json``). On a GPU the commands run in subprocesses (a real out-of-memory error and the allocator cap of
``--memory-budget`` stay in their own process); in the dry run they run in this process.

``--dry-run`` (automatic without CUDA) runs every section end to end on the CPU at tiny sizes (about 25 s of CPU
time; fp32 where bf16 would be emulated; the compile section skipped, see ``section_compile``), so that this script
cannot rot unnoticed: ``tests/test_bench_gpu.py`` runs it in ``make test-slow``. Its JSON goes to
``benchmarks/results/gpu_quick.json`` (ignored by git and never shown by ``write_report.py``, like every
``*_quick.json``) and says ``"dry_run": true``; its figures are not GPU results.

    .venv/bin/python benchmarks/gpu.py [--dry-run] [--out FILE] [--budget-s 450] [--sections a,b] [--with-compile]
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts the imports too (torch and CUDA's start-up take seconds)

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"
RESULTS = HERE / "results"
# The GPU machine has torch and the libraries compared against, but not this project installed: the working tree's
# src/ comes first so that the cadence measured is this checkout's, installed or not.
sys.path[:0] = [str(SRC), str(HERE)]

# Imported after the sys.path line above (benchmarks/ and src/ are importable only from here on).
import overhead
import report_sections
import torch
from bench_env import environment
from memory_estimate import estimate_grid

from cadence.config import parse_size
from cadence.models import GPT, GPTConfig, build_model
from cadence.profiling.flops import matmul_speed, model_flops_per_token

# The GPU acceptance thresholds.
SPEED_TARGET = 0.98  # cadence's engine >= 0.98 x the hand-written loop's tokens/s (gpt-base bf16, paired)
MFU_TARGET = 0.45  # the ~1B model's MFU in bf16, against the measured bf16 matmul peak
ESTIMATE_TOLERANCE = 0.10  # the memory estimate within 10% of the CUDA peak, every configuration of the grid
STEADY_AFTER = 3  # `cadence train` tokens/s: the median over the steps after these (warm-up, memory, compile)


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What each section runs at: the issue's sizes on a GPU, tiny ones in the dry run."""

    precision: str
    base_model: str
    base_seq: int
    base_micro: int
    base_accum: int
    base_rounds: int
    base_steps: int
    big_name: str
    big: GPTConfig
    big_seq: int
    big_micro: int
    big_accum: int
    big_rounds: int
    big_steps: int
    train_steps: int
    steady_after: int
    estimate_model: str
    estimate_micro: int
    estimate_seq: int
    verify_flags: tuple[str, ...]
    plan_budget: str
    plan_flags: tuple[str, ...]
    auto_budget: str
    auto_flags: tuple[str, ...]
    peak_sizes: tuple[int, ...]
    expected_s: dict[str, float] = field(default_factory=dict)
    """Each section's expected cost on this device: a section is skipped when it no longer fits the budget."""


GPU = Sizes(
    precision="bf16",
    base_model="gpt-base", base_seq=1024, base_micro=8, base_accum=4, base_rounds=8, base_steps=4,
    # ~1.01B parameters: 20 blocks of width 2048 (16 heads of 128, the shape flash attention is fastest at).
    # Micro 8 x accum 2 at seq 2048 is 32k tokens a step; the estimate puts its peak near 40 GiB.
    big_name="gpt-1b", big=GPTConfig(context_length=2048, n_layer=20, n_head=16, n_embd=2048),
    big_seq=2048, big_micro=8, big_accum=2, big_rounds=3, big_steps=3,
    train_steps=16, steady_after=STEADY_AFTER,
    estimate_model="gpt-base", estimate_micro=8, estimate_seq=1024,
    verify_flags=("--model", "gpt-base", "--seq-len", "1024", "--micro-batch-size", "4", "--grad-accum-steps", "4"),
    # 64 sequences of 1024 at once need ~22 GiB in bf16 (estimate): the plan has to accumulate, recompute or offload.
    plan_budget="6GiB", plan_flags=("--model", "gpt-base", "--seq-len", "1024", "--effective-batch-size", "64"),
    # By the estimate, micro 64, 32 and 16 do not fit in 6 GiB (22, 12, 6.4 GiB) and 8 does (3.8 GiB): three real
    # out-of-memory errors before the first step.
    auto_budget="6GiB",
    auto_flags=("--model", "gpt-base", "--seq-len", "1024", "--precision", "bf16", "--micro-batch-size", "auto",
                "--effective-batch-size", "64", "--max-steps", "4"),
    peak_sizes=(4096, 8192),
    # Guesses for an H200 (never measured yet), rounded up: 390 s in all. A subprocess gets at most 3 times its
    # section's figure, so one that hangs cannot take the sections after it down with it.
    expected_s={"peak_flops": 5, "paired_base": 30, "paired_1b": 50, "verify": 25, "memory_estimate": 15,
                "train_vs_engine": 20, "compile": 90, "plan": 75, "auto_oom": 20, "pytest_gpu": 60},
)
DRY = Sizes(
    # fp32: bf16 is emulated on CPUs without bf16 instructions, and its first steps cost seconds even on gpt-tiny
    # (a paired round 2-4 s against 0.2-0.4 s in fp32); verify and the memory grid still run bf16.
    precision="fp32",
    base_model="gpt-tiny", base_seq=64, base_micro=2, base_accum=2, base_rounds=2, base_steps=1,
    big_name="gpt-1b stand-in", big=GPTConfig(context_length=64, n_layer=2, n_head=2, n_embd=64),
    big_seq=64, big_micro=2, big_accum=1, big_rounds=1, big_steps=1,
    # On CPU the CLI's second step is measured by the profiler (slow): steady steps are the ones after it.
    train_steps=4, steady_after=2,
    estimate_model="gpt-tiny", estimate_micro=1, estimate_seq=32,  # 12 profiled steps: 4.6 s here, 7.5 s at 2 x 64
    verify_flags=("--model", "gpt-tiny", "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "2"),
    # A budget the CPU's profiler guard enforces (gpt-tiny micro 4 measures ~27 MiB, micro 2 ~22 MiB). Precision
    # and recompute are fixed: a free search probes bf16 and measures recompute trials, ~40 s more on 2 cores.
    plan_budget="24MiB",
    plan_flags=("--model", "gpt-tiny", "--seq-len", "64", "--effective-batch-size", "8", "--precision", "fp32",
                "--activation-checkpointing", "none", "--max-trials", "2", "--trial-steps", "3",
                "--quality-steps", "2"),
    auto_budget="24MiB",
    auto_flags=("--model", "gpt-tiny", "--seq-len", "64", "--micro-batch-size", "auto", "--effective-batch-size",
                "16", "--max-steps", "2"),
    peak_sizes=(256,),
)


class Skipped(Exception):
    """A section that cannot run here; its message is the reason recorded in the JSON."""


@dataclass
class Context:
    """What every section sees: sizes, device, time left, the sections so far, where to put run directories."""

    sizes: Sizes
    device: torch.device
    dry_run: bool
    work: Path
    budget_s: float
    with_compile: bool
    started: float = STARTED
    sections: dict[str, dict] = field(default_factory=dict)
    current: str = ""
    """The section running now (its expected cost bounds the time a subprocess of it may take)."""

    @property
    def isolate(self) -> bool:
        """cadence commands in subprocesses (on a GPU: OOMs and the allocator cap stay there), else in-process."""
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def timeout(self) -> float:
        """For a subprocess of the current section: what is left of the budget, at most 3 times the section's
        expected cost, and never under 30 s."""
        expected = self.sizes.expected_s.get(self.current)
        return max(30.0, min(self.left(), 3 * expected) if expected else self.left())

    def shown(self, args: list[str]) -> str:
        """A command as run, the temporary directory written $TMP."""
        return " ".join(args).replace(str(self.work), "$TMP")

    def results(self, name: str) -> dict:
        """A finished section's results; Skipped (with why) when it did not finish, for the sections built on it."""
        entry = self.sections.get(name)
        if entry is None or entry["status"] != "ok":
            why = "not run" if entry is None else entry.get("reason") or entry.get("error")
            raise Skipped(f"needs section {name}, which did not finish ({why})")
        return entry["results"]


def say(ctx: Context | None, text: str) -> None:
    stamp = f"{ctx.elapsed():6.1f}s " if ctx is not None else ""
    print(f"[bench-gpu] {stamp}{text}", flush=True)


def free_device_memory(ctx: Context) -> None:
    """Between sections: the models of the last one are garbage now; hand their cached blocks back to the driver."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ cadence commands
@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def cadence(ctx: Context, *args: str) -> Completed:
    """``cadence ARGS``: in a subprocess on a GPU (``python -m cadence``, src/ on PYTHONPATH, timed out when the
    budget runs out), in this process in the dry run (each subprocess would pay ~4 s of imports on 2 cores)."""
    if ctx.isolate:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=ctx.timeout())
        return Completed(done.returncode, done.stdout, done.stderr)
    from cadence.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return Completed(code, out.getvalue(), err.getvalue())


def failed(what: str, done: Completed) -> RuntimeError:
    return RuntimeError(f"{what} exited with status {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")


def train_run(ctx: Context, label: str, *extra: str) -> dict:
    """``cadence train`` at the paired comparison's configuration; its steady tokens/s and summary."""
    s = ctx.sizes
    out = ctx.work / label
    args = ["train", "--model", s.base_model, "--seq-len", str(s.base_seq), "--micro-batch-size", str(s.base_micro),
            "--grad-accum-steps", str(s.base_accum), "--precision", s.precision, "--max-steps", str(s.train_steps),
            "--val-fraction", "0", "--log-every", "1000", "--out", str(out), *extra]
    done = cadence(ctx, *args)
    if done.returncode != 0:
        raise failed(f"cadence {' '.join(args)}", done)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    steady = [row["tokens_per_s"] for row in metrics[s.steady_after:]]
    if not steady:
        raise RuntimeError(f"{len(metrics)} steps: none after the first {s.steady_after} to time")
    return {"command": "cadence " + ctx.shown(args), "steady_tokens_per_s": statistics.median(steady),
            "steady_steps": len(steady), "tokens_per_s_by_step": [row["tokens_per_s"] for row in metrics],
            "summary": summary}


# ---------------------------------------------------------------------------------------------------------- sections
def section_peak_flops(ctx: Context) -> dict:
    """The matmul peak in the comparison's precision (bf16 on a GPU), the best of several ways to measure it: a
    peak measured too low would flatter the MFU. ``matmul_speed`` (what ``cadence profile`` uses) multiplies fp32
    inputs under autocast, so each product also pays the casts of its inputs; on CUDA the same product of inputs
    already in bf16 is timed too. Square sizes: a small one underrates a big GPU."""
    precision = ctx.sizes.precision
    repeats = 20 if ctx.device.type == "cuda" else 4
    by_size = {}
    for size in ctx.sizes.peak_sizes:
        by_size[f"{size} autocast"] = 2.0 * matmul_speed(precision, ctx.device, size=size, repeats=repeats)  # 2/FMA
        if ctx.device.type == "cuda":
            by_size[f"{size} {precision} inputs"] = 2.0 * _matmul_speed_in(torch.bfloat16, ctx.device, size, repeats)
    best = max(by_size, key=by_size.__getitem__)
    return {"precision": precision, "peak_flops": by_size[best], "by_size": by_size,
            "source": f"measured: {precision} matmul {best} on {ctx.device.type}, the best of "
                      f"{', '.join(by_size)}; best of 3 timed rounds each"}


def _matmul_speed_in(dtype: torch.dtype, device: torch.device, size: int, repeats: int) -> float:
    """Multiply-adds per second of a square matmul of inputs already in ``dtype`` (CUDA): best of three rounds."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: cuBLAS picks its kernel
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)  # the timer starts and stops with an empty queue
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return repeats * size**3 / best


def available_implementations() -> tuple[tuple[str, ...], dict[str, str]]:
    """The implementations of ``overhead.py`` whose library is installed, and why the others are left out."""
    missing = {name: f"{module} is not installed" for name, module in (("accelerate", "accelerate"),
                                                                        ("fabric", "lightning"))
               if importlib.util.find_spec(module) is None}
    return tuple(n for n in overhead.IMPLEMENTATIONS if n not in missing), missing


def paired(ctx: Context, initial: torch.nn.Module, model: str, seq: int, micro: int, accum: int, rounds: int,
           steps: int) -> dict:
    """``overhead.compare`` on ``ctx.device`` at these sizes, with the paired ratio the target is judged on."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")  # Accelerate's and Lightning's notices, as overhead.py silences them
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    names, missing = available_implementations()
    windows = overhead.take_windows(seq, micro, accum, steps + 2, device=ctx.device)
    per, mismatches = overhead.compare(initial, windows, ctx.sizes.precision, accum, rounds, steps, names)
    if overhead.Accelerate.accelerator is not None:
        # The accelerator keeps the last round's model and optimizer: on a GPU, gigabytes that the later sections
        # (the memory estimate's high-water mark above all) must not see.
        overhead.Accelerate.accelerator.free_memory()
    ratios = report_sections.paired_ratios(per, "cadence")
    return {"model": model, "seq_len": seq, "micro_batch_size": micro, "grad_accum_steps": accum,
            "precision": ctx.sizes.precision, "tokens_per_step": windows[1].tokens, "rounds": rounds,
            "steps_per_round": steps, "implementations": per, "not_run": missing,
            "paired_ratio": statistics.median(ratios), "paired_ratios": ratios,
            "loss_check": mismatches or "every implementation's losses and gradient norms match the hand-written "
                                        f"loop's within {overhead.LOSS_TOLERANCE[ctx.sizes.precision]:g}"}


def section_paired_base(ctx: Context) -> dict:
    s = ctx.sizes
    torch.manual_seed(0)
    initial = build_model(s.base_model).to(ctx.device)
    return paired(ctx, initial, s.base_model, s.base_seq, s.base_micro, s.base_accum, s.base_rounds, s.base_steps)


def section_paired_1b(ctx: Context) -> dict:
    s = ctx.sizes
    torch.manual_seed(0)
    with torch.device(ctx.device):  # built where it runs: initialising 1B parameters on the host takes seconds
        initial = GPT(s.big)
    result = paired(ctx, initial, s.big_name, s.big_seq, s.big_micro, s.big_accum, s.big_rounds, s.big_steps)
    flops = model_flops_per_token(s.big, s.big_seq)
    result.update(config=dataclasses.asdict(s.big), parameters=s.big.num_parameters(), flops_per_token=flops)
    try:
        peak = ctx.results("peak_flops")["peak_flops"]
    except Skipped as why:
        result["mfu_note"] = str(why)
        return result
    result["peak_flops"] = peak
    for row in result["implementations"].values():
        row["mfu"] = row["median_tokens_per_s"] * flops / peak
    result["mfu"] = result["implementations"]["cadence"]["mfu"]
    return result


def section_verify(ctx: Context) -> dict:
    out = {}
    for precision in ("fp16", "bf16"):
        done = cadence(ctx, "verify", *ctx.sizes.verify_flags, "--precision", precision, "--json")
        if done.returncode not in (0, 1):  # 1 is FAIL, a result; anything else is an error
            raise failed(f"cadence verify --precision {precision}", done)
        report = json.loads(done.stdout[done.stdout.index("{"):])
        out[precision] = {key: report.get(key) for key in ("passed", "relative_error", "cosine", "tolerance",
                                                           "reference", "effective_batch_size")}
        out[precision]["exit_status"] = done.returncode
        say(ctx, f"verify {precision}: {'PASS' if report['passed'] else 'FAIL'} "
                 f"(relative error {report['relative_error']:.2e}, tolerance {report['tolerance']:g})")
    out["command"] = "cadence verify " + " ".join(ctx.sizes.verify_flags) + " --precision {fp16,bf16} --json"
    return out


def section_memory_estimate(ctx: Context) -> dict:
    s = ctx.sizes
    rows = estimate_grid(s.estimate_model, s.estimate_micro, s.estimate_seq, ctx.device)
    worst = max(abs(row["error"]) for row in rows)
    measured_by = ("torch.cuda.max_memory_allocated around the step" if ctx.device.type == "cuda" else
                   "the profiler's allocation events around the step (CPU)")
    return {"rows": rows, "max_abs_error": worst, "measured_by": measured_by}


def section_train_vs_engine(ctx: Context) -> dict:
    run = train_run(ctx, "train")
    result = {"train": run}
    engine = ctx.results("paired_base")["implementations"]["cadence"]["median_tokens_per_s"]
    result.update(engine_tokens_per_s=engine, ratio=run["steady_tokens_per_s"] / engine)
    return result


def section_compile(ctx: Context) -> dict:
    if ctx.dry_run and not ctx.with_compile:
        # Skipped in the dry run, not shrunk: a cold inductor compile of even gpt-tiny's blocks (one graph, forward
        # and backward, whatever the width or depth) took 30.5 s on this 2-core CPU, more than the rest of the dry
        # run together. The run it would make is train_run's, which train_vs_engine exercises; --with-compile runs it.
        raise Skipped("dry run: a cold inductor compile costs ~30 s on a 2-core CPU (--with-compile runs it)")
    compiled = train_run(ctx, "compile", "--compile")
    eager = ctx.results("train_vs_engine")["train"]
    plain = ctx.results("paired_base")["implementations"]["plain"]["median_tokens_per_s"]
    return {"compiled": compiled, "eager_tokens_per_s": eager["steady_tokens_per_s"], "plain_tokens_per_s": plain,
            "speedup": compiled["steady_tokens_per_s"] / eager["steady_tokens_per_s"],
            "vs_hand_written": compiled["steady_tokens_per_s"] / plain,
            "compile_summary": {k: v for k, v in compiled["summary"].items() if "compile" in k}}


def section_plan(ctx: Context) -> dict:
    s = ctx.sizes
    out = ctx.work / "plan"
    args = ["plan", *s.plan_flags, "--memory-budget", s.plan_budget, "--out", str(out)]
    done = cadence(ctx, *args)
    if not (out / "plan.json").exists():
        raise failed("cadence plan", done)
    # plan.json is written before the report: a report that fails (matplotlib missing) still leaves the decision.
    report_error = None if done.returncode == 0 else f"exit status {done.returncode}: {done.stderr[-600:]}"
    plan = json.loads((out / "plan.json").read_text())
    budget = parse_size(s.plan_budget)
    choice = plan["choice"]
    chosen = next(c for c in plan["candidates"] if c["id"] == choice["id"])
    peak = (chosen.get("measured") or {}).get("peak_bytes")
    offload = [c for c in plan["candidates"] if c["offload"] != "none"]
    return {"command": "cadence " + ctx.shown(args), "report_error": report_error, "budget_bytes": budget,
            "choice": choice,
            "choice_estimated_peak_bytes": chosen["estimated_peak_bytes"], "choice_measured_peak_bytes": peak,
            "within_budget": peak is not None and peak <= budget, "candidates": len(plan["candidates"]),
            "measured_candidates": sum(c["measured"] is not None for c in plan["candidates"]),
            "offload_candidates": len(offload),
            "offload_measured": sum(c["measured"] is not None for c in offload),
            "quality_passed": {k: v.get("passed") for k, v in (plan.get("quality") or {}).items()
                               if isinstance(v, dict)},  # the lossy optimizer-state checks are a list
            "notes": plan.get("notes", []), "duration_s": plan.get("duration_s")}


def section_auto_oom(ctx: Context) -> dict:
    s = ctx.sizes
    out = ctx.work / "auto"
    args = ["train", *s.auto_flags, "--memory-budget", s.auto_budget, "--val-fraction", "0", "--out", str(out)]
    done = cadence(ctx, *args)
    if done.returncode != 0:
        raise failed("cadence train --micro-batch-size auto", done)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    budget = parse_size(s.auto_budget)
    peaks = [row["peak_memory_bytes"] for row in metrics if row.get("peak_memory_bytes") is not None]
    retries = summary.get("oom_retries", 0)
    return {"command": "cadence " + ctx.shown(args), "budget_bytes": budget, "oom_retries": retries,
            "micro_batch_size_by_step": [row["micro_batch_size"] for row in metrics],
            "final_micro_batch_size": summary.get("final_micro_batch_size"), "max_peak_bytes": max(peaks, default=None),
            "steps": summary.get("steps"),
            "out_of_memory": ("real CUDA out-of-memory errors (allocator capped at the budget)"
                              if ctx.device.type == "cuda" else "the CPU's profiler guard (measured peak > budget)"),
            "passed": retries >= 1 and bool(peaks) and max(peaks) <= budget,
            "auto_lines": [line for line in (done.stdout + done.stderr).splitlines() if "auto micro-batch" in line]}


def section_pytest_gpu(ctx: Context) -> dict:
    if importlib.util.find_spec("pytest") is None:
        raise Skipped("pytest is not installed here")
    # Only the files that mark a test gpu: `-m gpu` over the whole suite would import every test module first.
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text(encoding="utf-8"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=ctx.timeout())
    tail = (done.stdout + done.stderr).strip().splitlines()
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[-1] if tail else "")}
    return {"command": "python -m pytest -m gpu -q " + " ".join(files), "exit_status": done.returncode,
            "counts": counts, "tail": tail[-30:]}


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    run: Callable[[Context], dict]


SECTIONS = (
    Section("peak_flops", "matmul peak", section_peak_flops),
    Section("paired_base", "paired comparison: hand-written, cadence, Accelerate, Fabric", section_paired_base),
    Section("paired_1b", "paired comparison and MFU of a ~1B model", section_paired_1b),
    Section("verify", "cadence verify, fp16 and bf16", section_verify),
    Section("memory_estimate", "memory estimate against the measured peak", section_memory_estimate),
    Section("train_vs_engine", "cadence train against the engine alone", section_train_vs_engine),
    Section("compile", "--compile on/off", section_compile),
    Section("plan", "cadence plan under a memory budget", section_plan),
    Section("auto_oom", "--micro-batch-size auto under --memory-budget", section_auto_oom),
    Section("pytest_gpu", "pytest -m gpu", section_pytest_gpu),
)


# -------------------------------------------------------------------------------------------------------- acceptance
def acceptance(sections: dict[str, dict], cuda: bool) -> list[dict]:
    """The issue's GPU acceptance figures, each with its value, threshold and pass/fail (None: not judged, with
    why). Judged from the sections' results only, so the renderer and a reader of the JSON see the same verdicts."""
    items = []

    def judge(key: str, target: str, section: str, value: Callable[[dict], float | bool | None],
              passes: Callable[[float | bool], bool], threshold: float | None = None) -> None:
        entry = sections.get(section)
        item = {"id": key, "target": target, "section": section, "threshold": threshold, "value": None,
                "passed": None, "why": None}
        if entry is None or entry["status"] != "ok":
            item["why"] = "not run" if entry is None else entry.get("reason") or entry.get("error")
        else:
            try:
                item["value"] = value(entry["results"])
            except (KeyError, TypeError) as err:
                item["why"] = f"not in the results ({type(err).__name__}: {err})"
            if item["value"] is not None:
                item["passed"] = bool(passes(item["value"]))
        items.append(item)

    judge("speed", f"cadence >= {SPEED_TARGET}x the hand-written loop's tokens/s (paired)", "paired_base",
          lambda r: r["paired_ratio"], lambda v: v >= SPEED_TARGET, SPEED_TARGET)
    judge("compile", "with --compile, cadence train above the hand-written eager loop", "compile",
          lambda r: r["vs_hand_written"], lambda v: v > 1.0, 1.0)
    judge("mfu", f"MFU of the ~1B model >= {MFU_TARGET} (cadence's engine)", "paired_1b",
          lambda r: r.get("mfu"), lambda v: v >= MFU_TARGET, MFU_TARGET)
    judge("estimate", f"memory estimate within {ESTIMATE_TOLERANCE:.0%} of the measured peak (every configuration)",
          "memory_estimate", lambda r: r["max_abs_error"], lambda v: v <= ESTIMATE_TOLERANCE, ESTIMATE_TOLERANCE)
    judge("plan", "plan's choice within the budget (measured)", "plan",
          lambda r: (r["choice_measured_peak_bytes"] / r["budget_bytes"]
                     if r["choice_measured_peak_bytes"] is not None else None), lambda v: v <= 1.0, 1.0)
    judge("verify_fp16", "cadence verify --precision fp16 PASS", "verify", lambda r: r["fp16"]["passed"], bool)
    judge("verify_bf16", "cadence verify --precision bf16 PASS", "verify", lambda r: r["bf16"]["passed"], bool)
    judge("auto_oom", "--micro-batch-size auto hits out-of-memory and trains within --memory-budget", "auto_oom",
          lambda r: r["passed"], bool)
    if cuda:
        judge("pytest_gpu", "pytest -m gpu: every GPU test passes", "pytest_gpu",
              lambda r: r["exit_status"] == 0 and r["counts"].get("passed", 0) > 0, bool)
    else:
        items.append({"id": "pytest_gpu", "target": "pytest -m gpu: every GPU test passes", "section": "pytest_gpu",
                      "threshold": None, "value": None, "passed": None, "why": "no CUDA: every GPU test skips"})
    return items


# -------------------------------------------------------------------------------------------------------------- main
def write_json(path: Path, document: dict) -> None:
    """Atomically: a reader (or a timeout) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2, default=str) + "\n")
    partial.replace(path)


def run_sections(ctx: Context, sections: tuple[Section, ...], document: dict, out: Path) -> None:
    """Each section in turn, isolated: an error or a skip is recorded and the next one runs; the JSON is rewritten
    after every section."""
    for section in sections:
        expected = ctx.sizes.expected_s.get(section.name, 0.0)
        entry: dict = {"title": section.title}
        began = time.perf_counter()
        if expected > ctx.left():
            entry.update(status="skipped", reason=f"time budget: {ctx.left():.0f} s left of {ctx.budget_s:.0f} s, "
                                                   f"the section takes about {expected:.0f} s")
        else:
            ctx.current = section.name
            say(ctx, f"{section.name}: {section.title} ...")
            try:
                entry.update(status="ok", results=section.run(ctx))
            except Skipped as why:
                entry.update(status="skipped", reason=str(why))
            except Exception as err:  # noqa: BLE001 - one broken section must not lose the others
                entry.update(status="error", error=f"{type(err).__name__}: {err}",
                             traceback=traceback.format_exc()[-4000:])
        entry["wall_s"] = time.perf_counter() - began
        ctx.sections[section.name] = entry
        free_device_memory(ctx)
        say(ctx, f"{section.name}: {entry['status']}" + (f" ({entry.get('reason') or entry.get('error')})"
                                                         if entry["status"] != "ok" else ""))
        document["sections"] = ctx.sections
        document["acceptance"] = acceptance(ctx.sections, ctx.device.type == "cuda")
        document["wall_s"] = ctx.elapsed()
        write_json(out, document)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (automatic without CUDA)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default benchmarks/results/gpu.json, gpu_quick.json for a dry run)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock budget in seconds (default 450 on a GPU, 600 in a dry run): a section that "
                             "no longer fits is skipped, with the reason recorded")
    parser.add_argument("--sections", default=None, help=f"a subset, comma-separated, of: "
                                                         f"{', '.join(s.name for s in SECTIONS)}")
    parser.add_argument("--with-compile", action="store_true", help="dry run: also run the compile section")
    args = parser.parse_args(argv)
    dry_run = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry_run:
        say(None, "no CUDA device: running the dry run (tiny sizes on the CPU); its figures are not GPU results")
    out = args.out or RESULTS / ("gpu_quick.json" if dry_run else "gpu.json")
    if dry_run and out.resolve() == (RESULTS / "gpu.json").resolve():
        print("bench-gpu: error: --out: a dry run must not write benchmarks/results/gpu.json (BENCHMARKS.md shows it "
              "as GPU results)", file=sys.stderr)
        return 2
    chosen = SECTIONS
    if args.sections:
        names = args.sections.split(",")
        unknown = [n for n in names if n not in {s.name for s in SECTIONS}]
        if unknown:
            print(f"bench-gpu: error: --sections: unknown {', '.join(unknown)}", file=sys.stderr)
            return 2
        chosen = tuple(s for s in SECTIONS if s.name in names)
    sizes = DRY if dry_run else GPU
    device = torch.device("cpu" if dry_run else "cuda")
    budget = args.budget_s if args.budget_s is not None else (600.0 if dry_run else 450.0)
    if dry_run:
        # One intra-op thread: at these sizes a second one gains nothing, and on shared cores OpenMP threads that
        # spin-wait for a busy core made the dry run's steps several times slower (the tiny plan: 32 s against 4 s).
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="cadence-bench-gpu-") as work:
        ctx = Context(sizes=sizes, device=device, dry_run=dry_run, work=Path(work), budget_s=budget,
                      with_compile=args.with_compile)
        document = {
            "benchmark": "bench-gpu (issue 16)", "dry_run": dry_run, "device": device.type,
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
            "command": "benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "budget_s": budget, "sizes": dataclasses.asdict(sizes),
            "environment": environment(("accelerate", "lightning", "transformers")),
            "libraries": {name: _version(name) for name in ("accelerate", "lightning", "transformers", "pytest",
                                                            "tensorboard", "matplotlib", "numpy")},
            "thresholds": {"speed": SPEED_TARGET, "mfu": MFU_TARGET, "estimate": ESTIMATE_TOLERANCE},
            "sections": {}, "acceptance": [], "wall_s": 0.0,
        }
        say(ctx, f"{'dry run on the CPU' if dry_run else document['gpu']}; budget {budget:.0f} s; writing {out}")
        run_sections(ctx, chosen, document, out)
    say(ctx, f"done in {ctx.elapsed():.0f} s; {out}")
    for item in document["acceptance"]:
        state = {True: "PASS", False: "FAIL", None: "n/a "}[item["passed"]]
        value = item["value"] if not isinstance(item["value"], float) else f"{item['value']:.3f}"
        print(f"  {state} {item['target']}: {value if item['why'] is None else item['why']}", flush=True)
    return 0 if all(entry["status"] != "error" for entry in ctx.sections.values()) else 1


def _version(name: str) -> str | None:
    """An installed distribution's version, None when absent (the GPU machine may lack some of cadence's own)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
