"""What every optimizer cadence owns does the same way at its ``step``: the closure, and DTensor shards.

One place for the ``step(closure)`` preamble that cadence's own optimizers (the bf16-state AdamW, the offload
wrapper, Muon, Schedule-Free AdamW) share, instead of a copy in each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What ``torch.optim.Optimizer.step(closure)`` returns: the closure's loss, computed with gradients enabled
    (``step`` itself runs under ``torch.no_grad``), or None without a closure. cadence's engine passes none; a
    user's loop may."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the storage an in-place update must write), or the tensor itself."""
    if type(tensor).__name__ != "DTensor":
        return tensor
    return tensor.to_local()  # type: ignore[attr-defined]  # a DTensor (told by its type's name)


def shard_index(param: torch.Tensor) -> int:
    """Which shard of an FSDP2-sharded parameter this process holds (0 for an ordinary tensor)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or type(param).__name__ != "DTensor":
        return 0
    coordinate = mesh.get_coordinate() or [0]
    return int(coordinate[0])
