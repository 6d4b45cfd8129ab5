# expect: CAD026 line 29
"""ORPO-style: the chosen completions' NLL as a token mean per micro-batch (nn.CrossEntropyLoss's default), on
micro-batches of equal pair counts but uneven chosen lengths: short completions' tokens weigh more."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
lengths = [16, 14, 3, 2]  # chosen tokens of each pair; the rest of the 16 positions is padding (-100)


def collate(rows):
    chosen = torch.randn(len(rows), 16, 8)
    labels = torch.randint(0, 4, (len(rows), 16))
    for row, n in enumerate(rows):
        labels[row, n:] = -100
    return {"chosen_input_ids": chosen, "chosen_labels": labels, "rejected_input_ids": torch.randn(len(rows), 16, 8)}


loader = DataLoader(lengths, batch_size=2, collate_fn=collate)
accum = 2
for i, batch in enumerate(loader):
    logits = model(batch["chosen_input_ids"])
    nll = F.cross_entropy(logits.flatten(0, 1), batch["chosen_labels"].flatten(), ignore_index=-100)
    odds = model(batch["chosen_input_ids"]).mean((1, 2)) - model(batch["rejected_input_ids"]).mean((1, 2))
    loss = (nll - 0.1 * F.logsigmoid(odds).mean()) / accum
    loss.backward()  # <- CAD026
    if (i + 1) % accum == 0:
        optimizer.step()
        optimizer.zero_grad()
