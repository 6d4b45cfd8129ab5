# expect: none
"""The hand-written -log_softmax loss normalised right: summed over targets and divided by the WINDOW's target count
(uneven micro-batches, a short last window with its own count)."""
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
accum = 2
lengths = [16, 3, 12, 5, 7]
for start in range(0, len(lengths), accum):
    window = lengths[start:start + accum]
    for n in window:
        x = torch.randn(16, 8)
        y = torch.randint(0, 4, (16,))
        mask = torch.arange(16) < n
        picked = -torch.log_softmax(model(x), -1).gather(1, y[:, None]).squeeze(1)
        ((picked * mask).sum() / sum(window)).backward()
    optimizer.step()
    optimizer.zero_grad()
