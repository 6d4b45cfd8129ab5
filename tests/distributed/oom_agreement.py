"""Run under torchrun (2 gloo ranks) by tests/test_distributed.py: rank 1 alone runs out of memory on micro-batches
of more than 2 sequences; with the engine's out-of-memory agreement both ranks retry the window at 2 and stay in
step. Writes what each rank saw as JSON to argv[1] (rank 0 gathers)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers' tiny model and data

from helpers import prompt_completion_dataset, tiny_model  # noqa: E402

from cadence.distributed.ranks import ProcessGroupCollective, start, stop, wrap_model  # noqa: E402
from cadence.engine.cut import Cut
from cadence.engine.step import Engine, token_cross_entropy_sum  # noqa: E402
from cadence.engine.windows import Batch, epoch_windows  # noqa: E402
from cadence.training.autobatch import MicroBatchController  # noqa: E402


def main() -> None:
    ranks = start(device_type="cpu", strategy="ddp", sync_every_micro_step=False, timeout_s=20)
    device = torch.device("cpu")
    model = wrap_model(tiny_model(), ranks, device)

    def loss_fn(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        if ranks.rank == 1 and batch["labels"].shape[0] > 2:  # a smaller GPU on rank 1
            raise torch.OutOfMemoryError("rank 1 ran out of memory (simulated)")
        return token_cross_entropy_sum(model, batch)

    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0, loss_fn=loss_fn,
                    collective=ProcessGroupCollective(ranks, device), agree_on_out_of_memory=True)
    controller = MicroBatchController(cut=Cut(micro_batch_size=4), grow_after=1000, log=lambda text: None)
    retries = []
    windows = epoch_windows(prompt_completion_dataset(count=64), cut=Cut(micro_batch_size=4), grad_accum_steps=2,
                            seed=0, epoch=0, world_size=ranks.world_size, rank=ranks.rank)
    losses = []
    for _, window in zip(range(3), windows):
        result, retried = controller.step(engine, window)
        retries.append(retried)
        losses.append(result.loss)
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(ranks.world_size)]
    dist.all_gather(gathered, checksum)
    if ranks.is_main:
        Path(sys.argv[1]).write_text(json.dumps({
            "retries": retries, "final_micro_batch_size": controller.current, "steps": engine.steps,
            "losses": losses, "weight_checksums": [float(t) for t in gathered],
        }))
    stop(ranks)


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, which torch's gloo threads sometimes abort under load (SIGABRT after all
    # the work is done); cadence's own rank entry point (cadence/__main__.py) does the same.
    sys.stdout.flush()
    os._exit(0)
