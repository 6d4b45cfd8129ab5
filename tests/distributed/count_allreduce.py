"""Run under torchrun (2 gloo ranks) by tests/test_distributed.py: counts DDP's gradient all-reduces with a
communication hook while cadence's engine runs windows of 4 micro-batches. Writes the counts as JSON to argv[1]."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers' tiny model and data

from helpers import prompt_completion_dataset, tiny_model  # noqa: E402

from cadence.distributed.ranks import ProcessGroupCollective, rank_device, start, stop, wrap_model  # noqa: E402
from cadence.engine.cut import Cut
from cadence.engine.step import Engine  # noqa: E402
from cadence.engine.windows import epoch_windows  # noqa: E402

STEPS, ACCUM = 3, 4


def main() -> None:
    ranks = start(device_type="cpu", strategy="ddp", sync_every_micro_step=False, timeout_s=60)
    device = rank_device(torch.device("cpu"), ranks)  # as docs/distributed.md's fragment of this file: cuda:LOCAL_RANK on GPUs
    model = wrap_model(tiny_model().to(device), ranks, device)
    calls: list[int] = []  # the engine's window count at each all-reduce

    # No `from __future__ import annotations` here: DDP checks this hook's annotations as real types.
    def counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(engine.windows)
        return default_hooks.allreduce_hook(state, bucket)  # type: ignore[arg-type]

    model.register_comm_hook(None, counting_hook)  # type: ignore[operator]
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0,
                    collective=ProcessGroupCollective(ranks, device))
    before_micro_batch: list[tuple[int, int]] = []  # (micro-batch index, all-reduces so far)
    windows = epoch_windows(prompt_completion_dataset(count=64), cut=Cut(micro_batch_size=2), grad_accum_steps=ACCUM,
                            seed=0, epoch=0, world_size=ranks.world_size, rank=ranks.rank)
    for _, window in zip(range(STEPS), windows):
        engine.step(window, on_micro_batch=lambda index: before_micro_batch.append((index, len(calls))))
    if ranks.is_main:
        Path(sys.argv[1]).write_text(json.dumps({
            "optimizer_steps": engine.steps, "all_reduces": len(calls), "windows_at_call": calls,
            "before_micro_batch": before_micro_batch,
        }))
    stop(ranks)


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, which torch's gloo threads sometimes abort under load (SIGABRT after all
    # the work is done); cadence's own rank entry point (cadence/__main__.py) does the same.
    sys.stdout.flush()
    os._exit(0)
