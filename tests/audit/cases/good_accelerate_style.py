# expect: none
"""Accelerate's accumulate() pattern written by hand: sync on the window's last micro-batch (or the data's last),
clip, step, schedule and zero there; bf16 autocast without a scaler."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=3)
batches = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(8)]
accum = 2
step = 0
for index, (x, y) in enumerate(batches):
    step += 1
    sync_gradients = step % accum == 0 or index == len(batches) - 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    (loss / accum).backward()
    if sync_gradients:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
