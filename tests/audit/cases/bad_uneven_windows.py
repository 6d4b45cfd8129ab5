# expect: CAD010 line 14
"""Off by one: `i % accum == 0` steps after the very first micro-batch, then every accum micro-batches."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 4
for i in range(13):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    torch.autograd.backward(F.cross_entropy(model(x), y) / accum)
    if i % accum == 0:
        optimizer.step()  # <- CAD010
        optimizer.zero_grad()
