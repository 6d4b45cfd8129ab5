# expect: CAD027 line 28
"""KTO's reference point z estimated from each micro-batch's own mismatched (KL_) rows, with 2 micro-batches per
optimizer step (TRL's KTOTrainer with gradient accumulation): the objective itself changes with the split."""
import torch
from torch.utils.data import DataLoader

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
reference = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
rows = [(torch.randn(8), torch.randn(8), i % 2 == 0) for i in range(8)]


def collate(batch):
    return {"input_ids": torch.stack([x for x, _, _ in batch]), "KL_input_ids": torch.stack([k for _, k, _ in batch]),
            "label": torch.tensor([d for _, _, d in batch])}


loader = DataLoader(rows, batch_size=2, collate_fn=collate)
accum = 2
for i, batch in enumerate(loader):
    with torch.no_grad():  # z from this micro-batch alone
        z = (model(batch["KL_input_ids"]) - reference(batch["KL_input_ids"])).mean().clamp(min=0)
    gap = (model(batch["input_ids"]) - reference(batch["input_ids"])).squeeze(1)
    desirable = batch["label"]
    losses = torch.where(desirable, 1 - torch.sigmoid(0.1 * (gap - z)), 1 - torch.sigmoid(0.1 * (z - gap)))
    loss = losses.sum() / (2 * accum)
    loss.backward()  # <- CAD027
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
