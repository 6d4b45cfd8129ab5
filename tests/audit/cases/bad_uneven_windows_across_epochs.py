# expect: CAD010 line 17, CAD020 line 15
"""The micro-step counter restarts each epoch, so the leftover micro-batches join the next epoch's first window."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,)))
loader = DataLoader(data, batch_size=4)  # 10 micro-batches per epoch
accum = 4
for epoch in range(3):
    for i, (x, y) in enumerate(loader):
        (F.cross_entropy(model(x), y) / accum).backward()
        if (i + 1) % accum == 0:
            optimizer.step()  # <- CAD010
            optimizer.zero_grad()
