"""Benchmark: does a plan predict the training it chooses, on a quiet machine and beside a CPU-bound process?

Issue 28's setup: `cadence plan` of gpt-small (`--seq-len 256 --effective-batch-size 32 --memory-budget 384MiB`,
default `--time-budget`), then `cadence train --plan` with no other flag than its length and --out, as a user
would. Each condition (quiet, then with one `while True: pass` process per core but one beside it) records the
plan's wall time against its time budget, its decision, the predicted tokens/s (the median of the decision's
alternating rounds) and the training's measured tokens/s. Writes benchmarks/results/plan_prediction.json and prints
the markdown block for BENCHMARKS.md.

Issue 43 item 5 asks whether plans beside the same load make the same decision, or state a tie: ``--conditions loaded
loaded loaded`` plans three times under load, and ``--result`` writes them apart from issue 28's record (the gpt-tiny
run below, a 60 s --time-budget per plan, is meant to take under 10 minutes on 2 cores). Each plan also records the
load average before it: on a machine shared with other work, that is load too.

    .venv/bin/python benchmarks/plan_prediction.py [--quick] [--train-steps 30] [--conditions quiet loaded]
    .venv/bin/python benchmarks/plan_prediction.py --model gpt-tiny --seq-len 128 --batch 16 --budget 160MiB \
        --time-budget 60 --train-steps 10 --conditions loaded loaded loaded --result plan_prediction_loaded.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench_env import environment
from report_sections import render_plan_prediction

from cadence.cli import main as cadence

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def load(condition: str, burners: int | None = None) -> Iterator[int]:
    """``loaded``: CPU-bound processes beside the plan (``burners``; default all cores but one, at least one);
    ``quiet``: none."""
    count = 0 if condition == "quiet" else (burners if burners is not None else max(1, (os.cpu_count() or 2) - 1))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield count
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def run_condition(condition: str, args: argparse.Namespace, root: Path, index: int) -> dict:
    plan_dir, run_dir = root / f"plan-{index}-{condition}", root / f"run-{index}-{condition}"
    shape = ["--model", args.model, "--seq-len", str(args.seq_len), "--effective-batch-size", str(args.batch),
             "--memory-budget", args.budget]
    extra = ["--time-budget", str(args.time_budget)] if args.time_budget else []
    load_before = os.getloadavg()[0]  # other sessions' work included: load the burners do not account for
    with load(condition, args.burners) as burners:
        started = time.perf_counter()
        assert cadence(["plan", *shape, *extra, "--out", str(plan_dir)]) == 0
        plan_seconds = time.perf_counter() - started
        assert cadence(["train", "--plan", str(plan_dir / "plan.json"), "--max-steps", str(args.train_steps),
                        "--val-fraction", "0", "--out", str(run_dir)]) == 0
    plan = json.loads((plan_dir / "plan.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    predicted, measured = plan["prediction"]["tokens_per_s"], summary["tokens_per_s"]
    # The candidates each plan said were tied with its choice (its notes: "front-runners c30, c22 were tied ...").
    ties = [re.findall(r"c\d+", note.split(" were tied")[0]) for note in plan["notes"] if " were tied within" in note]
    tied_with = sorted({cid for tie in ties if plan["choice"]["id"] in tie for cid in tie})
    return {"condition": condition, "burners": burners, "load_average_before": load_before,
            "load_average_after": os.getloadavg()[0], "plan_seconds": plan_seconds, "tied_with": tied_with,
            "time_budget_s": plan["time_budget_s"], "choice": plan["choice"], "prediction": plan["prediction"],
            "train_steps": args.train_steps, "measured_tokens_per_s": measured,
            "ratio": measured / predicted if predicted else None,
            "notes": [note for note in plan["notes"] if "tied" in note or "time-budget" in note or "disagree" in note]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", default="384MiB")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--time-budget", type=float, default=None, help="default: the plan's own default")
    parser.add_argument("--conditions", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    parser.add_argument("--burners", type=int, default=None,
                        help="CPU-bound processes beside a loaded plan (default: all cores but one)")
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, seq 64, a few steps: a smoke run")
    parser.add_argument("--result", default=None, help="file name under benchmarks/results (default: "
                        "plan_prediction.json, or plan_prediction_quick.json with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.seq_len, args.batch, args.budget, args.train_steps = "gpt-tiny", 64, 8, "256MiB", 4
        args.time_budget = args.time_budget or 30.0
    with tempfile.TemporaryDirectory() as tmp:
        # A condition given twice (``--conditions quiet loaded loaded``) plans twice: issue 28 asks whether two plans
        # beside the same load choose the same configuration (or report a tie within their noise).
        rows = [run_condition(condition, args, Path(tmp), index) for index, condition in enumerate(args.conditions)]
    data = {"environment": environment(), "model": args.model, "seq_len": args.seq_len,
            "effective_batch_size": args.batch, "budget": args.budget, "conditions": rows}
    out = RESULTS / (args.result or ("plan_prediction_quick.json" if args.quick else "plan_prediction.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print("\n".join(render_plan_prediction(data)))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
