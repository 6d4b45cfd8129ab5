# expect: none
"""A DPO-style pair loss summed per micro-batch and divided by the window's pair count (cadence's reduction), on
micro-batches of 2, 2 and 1 pairs: every pair weighs the same, as in one big batch."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
pairs = [(torch.randn(8), torch.randn(8)) for _ in range(5)]


def collate(rows):
    return {"chosen_input_ids": torch.stack([c for c, _ in rows]), "rejected_input_ids": torch.stack([r for _, r in rows])}


loader = DataLoader(pairs, batch_size=2, collate_fn=collate)
window_pairs = len(pairs)  # the whole window's pairs, known before its first backward
for batch in loader:
    margin = model(batch["chosen_input_ids"]).squeeze(1) - model(batch["rejected_input_ids"]).squeeze(1)
    ((-F.logsigmoid(0.1 * margin)).sum() / window_pairs).backward()
optimizer.step()
optimizer.zero_grad()
