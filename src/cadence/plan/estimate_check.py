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
from cadence.memory.choices import CheckpointingMode
from cadence.memory.estimate_for import estimate_for
from cadence.memory.measure import MeasuredMemory, measure_step
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models.spec import ModelSpec
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
