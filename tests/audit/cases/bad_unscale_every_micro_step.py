# expect: CAD003 line 17, CAD002 line 18
# exit: 1
"""unscale_ after every micro-batch: torch raises on the second one (unscale_ already called since update)."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
accum = 2
for i in range(6):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) / accum
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # <- CAD003
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <- CAD002
    if (i + 1) % accum == 0:
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
