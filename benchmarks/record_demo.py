"""Record the result of `make demo` (a finished run directory) as benchmarks/results/demo.json for BENCHMARKS.md.

`make demo` is the project's two-command showcase, so its figures (training time, final losses, peak memory) belong
in BENCHMARKS.md; this copies them from the run directory instead of someone typing them in. Run it on the machine
that ran the demo, right after: the machine is read now, while the date and the versions come from the run itself
(summary.json's modification time, config.json's ``versions``).

    make demo && .venv/bin/python benchmarks/record_demo.py [--run runs/demo]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from bench_env import environment

ROOT = Path(__file__).resolve().parents[1]
# The settings a reader needs to know what was trained; the rest of config.json is defaults.
CONFIG_KEYS = ("model", "seq_len", "micro_batch_size", "grad_accum_steps", "precision", "max_steps", "eval_every",
               "checkpoint_every", "lr", "warmup_steps", "resolved_device", "model_parameters", "data_description")
SUMMARY_KEYS = ("steps", "tokens", "wall_time_s", "tokens_per_s", "peak_memory_bytes", "peak_memory_source",
                "final_loss", "final_val_loss")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "demo.json")
    args = parser.parse_args()
    summary_path = args.run / "summary.json"
    if not summary_path.exists():
        print(f"{summary_path} not found: run `make demo` first", file=sys.stderr)
        return 1
    config = json.loads((args.run / "config.json").read_text())
    summary = json.loads(summary_path.read_text())
    env = environment()
    finished = datetime.datetime.fromtimestamp(summary_path.stat().st_mtime, datetime.timezone.utc)
    env["measured_at"] = finished.strftime("%Y-%m-%dT%H:%M:%SZ")
    env["versions"] = config.get("versions", {})  # what the run used, not what is installed now
    env["torch_threads"] = None  # not in the run directory; the current value could differ from the run's
    result = {"environment": env, "config": {k: config.get(k) for k in CONFIG_KEYS},
              "summary": {k: summary.get(k) for k in SUMMARY_KEYS}}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    print(f"raw: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
