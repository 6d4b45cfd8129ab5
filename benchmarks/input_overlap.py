"""Benchmark (issue 16): input that overlaps compute, on the slow-dataset case of `cadence profile`.

A data-heavy configuration: the windows are cut and collated by ``epoch_windows`` as `cadence train` cuts them, and
each micro-batch then costs ``--delay-ms`` more of waiting (a sleep: a dataset read from slow storage or over the
network, the case tests/profiling/test_profiling.py calls data-bound). Each window is run through ``Engine.step``
under ``StepProfiler`` with the windows prepared by ``prefetch`` at depth 0 (in the loop's own thread, as before
--prefetch-windows), 1 (the default) and 2. Reported per depth: the share of the step spent waiting for data (the
profiler's data_wait phase), tokens/s over whole steps (boundary to boundary, data wait included), the median of a
few rounds; rounds rotate which depth goes first, so a slow moment of the machine hits all of them. The losses of
every depth are compared too: prefetching must change nothing but the time.

Set up so that the data cost is below the compute cost (the case prefetching can hide completely): gpt-tiny on
packed text, seq 128, micro 8 x accum 2, one torch thread (a second intra-op thread only adds noise on a shared
2-core machine), 2 x the delay of data per step.

    .venv/bin/python benchmarks/input_overlap.py [--quick] [--delay-ms 75] [--rounds 5] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from bench_env import environment, write_results

from cadence import Engine, Window, epoch_windows, prefetch
from cadence.data import pack_bytes
from cadence.engine.cut import Cut
from cadence.models import GPT, MODEL_CONFIGS
from cadence.profiling.profiler import ProfileSettings, StepProfiler

DEPTHS = (0, 1, 2)
MODEL, SEQ_LEN, MICRO, ACCUM = "gpt-tiny", 128, 8, 2


def slow(windows: Iterator[Window], seconds_per_micro_batch: float) -> Iterator[Window]:
    """``windows``, each ready only after a wait per micro-batch: a slow dataset, not a slow computer (the sleep
    takes no CPU, so this measures the overlap itself, not two threads sharing cores)."""
    for window in windows:
        time.sleep(seconds_per_micro_batch * len(window))
        yield window


def text(num_bytes: int) -> bytes:
    """Deterministic English-like bytes (the benchmark's own corpus; the content does not matter to the timing)."""
    words = [b"window", b"micro", b"batch", b"overlap", b"prefetch", b"thread", b"token", b"loss", b"step", b"data"]
    out, state = bytearray(), 1
    while len(out) < num_bytes:
        state = (state * 1103515245 + 12345) % 2**31
        out += words[state % len(words)] + b" "
    return bytes(out[:num_bytes])


def profile_once(depth: int, *, delay: float, steps: int, out: Path) -> dict:
    """One profiled run at prefetch ``depth``: 1 wait + 1 warm-up + ``steps`` measured steps; its figures."""
    data = pack_bytes(text(MICRO * ACCUM * (steps + 3) * SEQ_LEN + 1), SEQ_LEN)
    torch.manual_seed(0)
    model = GPT(MODEL_CONFIGS[MODEL])
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
    settings = ProfileSettings(active=steps, tokens_per_step=MICRO * ACCUM * SEQ_LEN)
    windows = slow(epoch_windows(data, cut=Cut(micro_batch_size=MICRO), grad_accum_steps=ACCUM, seed=0, epoch=0), delay)
    losses = []
    with prefetch(windows, depth=depth) as ahead, StepProfiler(engine, out=out, settings=settings) as profiler:
        for window in ahead:
            losses.append(engine.step(window).loss)
            profiler.step()
            if profiler.done:
                break
    result = profiler.result or {}
    return {"data_wait_share": result["phases"]["data_wait"]["share"], "tokens_per_s": result["tokens_per_s"],
            "step_time_s": statistics.median(result["step_times_s"]), "verdict": result["verdict"]["kind"],
            "losses": losses}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps: a smoke run")
    parser.add_argument("--delay-ms", type=float, default=75.0, help="waiting per micro-batch (default 75)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="profiled steps per run (default 6)")
    args = parser.parse_args()
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    runs: dict[int, list[dict]] = {depth: [] for depth in DEPTHS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(rounds):
            order = DEPTHS[round_index % len(DEPTHS):] + DEPTHS[:round_index % len(DEPTHS)]
            for depth in order:
                runs[depth].append(profile_once(depth, delay=args.delay_ms / 1000, steps=steps,
                                                out=Path(scratch) / f"r{round_index}-d{depth}"))
            print(f"round {round_index + 1}/{rounds}: " + ", ".join(
                f"prefetch {d}: data wait {runs[d][-1]['data_wait_share']:.0%}, {runs[d][-1]['tokens_per_s']:,.0f} "
                f"tok/s" for d in DEPTHS), flush=True)
    results = {}
    for depth, done in runs.items():
        results[str(depth)] = {
            "data_wait_share": statistics.median(run["data_wait_share"] for run in done),
            "tokens_per_s": statistics.median(run["tokens_per_s"] for run in done),
            "step_time_s": statistics.median(run["step_time_s"] for run in done),
            "verdicts": [run["verdict"] for run in done],
            "rounds": [{key: run[key] for key in ("data_wait_share", "tokens_per_s", "step_time_s")} for run in done],
            "same_losses_as_depth_0": all(run["losses"] == base["losses"] for run, base in zip(done, runs[0])),
        }
    base = results["0"]["tokens_per_s"]
    for depth, row in results.items():
        row["speedup"] = row["tokens_per_s"] / base
        print(f"prefetch {depth}: data wait {row['data_wait_share']:.1%} of the step, {row['tokens_per_s']:,.0f} "
              f"tok/s ({row['speedup']:.2f}x), same losses: {row['same_losses_as_depth_0']}", flush=True)
    output = {
        "environment": environment(),
        "command": ".venv/bin/python benchmarks/input_overlap.py" + (" --quick" if args.quick else "".join(
            f" --{name.replace('_', '-')} {getattr(args, name):g}" for name in ("delay_ms", "rounds", "steps")
            if getattr(args, name) != parser.get_default(name))),
        "model": MODEL, "seq_len": SEQ_LEN, "micro_batch_size": MICRO, "grad_accum_steps": ACCUM,
        "delay_per_micro_batch_s": args.delay_ms / 1000, "rounds": rounds, "profiled_steps": steps,
        "results": results,
    }
    write_results("input_overlap", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
