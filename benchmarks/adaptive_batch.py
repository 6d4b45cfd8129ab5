"""Benchmark (issue 53 item 7): --effective-batch-size adaptive against a fixed small and a fixed large batch, on
gpt-tiny over the built-in corpus (CPU): the optimizer steps and the tokens each needs to reach a validation loss.

Every run trains on the same examples in the same order (the built-in corpus, sequences of 32 bytes) for the same
number of examples (``BUDGET`` windows of the small batch), AdamW at --lr 2e-3 for the small batch, cosine decay, and
evaluates the same held-out batches every ``EVAL_SEQUENCES`` sequences. The large batch is 8 times the small one at
--lr x sqrt(8) (the square-root rule adaptive applies too); adaptive goes from the small batch to the large one
at --noise-scale-ema 0.9 and at 0.97 (these runs are a few hundred windows, the default 0.99 would average over
most of them). The
target loss of a seed is the one the fixed small batch ends at (the median of its last 4 evaluations); for each run,
the first evaluation at or below it gives the steps and tokens (or none: not reached). A preset ramp (OLMo-core style) is not run: cadence
has no preset ramp to run.

    .venv/bin/python benchmarks/adaptive_batch.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_env import environment, write_results

SMALL, LARGE, MICRO, SEQ, LR = 4, 32, 2, 32, 2e-3
BUDGET = 256
"""Windows of the small batch per run: 1,024 sequences, 32,768 tokens."""
ADAPTIVE = {"adaptive": 0.9, "adaptive-0.97": 0.97}
"""The adaptive runs and their --noise-scale-ema: 0.9 follows the estimate closely, 0.97 averages about 33 windows."""
EVAL_SEQUENCES = 32
"""Evaluate every 32 training sequences (8 small steps, 1 large one)."""


def run(kind: str, seed: int, out: Path, budget: int) -> dict[str, Any]:
    """One `cadence train` in a process of its own; its metrics rows with a validation loss, and its figures."""
    common = ["--seq-len", str(SEQ), "--micro-batch-size", str(MICRO), "--seed", str(seed), "--device", "cpu",
              "--eval-batches", "8", "--log-every", "100000", "--out", str(out)]
    if kind == "small":
        flags = ["--effective-batch-size", str(SMALL), "--max-steps", str(budget), "--lr", str(LR),
                 "--eval-every", str(EVAL_SEQUENCES // SMALL)]
    elif kind == "large":
        flags = ["--effective-batch-size", str(LARGE), "--max-steps", str(budget * SMALL // LARGE),
                 "--lr", str(LR * math.sqrt(LARGE / SMALL)), "--eval-every", "1"]
    else:
        # Adaptive evaluates every step: at the small batch that is every 4 sequences, thinned below to match.
        flags = ["--effective-batch-size", "adaptive", "--min-effective-batch-size", str(SMALL),
                 "--max-effective-batch-size", str(LARGE), "--max-steps", str(budget), "--lr", str(LR),
                 "--noise-scale-ema", str(ADAPTIVE[kind]), "--eval-every", "1"]
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "cadence", "train", *common, *flags], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = tokens = 0
    evaluated = []
    for row in rows:
        samples += row["samples"]
        tokens += row["tokens"]
        if row.get("val_loss") is not None:
            evaluated.append({"step": row["step"], "samples": samples, "tokens": tokens, "val_loss": row["val_loss"],
                              "effective_batch": row.get("effective_batch", row["samples"])})
    summary = json.loads((out / "summary.json").read_text())
    return {"kind": kind, "seed": seed, "steps": rows[-1]["step"], "tokens": tokens, "evaluations": evaluated,
            "wall_s": time.perf_counter() - started,
            "batches": [row.get("effective_batch", row["samples"]) for row in rows],
            "switches": summary.get("adaptive_batch", {}).get("switches", [])}


def reach(runs: list[dict[str, Any]], eval_sequences: int = EVAL_SEQUENCES) -> dict[str, Any]:
    """The seed's target, the loss the fixed small batch ends at (the median of its last 4 evaluations, as one is
    noisy), and per run the first evaluation at or below it on a grid of ``eval_sequences`` sequences for every run
    (None: not reached within the budget). BENCHMARKS.md's section computes it from the recorded evaluations."""
    def grid(run: dict[str, Any]) -> list[dict[str, Any]]:
        return [point for point in run["evaluations"] if point["samples"] % eval_sequences == 0]

    small = next(run for run in runs if run["kind"] == "small")
    target = statistics.median(point["val_loss"] for point in grid(small)[-4:])
    reached: dict[str, dict[str, int] | None] = {}
    for run in runs:
        first = next((point for point in grid(run) if point["val_loss"] <= target), None)
        reached[run["kind"]] = None if first is None else {"step": first["step"], "tokens": first["tokens"]}
    return {"target": target, "reached": reached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, a quarter of the budget (never reported)")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    budget = BUDGET // 4 if args.quick else BUDGET
    load = os.getloadavg()
    per_seed = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            runs = [run(kind, seed, Path(tmp) / f"{kind}-{seed}", budget) for kind in ("small", "large", *ADAPTIVE)]
            per_seed.append({"seed": seed, "runs": runs, **reach(runs)})
            print(json.dumps({"seed": seed, **reach(runs)}), flush=True)
    output = {"environment": environment(), "load_average": [load, os.getloadavg()],
              "settings": {"small": SMALL, "large": LARGE, "micro": MICRO, "seq_len": SEQ, "lr": LR,
                           "budget_windows": budget, "eval_sequences": EVAL_SEQUENCES, "model": "gpt-tiny",
              "adaptive_ema": ADAPTIVE},
              "seeds": per_seed}
    write_results("adaptive_batch", output, quick=args.quick)


if __name__ == "__main__":
    main()
