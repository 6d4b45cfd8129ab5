# expect: none
"""Muon for the matrices and AdamW for the rest, each stepped once per window after the last backward, the raw
gradient clipped once before both: Newton-Schulz sees the window's whole gradient, once per step."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
muon = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
adamw = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-3)
for step in range(3):
    for micro in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        (F.cross_entropy(model(x), y, reduction="sum") / 16).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    muon.step()
    adamw.step()
    model.zero_grad()
