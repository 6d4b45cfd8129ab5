"""Benchmark: what do the engine's phase annotations cost when profiling is off?

Runs the current engine (annotations present, no profiler attached) and the engine as it was before annotations
(its source taken from git at --baseline-rev) alternately (A B A B ...) on the same model, data and settings, and
reports the median tokens/s of each and their ratio. Target: within 1%.

    .venv/bin/python benchmarks/phase_overhead.py [--baseline-rev REV] [--rounds 10] [--steps 6]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_env import environment

from cadence.data import iterate_micro_batches, load_data
from cadence.engine.step import Engine
from cadence.engine.windows import iter_windows
from cadence.models import build_model

ROOT = Path(__file__).resolve().parents[1]


def baseline_engine_class(rev: str) -> type:
    """cadence.engine.step.Engine as it was at ``rev``, loaded as a separate module beside the current package."""
    source = subprocess.run(["git", "show", f"{rev}:src/cadence/engine.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    if "_phase(" in source:
        raise SystemExit(f"{rev} already has phase annotations; give the revision before them")
    path = Path(tempfile.mkdtemp()) / "engine_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("engine_baseline", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["engine_baseline"] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.Engine


def tokens_per_s(engine_class: type, windows: list, steps: int) -> float:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    engine = engine_class(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
    engine.step(windows[0])  # warm-up: allocates the optimizer state
    rates = [engine.step(window).tokens_per_s for window in windows[1:steps + 1]]
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default="c93079e")  # the last commit before phase annotations
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    data = load_data(None, 256, 0.0, max_corpus_bytes=4_000_000)
    windows = list(zip(range(args.steps + 1), iter_windows(iterate_micro_batches(data.train, 8, 0, 0), 4)))
    windows = [window for _, window in windows]
    baseline = baseline_engine_class(args.baseline_rev)
    annotated, plain = [], []
    for _ in range(args.rounds):
        annotated.append(tokens_per_s(Engine, windows, args.steps))
        plain.append(tokens_per_s(baseline, windows, args.steps))
    ratio = statistics.median(annotated) / statistics.median(plain)
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
              "baseline_rev": args.baseline_rev, "rounds": args.rounds, "steps_per_round": args.steps,
              "annotated_median_tokens_per_s": statistics.median(annotated),
              "baseline_median_tokens_per_s": statistics.median(plain), "ratio": ratio,
              "annotated": annotated, "baseline": plain, "environment": environment()}
    out = ROOT / "benchmarks" / "results" / "phase_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("annotated", "baseline")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
