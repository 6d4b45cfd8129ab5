# expect: CAD004 line 14
# exit: 1
"""A helper unscales again after the loop already did: torch raises."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")


def clip(max_norm: float) -> None:
    scaler.unscale_(optimizer)  # <- CAD004
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


for i in range(3):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    clip(1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
