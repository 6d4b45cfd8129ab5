"""Run under torchrun (2 gloo ranks) by tests/distributed/test_distributed.py: the same bf16 windows through FSDP2
sharded by ``wrap_model`` with ``precision="bf16"`` (bf16 parameters gathered, fp32 gradient reduction) and with
``precision="fp32"`` (fp32 parameters gathered, autocast casting them per matmul). Records the losses, the dtype of
the weights each block's forward saw, and the dtypes of the sharded parameters and gradients; writes JSON to argv[1]."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers' tiny model and data

from helpers import prompt_completion_dataset, tiny_model  # noqa: E402

from cadence.distributed.ranks import ProcessGroupCollective, start, stop, wrap_model  # noqa: E402
from cadence.engine.cut import Cut
from cadence.engine.step import Engine  # noqa: E402
from cadence.engine.windows import epoch_windows  # noqa: E402

STEPS, ACCUM = 3, 2


def run(ranks, wrap_precision: str) -> dict:
    device = torch.device("cpu")
    model = wrap_model(tiny_model(), ranks, device, precision=wrap_precision)
    seen: list[str] = []
    first_block = model.blocks[0]
    # A forward pre-hook registered after fully_shard runs after FSDP2's own (which all-gathers): it sees the
    # unsharded parameters the block computes with.
    first_block.register_forward_pre_hook(lambda module, args: seen.append(str(next(module.parameters()).dtype)))
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16", max_grad_norm=1.0,
                    collective=ProcessGroupCollective(ranks, device))
    grad_dtypes: set[str] = set()
    losses = []
    windows = epoch_windows(prompt_completion_dataset(count=64), cut=Cut(micro_batch_size=2), grad_accum_steps=ACCUM,
                            seed=0, epoch=0, world_size=ranks.world_size, rank=ranks.rank)
    for _, window in zip(range(STEPS), windows):
        # The gradients as the optimizer receives them: recorded just before it steps.
        handle = engine.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: grad_dtypes.update(
                str(p.grad.dtype) for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None))
        losses.append(engine.step(window).loss)
        handle.remove()
    return {"losses": losses, "forward_weight_dtypes": sorted(set(seen)), "grad_dtypes": sorted(grad_dtypes),
            "sharded_param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def main() -> None:
    ranks = start(device_type="cpu", strategy="fsdp", sync_every_micro_step=False, timeout_s=60)
    found = {name: run(ranks, name) for name in ("bf16", "fp32")}
    if ranks.is_main:
        Path(sys.argv[1]).write_text(json.dumps(found))
    stop(ranks)


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, which torch's gloo threads sometimes abort under load (see count_allreduce.py).
    sys.stdout.flush()
    os._exit(0)
