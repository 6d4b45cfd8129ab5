"""Benchmark: memory flatness over accumulation, the cost of recompute and offload, and MFU.

1. Peak memory vs accumulation steps {1, 2, 4, 8, 16, 32} at a fixed micro-batch, beside the one-big-batch
   alternative (micro-batch = micro x accum, no accumulation) that holds the same samples per optimizer step.
2. Throughput and peak memory of each recompute x offload mode at a fixed configuration.
3. MFU: achieved model FLOP/s (PaLM appendix-B FLOPs per token x tokens/s) against the measured peak matmul FLOP/s
   of this machine, for gpt-small and gpt-base, fp32 and bf16.

Writes benchmarks/results/memory_and_modes.json and benchmarks/results/memory_flatness.png, prints markdown tables.

    .venv/bin/python benchmarks/memory_and_modes.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
from bench_env import environment

from cadence.config import TrainConfig
from cadence.data import iterate_micro_batches, load_data
from cadence.engine.choices import PrecisionName
from cadence.engine.step import Engine
from cadence.engine.windows import iter_windows
from cadence.memory.choices import CheckpointingMode, OffloadMode
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models import MODEL_CONFIGS, build_model
from cadence.profiling.flops import measured_peak_flops, model_flops_per_token
from cadence.training.components import build_optimizer

RESULTS = Path(__file__).parent / "results"


def run(model_name: str, *, micro: int, accum: int, seq_len: int, precision: PrecisionName = "fp32",
        recompute: CheckpointingMode = "none", offload: OffloadMode = "none", steps: int = 3, data=None) -> dict:
    """Step 1 warm-up, step 2 measured for memory, steps 3.. timed (median tokens/s)."""
    data = data or load_data(None, seq_len, 0.0, max_corpus_bytes=4_000_000)
    torch.manual_seed(0)
    model = build_model(model_name)
    apply_activation_checkpointing(model, recompute)
    config = TrainConfig(offload=offload)
    engine = Engine(model, build_optimizer(model, config), precision=precision, max_grad_norm=1.0,
                    offload_activations=offload == "activations")
    windows = iter_windows(iterate_micro_batches(data.train, micro, 0, 0), accum)
    peak, rates = None, []
    for number, window in zip(range(steps + 2), windows):
        result = engine.step(window, measure_memory=number == 1)
        if number == 1:
            peak = result.peak_memory_bytes
        elif number >= 2:
            rates.append(result.tokens_per_s)
    return {"peak_bytes": peak, "tokens_per_s": statistics.median(rates)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no gpt-base")
    args = parser.parse_args()
    steps = 2 if args.quick else 4
    mib = 2**20
    data = load_data(None, 256, 0.0, max_corpus_bytes=4_000_000)

    flat = []
    for accum in (1, 2, 4, 8, 16, 32):
        accumulated = run("gpt-tiny", micro=4, accum=accum, seq_len=256, steps=1, data=data)
        big = run("gpt-tiny", micro=4 * accum, accum=1, seq_len=256, steps=1, data=data)
        flat.append({"accum": accum, "accumulated_peak_bytes": accumulated["peak_bytes"],
                     "one_big_batch_peak_bytes": big["peak_bytes"]})
        print(f"accum {accum}: {accumulated['peak_bytes'] / mib:.1f} MiB vs one big batch "
              f"{big['peak_bytes'] / mib:.1f} MiB", flush=True)

    modes = []
    recomputes: tuple[CheckpointingMode, ...] = ("none", "selective", "full")
    offloads: tuple[OffloadMode, ...] = ("none", "activations", "optimizer")
    for recompute in recomputes:
        for offload in offloads:
            measured = run("gpt-small", micro=4, accum=2, seq_len=256, recompute=recompute, offload=offload,
                           steps=steps, data=data)
            modes.append({"recompute": recompute, "offload": offload, **measured})
            print(f"recompute {recompute}, offload {offload}: {measured['tokens_per_s']:,.0f} tokens/s, "
                  f"{measured['peak_bytes'] / mib:.1f} MiB", flush=True)

    mfu = []
    for model_name in ("gpt-small",) if args.quick else ("gpt-small", "gpt-base"):
        precisions: tuple[PrecisionName, ...] = ("fp32", "bf16")
        for precision in precisions:
            micro = 4 if model_name == "gpt-small" else 1
            measured = run(model_name, micro=micro, accum=2, seq_len=256, precision=precision, steps=steps, data=data)
            peak, source = measured_peak_flops(precision, torch.device("cpu"))
            achieved = measured["tokens_per_s"] * model_flops_per_token(MODEL_CONFIGS[model_name], 256)
            mfu.append({"model": model_name, "precision": precision, "tokens_per_s": measured["tokens_per_s"],
                        "achieved_flops": achieved, "peak_flops": peak, "peak_source": source,
                        "mfu": achieved / peak})
            print(f"{model_name} {precision}: MFU {achieved / peak:.1%} ({achieved / 1e9:.1f} of "
                  f"{peak / 1e9:.1f} GFLOP/s)", flush=True)

    RESULTS.mkdir(exist_ok=True)
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
              "environment": environment(), "quick": args.quick, "timed_steps": steps, "flatness": flat, "modes": modes,
              "mfu": mfu}
    (RESULTS / "memory_and_modes.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(flat, RESULTS / "memory_flatness.png")
    print("\n| accumulation | peak, micro 4 x accum | peak, one batch of 4 x accum |\n|---|---|---|")
    for row in flat:
        print(f"| {row['accum']} | {row['accumulated_peak_bytes'] / mib:.1f} MiB | "
              f"{row['one_big_batch_peak_bytes'] / mib:.1f} MiB |")
    print("\n| recompute | offload | tokens/s | peak |\n|---|---|---|---|")
    for row in modes:
        print(f"| {row['recompute']} | {row['offload']} | {row['tokens_per_s']:,.0f} | {row['peak_bytes'] / mib:.1f} MiB |")
    print("\n| model | precision | tokens/s | achieved GFLOP/s | peak GFLOP/s | MFU |\n|---|---|---|---|---|---|")
    for row in mfu:
        print(f"| {row['model']} | {row['precision']} | {row['tokens_per_s']:,.0f} | {row['achieved_flops'] / 1e9:.1f} "
              f"| {row['peak_flops'] / 1e9:.1f} | {row['mfu']:.1%} |")
    return 0


def _plot(flat: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 3.6))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    accums = [row["accum"] for row in flat]
    axes.plot(accums, [row["accumulated_peak_bytes"] / 2**20 for row in flat], marker="o",
              label="micro-batch 4 x accumulation")
    axes.plot(accums, [row["one_big_batch_peak_bytes"] / 2**20 for row in flat], marker="s",
              label="one batch of the same samples")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("sequences per optimizer step / 4")
    axes.set_ylabel("peak memory (MiB)")
    axes.set_title("gpt-tiny, seq 256: accumulation keeps peak memory flat")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
