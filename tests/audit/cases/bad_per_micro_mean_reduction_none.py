# expect: CAD018 line 17
"""reduction="none", the padded positions dropped, then .mean() per micro-batch and / accum (nll_loss on
log_softmax): the mean runs over each micro-batch's own targets."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 2
for i, n in enumerate([16, 3, 12, 5]):
    x = torch.randn(16, 8)
    y = torch.randint(0, 4, (16,))
    y[n:] = -100
    per_target = F.nll_loss(F.log_softmax(model(x), -1), y, reduction="none")
    loss = per_target[y != -100].mean() / accum
    loss.backward()  # <- CAD018
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
