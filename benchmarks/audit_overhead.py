"""Benchmark: the cost of `cadence audit` on a correct loop, as a share of the step time.

A nanoGPT-style loop (gpt-tiny, seq 128, micro 8 x accum 4, AdamW, unscale-free fp32 with clipping) runs with and
without the audit alternately (A B A B ...), each round a few timed steps after a warm-up; reports the median step
time of each and the overhead. Target: under 5%.

Then the real loops of tests/audit/real_loops/ (transformers.Trainer, TRL's SFTTrainer, Accelerate, Lightning on a
tiny llama; their correct forms), each run whole in this process with and without the audit in paired rounds (A B,
then B A, so a drift of the machine falls on both), timed in process CPU time (all threads; a shared machine's wall
clock is noisier). Per loop: the median CPU time of a run each way, the median of the paired ratios, and the added
CPU time per backward pass. A first unaudited run of each loop (imports, caches) is not timed. The libraries a loop
needs must be installed; a loop whose library is missing is left out.

    .venv/bin/python benchmarks/audit_overhead.py [--rounds 8] [--steps 5] [--real-rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_env import environment

from cadence.audit.checker import Audit
from cadence.audit.run import audit_script
from cadence.models import build_model

LOOPS = Path(__file__).resolve().parent.parent / "tests" / "audit" / "real_loops"
# (name, script, arguments after the output folder or None when it takes none, modules it needs)
REAL_LOOPS = [
    ("transformers.Trainer", "hf_trainer.py", [], ["transformers", "datasets"]),
    ("TRL SFTTrainer", "trl_sft.py", [], ["trl", "datasets"]),
    ("Accelerate", "accelerate_loop.py", None, ["accelerate", "transformers"]),
    ("Lightning", "lightning_loop.py", [], ["pytorch_lightning", "transformers"]),
]


def run_loop(steps: int, batches: list[tuple[torch.Tensor, torch.Tensor]], accum: int) -> float:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 1):  # the first is a warm-up (AdamW allocates its state)
        started = time.perf_counter()
        for micro in range(accum):
            inputs, targets = batches[(step * accum + micro) % len(batches)]
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_real_loop(script: str, args: list[str] | None, out: str, *, audited: bool) -> tuple[float, int]:
    """One whole run of a real loop in this process: (process CPU seconds, backward passes; 0 when not audited)."""
    argv = [str(LOOPS / script), *([] if args is None else [out, *args])]
    sink = io.StringIO()
    started = time.process_time()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        if audited:
            status, report = audit_script(argv)
            assert status == 0 and not report.findings, f"{script}: a correct loop must give no finding"
            backwards = report.cadence.backwards
        else:
            saved_argv, saved_path = sys.argv[:], sys.path[:]
            sys.argv = argv
            sys.path.insert(0, str(LOOPS))
            try:
                runpy.run_path(argv[0], run_name="__main__")
            finally:
                sys.argv, sys.path[:] = saved_argv, saved_path
            backwards = 0
    return time.process_time() - started, backwards


def measure_real_loops(rounds: int) -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = []
    with tempfile.TemporaryDirectory() as out:
        for name, script, args, needs in REAL_LOOPS:
            if any(importlib.util.find_spec(module) is None for module in needs):
                continue
            run_real_loop(script, args, out, audited=False)  # imports and caches: not timed
            plain, audited, backwards = [], [], 0
            for index in range(rounds):
                order = (False, True) if index % 2 == 0 else (True, False)
                for audit in order:
                    seconds, count = run_real_loop(script, args, out, audited=audit)
                    (audited if audit else plain).append(seconds)
                    backwards = count or backwards
            ratios = [a / p for a, p in zip(audited, plain)]
            added = statistics.median(a - p for a, p in zip(audited, plain))
            results.append({"loop": name, "script": script, "rounds": rounds, "backwards": backwards,
                            "median_cpu_s_plain": statistics.median(plain),
                            "median_cpu_s_audited": statistics.median(audited),
                            "overhead": statistics.median(ratios) - 1,
                            "added_cpu_ms_per_backward": added / backwards * 1000})
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--real-rounds", type=int, default=3, help="paired rounds per real loop (0: skip them)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (8, 128), generator=generator), torch.randint(0, 256, (8, 128),
                                                                                    generator=generator))
               for _ in range(8)]
    plain, audited = [], []
    for _ in range(args.rounds):
        plain.append(run_loop(args.steps, batches, 4))
        with Audit() as audit:
            audited.append(run_loop(args.steps, batches, 4))
        assert not audit.report().findings, "the benchmark loop must be a correct loop"
    overhead = statistics.median(audited) / statistics.median(plain) - 1
    result = {"machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
              "rounds": args.rounds, "steps_per_round": args.steps,
              "median_step_s_plain": statistics.median(plain), "median_step_s_audited": statistics.median(audited),
              "overhead": overhead, "real_loops": measure_real_loops(args.real_rounds) if args.real_rounds else [],
              "environment": environment(("accelerate", "transformers", "trl"))}
    if args.real_rounds:  # the column BENCHMARKS.md calls lightning: this benchmark runs the pytorch-lightning package
        from bench_env import package_version

        result["environment"]["versions"]["lightning"] = f"pytorch-lightning {package_version('pytorch-lightning')}"
    out = Path(__file__).parent / "results" / "audit_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
