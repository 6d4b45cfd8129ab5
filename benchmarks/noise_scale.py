"""Benchmark: what measuring the gradient noise scale costs per optimizer step (issue 27). Target: under 1% on gpt-small.

The same model (gpt-small, fresh from the same starting weights each round), the same windows of the built-in corpus
(seq 128, micro 4 x accum 4, 2,048 tokens a step), fp32, AdamW lr 1e-3, clipping at 1.0; two measurements:

1. **The added work, timed alone**: what the engine does more per window when it measures (the norm of the gradients
   after the first micro-batch's backward, ``cadence.engine.noise_scale.gradient_norm``, and the window's two
   estimates on the device, ``GradientNoiseScale.window_terms``; their read-back rides on the loss's), each timed by
   itself over many repeats (median), as a share of the median step time without it.
2. **End to end**: one engine per round (from the same starting weights, one warm-up step), then ``--pairs`` pairs of
   consecutive steps, one without the noise scale and one with it (``engine.noise_scale`` set or not; the order
   alternating from pair to pair), so that the two steps of a pair see the same machine load; the median of the
   pairs' step-time ratios. On a shared CPU their spread is wider than the target itself, which is why (1) is the
   figure the target is judged on.

    .venv/bin/python benchmarks/noise_scale.py [--quick] [--rounds 4] [--pairs 8] [--model gpt-small] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from bench_env import environment, write_results

from cadence import Engine
from cadence.data import iterate_micro_batches, load_data
from cadence.engine.noise_scale import FirstGradient, GradientNoiseScale, gradient_norm
from cadence.engine.windows import Window, iter_windows
from cadence.models import build_model

TARGET = 0.01


def paired_steps(model: torch.nn.Module, start: dict, windows: list[Window], pairs: int) -> list[tuple[float, float]]:
    """From ``start``'s weights, one engine and one warm-up step, then ``pairs`` pairs of consecutive steps, one
    without the noise scale and one with it (the order alternating from pair to pair): (without, with) step_time_s.
    Back to back on the same engine, the two steps of a pair see the same machine load."""
    model.load_state_dict(start)
    meter = GradientNoiseScale()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
    engine.step(windows[0])  # allocates the optimizer state
    out = []
    for pair in range(pairs):
        times = {}
        for measured in ((False, True) if pair % 2 == 0 else (True, False)):
            engine.noise_scale = meter if measured else None
            times[measured] = engine.step(windows[1 + (2 * pair + measured) % (len(windows) - 1)]).step_time_s
        out.append((times[False], times[True]))
    assert meter.windows == pairs
    return out


def added_work_s(model: torch.nn.Module, window: Window, repeats: int) -> dict[str, float]:
    """The engine's extra work per window when it measures, each part timed alone (median seconds)."""
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = window.micro_batches[0]
    engine.precision.backward(engine.loss_fn(model, batch) / max(1, window.targets))  # gradients to take a norm of

    def median_of(work) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    meter = GradientNoiseScale()
    norm = gradient_norm(model.parameters())

    def terms() -> None:
        meter._first = FirstGradient(norm=norm)  # noqa: SLF001 - the benchmark feeds the one step it times
        meter.window_terms(grad_norm=1.0, stepped=True, window_targets=window.targets, first_targets_here=512,
                           first_targets_all=512, world_size=1, loss_scale=None, device=norm.device)

    return {"first_gradient_norm_s": median_of(lambda: gradient_norm(model.parameters())),
            "window_terms_s": median_of(terms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 pairs (a smoke run, *_quick.json)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--seq-len", type=int, default=128)
    # One thread: on a shared 2-core machine, OpenMP threads that spin-wait for a busy core make step times swing
    # by tens of percent from one step to the next whenever another process runs.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, steps = (2, 2) if args.quick else (args.rounds, args.pairs)
    started = time.perf_counter()
    data = load_data(None, args.seq_len, 0.0, max_corpus_bytes=4_000_000)
    windows = [window for window, _ in zip(iter_windows(iterate_micro_batches(data.train, 4, 0, 0), 4), range(9))]
    torch.manual_seed(0)
    model = build_model(args.model)
    start = copy.deepcopy(model.state_dict())
    off: list[float] = []
    on: list[float] = []
    ratios: list[float] = []
    for index in range(rounds):
        pairs = paired_steps(model, start, windows, steps)
        off += [a for a, _ in pairs]
        on += [b for _, b in pairs]
        ratios += [b / a for a, b in pairs]
        print(f"round {index + 1}/{rounds}: median step {statistics.median(a for a, _ in pairs) * 1000:.1f} ms "
              f"without, {statistics.median(b for _, b in pairs) * 1000:.1f} ms with; paired ratios "
              + ", ".join(f"{b / a:.3f}" for a, b in pairs), file=sys.stderr, flush=True)
    model.load_state_dict(start)
    work = added_work_s(model, windows[0], repeats=20 if args.quick else 100)
    step = statistics.median(off)
    added = work["first_gradient_norm_s"] + work["window_terms_s"]
    parameters = sum(p.numel() for p in model.parameters())
    output = {
        "model": args.model, "parameters": parameters, "seq_len": args.seq_len, "micro_batch_size": 4,
        "grad_accum_steps": 4, "tokens_per_step": 16 * args.seq_len, "precision": "fp32", "rounds": rounds,
        "pairs_per_round": steps, "median_step_s_without": step, "median_step_s_with": statistics.median(on),
        "step_s_without": off, "step_s_with": on, "paired_ratios": ratios,
        "paired_ratio_median": statistics.median(ratios), **work, "added_s_per_step": added,
        "added_share_of_step": added / step, "target": TARGET, "wall_s": time.perf_counter() - started,
        "environment": environment(),
    }
    write_results("noise_scale", output, quick=args.quick)
    print(f"added work {added * 1000:.2f} ms per step = {added / step:.2%} of a {step * 1000:.0f} ms step "
          f"(target < {TARGET:.0%}); end to end, paired ratio median {statistics.median(ratios):.4f} "
          f"(min {min(ratios):.4f}, max {max(ratios):.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
