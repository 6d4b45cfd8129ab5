# expect: CAD024 line 19, CAD024 line 23
"""A schedule-free optimizer's model evaluated and saved without optimizer.eval(): the weights are the gradient
point y, not the averaged x it is meant to be evaluated and kept at (schedule_free #48, accelerate #4159)."""
import io

import torch
import torch.nn.functional as F

from cadence.optim.schedule_free import ScheduleFreeAdamW

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = ScheduleFreeAdamW(model.parameters(), lr=1e-2)
for step in range(3):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
model.eval()  # <- CAD024
with torch.no_grad():
    F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 4, (4,)))
model.train()
torch.save(model.state_dict(), io.BytesIO())  # <- CAD024
