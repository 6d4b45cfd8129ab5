# expect: none
"""cadence's own Engine under the audit: fp16 with clipping, accumulation of 3, a scheduler, a short last window."""
import torch

from cadence import Engine, iter_windows

torch.manual_seed(0)


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
engine = Engine(model, optimizer, scheduler=scheduler, precision="fp16", max_grad_norm=1.0)
micro_batches = []
for n in [6, 3, 6, 2, 5, 6, 4, 6]:
    ids = torch.randint(0, 16, (2, 6))
    labels = torch.roll(ids, -1, dims=1)  # cadence's convention: the target of position t is the token after it
    labels[:, n - 1:] = -100
    micro_batches.append({"input_ids": ids, "labels": labels})
for window in iter_windows(micro_batches, 3):
    engine.step(window)
