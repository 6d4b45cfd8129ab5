# expect: CAD006 line 14
"""scheduler.step() before optimizer.step(): torch's own warning case; the first LR value is skipped."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
for i in range(4):
    optimizer.zero_grad()
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    scheduler.step()  # <- CAD006
    optimizer.step()
