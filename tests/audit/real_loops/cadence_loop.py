"""cadence's own Engine on the same data as accelerate_loop.py: the tiny llama, 10 micro-batches of 2 rows x 12 tokens,
accumulation 4 (windows 4, 4 and a short last 2, each normalised by its own target count)."""
import torch
from tiny import llama, token_rows, tokenizer

from cadence import Engine, iter_windows


class Logits(torch.nn.Module):
    """The llama's logits (cadence's loss reads logits; its labels are already shifted: the token after each)."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = llama(len(tokenizer()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=input_ids).logits


model = Logits()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine = Engine(model, optimizer, max_grad_norm=1.0)
rows = token_rows(20, vocab_size=model.llama.config.vocab_size)
micro_batches = []
for i in range(0, len(rows), 2):
    ids = torch.stack([row["input_ids"] for row in rows[i:i + 2]])
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    micro_batches.append({"input_ids": ids, "labels": labels})
for window in iter_windows(micro_batches, 4):
    engine.step(window)
