# expect: CAD023 line 21
"""An orthogonalising optimizer that clips after making its update: clipping the orthogonalised update divides it by
its own norm (DeepSpeed #8439: an attenuation of 4.2x at hidden 128, 85.6x at 8192)."""
import torch
import torch.nn.functional as F
from torch.optim._muon import _zeropower_via_newtonschulz

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class OrthogonalisedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            p.grad.copy_(_zeropower_via_newtonschulz(p.grad, (3.4445, -4.7750, 2.0315), 5, 1e-7))
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # <- CAD023
        for p in params:
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


optimizer = OrthogonalisedSGD([p for p in model.parameters() if p.ndim == 2], lr=0.02)
for step in range(3):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    model.zero_grad()
