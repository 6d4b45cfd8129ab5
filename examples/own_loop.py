"""Your own model, data and loop; cadence's engine does the step chain.

Run: python examples/own_loop.py
"""

import torch
from torch import nn

from cadence import Engine, build_lr_scheduler, iter_windows

torch.manual_seed(0)
vocab, seq_len = 64, 16
model = nn.Sequential(nn.Embedding(vocab, 32), nn.Linear(32, vocab))  # any module returning [B, T, vocab] logits
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=5, max_steps=40)
engine = Engine(model, optimizer, scheduler=scheduler, precision="bf16", max_grad_norm=1.0)


def micro_batches(count: int, size: int):
    """Variable-length examples: labels are -100 where there is no loss (padding, prompts)."""
    for _ in range(count):
        input_ids = (torch.randint(0, vocab, (size, 1)) + torch.arange(seq_len)) % vocab  # counting sequences
        labels = (input_ids + 1) % vocab  # next token
        labels[:, torch.randint(2, seq_len, ()).item():] = -100  # a padded tail: no loss there
        yield {"input_ids": input_ids, "labels": labels}


# 40 optimizer steps, each a window of 4 micro-batches of 8 sequences (effective batch 32).
for window in iter_windows(micro_batches(count=160, size=8), grad_accum_steps=4):
    result = engine.step(window)  # loss / window targets, backward x4, unscale, clip once, step, schedule
    if result.step % 10 == 0 or result.skipped:
        print(f"step {result.step}: loss {result.loss:.3f}, grad norm {result.grad_norm:.2f}, lr {result.lr:.2e}")
print(f"{engine.steps} optimizer steps, {engine.skipped_steps} skipped")
