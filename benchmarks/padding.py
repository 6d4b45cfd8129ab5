"""Benchmark (issue 15): real tokens/s of length-aware micro-batches against the padded baseline, paired in one process.

The same windows (the epoch's permutation, micro 8 x accum 4) cut four ways: in drawn order (the baseline), sorted by
length (``--micro-batch-order by-length``), by a token budget of micro x seq-len positions (``--micro-batch-tokens``,
the baseline's worst case, so its memory peak is never above the baseline's), and packed (``--packing``: rows of
seq-len tokens, 8 rows per micro-batch, document-masked attention). Each mode
keeps its own model (same seed); rounds alternate the modes, so a slow moment of the machine hits all of them.
Reports the median real tokens/s per mode and its ratio to the baseline, the share of computed positions that are
real tokens, the loss of every step (equal across modes up to float summation order) and the measured peak memory.

Data: prompt/completion examples with a wide spread of lengths, cut from the standard library's source: prompt
20-200 bytes, completion 20-700 bytes (mean about 470 bytes, truncated at the sequence length), like the issue's.
gpt-small's context is 512, so the sequence length is 512, not the issue's 1024.

    .venv/bin/python benchmarks/padding.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sysconfig
from pathlib import Path

import torch
from bench_env import environment

from cadence.config import TrainConfig
from cadence.data import TokenDataset, make_example
from cadence.engine.step import Engine
from cadence.engine.windows import epoch_windows
from cadence.models import build_model
from cadence.training.components import build_optimizer

RESULTS = Path(__file__).parent / "results"
MODES = {"drawn": ("drawn", None, False), "by-length": ("by-length", None, False),
         "token budget": ("by-length", "budget", False), "packing": ("drawn", None, True)}


def dataset(count: int, seq_len: int, seed: int = 15) -> TokenDataset:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    source = b"\n".join(path.read_bytes() for path in files)
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        prompt_len, completion_len = rng.randint(20, 200), rng.randint(20, 700)
        at = rng.randrange(0, len(source) - prompt_len - completion_len)
        tokens = source[at:at + prompt_len + completion_len][:seq_len + 1]
        labels = [tokens[i + 1] if i + 1 >= prompt_len else -100 for i in range(len(tokens) - 1)]
        examples.append(make_example(tokens[:-1], labels))
    return TokenDataset(examples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, seq 256, 2 rounds: a smoke run")
    args = parser.parse_args()
    model_name, seq_len, rounds, steps = ("gpt-tiny", 256, 2, 1) if args.quick else ("gpt-small", 512, 3, 2)
    micro, accum = 8, 4
    data = dataset(micro * accum * (rounds * steps + 2) * 2, seq_len)
    results: dict[str, dict] = {}
    for precision in ("fp32", "bf16"):
        runs = {}
        for mode, (order, budget, packing) in MODES.items():
            torch.manual_seed(0)
            model = build_model(model_name)
            engine = Engine(model, build_optimizer(model, TrainConfig(lr=1e-3)), precision=precision, max_grad_norm=1.0)
            windows = epoch_windows(data, micro_batch_size=micro, grad_accum_steps=accum, seed=0, epoch=0,
                                    order=order, micro_batch_tokens=micro * seq_len if budget else None,
                                    pack_length=seq_len if packing else None)
            runs[mode] = {"engine": engine, "windows": windows, "losses": [], "rates": [], "tokens": 0, "padded": 0}
            # Step 1 warms up; step 2 measures the peak memory (the profiler slows it: not timed).
            for number in range(2):
                result = engine.step(next(windows), measure_memory=number == 1)
                runs[mode]["losses"].append(result.loss)
                if number == 1:
                    runs[mode]["peak_bytes"] = result.peak_memory_bytes
        for round_index in range(rounds):
            names = list(MODES)
            names = names[round_index % len(names):] + names[:round_index % len(names)]  # rotate who goes first
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
            print(f"{precision} round {round_index + 1}/{rounds}: " + ", ".join(
                f"{mode} {runs[mode]['rates'][-1]:,.0f} tok/s" for mode in MODES), flush=True)
        base = statistics.median(runs["drawn"]["rates"])
        results[precision] = {mode: {
            "tokens_per_s": statistics.median(run["rates"]),
            "ratio": statistics.median(run["rates"]) / base,
            "real_share": run["tokens"] / (run["tokens"] + run["padded"]),
            "peak_bytes": run["peak_bytes"],
            "losses": run["losses"],
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
        "rounds": rounds, "steps_per_round": steps, "examples": len(data),
        "results": results,
    }
    RESULTS.mkdir(exist_ok=True)
    name = "padding_quick.json" if args.quick else "padding.json"
    (RESULTS / name).write_text(json.dumps(output, indent=1))
    print(f"wrote {RESULTS / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
