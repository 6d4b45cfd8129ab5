"""Several processes: torchrun's ranks, DDP / FSDP2 wrapping, when gradients sync, and launching N ranks."""

from cadence.distributed.launch import launch
from cadence.distributed.ranks import (
    SINGLE,
    ProcessGroupCollective,
    Ranks,
    rank_device,
    start,
    stop,
    torchrun_ranks,
    unwrap,
    wrap_model,
)

__all__ = ["SINGLE", "ProcessGroupCollective", "Ranks", "launch", "rank_device", "start", "stop", "torchrun_ranks",
           "unwrap", "wrap_model"]
