# expect: CAD008 line 12
"""model.zero_grad() between backward and step: the step sees no gradient at all."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for i in range(3):
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    F.cross_entropy(model(x), y).backward()
    model.zero_grad()  # <- CAD008
    optimizer.step()
