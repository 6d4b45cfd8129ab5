# expect: CAD022 line 19
"""Muon stepped after every micro-batch beside an AdamW stepped once per window: Newton-Schulz orthogonalises each
micro-batch's accumulated gradient instead of the window's (DeepSpeed #8443: weights 1e-1 away from one step)."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
matrices = [p for p in model.parameters() if p.ndim == 2]
others = [p for p in model.parameters() if p.ndim != 2]
muon = torch.optim.Muon(matrices, lr=0.02)
adamw = torch.optim.AdamW(others, lr=1e-3)
accumulation = 4
for step in range(3):
    for micro in range(accumulation):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        loss = F.cross_entropy(model(x), y, reduction="sum") / (4 * accumulation)
        loss.backward()
        muon.step()  # <- CAD022
        muon.zero_grad()
    adamw.step()
    adamw.zero_grad()
