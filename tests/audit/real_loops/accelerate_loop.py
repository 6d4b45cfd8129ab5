"""Accelerate's documented gradient-accumulation loop on a tiny llama: 10 micro-batches of 2 rows x 12 tokens (equal
target counts), Accelerator(gradient_accumulation_steps=4): windows 4, 4 and a short last 2.

    python accelerate_loop.py            correct: the summed loss over the window's target count (Accelerate's own
                                         "loss normalisation" recipe; accelerator.backward divides by the 4 again,
                                         so the loss is multiplied by it)
    python accelerate_loop.py --broken   the documented `accelerator.backward(outputs.loss)`: every loss divided by the
                                         fixed 4, also in the short window (0.50x its gradient)
"""
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from tiny import llama, token_rows, tokenizer
from torch.utils.data import DataLoader

broken = "--broken" in sys.argv
accum = 4
accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
model = llama(len(tokenizer()))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
rows = token_rows(20, vocab_size=model.config.vocab_size)
loader = DataLoader(rows, batch_size=2)
# the correct form's divisor: the targets of each window (labels shifted by one, as the model shifts them)
targets = [int((row["labels"][1:] != -100).sum()) for row in rows]
micro_targets = [sum(targets[i:i + 2]) for i in range(0, len(targets), 2)]
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
for index, batch in enumerate(loader):
    with accelerator.accumulate(model):
        if broken:
            loss = model(**batch).loss
        else:
            start = index // accum * accum
            window_targets = sum(micro_targets[start:start + accum])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            summed = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum")
            loss = summed / window_targets * accum
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
