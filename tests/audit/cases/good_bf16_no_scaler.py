# expect: none
"""bf16 autocast needs no GradScaler."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accum = 2
for window in range(3):
    for micro in range(accum):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y) / accum
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # evaluation: no backward, no scaler needed
        model(torch.randn(4, 8))
