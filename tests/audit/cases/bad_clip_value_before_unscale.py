# expect: CAD001 line 15
"""clip_grad_value_ (imported from torch.nn.utils.clip_grad) on scaled fp16 gradients."""
import torch
from torch.nn.utils.clip_grad import clip_grad_value_

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    clip_grad_value_(model.parameters(), 0.5)  # <- CAD001
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
