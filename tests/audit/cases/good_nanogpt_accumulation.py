# expect: none
"""nanoGPT's loop: fixed-length sequences, loss / accum, fp16 GradScaler, unscale then clip, manual LR."""
import math

import torch
import torch.nn.functional as F

torch.manual_seed(0)
vocab, block, accum, max_iters = 16, 8, 4, 3
model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler("cpu", enabled=True)
ctx = torch.autocast("cpu", dtype=torch.float16)


def get_batch():
    data = torch.randint(0, vocab, (2, block + 1))
    return data[:, :-1], data[:, 1:]


def get_lr(it: int) -> float:
    return 1e-3 * 0.5 * (1 + math.cos(math.pi * it / max_iters))


X, Y = get_batch()
for iter_num in range(max_iters):
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num)
    for micro_step in range(accum):
        with ctx:
            logits = model(X)
            loss = F.cross_entropy(logits.view(-1, vocab), Y.reshape(-1), ignore_index=-1) / accum
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
