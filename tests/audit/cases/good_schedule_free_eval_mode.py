# expect: none
"""A schedule-free optimizer switched to eval mode (the averaged weights) to evaluate and to save, and back to train
mode to step."""
import io

import torch
import torch.nn.functional as F

from cadence.optim.schedule_free import ScheduleFreeAdamW

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = ScheduleFreeAdamW(model.parameters(), lr=1e-2)
for step in range(4):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    if step % 2 == 1:
        optimizer.eval()
        model.eval()
        with torch.no_grad():
            F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 4, (4,)))
        torch.save(model.state_dict(), io.BytesIO())
        model.train()
        optimizer.train()
