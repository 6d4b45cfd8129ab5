"""Benchmark: the cost of `cadence audit` on a correct loop, as a share of the step time.

A nanoGPT-style loop (gpt-tiny, seq 128, micro 8 x accum 4, AdamW, unscale-free fp32 with clipping) runs with and
without the audit alternately (A B A B ...), each round a few timed steps after a warm-up; reports the median step
time of each and the overhead. Target: under 5%.

    .venv/bin/python benchmarks/audit_overhead.py [--rounds 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_env import environment

from cadence.audit.checker import Audit
from cadence.models import build_model


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
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
              "overhead": overhead, "environment": environment()}
    out = Path(__file__).parent / "results" / "audit_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
