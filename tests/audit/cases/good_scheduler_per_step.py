# expect: none
"""A DataLoader over 2 epochs of 10 micro-batches, accum 4: a short window ends each epoch; the scheduler steps once
per optimizer step; each loss is divided by its window's own micro-batch count (4, or 2 in the short one)."""
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
        in_window = min(accum, len(loader) - i // accum * accum)
        (F.cross_entropy(model(x), y) / in_window).backward()
        if (i + 1) % accum == 0 or i == len(loader) - 1:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
