# expect: CAD014 line 20
# exit: 1
"""scaler.update() after every micro-batch: there is no step to update from (torch raises)."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
accum = 2
for i in range(4):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) / accum
    scaler.scale(loss).backward()
    if (i + 1) % accum == 0:
        scaler.step(optimizer)
        optimizer.zero_grad()
    scaler.update()  # <- CAD014
