"""`make demo`'s training on this CPU, quiet and beside one CPU-bound process (issue 41 item 4).

A newcomer's machine is rarely idle: the demo's throughput must fall in proportion to the share of the cores it gets
(on 2 cores, one busy process beside it leaves it about half), not collapse because its threads wait on each other.
Rounds alternate quiet / loaded (the competitor: one Python process spinning, started before the round and killed
after it), each a fresh `cadence train` with the demo's settings for a few steps; the median tokens/s of each
condition is recorded with the CPU's bf16 support (the demo trains in fp32 where the CPU lacks it) and the projected
time of the demo's 300 steps.

    .venv/bin/python benchmarks/demo_load.py [--steps 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_env import cpu_bf16, environment

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "demo_load.json"
DEMO_STEPS = 300
DEMO = ["--model", "gpt-tiny", "--seq-len", "256", "--micro-batch-size", "8", "--grad-accum-steps", "4",
        "--lr", "2e-3", "--val-fraction", "0"]
"""The demo's shape (Makefile `demo`), without its evaluation and checkpoints: the throughput of its steps."""


def _round(precision: str, steps: int, loaded: bool) -> float:
    """tokens/s of one fresh run of the demo's steps, with a spinning process beside it when ``loaded``."""
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if loaded else None
    try:
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, "-m", "cadence", "train", *DEMO, "--precision", precision,
                            "--max-steps", str(steps), "--warmup-steps", "0", "--out", f"{out}/run"],
                           check=True, capture_output=True, text=True, cwd=ROOT)
            summary = json.loads(Path(out, "run", "summary.json").read_text())
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return float(summary["tokens_per_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    # The demo's precision on this CPU, as the Makefile chooses it.
    precision = "bf16" if cpu_bf16() == "native" else "fp32"
    load_before = os.getloadavg()
    quiet, loaded = [], []
    for _ in range(args.rounds):
        quiet.append(_round(precision, args.steps, loaded=False))
        loaded.append(_round(precision, args.steps, loaded=True))
    tokens_per_step = 8 * 4 * 256
    result = {
        "precision": precision, "cpu_bf16": cpu_bf16(), "steps_per_round": args.steps, "rounds": args.rounds,
        "quiet_tokens_per_s": quiet, "loaded_tokens_per_s": loaded,
        "quiet_median": statistics.median(quiet), "loaded_median": statistics.median(loaded),
        "loaded_share": statistics.median(loaded) / statistics.median(quiet),
        "demo_training_s_projected": DEMO_STEPS * tokens_per_step / statistics.median(quiet),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d"), "environment": environment(),
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: value for key, value in result.items() if key != "environment"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
