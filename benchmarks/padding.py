"""Benchmark (issue 15): real tokens/s of length-aware micro-batches against the padded baseline, paired in one process.

The same windows (the epoch's permutation, micro 8 x accum 4) cut four ways: in drawn order (the baseline), sorted by
length (``--micro-batch-order by-length``), by a token budget (``--micro-batch-tokens``) and packed (``--packing``:
rows of seq-len tokens, document-masked attention, cut by the same token budget). The budget is micro x the longest
example the data holds: the baseline's own worst case, so neither mode's memory peak can rise above the baseline's.
Each mode keeps its own model (same seed); rounds alternate the modes, so a slow moment of the machine hits all of
them. Reports the median real tokens/s per mode and its ratio to the baseline, the share of computed positions that
are real tokens, the loss of every step (equal across modes up to float summation order) and the measured peak memory.

Data: prompt/completion examples with the issue's spread of lengths, cut from the standard library's source: total
length drawn from a gamma distribution (shape 2, scale 222 bytes) clipped to 24-930, mean about 425, the prompt its
first 10-200 bytes. At micro 8 x accum 4 that gives the issue's real-token shares: about 0.52 in drawn order, 0.81
sorted. The model is gpt-small with a position table of 1024 (its built-in context is 512), for the issue's seq 1024.

    .venv/bin/python benchmarks/padding.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from bench_env import cpu_bf16, environment, write_results

from cadence.config import TrainConfig
from cadence.data import TokenDataset, make_example
from cadence.engine.cut import Cut
from cadence.engine.step import Engine
from cadence.engine.windows import Window, epoch_windows
from cadence.models import GPT, MODEL_CONFIGS
from cadence.training.components import build_optimizer

MODES = {"drawn": ("drawn", False, False), "by-length": ("by-length", False, False),
         "token budget": ("by-length", True, False), "packing": ("drawn", True, True)}
LONGEST = 930
"""Longest example (bytes, the prompt included), as in the issue's data."""


