"""Several processes: torchrun's ranks, DDP / FSDP2 wrapping, when gradients sync, and launching N ranks."""

from __future__ import annotations

from cadence.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "cadence.distributed.launch": ("launch",),
    "cadence.distributed.torchrun": ("torchrun_ranks",),
    "cadence.distributed.ranks": (
        "SINGLE", "ProcessGroupCollective", "Ranks", "rank_device", "start", "stop", "unwrap",
        "wrap_model"),
})
