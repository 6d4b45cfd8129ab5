# expect: CAD013 line 16
# exit: 1
"""scaler.update() is never called: the scale never adapts and torch raises at the second scaler.step."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for i in range(3):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # <- CAD013
    optimizer.zero_grad()
