# expect: CAD018 line 16
"""Mean cross_entropy per micro-batch / accum, with padding: short micro-batches' targets weigh more."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 2
lengths = [16, 3, 12, 5, 16, 2]  # targets per micro-batch; the rest of the 16 positions is padding (-100)
for i, n in enumerate(lengths):
    x = torch.randn(16, 8)
    y = torch.randint(0, 4, (16,))
    y[n:] = -100
    loss = F.cross_entropy(model(x), y, ignore_index=-100) / accum
    loss.backward()  # <- CAD018
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
