"""Benchmark (issue 53 item 7): the adaptive effective batch against a fixed small batch, a fixed large batch and a
preset ramp, on gpt-small over the built-in corpus and a transformers llama over English text (CPU): the optimizer
steps and the tokens each needs to reach a validation loss.

Per model and seed, four runs see the same sequences in the same order (the same ``--max-steps`` windows of the small
batch) under the same schedule (AdamW, linear warm-up over the first ``WARMUP`` windows, then a constant LR), and are
evaluated on the same held-out micro-batches every ``EVAL_WINDOWS`` windows of the small batch (the same tokens for
every run: a fixed batch's --eval-every in its own steps, a changing batch's in windows of the minimum):

- small: a fixed batch of ``SMALL`` at ``LR``;
- large: a fixed batch of ``LARGE`` at ``LR`` x sqrt(LARGE / SMALL) (the square-root rule the other runs apply too);
- ramp: ``--effective-batch-size ramp`` from SMALL to LARGE, doubling at a quarter, a half and three quarters of the
  budget's tokens (OLMo-core's batch size scheduler: a preset, nothing measured);
- adaptive: ``--effective-batch-size adaptive`` from SMALL to LARGE at cadence's default rule, ``--noise-scale-ema
  EMA`` (0.98: about the last 50 windows; these runs are a few hundred windows, the default 0.99 would average
  over most of them).

A seed's target is the loss the fixed small batch ends at (the median of its last 3 evaluations, as one evaluation is
noisy); each run's figures are those of its first evaluation at or below it (None: not reached within the budget).
The issue's target: adaptive reaches it in at least 25% fewer optimizer steps than the fixed small batch with at most
10% more tokens, and in fewer tokens than the fixed large batch.

    .venv/bin/python benchmarks/adaptive_batch.py [--models gpt-small,llama] [--seeds 0,1,2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_env import environment, write_results

SMALL, LARGE, MICRO, SEQ, LR, EMA = 4, 32, 2, 64, 1e-3, 0.98
BUDGET = 512
"""Windows of the small batch per run: 2,048 sequences, 131,072 tokens (on gpt-small the measured critical batch
passes twice the small batch only after about 200 windows: a shorter run leaves nothing to adapt to)."""
WARMUP = 16
EVAL_WINDOWS, EVAL_BATCHES = 32, 16
"""Evaluate every 32 windows of the small batch (128 sequences) on the first 16 held-out micro-batches (2,048
tokens)."""
KINDS = ("small", "large", "ramp", "adaptive")
LLAMA = ("hidden_size=256", "num_hidden_layers=4", "num_attention_heads=4", "intermediate_size=688",
         "vocab_size=256", "max_position_embeddings=512")


def english_text(path: Path) -> Path:
    """Python's own documentation prose (pydoc_data's topics: about 0.8 MB of English), byte-level: the llama's
    text, the same bytes on every machine with this Python."""
    from pydoc_data.topics import topics

    path.write_text("\n\n".join(topics[name] for name in sorted(topics)))
    return path


def model_flags(model: str, text: Path) -> list[str]:
    if model == "llama":
        return ["--model", "hf:llama", *(flag for item in LLAMA for flag in ("--model-config", item)),
                "--data", str(text)]
    return ["--model", model]


def run(model: str, kind: str, seed: int, out: Path, budget: int, text: Path) -> dict[str, Any]:
    """One `cadence train` in a process of its own; its evaluations and figures."""
    common = [*model_flags(model, text), "--seq-len", str(SEQ), "--micro-batch-size", str(MICRO), "--seed", str(seed),
              "--device", "cpu", "--lr-schedule", "constant", "--eval-batches", str(EVAL_BATCHES),
              "--log-every", "100000", "--out", str(out)]
    ramp = ",".join(str(budget * SMALL * SEQ * quarter // 4) for quarter in (1, 2, 3))
    changing = ["--min-effective-batch-size", str(SMALL), "--max-effective-batch-size", str(LARGE),
                "--max-steps", str(budget), "--warmup-steps", str(WARMUP), "--lr", str(LR),
                "--eval-every", str(EVAL_WINDOWS), "--noise-scale-ema", str(EMA)]
    flags = {
        "small": ["--effective-batch-size", str(SMALL), "--max-steps", str(budget), "--warmup-steps", str(WARMUP),
                  "--lr", str(LR), "--eval-every", str(EVAL_WINDOWS), "--noise-scale-ema", str(EMA)],
        "large": ["--effective-batch-size", str(LARGE), "--max-steps", str(budget * SMALL // LARGE),
                  "--warmup-steps", str(WARMUP * SMALL // LARGE), "--lr", str(LR * math.sqrt(LARGE / SMALL)),
                  "--eval-every", str(EVAL_WINDOWS * SMALL // LARGE), "--noise-scale-ema", str(EMA)],
        "ramp": ["--effective-batch-size", "ramp", "--batch-ramp-tokens", ramp, *changing],
        "adaptive": ["--effective-batch-size", "adaptive", *changing],
    }[kind]
    if not (out / "summary.json").exists():  # --work: a run finished by an earlier invocation is read, not rerun
        shutil.rmtree(out, ignore_errors=True)
        # One intra-op thread per run: the two models run side by side on 2 cores, and two 2-thread OpenMP pools
        # spinning against each other (and a text file's data thread) slowed a step 10-40x here.
        result = subprocess.run([sys.executable, "-m", "cadence", "train", *common, *flags], capture_output=True,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            raise SystemExit(result.stderr[-2000:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = tokens = 0
    evaluated = []
    for row in rows:
        samples += row["samples"]
        tokens += row["tokens"]
        if row.get("val_loss") is not None:
            evaluated.append({"step": row["step"], "samples": samples, "tokens": tokens, "val_loss": row["val_loss"]})
    summary = json.loads((out / "summary.json").read_text())
    return {"model": model, "kind": kind, "seed": seed, "steps": rows[-1]["step"], "tokens": tokens,
            # the run's own wall time (summary.json): a run reused from --work keeps the time it took then
            "evaluations": evaluated, "wall_s": round(float(summary.get("wall_time_s", 0.0)), 1),
            "batches": [row.get("effective_batch", row["samples"]) for row in rows],
            "noise_scale": [row.get("grad_noise_scale") for row in rows],
            "switches": summary.get("adaptive_batch", {}).get("switches", [])}


def reach(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seed's target (the median of the fixed small batch's last 3 evaluations) and, per run, its first
    evaluation at or below it (None: not reached). BENCHMARKS.md's section computes the same from the evaluations."""
    small = next(run for run in runs if run["kind"] == "small")
    target = statistics.median(point["val_loss"] for point in small["evaluations"][-3:])
    reached: dict[str, dict[str, int] | None] = {}
    for run in runs:
        first = next((point for point in run["evaluations"] if point["val_loss"] <= target), None)
        reached[run["kind"]] = None if first is None else {"step": first["step"], "tokens": first["tokens"]}
    return {"target": target, "reached": reached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,llama")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--quick", action="store_true", help="one seed, an eighth of the budget (never reported)")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the runs in this directory and reuse the finished ones (an interrupted benchmark "
                             "goes on where it stopped); default: a temporary directory")
    args = parser.parse_args()
    models = args.models.split(",")
    seeds = [0] if args.quick else [int(seed) for seed in args.seeds.split(",")]
    budget = BUDGET // 8 if args.quick else BUDGET
    load = [os.getloadavg()]
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.work or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        text = english_text(Path(tmp) / "english.txt")

        def one_model(model: str) -> list[dict[str, Any]]:
            done = []
            for seed in seeds:
                runs = [run(model, kind, seed, Path(tmp) / f"{model}-{kind}-{seed}", budget, text) for kind in KINDS]
                load.append(os.getloadavg())
                done.append({"model": model, "seed": seed, "runs": runs, **reach(runs)})
                print(json.dumps({"model": model, "seed": seed, **reach(runs),
                                  "wall_s": [r["wall_s"] for r in runs]}), flush=True)
            return done

        # The models side by side, a process each at a time (one run's steps are too small to keep 2 cores busy);
        # the figures are steps and tokens, which the load does not change.
        with ThreadPoolExecutor(max_workers=len(models)) as pool:
            for done in pool.map(one_model, models):
                results.extend(done)
    # With --work, runs reused from earlier invocations ran under loads this one did not see.
    output = {"environment": environment(), "load_average": load, "work_dir_reused": args.work is not None,
              "settings": {"small": SMALL, "large": LARGE, "micro": MICRO, "seq_len": SEQ, "lr": LR, "ema": EMA,
                           "budget_windows": budget, "warmup_windows": WARMUP, "eval_windows": EVAL_WINDOWS,
                           "eval_batches": EVAL_BATCHES, "models": models, "llama": list(LLAMA),
                           "ramp_fractions": [0.25, 0.5, 0.75]},
              "results": results}
    write_results("adaptive_batch", output, quick=args.quick)


if __name__ == "__main__":
    main()
