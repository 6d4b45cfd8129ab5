# expect: CAD001 line 17
"""fp16 with a GradScaler, but the gradients are clipped while still multiplied by the loss scale."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
accum = 2
for step in range(3):
    for micro in range(accum):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y) / accum
        scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <- CAD001
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