def dataset(count: int, seq_len: int, seed: int = 15) -> TokenDataset:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    source = b"\n".join(path.read_bytes() for path in files)
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        # Each example's input is one token shorter than its text (the last byte is only a target).
        total = min(LONGEST, seq_len, max(24, int(rng.gammavariate(2.0, 222.0)))) + 1
        prompt_len = rng.randint(10, min(200, total // 2))
        at = rng.randrange(0, len(source) - total)
        tokens = source[at:at + total]
        labels = [tokens[i + 1] if i + 1 >= prompt_len else -100 for i in range(len(tokens) - 1)]
        examples.append(make_example(tokens[:-1], labels))
    return TokenDataset(examples)


def warmed_up(engine: Engine, windows: Iterator[Window]) -> dict:
    """A mode's record, after its first two steps: step 1 warms up, step 2 measures the peak memory (the profiler
    slows it: not timed)."""
    run: dict = {"engine": engine, "windows": windows, "losses": [], "rates": [], "tokens": 0, "padded": 0}
    for number in range(2):
        result = engine.step(next(windows), measure_memory=number == 1)
        run["losses"].append(result.loss)
        if number == 1:
            run["peak_bytes"] = result.peak_memory_bytes
    return run


def alternating_rounds(runs: dict[str, dict], rounds: int, steps: int, *, label: str = "") -> None:
    """Time every mode of ``runs`` in ``rounds`` rounds of ``steps`` steps, who goes first rotating from round to
    round, so that a slow moment of the machine falls on all of them; each round's real tokens/s is appended."""
    for round_index in range(rounds):
        names = list(runs)
        names = names[round_index % len(names):] + names[:round_index % len(names)]
        for mode in names:
            run = runs[mode]
            tokens, seconds = 0, 0.0
            for _ in range(steps):
                result = run["engine"].step(next(run["windows"]))
                run["losses"].append(result.loss)
                tokens += result.tokens
                seconds += result.step_time_s
                run["tokens"] += result.tokens
                run["padded"] += result.padded_positions
            run["rates"].append(tokens / seconds)
        print(f"{label}round {round_index + 1}/{rounds}: " + ", ".join(
            f"{mode} {runs[mode]['rates'][-1]:,.0f} tok/s" for mode in runs), flush=True)


def build(model_name: str, seq_len: int) -> GPT:
    """The built-in model's shape with a position table of at least ``seq_len``."""
    config = MODEL_CONFIGS[model_name]
    return GPT(dataclasses.replace(config, context_length=max(seq_len, config.context_length)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, seq 256, 2 rounds: a smoke run")
    args = parser.parse_args()
    model_name, seq_len = ("gpt-tiny", 256) if args.quick else ("gpt-small", 1024)
    # (rounds, timed steps per round) per precision.
    schedule = {"fp32": (2, 1), "bf16": (2, 1)} if args.quick else {"fp32": (3, 2), "bf16": (3, 2)}
    skipped = {}
    if not torch.cuda.is_available() and cpu_bf16() == "emulated" and not args.quick:
        # Without bf16 instructions a bf16 matmul runs at about a tenth of fp32's speed here: one step of gpt-small
        # at seq 1024 would take minutes, and the timing would measure the emulation, not the cut.
        del schedule["bf16"]
        skipped["bf16"] = "this CPU has no bf16 instructions (avx512_bf16 / amx_bf16): bf16 is emulated"
        print(f"bf16 skipped: {skipped['bf16']}", flush=True)
    micro, accum = 8, 4
    data = dataset(micro * accum * (max(r * s for r, s in schedule.values()) + 2) * 2, seq_len)
    budget = micro * max(len(example.input_ids) for example in data)
    results: dict[str, dict] = {}
    for precision, (rounds, steps) in schedule.items():
        runs = {}
        for mode, (order, budgeted, packing) in MODES.items():
            torch.manual_seed(0)
            model = build(model_name, seq_len)
            engine = Engine(model, build_optimizer(model, TrainConfig(lr=1e-3)), precision=precision, max_grad_norm=1.0)
            windows = epoch_windows(data,
                                    cut=Cut(micro_batch_size=micro, order=order,
                                            micro_batch_tokens=budget if budgeted else None,
                                            pack_length=seq_len if packing else None),
                                    grad_accum_steps=accum, seed=0, epoch=0)
            runs[mode] = warmed_up(engine, windows)
        alternating_rounds(runs, rounds, steps, label=f"{precision} ")
        base = statistics.median(runs["drawn"]["rates"])
        results[precision] = {mode: {
            "tokens_per_s": statistics.median(run["rates"]),
            "ratio": statistics.median(run["rates"]) / base,
            "real_share": run["tokens"] / (run["tokens"] + run["padded"]),
            "peak_bytes": run["peak_bytes"],
            "losses": run["losses"],
            "rounds": rounds, "steps_per_round": steps,
            "max_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], runs["drawn"]["losses"])),
        } for mode, run in runs.items()}
        for mode, row in results[precision].items():
            print(f"{precision} {mode}: {row['tokens_per_s']:,.0f} tok/s ({row['ratio']:.2f}x), real share "
                  f"{row['real_share']:.2f}, peak {row['peak_bytes'] / 2**20:.1f} MiB, max loss difference "
                  f"{row['max_loss_difference']:.1e}", flush=True)
    output = {
        "environment": environment(),
        "command": ".venv/bin/python benchmarks/padding.py" + (" --quick" if args.quick else ""),
        "model": model_name, "seq_len": seq_len, "micro_batch_size": micro, "grad_accum_steps": accum,
        "micro_batch_tokens": budget, "mean_length": statistics.fmean(len(e.input_ids) for e in data),
        "schedule": {precision: {"rounds": r, "steps_per_round": s} for precision, (r, s) in schedule.items()},
        "examples": len(data), "skipped": skipped,
        "results": results,
    }
    write_results("padding", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
