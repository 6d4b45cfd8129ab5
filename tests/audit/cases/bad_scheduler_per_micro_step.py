# expect: CAD005 line 14
"""The scheduler advances per micro-batch: the schedule runs accum times too fast."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
accum = 4
for i in range(12):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    (F.cross_entropy(model(x), y) / accum).backward()
    scheduler.step()  # <- CAD005
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
