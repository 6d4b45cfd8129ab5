"""PyTorch Lightning on a tiny llama: 16 micro-batches of 2 rows x 12 tokens (equal target counts),
accumulate_grad_batches=2, an LR scheduler stepped every optimizer step (interval "step").

    python lightning_loop.py OUT_DIR            correct: fp32
    python lightning_loop.py OUT_DIR --broken   fp16 mixed precision with a GradScaler that starts at 2**24: the first
                                                steps overflow and the scaler skips them, yet Lightning steps the
                                                scheduler after each (the schedule runs ahead of the optimizer)
    python lightning_loop.py OUT_DIR --short    fp32 on 9 micro-batches: the epoch ends in a window of 1, whose loss
                                                Lightning still divides by accumulate_grad_batches (0.50x)
"""
import sys

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision
from tiny import llama, token_rows, tokenizer
from torch.utils.data import DataLoader

out, broken, short = sys.argv[1], "--broken" in sys.argv, "--short" in sys.argv


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = llama(len(tokenizer()))

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**24))] if broken else []
trainer = pl.Trainer(default_root_dir=out, accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                     plugins=plugins, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(TinyLM(), DataLoader(token_rows(18 if short else 32, vocab_size=len(tokenizer())), batch_size=2))
