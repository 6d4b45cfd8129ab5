"""Run under torchrun (2 gloo ranks) by tests/distributed/test_distributed.py: the gradient noise scale measured by
two ranks at fixed weights, for the windows of one epoch, under DDP with one and with two micro-batches per rank,
and under FSDP2 with and without --sync-every-micro-step. Rank 0 writes what it measured as JSON to argv[1], rank r
to argv[1].rank<r>.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers' tiny model and data

from helpers import tiny_model, variable_text_dataset  # noqa: E402

from cadence.distributed.ranks import ProcessGroupCollective, start, stop, wrap_model  # noqa: E402
from cadence.engine.cut import Cut  # noqa: E402
from cadence.engine.noise_scale import GradientNoiseScale  # noqa: E402
from cadence.engine.step import Engine  # noqa: E402
from cadence.engine.windows import epoch_windows  # noqa: E402

EMA = 0.9
CASES = {  # name: (strategy, sync every micro-step, micro-batch size, accumulation); windows of 8 samples
    "ddp_accum1": ("ddp", False, 4, 1),
    "ddp_accum2": ("ddp", False, 2, 2),
    "fsdp_sync_every_accum2": ("fsdp", True, 2, 2),
    "fsdp_accum2": ("fsdp", False, 2, 2),
}


def main() -> None:
    ranks = start(device_type="cpu", strategy="ddp", sync_every_micro_step=False, timeout_s=120)
    device = torch.device("cpu")
    dataset = variable_text_dataset(count=64)
    found = {}
    for name, (strategy, every, micro, accum) in CASES.items():
        case_ranks = dataclasses.replace(ranks, strategy=strategy, sync_every_micro_step=every)
        model = wrap_model(tiny_model(), case_ranks, device)
        collective = ProcessGroupCollective(case_ranks, device)
        collective.watch_local_gradients(model)
        meter = GradientNoiseScale(ema=EMA)
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0,
                        collective=collective, noise_scale=meter)
        terms, estimates = [], []
        for window in epoch_windows(dataset, cut=Cut(micro_batch_size=micro), grad_accum_steps=accum, seed=0,
                                    epoch=0, world_size=ranks.world_size, rank=ranks.rank):
            estimates.append(engine.step(window).grad_noise_scale)
            terms.append(None if meter.last is None else [meter.last.trace, meter.last.grad_sq])
        found[name] = {"terms": terms, "estimates": estimates, "why_none": meter.why_none(),
                       "problem": collective.first_gradient_problem(synced=accum == 1)}
    Path(sys.argv[1] + ("" if ranks.is_main else f".rank{ranks.rank}")).write_text(json.dumps(found))
    stop(ranks)


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, which torch's gloo threads sometimes abort under load (SIGABRT after all
    # the work is done); cadence's own rank entry point (cadence/__main__.py) does the same.
    sys.stdout.flush()
    os._exit(0)
