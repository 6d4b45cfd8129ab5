"""Benchmark (issue 26 items 2 and 3): what --optimizer-state and --lora-rank save, what they cost, and whether the
memory estimate predicts them.

1. `cadence train --model gpt-small --seq-len 64 --micro-batch-size 8 --max-steps 200 --warmup-steps 20 --lr 1e-3`
   on the built-in corpus with --optimizer-state fp32, bf16 and 8bit: the optimizer state's bytes
   (summary.json's `optimizer_state_bytes`), the measured peak (`peak_memory_bytes`: the profiler's allocation replay
   of window 2 on CPU) against the estimate (`estimate_step_memory(..., optimizer=OptimizerSpec(state=...))`), tokens/s, and the
   loss: the mean of the last 20 steps against fp32's (the same data, the same seed: only the state's precision
   differs).
2. `cadence train --model hf:llama` (width 256, 4 layers, byte vocabulary) trained whole, with --lora-rank 8, and with
   --lora-rank 8 --precision bf16 --lora-base-precision bf16: trained and frozen parameters, the state's bytes, the
   measured peak against the estimate (`estimate_hf_step_memory(..., lora=...)`), tokens/s.

    .venv/bin/python benchmarks/optimizer_state.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_env import environment, write_results

from cadence.cli import main as cadence
from cadence.config import TrainConfig
from cadence.memory.estimate import estimate_step_memory
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.models import MODEL_CONFIGS
from cadence.models.lora import lora_shape
from cadence.models.spec import ModelSpec
from cadence.optim.spec import OptimizerSpec
from cadence.training.run_dir import read_metrics

LLAMA = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 688,
         "vocab_size": 256, "max_position_embeddings": 512}
QUICK_LLAMA = {**LLAMA, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 176}
LAST = 20
"""The final loss is the mean of the last this many steps (one step's loss is one window's: noisy)."""


def train(out: Path, *flags: str) -> tuple[dict, list[dict], float]:
    started = time.perf_counter()
    assert cadence(["train", *flags, "--val-fraction", "0", "--log-every", "50", "--out", str(out)]) == 0
    return json.loads((out / "summary.json").read_text()), read_metrics(out), time.perf_counter() - started


def optimizer_states(root: Path, *, steps: int, model: str) -> dict:
    shape = {"seq_len": 64, "micro_batch_size": 8}
    common = ["--model", model, "--seq-len", str(shape["seq_len"]), "--micro-batch-size",
              str(shape["micro_batch_size"]), "--max-steps", str(steps), "--warmup-steps", str(steps // 10),
              "--lr", "1e-3"]
    runs = {}
    for state in ("fp32", "bf16", "8bit"):
        summary, rows, wall = train(root / f"state-{state}", *common, "--optimizer-state", state)
        estimate = estimate_step_memory(MODEL_CONFIGS[model], precision="fp32", checkpointing="none",
                                        optimizer=OptimizerSpec(state=state), **shape)
        losses = [row["loss"] for row in rows]
        runs[state] = {
            "optimizer_state_bytes": summary["optimizer_state_bytes"], "peak_memory_bytes": summary["peak_memory_bytes"],
            "estimated_peak_bytes": estimate.peak_bytes,
            "estimate_error": (estimate.peak_bytes - summary["peak_memory_bytes"]) / summary["peak_memory_bytes"],
            "estimated_state_bytes": estimate.by_category["optimizer_state"], "tokens_per_s": summary["tokens_per_s"],
            "wall_s": wall, "final_loss": statistics.mean(losses[-LAST:]), "first_loss": losses[0], "losses": losses,
        }
        print(f"{state}: state {summary['optimizer_state_bytes'] / 2**20:.1f} MiB, peak "
              f"{summary['peak_memory_bytes'] / 2**20:.1f} MiB (estimate {runs[state]['estimate_error']:+.1%}), "
              f"loss {runs[state]['final_loss']:.4f}, {summary['tokens_per_s']:.0f} tok/s", flush=True)
    for run in runs.values():
        run["state_vs_fp32"] = run["optimizer_state_bytes"] / runs["fp32"]["optimizer_state_bytes"]
        run["loss_vs_fp32"] = (run["final_loss"] - runs["fp32"]["final_loss"]) / runs["fp32"]["final_loss"]
        run["max_step_loss_difference"] = max(abs(a - b) / b for a, b in zip(run["losses"], runs["fp32"]["losses"],
                                                                           strict=True))
    return {"model": model, "steps": steps, "last_steps_averaged": LAST, **shape, "runs": runs}


def lora(root: Path, *, steps: int, sizes: dict) -> dict:
    model = ["--model", "hf:llama", *[item for key, value in sizes.items() for item in ("--model-config",
                                                                                        f"{key}={value}")]]
    shape = {"seq_len": 128, "micro_batch_size": 4}
    common = [*model, "--seq-len", str(shape["seq_len"]), "--micro-batch-size", str(shape["micro_batch_size"]),
              "--max-steps", str(steps), "--lr", "1e-3"]
    variants = {"full": [], "lora-8": ["--lora-rank", "8"],
                "lora-8-bf16-base": ["--lora-rank", "8", "--precision", "bf16", "--lora-base-precision", "bf16"]}
    runs = {}
    for name, flags in variants.items():
        summary, _, wall = train(root / name, *common, *flags)
        config = TrainConfig(model="hf:llama", model_config=[f"{k}={v}" for k, v in sizes.items()],
                             lora_rank=8 if flags else 0, precision="bf16" if "bf16" in flags else "fp32",
                             lora_base_precision="bf16" if "bf16" in flags else "fp32")
        built = ModelSpec.from_flags(config).build(seed=config.seed, precision=config.precision,
                                                   base_precision=config.lora_base_precision)
        estimate = estimate_hf_step_memory(ModelSpec.from_flags(config).shape, style="llama",
                                           precision=config.precision, checkpointing="none",
                                           lora=lora_shape(built.module),
                                           **shape)
        runs[name] = {
            "trainable_parameters": summary["trainable_parameters"], "frozen_parameters": summary["frozen_parameters"],
            "optimizer_state_bytes": summary["optimizer_state_bytes"], "peak_memory_bytes": summary["peak_memory_bytes"],
            "estimated_peak_bytes": estimate.peak_bytes,
            "estimate_error": (estimate.peak_bytes - summary["peak_memory_bytes"]) / summary["peak_memory_bytes"],
            "tokens_per_s": summary["tokens_per_s"], "wall_s": wall,
        }
        print(f"{name}: {summary['trainable_parameters']:,} trained, peak {summary['peak_memory_bytes'] / 2**20:.1f} "
              f"MiB (estimate {runs[name]['estimate_error']:+.1%}), {summary['tokens_per_s']:.0f} tok/s", flush=True)
    for run in runs.values():
        run["peak_vs_full"] = run["peak_memory_bytes"] / runs["full"]["peak_memory_bytes"]
    return {"llama_config": sizes, "steps": steps, **shape, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny for 20 steps, a width-64 llama: a smoke run")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        states = optimizer_states(root, steps=20 if args.quick else 200, model="gpt-tiny" if args.quick else "gpt-small")
        adapters = lora(root, steps=4 if args.quick else 10, sizes=QUICK_LLAMA if args.quick else LLAMA)
    output = {
        "environment": environment(("transformers", "peft", "bitsandbytes")),
        "command": ".venv/bin/python benchmarks/optimizer_state.py" + (" --quick" if args.quick else ""),
        "torch_threads": torch.get_num_threads(), "wall_s": time.perf_counter() - started,
        "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0],
        "optimizer_state": states, "lora": adapters,
    }
    write_results("optimizer_state", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
