"""Run under torchrun (2 gloo ranks) by tests/distributed/test_preference_ranks.py: every preference objective for one
epoch of 20 uneven samples (windows of 8, 8 and a short 4), each rank holding its share of each window in
micro-batches of one sample, under DDP, with plain SGD. Rank 0 writes the losses as JSON to argv[1] and each
objective's final weights to argv[1].<objective>.safetensors.
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers' tiny model and data

from helpers import preference_samples, tiny_model  # noqa: E402

from cadence.distributed.ranks import ProcessGroupCollective, start, stop, wrap_model  # noqa: E402
from cadence.engine.cut import Cut  # noqa: E402
from cadence.engine.objective import Objective  # noqa: E402
from cadence.engine.reference import FrozenReference  # noqa: E402
from cadence.engine.step import Engine  # noqa: E402
from cadence.engine.windows import epoch_windows  # noqa: E402

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")


def main() -> None:
    ranks = start(device_type="cpu", strategy="ddp", sync_every_micro_step=False, timeout_s=120)
    device = torch.device("cpu")
    found = {}
    for name in OBJECTIVES:
        samples = preference_samples(name)
        policy = tiny_model()
        reference = FrozenReference(model=tiny_model(seed=1).eval(), targets_only=True)
        objective = Objective(name=name).for_model(policy, vocab_size=256).with_reference(reference)
        model = wrap_model(policy, ranks, device)
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.5), objective=objective,
                        collective=ProcessGroupCollective(ranks, device))
        windows = epoch_windows(samples, cut=Cut(micro_batch_size=1), grad_accum_steps=4, seed=0, epoch=0,
                                world_size=ranks.world_size, rank=ranks.rank)
        found[name] = [engine.step(window).loss for window in windows]
        if ranks.is_main:
            save_file({key: value.clone() for key, value in policy.state_dict().items()},
                      sys.argv[1] + f".{name}.safetensors")
    if ranks.is_main:
        Path(sys.argv[1]).write_text(json.dumps(found))
    stop(ranks)


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, which torch's gloo threads sometimes abort under load (as noise_scale_ranks.py).
    sys.stdout.flush()
    os._exit(0)
