# expect: CAD021 line 16
"""Accelerate's documented loop by hand: every loss divided by the fixed accum (4), also in the short window (2 of 4
micro-batches) that ends each epoch: that window's gradient is 0.50x one big batch's."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=6)
loader = DataLoader(TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,))), batch_size=4)
accum = 4
for epoch in range(2):
    for i, (x, y) in enumerate(loader):
        (F.cross_entropy(model(x), y) / accum).backward()  # <- CAD021 (the window's first backward)
        if (i + 1) % accum == 0 or i == len(loader) - 1:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
