"""The memory estimate against measurement: the table that says how far ``cadence plan`` can trust its estimates.

The estimate (``cadence.memory.estimate``) is a replay of one step's allocations; the measurement
(``cadence.memory.measure``) is the profiler's memory timeline of a real step through the real engine. This builds
both for the same configurations, for the test that asserts the table and the benchmark that records it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from cadence.config import TrainConfig
from cadence.engine.choices import PrecisionName
from cadence.engine.step import Engine
from cadence.engine.windows import iter_windows
from cadence.memory.choices import CheckpointingMode
from cadence.memory.estimate import MemoryEstimate
from cadence.memory.estimate_for import estimate_for
from cadence.memory.measure import MeasuredMemory, measure_step
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models.spec import ModelSpec
from cadence.optim.spec import OptimizerSpec
from cadence.training.components import build_optimizer


def estimate_against_measurement(
    model_name: str, micro_batch_size: int, seq_len: int, precisions: tuple[PrecisionName, ...] = ("fp32", "bf16"),
) -> list[tuple[str, str, Any, MeasuredMemory]]:
    """The estimate's acceptance table for one built-in model: (precision, recompute, estimate, measurement) for
    ``precisions`` x {none, full} (AdamW, clipping 1.0, random tokens: a step's memory depends on shapes only).

    A first step allocates AdamW's state, so it is never the measured one. Shared by the test that asserts the
    table and the benchmark that records it."""
    def random_window(seed: int) -> list[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 256, (micro_batch_size, seq_len), generator=generator)
        return [{"input_ids": ids, "labels": torch.randint(0, 256, (micro_batch_size, seq_len), generator=generator)}]

    spec = ModelSpec.from_flags({"model": model_name})
    model = spec.build(seed=0).module
    optimizer = build_optimizer(model, TrainConfig())
    window = random_window(seed=1)
    Engine(model, optimizer, precision="fp32", max_grad_norm=1.0).step(random_window(seed=0))
    rows: list[tuple[str, str, Any, MeasuredMemory]] = []
    checkpointings: tuple[CheckpointingMode, ...] = ("none", "full")
    for checkpointing in checkpointings:
        apply_activation_checkpointing(model, checkpointing)
        for precision in precisions:
            engine = Engine(model, optimizer, precision=precision, max_grad_norm=1.0)
            measured = measure_step(model, optimizer, functools.partial(engine.step, window), "cpu")
            predicted = estimate_for(spec, micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision,
                                     checkpointing=checkpointing)
            rows.append((precision, checkpointing, predicted, measured))
    return rows


def optimizer_step_against_estimate(model_name: str, spec: OptimizerSpec, *, micro: int, seq: int,
                                    llama: dict[str, Any]) -> tuple[MeasuredMemory, MemoryEstimate]:
    """One fp32 step of a built-in model (or, for ``"llama"``, a transformers llama of the config ``llama``) trained
    by ``spec``: the profiler's measurement of its second step (the first allocates the optimizer state) and the
    estimate of that step. What tests/optim's estimate test asserts and benchmarks/memory_estimate_optimizers.py
    records, per optimizer."""
    flags: dict[str, Any] = {"model": model_name}
    if model_name == "llama":
        flags = {"model": "hf:llama", "model_config": [f"{key}={value}" for key, value in llama.items()]}
    model_spec = ModelSpec.from_flags(flags)
    model = model_spec.build(seed=0).module
    optimizer = spec.build(model)
    engine = Engine(model, optimizer, precision="fp32", max_grad_norm=1.0)
    tokens = torch.randint(0, model_spec.shape.vocab_size, (micro, seq + 1), generator=torch.Generator().manual_seed(0))
    window = next(iter(iter_windows([{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}], 1)))
    engine.step(window)
    measured = measure_step(model, optimizer, lambda: engine.step(window), "cpu")
    estimate = estimate_for(model_spec, micro_batch_size=micro, seq_len=seq, precision="fp32", checkpointing="none",
                            optimizer=spec, full_logits=True)
    return measured, estimate
