# expect: CAD008 line 11
"""zero_grad at the top of every micro-batch: only the last micro-batch's gradient reaches the step."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 4
for i in range(8):
    optimizer.zero_grad()  # <- CAD008
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    (F.cross_entropy(model(x), y) / accum).backward()
    if (i + 1) % accum == 0:
        optimizer.step()
