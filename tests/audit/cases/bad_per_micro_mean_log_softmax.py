# expect: CAD018 line 17
"""A hand-written loss (no cross_entropy call): -log_softmax gathered at the targets, summed, divided by the
micro-batch's OWN target count, then by accum: a per-micro-batch mean over uneven target counts."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 2
for i, n in enumerate([16, 3, 12, 5]):
    x = torch.randn(16, 8)
    y = torch.randint(0, 4, (16,))
    mask = torch.arange(16) < n  # the rest is padding
    picked = -torch.log_softmax(model(x), -1).gather(1, y[:, None]).squeeze(1)
    loss = (picked * mask).sum() / mask.sum()
    loss = loss / accum
    loss.backward()  # <- CAD018
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
