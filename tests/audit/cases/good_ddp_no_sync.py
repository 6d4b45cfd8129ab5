# expect: none
"""DDP (gloo, world size 1): no_sync entered BEFORE the forward of every micro-step but the window's last."""
import contextlib
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
try:
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    accum = 3
    for step in range(3):
        for micro in range(accum):
            last = micro == accum - 1
            with contextlib.nullcontext() if last else model.no_sync():
                x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
                loss = F.cross_entropy(model(x), y, reduction="sum") * dist.get_world_size() / (4 * accum)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
finally:
    dist.destroy_process_group()
