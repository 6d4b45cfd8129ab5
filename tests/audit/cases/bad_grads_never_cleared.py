# expect: CAD019 line 12
"""No zero_grad at all: every step re-applies all earlier gradients."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # <- CAD019
    optimizer.step()
