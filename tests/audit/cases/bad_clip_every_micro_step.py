# expect: CAD002 line 14
"""Clipping each micro-batch's partial gradient is not clipping the step's gradient."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 3
for i in range(9):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    loss = F.cross_entropy(model(x), y) / accum
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <- CAD002
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
