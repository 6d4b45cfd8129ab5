"""Benchmark (issue 54): how long `cadence plan` takes on the issue's case, where the time goes, and what it chose.

Runs `cadence plan --model gpt-small --seq-len 256 --effective-batch-size 32 --memory-budget 384MiB` with a given
cadence executable (this checkout's, or another checkout's to compare before and after on the same machine, in the
same session), and records its wall time, the CPU time it got (user + system: on a shared machine the wall time is
mostly waiting, so the CPU time says what a quiet machine would take), the 1-minute load average before and after,
plan.json's `time_spent_s` phases, its choice and its trials. Each run is appended to
benchmarks/results/plan_time.json under its --label.

    .venv/bin/python benchmarks/plan_time.py --label after
    .venv/bin/python benchmarks/plan_time.py --label before --cadence /path/to/main/.venv/bin/cadence
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_env import environment

CASE = ["--model", "gpt-small", "--seq-len", "256", "--effective-batch-size", "32", "--memory-budget", "384MiB"]
RESULT = Path(__file__).parent / "results" / "plan_time.json"


def run(cadence: str, label: str, commit: str | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        load_before = os.getloadavg()[0]
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([cadence, "plan", *CASE, "--out", str(out)], capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        load_after = os.getloadavg()[0]
        if done.returncode != 0:
            raise SystemExit(f"the plan failed ({done.returncode}): {done.stderr[-2000:]}")
        plan = json.loads((out / "plan.json").read_text())
    chosen = next(c for c in plan["candidates"] if c["id"] == plan["choice"]["id"])
    return {
        "label": label, "commit": commit, "wall_s": wall,
        "cpu_s": (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime),
        "load_average_before": load_before, "load_average_after": load_after,
        "duration_s": plan["duration_s"], "time_budget_s": plan["time_budget_s"], "time_spent_s": plan["time_spent_s"],
        "choice": {key: plan["choice"][key] for key in ("id", "micro_batch_size", "grad_accum_steps", "precision",
                                                         "activation_checkpointing")},
        "chosen_tokens_per_s": (chosen["measured"] or {}).get("tokens_per_s"),
        "chosen_peak_bytes": (chosen["measured"] or {}).get("peak_bytes"),
        "peak_decided_by": (chosen.get("memory") or {}).get("decided_by", "measured"),
        "memory_trials": sum(1 for c in plan["candidates"] if c["measured"]
                             and (c.get("memory") or {}).get("decided_by", "measured") == "measured"),
        "timed": sum(1 for c in plan["candidates"] if c["rounds"] and c["rounds"]["rounds"]),
        "quality_reused": (plan["quality"]["loss"] or {}).get("reused"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--cadence", default=str(Path(sys.executable).parent / "cadence"))
    parser.add_argument("--commit", default=None, help="the commit the cadence executable runs (for the record)")
    args = parser.parse_args()
    row = run(args.cadence, args.label, args.commit)
    data = json.loads(RESULT.read_text()) if RESULT.exists() else {"case": " ".join(CASE), "runs": []}
    data["runs"].append(row)
    data["environment"] = environment()
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(row, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
