# expect: CAD025 line 23
"""A DPO-style pair loss averaged per micro-batch / accum, on micro-batches of 2, 2 and 1 pairs (TRL's DPOTrainer
reduction): the lone pair of the last micro-batch weighs twice the others."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
pairs = [(torch.randn(8), torch.randn(8)) for _ in range(5)]


def collate(rows):  # TRL's older layout: the chosen and rejected sequences under keys of their own
    return {"chosen_input_ids": torch.stack([c for c, _ in rows]), "rejected_input_ids": torch.stack([r for _, r in rows])}


loader = DataLoader(pairs, batch_size=2, collate_fn=collate)
accum = 3
for i, batch in enumerate(loader):
    margin = model(batch["chosen_input_ids"]).squeeze(1) - model(batch["rejected_input_ids"]).squeeze(1)
    loss = (-F.logsigmoid(0.1 * margin)).mean() / accum  # per pair, then the micro-batch mean
    loss.backward()  # <- CAD025
    if (i + 1) % accum == 0 or i == len(loader) - 1:
        optimizer.step()
        optimizer.zero_grad()
