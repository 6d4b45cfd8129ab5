# expect: none
"""Plain lists (no DataLoader) over 3 epochs of 10 micro-batches, accum 4: windows 4, 4, 2 in every epoch; a
ReduceLROnPlateau stepped once per epoch; each loss is divided by its window's own micro-batch count."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1)
data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(10)]
accum = 4
for epoch in range(3):
    total = 0.0
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y)
        (loss / min(accum, len(data) - i // accum * accum)).backward()
        total += loss.item()
        if (i + 1) % accum == 0 or i == len(data) - 1:
            optimizer.step()
            optimizer.zero_grad()
    plateau.step(total)
