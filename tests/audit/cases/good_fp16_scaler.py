# expect: none
"""fp16 done right, including steps the scaler skips: the scheduler only follows real steps."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)  # the first steps overflow and are skipped
accum = 2
for window in range(6):
    for micro in range(accum):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y, reduction="sum") / (4 * accum)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scale = scaler.get_scale()
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if scaler.get_scale() >= scale:  # the scale dropped: the step was skipped
        scheduler.step()
