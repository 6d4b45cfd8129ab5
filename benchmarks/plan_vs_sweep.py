"""Benchmark: does `cadence plan` pick (nearly) the best configuration an exhaustive sweep would find?

Runs the plan as a user would (default trial budget), then an exhaustive sweep (every candidate measured, same
machine, right after), and reports: the plan's wall time, its choice and measured peak against the budget, and the
throughput of the plan's choice as measured IN THE SWEEP against the sweep's best feasible candidate (same
conditions for both numbers). Writes benchmarks/results/plan_vs_sweep.json and prints a markdown block for
BENCHMARKS.md.

    .venv/bin/python benchmarks/plan_vs_sweep.py [--budget 64MiB] [--effective-batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_env import environment

from cadence.config import TrainConfig
from cadence.plan.planner import PlanOptions, make_plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="64MiB")
    parser.add_argument("--effective-batch-size", type=int, default=32)
    parser.add_argument("--model", default="gpt-tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = TrainConfig(model=args.model, effective_batch_size=args.effective_batch_size,
                           memory_budget=args.budget, micro_batch_size=1)
        started = time.perf_counter()
        plan = make_plan(TrainConfig(**{**base.__dict__, "out": Path(tmp) / "plan"}), PlanOptions(), constrained=set())
        plan_seconds = time.perf_counter() - started
        # Exhaustive: every candidate measured (no estimate trusted, none skipped), whatever the time it takes.
        sweep = make_plan(TrainConfig(**{**base.__dict__, "out": Path(tmp) / "sweep"}),
                          PlanOptions(max_trials=0, time_budget=7200.0), constrained=set())
    key = ("micro_batch_size", "precision", "activation_checkpointing", "offload")
    pick = tuple(plan["choice"][k] for k in key)
    chosen_in_plan = next(c for c in plan["candidates"] if c["id"] == plan["choice"]["id"])
    feasible = [c for c in sweep["candidates"] if c["measured"] and c["measured"]["fits"]]
    best = max(feasible, key=lambda c: c["measured"]["tokens_per_s"])
    same = next((c for c in sweep["candidates"] if tuple(c[k] for k in key) == pick), None)
    ratio = (same["measured"]["tokens_per_s"] / best["measured"]["tokens_per_s"]
             if same and same["measured"] and same["measured"]["tokens_per_s"] else None)
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "model": args.model, "budget_bytes": plan["memory_budget_bytes"],
        "effective_batch_size": args.effective_batch_size,
        # Trials run (a candidate that fits by its trusted estimate ran none: issue 54), and contenders timed.
        "plan_seconds": plan_seconds, "plan_trials": sum(1 for c in plan["candidates"] if c["measured"] and (
            c.get("memory") or {}).get("decided_by") != "estimate"),
        "plan_timed": sum(1 for c in plan["candidates"] if c["rounds"] and c["rounds"]["rounds"]),
        "plan_time_spent_s": plan["time_spent_s"],
        "candidates": len(sweep["candidates"]),
        "plan_choice": dict(zip(key, pick)), "plan_choice_peak_bytes": chosen_in_plan["measured"]["peak_bytes"],
        "sweep_best": {k: best[k] for k in key}, "sweep_best_tokens_per_s": best["measured"]["tokens_per_s"],
        "plan_choice_tokens_per_s_in_sweep": same["measured"]["tokens_per_s"] if same and same["measured"] else None,
        "ratio": ratio, "sweep_seconds": sweep["duration_s"], "environment": environment(),
    }
    out = Path(__file__).parent / "results" / "plan_vs_sweep.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    fits = result["plan_choice_peak_bytes"] <= result["budget_bytes"]
    print(f"\n| plan time | trials | chosen | peak / budget | chosen in sweep / sweep best |\n|---|---|---|---|---|\n"
          f"| {plan_seconds:.0f} s | {result['plan_trials']} of {result['candidates']} | {result['plan_choice']} | "
          f"{result['plan_choice_peak_bytes'] / 2**20:.1f} / {result['budget_bytes'] / 2**20:.0f} MiB "
          f"({'fits' if fits else 'OVER'}) | {ratio:.2f} |" if ratio else "ratio unavailable")
    return 0


if __name__ == "__main__":
    sys.exit(main())
