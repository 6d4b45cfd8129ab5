"""Benchmark (issue 16): what `--compile` does to tokens/s on this machine, with the compile time reported apart.

Per recompute mode (none, full), two engines train the same model from the same seed on the same windows: one eager,
one with every block compiled as `cadence train --compile` compiles it (``compile_blocks`` after recompute). Step 1
compiles (timed on its own, with dynamo's compile-time accounting); step 2 is a warm-up of both; then rounds alternate
the two (rotating which goes first, so that a slow moment of a shared machine hits both) and each round's tokens/s is
tokens over the summed step times. Reported: the median tokens/s of each, their ratio, the compile time cold (an empty
inductor cache, the price of a first run on a machine) and warm (a new process with the cache filled: dynamo traces
again, inductor reuses its kernels), the graphs compiled, the loss difference between the two, and the steps a run
needs before compiling has paid for itself (cold compile time over the time saved per step).

fp32 (bf16 is emulated on CPUs without bf16 instructions: it would time the emulation). The load average is recorded
before and after: on a shared machine it says how much to trust the timings.

    .venv/bin/python benchmarks/compile.py [--quick]
"""

from __future__ import annotations

import os
import tempfile

# An empty inductor cache of its own, before torch is imported: the first compile below is a cold one.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cadence-bench-inductor-")

import argparse  # noqa: E402
import itertools  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from bench_env import environment, write_results  # noqa: E402

from cadence.config import TrainConfig  # noqa: E402
from cadence.data import pack_bytes  # noqa: E402
from cadence.engine.cut import Cut
from cadence.engine.step import Engine  # noqa: E402
from cadence.engine.windows import epoch_windows  # noqa: E402
from cadence.memory.recompute import apply_activation_checkpointing  # noqa: E402
from cadence.models import build_model, compile_blocks, compile_stats  # noqa: E402
from cadence.training.components import build_optimizer  # noqa: E402

MODES = ("none", "full")


def engine(model_name: str, recompute: str, compiled: bool) -> Engine:
    """The engine `cadence train` builds (AdamW, clipping at 1.0), from seed 0, compiled or not."""
    torch.manual_seed(0)
    model = build_model(model_name)
    apply_activation_checkpointing(model, recompute)  # type: ignore[arg-type]
    if compiled:
        compile_blocks(model)
    return Engine(model, build_optimizer(model, TrainConfig(lr=1e-3)), precision="fp32", max_grad_norm=1.0)


def first_step(run: Engine, window: object) -> tuple[float, float, int]:
    """Seconds of the first step, of it compiling, and graphs compiled."""
    before = compile_stats()
    started = time.perf_counter()
    run.step(window)  # type: ignore[arg-type]
    seconds = time.perf_counter() - started
    compiled = compile_stats().since(before)
    return seconds, compiled.seconds, compiled.graphs


def warm_compile(model_name: str, recompute: str, window: object) -> float:
    """Compile time with the inductor cache filled, as in a second run: dynamo forgets its graphs (as a new process
    starts without them) and traces again; inductor finds its kernels on disk."""
    torch._dynamo.reset()
    return first_step(engine(model_name, recompute, compiled=True), window)[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, seq 64, 2 rounds: a smoke run")
    args = parser.parse_args()
    model_name, seq_len, micro, accum = ("gpt-tiny", 64, 2, 2) if args.quick else ("gpt-small", 256, 4, 2)
    rounds, steps = (2, 1) if args.quick else (5, 3)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    data = pack_bytes(b"\n".join(path.read_bytes() for path in files), seq_len)
    load_before = os.getloadavg()
    results = {}
    for recompute in MODES:
        windows = list(itertools.islice(epoch_windows(data, cut=Cut(micro_batch_size=micro), grad_accum_steps=accum,
                                                      seed=0, epoch=0), 2 + rounds * steps))
        runs = {"eager": engine(model_name, recompute, compiled=False),
                "compiled": engine(model_name, recompute, compiled=True)}
        losses: dict[str, list[float]] = {name: [] for name in runs}
        first = {}
        for name, run in runs.items():
            first[name] = first_step(run, windows[0])
            losses[name].append(run.step(windows[1]).loss)  # warm-up: not timed
        rates: dict[str, list[float]] = {name: [] for name in runs}
        step_times: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(rounds):
            order = list(runs)[round_index % 2:] + list(runs)[:round_index % 2]
            for name in order:
                tokens, seconds = 0, 0.0
                for window in windows[2 + round_index * steps:2 + (round_index + 1) * steps]:
                    result = runs[name].step(window)
                    losses[name].append(result.loss)
                    tokens += result.tokens
                    seconds += result.step_time_s
                    step_times[name].append(result.step_time_s)
                rates[name].append(tokens / seconds)
            print(f"{recompute} round {round_index + 1}/{rounds}: " + ", ".join(
                f"{name} {rates[name][-1]:,.0f} tok/s" for name in runs), flush=True)
        eager_step, compiled_step = (statistics.median(step_times[name]) for name in runs)
        cold = first["compiled"][1]
        warm = warm_compile(model_name, recompute, windows[0])
        saved = eager_step - compiled_step
        results[recompute] = {
            "eager": {"tokens_per_s": statistics.median(rates["eager"]), "rates": rates["eager"],
                      "median_step_s": eager_step, "first_step_s": first["eager"][0]},
            "compiled": {"tokens_per_s": statistics.median(rates["compiled"]), "rates": rates["compiled"],
                         "median_step_s": compiled_step, "first_step_s": first["compiled"][0]},
            "ratio": statistics.median(rates["compiled"]) / statistics.median(rates["eager"]),
            "compile_cold_s": cold, "compile_warm_s": warm, "compiled_graphs": first["compiled"][2],
            # Steps until the cold compile is paid back by faster steps; None when compiled steps are not faster.
            "break_even_steps": cold / saved if saved > 0 else None,
            "max_loss_difference": max(abs(a - b) / abs(b) for a, b in zip(losses["compiled"], losses["eager"])),
        }
        row = results[recompute]
        print(f"{recompute}: eager {row['eager']['tokens_per_s']:,.0f} tok/s, compiled "
              f"{row['compiled']['tokens_per_s']:,.0f} tok/s ({row['ratio']:.2f}x); compile {cold:.1f} s cold, "
              f"{warm:.1f} s warm, {row['compiled_graphs']} graph(s); max loss difference "
              f"{row['max_loss_difference']:.1e}", flush=True)
    output = {
        "environment": environment(),
        "command": ".venv/bin/python benchmarks/compile.py" + (" --quick" if args.quick else ""),
        "model": model_name, "seq_len": seq_len, "micro_batch_size": micro, "grad_accum_steps": accum,
        "precision": "fp32", "rounds": rounds, "steps_per_round": steps,
        "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0],
        "results": results,
    }
    write_results("compile", output, quick=args.quick)
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
