# expect: none
"""A per-micro-batch mean (mean cross_entropy / accum) is exact when every micro-batch holds the same number of
targets: no padding, windows of 4, 4 and a short last 2 divided by its own micro-batch count."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(10)]
accum = 4
for i, (x, y) in enumerate(data):
    in_window = min(accum, len(data) - i // accum * accum)
    (F.cross_entropy(model(x), y) / in_window).backward()
    if (i + 1) % accum == 0 or i == len(data) - 1:
        optimizer.step()
        optimizer.zero_grad()
