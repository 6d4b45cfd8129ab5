# expect: CAD009 line 14
"""A second optimizer.step per window (here in a 'logging' branch) applies the same gradients twice."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    if i % 2 == 1:
        optimizer.step()  # <- CAD009
    optimizer.zero_grad()
