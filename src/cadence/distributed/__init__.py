"""Several processes: torchrun's ranks, DDP / FSDP2 wrapping, when gradients sync, and launching N ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cadence.lazy import lazy_exports

if TYPE_CHECKING:  # the type checker's view of the names below (a test keeps the two the same)
    from cadence.distributed.launch import launch
    from cadence.distributed.ranks import (
        SINGLE,
        ProcessGroupCollective,
        Ranks,
        rank_device,
        start,
        stop,
        unwrap,
        wrap_model,
    )
    from cadence.distributed.torchrun import torchrun_ranks

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.distributed.launch": ("launch",),
    "cadence.distributed.torchrun": ("torchrun_ranks",),
    "cadence.distributed.ranks": (
        "SINGLE", "ProcessGroupCollective", "Ranks", "rank_device", "start", "stop", "unwrap",
        "wrap_model"),
})
