"""Benchmark: gpt-tiny's step time on CPU from a small .txt file and from the built-in corpus, with OpenMP's threads
busy-waiting (libgomp's default, what every run had before cadence asked for a passive wait) and with the passive
wait the command line now asks for (src/cadence/openmp.py says why; docs/memory.md has the analysis).

The before case is reproduced with ``GOMP_SPINCOUNT=300000``: libgomp's own default, which a user's setting keeps
(cadence leaves a wait policy the user chose alone). ``OMP_NUM_THREADS=1`` is shown beside them for reference. Runs
alternate (mode by mode, data by data) so that the machine's load, which varies, falls on every mode alike; the
1-minute load average is recorded before each run. Per run: the median step after the first (the first allocates the
optimizer state) and the mean of every step (the busy wait's slow steps come in bursts, which a median hides).

    .venv/bin/python benchmarks/openmp_wait.py [--repeats 3] [--steps 8]
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "openmp_wait.json"
MODES: dict[str, dict[str, str]] = {
    "busy wait (before: GOMP_SPINCOUNT=300000, libgomp's default)": {"GOMP_SPINCOUNT": "300000"},
    "passive wait (now: cadence's default)": {},
    "reference: OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}
"""Each mode's environment on top of this process's (with every OpenMP wait variable removed first)."""


def english_text(path: Path) -> Path:
    """The issue's small English file: Python's own pydoc topics (about 466 kB), no download."""
    from pydoc_data.topics import topics

    path.write_text("\n\n".join(topics[key] for key in sorted(topics)), encoding="utf-8")
    return path


def one_run(data: Path | None, env_extra: dict[str, str], steps: int, out: Path) -> dict[str, Any]:
    """One `cadence train` of gpt-tiny; its step times from metrics.jsonl."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(env_extra)
    command = [sys.executable, "-m", "cadence", "train", "--model", "gpt-tiny", "--seq-len", "64",
               "--micro-batch-size", "2", "--effective-batch-size", "4", "--max-steps", str(steps), "--device", "cpu",
               "--out", str(out), *(["--data", str(data)] if data else [])]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True, cwd=ROOT)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [row["step_time_s"] for row in rows if "step_time_s" in row]
    return {"load_average_before": load_before, "wall_s": wall, "step_times_s": step_times,
            "median_step_s": statistics.median(step_times[1:])}


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode and data, the median over runs of each run's median step (the steady state) and of its mean step
    (every step, the first included: the busy wait's slow steps come in bursts, which a median hides)."""
    summary = []
    for mode in MODES:
        for label in ("english.txt (466 kB)", "built-in corpus"):
            chosen = [run for run in runs if run["mode"] == mode and run["data"] == label]
            summary.append({"mode": mode, "data": label,
                            "median_step_s": statistics.median(run["median_step_s"] for run in chosen),
                            "mean_step_s": statistics.median(statistics.fmean(run["step_times_s"]) for run in chosen)})
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        english = english_text(Path(work) / "english.txt")
        for repeat in range(args.repeats):
            for mode, env_extra in MODES.items():
                for label, data in (("english.txt (466 kB)", english), ("built-in corpus", None)):
                    out = Path(work) / f"run-{len(runs)}"
                    result = one_run(data, env_extra, args.steps, out)
                    runs.append({"mode": mode, "data": label, "repeat": repeat, **result})
                    print(f"{mode} | {label} | load {result['load_average_before']:.1f} | median step "
                          f"{result['median_step_s']:.3f} s | steps {[round(t, 2) for t in result['step_times_s']]}",
                          flush=True)
    summary = summarise(runs)
    RESULTS.write_text(json.dumps({"cores": os.cpu_count(), "steps": args.steps, "repeats": args.repeats,
                                   "summary": summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
