"""Benchmark (issue 38): the time an optimizer step takes when a checkpoint is saved after it, with the save written
synchronously and with --async-checkpoint (copied, then written and sealed by a thread while training goes on).

`cadence train` in this process on gpt-small (built-in corpus, seq 128, micro 4, no accumulation, AdamW: the
checkpoint holds the weights and both moments, about 12 bytes per parameter, plus the hashing of each file for the
manifest), --checkpoint-every 4 and --keep-checkpoints 2, the two modes run alternately. The time of a step is
measured from the end of one ``after_step`` to the end of the next (the step, its metrics, and the checkpoint when
one is due); steps followed by a save and the others are reported apart, as medians, with the whole run's wall time.
One process on the CPU; the load average is recorded before and after.

    .venv/bin/python benchmarks/checkpoint_async.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_env import environment, write_results

from cadence.cli import main
from cadence.training import loop
from cadence.training.checkpoint import checkpoint_dirs, verify_checkpoint


def run(mode: str, out: Path, *, steps: int, every: int, model: str) -> dict:
    """One training run; the per-step times from the end of one after_step to the end of the next."""
    ends: list[float] = []
    saved: list[bool] = []
    original = loop.TrainingRun.after_step

    def timed(self, place, outcome, caught):  # type: ignore[no-untyped-def]
        stop = original(self, place, outcome, caught)
        ends.append(time.perf_counter())
        saved.append(self.engine.steps % every == 0)
        return stop

    loop.TrainingRun.after_step = timed  # type: ignore[method-assign]
    started = time.perf_counter()
    try:
        flags = ["train", "--model", model, "--seq-len", "128", "--micro-batch-size", "4", "--grad-accum-steps", "1",
                 "--max-steps", str(steps), "--checkpoint-every", str(every), "--keep-checkpoints", "2",
                 "--val-fraction", "0", "--log-every", "1000", "--out", str(out)]
        if mode == "async":
            flags.append("--async-checkpoint")
        assert main(flags) == 0
    finally:
        loop.TrainingRun.after_step = original  # type: ignore[method-assign]
    wall = time.perf_counter() - started
    assert all(verify_checkpoint(path) is None for path in checkpoint_dirs(out))
    # Interval i ends with step i + 2. Step 1 (no interval: it builds the optimizer state) and step 2 (measured by
    # the profiler) are left out.
    intervals = [(later - earlier, saved[index + 1]) for index, (earlier, later) in enumerate(zip(ends, ends[1:]))
                 if index >= 1]
    checkpoint_bytes = sum(file.stat().st_size for file in checkpoint_dirs(out)[-1].iterdir())
    return {"save_step_s": [seconds for seconds, save in intervals if save],
            "plain_step_s": [seconds for seconds, save in intervals if not save],
            "wall_s": wall, "checkpoint_bytes": checkpoint_bytes}


def main_benchmark() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, fewer steps (a smoke run)")
    options = parser.parse_args()
    model, steps, rounds = ("gpt-tiny", 9, 1) if options.quick else ("gpt-small", 21, 2)
    every = 4
    load_before = os.getloadavg()[0]
    results: dict[str, dict] = {mode: {"save_step_s": [], "plain_step_s": [], "wall_s": []} for mode in ("sync", "async")}
    checkpoint_bytes = 0
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(rounds):
            for mode in ("sync", "async") if round_index % 2 == 0 else ("async", "sync"):
                found = run(mode, Path(root) / f"{mode}-{round_index}", steps=steps, every=every, model=model)
                for key in ("save_step_s", "plain_step_s"):
                    results[mode][key] += found[key]
                results[mode]["wall_s"].append(found["wall_s"])
                checkpoint_bytes = found["checkpoint_bytes"]
    summary = {mode: {"median_save_step_s": statistics.median(entry["save_step_s"]),
                      "median_plain_step_s": statistics.median(entry["plain_step_s"]),
                      "median_wall_s": statistics.median(entry["wall_s"]),
                      "saves": len(entry["save_step_s"]), **entry}
               for mode, entry in results.items()}
    output = {"environment": environment(), "model": model, "steps": steps, "checkpoint_every": every,
              "rounds": rounds, "checkpoint_bytes": checkpoint_bytes, "results": summary,
              "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    for mode, entry in summary.items():
        print(f"{mode}: step with a save {entry['median_save_step_s']:.3f} s, without "
              f"{entry['median_plain_step_s']:.3f} s, run {entry['median_wall_s']:.1f} s")
    write_results("checkpoint_async", output, quick=options.quick)


if __name__ == "__main__":
    main_benchmark()
