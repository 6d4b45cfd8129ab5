"""Benchmark: cadence's analytic memory estimate against the measured peak of one optimizer step.

For gpt-tiny (micro 8), gpt-small (micro 4) and gpt-base (micro 1), seq 256, AdamW, clipping at 1.0, in
{fp32, bf16} x recompute {none, full}: the estimate (``cadence.memory.estimate.estimate_step_memory``) beside the
measurement (``cadence.memory.measure.measure_step``: the profiler's memory timeline of the second optimizer step, by
category). The same table ``tests/memory/test_memory_estimate.py -k 15_percent`` asserts within 15%; this script records it
as JSON for BENCHMARKS.md. One intra-op thread, as in that test: the bytes do not depend on it, and on shared cores it
keeps the run from stalling on spin-waiting threads.

``estimate_grid`` is the same comparison on any device and over accumulation too, measured the way a run measures
its own steps (``Engine.step(measure_memory=True)``: ``torch.cuda.max_memory_allocated`` on CUDA);
``benchmarks/gpu.py`` calls it.

    .venv/bin/python benchmarks/memory_estimate.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_env import environment

from cadence.config import TrainConfig
from cadence.engine.choices import PrecisionName
from cadence.engine.step import Engine
from cadence.memory.choices import CheckpointingMode
from cadence.memory.estimate import estimate_step_memory
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models import MODEL_CONFIGS, build_model
from cadence.plan.estimate_check import estimate_against_measurement
from cadence.training.components import build_optimizer

SIZES = {"gpt-tiny": (8, 256), "gpt-small": (4, 256), "gpt-base": (1, 256)}
"""(micro-batch, seq_len) per model: the test's table sizes, small enough for 2 CPU cores."""
TOLERANCE = 0.15


def measure_model(name: str, batch: int, seq: int) -> list[dict]:
    """{fp32, bf16} x {none, full} on one model, as ``cadence.plan.estimate_check.estimate_against_measurement`` gives it."""
    rows = []
    for precision, checkpointing, predicted, measured in estimate_against_measurement(name, batch, seq):
        rows.append({
            "model": name, "micro_batch_size": batch, "seq_len": seq, "precision": precision,
            "recompute": checkpointing, "estimated_peak_bytes": predicted.peak_bytes,
            "measured_peak_bytes": measured.peak_bytes, "estimated_activation_bytes": predicted.activation_bytes,
            "measured_activation_bytes": measured.activation_peak_bytes, "peak_phase": predicted.peak_phase,
        })
        print(f"{name} {precision} {checkpointing}: estimated {predicted.peak_bytes / 2**20:.1f} MiB, "
              f"measured {measured.peak_bytes / 2**20:.1f} MiB", flush=True)
    return rows


def estimate_grid(name: str, batch: int, seq: int, device: torch.device, *,
                  precisions: tuple[PrecisionName, ...] = ("fp32", "bf16"),
                  recomputes: tuple[CheckpointingMode, ...] = ("none", "selective", "full"),
                  accums: tuple[int, ...] = (1, 4)) -> list[dict]:
    """The estimate against the measured peak of one optimizer step for ``precisions`` x ``recomputes`` x
    ``accums`` on ``device``: the optimizer ``cadence train`` builds, clipping at 1.0, random tokens (a step's memory
    depends on shapes only). One model per recompute mode (recompute is applied once, when a model is built); its
    first step allocates AdamW's state and is never the measured one.

    On CUDA the allocator's high-water mark counts every tensor of the process: what was allocated before the
    model was built (another benchmark's leftovers) is recorded and subtracted."""
    rows = []
    for checkpointing in recomputes:
        other = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        torch.manual_seed(0)
        model = build_model(name).to(device)
        apply_activation_checkpointing(model, checkpointing)
        optimizer = build_optimizer(model, TrainConfig())
        generator = torch.Generator().manual_seed(0)

        def window(micro_batches: int) -> list[dict[str, torch.Tensor]]:
            return [{"input_ids": torch.randint(0, 256, (batch, seq), generator=generator),
                     "labels": torch.randint(0, 256, (batch, seq), generator=generator)}
                    for _ in range(micro_batches)]

        Engine(model, optimizer, precision="fp32", max_grad_norm=1.0).step(window(1))
        for precision in precisions:
            engine = Engine(model, optimizer, precision=precision, max_grad_norm=1.0)
            for accum in accums:
                measured = engine.step(window(accum), measure_memory=True).peak_memory_bytes
                predicted = estimate_step_memory(MODEL_CONFIGS[name], micro_batch_size=batch, seq_len=seq,
                                                 precision=precision, checkpointing=checkpointing,
                                                 device_type=device.type, grad_accum_steps=accum)
                assert measured is not None, "Engine.step(measure_memory=True) measures every device it runs on"
                measured -= other
                rows.append({"model": name, "micro_batch_size": batch, "seq_len": seq, "precision": precision,
                             "recompute": checkpointing, "grad_accum_steps": accum,
                             "estimated_peak_bytes": predicted.peak_bytes, "measured_peak_bytes": measured,
                             "error": predicted.peak_bytes / measured - 1, "peak_phase": predicted.peak_phase,
                             "other_allocated_bytes": other})
                print(f"{name} {precision} recompute {checkpointing} accum {accum}: estimated "
                      f"{predicted.peak_bytes / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB", flush=True)
        del engine, optimizer, model
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_estimate.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = [row for name, (batch, seq) in SIZES.items() for row in measure_model(name, batch, seq)]
    worst = max(abs(r["estimated_peak_bytes"] / r["measured_peak_bytes"] - 1) for r in rows)
    result = {"environment": environment(), "tolerance": TOLERANCE, "rows": rows, "max_abs_peak_error": worst,
              "wall_s": time.perf_counter() - started}
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"largest peak error {worst:.1%} (tolerance {TOLERANCE:.0%}); raw: {args.out}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
