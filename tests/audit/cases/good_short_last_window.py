# expect: none
"""10 variable-length micro-batches with accum 4: windows of 4, 4 and a short last 2, each normalised by its own
target count (summed loss / window targets), so padding does not change the weights."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
micro_batches = []
for n in [16, 3, 12, 5, 16, 2, 9, 7, 11, 4]:
    y = torch.randint(0, 4, (16,))
    y[n:] = -100
    micro_batches.append((torch.randn(16, 8), y))
accum = 4
for start in range(0, len(micro_batches), accum):
    window = micro_batches[start:start + accum]
    targets = sum(int((y != -100).sum()) for _, y in window)
    for x, y in window:
        loss = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / targets
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
