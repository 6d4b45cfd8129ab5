# expect: CAD020 line 12
"""10 micro-batches with accum 4: the last 2 backwards are never stepped (info)."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 4
for i in range(10):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    (F.cross_entropy(model(x), y, reduction="sum") / 16).backward()  # <- CAD020
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
