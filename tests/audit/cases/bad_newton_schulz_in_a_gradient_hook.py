# expect: CAD022 line 16
"""Each micro-batch's gradient orthogonalised as it is accumulated (a gradient hook, as ZeRO-3's Muon did): the
orthogonalisation of a sum is not the sum of the orthogonalisations."""
import torch
import torch.nn.functional as F
from torch.optim._muon import _zeropower_via_newtonschulz

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
coefficients = (3.4445, -4.7750, 2.0315)


def orthogonalise(param: torch.Tensor) -> None:
    if param.ndim == 2:
        param.grad.copy_(_zeropower_via_newtonschulz(param.grad, coefficients, 5, 1e-7))  # <- CAD022


for param in model.parameters():
    param.register_post_accumulate_grad_hook(orthogonalise)
for step in range(3):
    for micro in range(4):
        x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
        (F.cross_entropy(model(x), y, reduction="sum") / 16).backward()
    optimizer.step()
    optimizer.zero_grad()
