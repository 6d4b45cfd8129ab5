# expect: CAD016 line 23
"""no_sync around backward only: DDP decided to all-reduce at forward time, so nothing is saved."""
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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accum = 2
    for i in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        loss = F.cross_entropy(model(x), y) / accum
        if (i + 1) % accum != 0:
            with model.no_sync():  # <- CAD016
                loss.backward()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
finally:
    dist.destroy_process_group()
