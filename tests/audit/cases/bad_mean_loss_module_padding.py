# expect: CAD018 line 27
"""Hugging Face style: nn.CrossEntropyLoss (mean) over right-padded prompt/completion batches, loss / accum."""
import torch
from torch.utils.data import DataLoader

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss_fn = torch.nn.CrossEntropyLoss()  # reduction="mean", ignore_index=-100
examples = [torch.randint(0, 16, (n,)) for n in (12, 3, 10, 2, 12, 4, 9, 3)]


def collate(batch):
    width = max(len(e) for e in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100)
    for row, e in enumerate(batch):
        ids[row, : len(e)] = e
        labels[row, 1 : len(e)] = e[1:]  # completion tokens only; padding ignored
    return ids, labels


accum = 2
for i, (ids, labels) in enumerate(DataLoader(examples, batch_size=2, collate_fn=collate)):
    logits = model(ids)
    loss = loss_fn(logits.flatten(0, 1), labels.flatten()) / accum
    loss.backward()  # <- CAD018
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
