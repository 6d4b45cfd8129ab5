"""transformers.Trainer on a tiny llama, micro-batches of 2, accumulation 4 over 20 examples (windows 4, 4, 2).

    python hf_trainer.py OUT_DIR [--equal] [--broken]
        --equal    20 rows of 12 tokens (every micro-batch holds the same target count), else 20 texts of uneven length
        --broken   model_accepts_loss_kwargs=False: the model's mean loss per micro-batch / accumulation
"""
import sys

from datasets import Dataset
from tiny import llama, texts, token_rows, tokenizer
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

out, broken, equal = sys.argv[1], "--broken" in sys.argv, "--equal" in sys.argv
tok = tokenizer()
if equal:
    rows = token_rows(20, vocab_size=len(tok))
    data = Dataset.from_dict({"input_ids": [row["input_ids"].tolist() for row in rows]})
else:
    data = Dataset.from_dict(dict(tok(texts(20, equal=False))))
args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                         num_train_epochs=1, learning_rate=1e-3, report_to="none", save_strategy="no",
                         logging_steps=100, use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
trainer = Trainer(model=llama(len(tok)), args=args, train_dataset=data,
                  data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
if broken:
    trainer.model_accepts_loss_kwargs = False
trainer.train()
