"""TRL's SFTTrainer on a tiny llama: 20 texts of uneven length, micro-batches of 2, accumulation 4 (windows 4, 4, 2).

    python trl_sft.py OUT_DIR            correct: the loss is the summed per-token loss / num_items_in_batch
    python trl_sft.py OUT_DIR --broken   model_accepts_loss_kwargs=False: each micro-batch's loss is divided by its
                                         OWN label count, then by the accumulation (a per-micro-batch mean)
"""
import sys

from datasets import Dataset
from tiny import llama, texts, tokenizer
from trl import SFTConfig, SFTTrainer

out, broken = sys.argv[1], "--broken" in sys.argv
tok = tokenizer()
args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=4, num_train_epochs=1,
                 learning_rate=1e-3, max_length=32, report_to="none", save_strategy="no", logging_steps=100,
                 use_cpu=True, bf16=False, dataloader_num_workers=0, seed=0, disable_tqdm=True)
trainer = SFTTrainer(model=llama(len(tok)), args=args, processing_class=tok,
                     train_dataset=Dataset.from_dict({"text": texts(20, equal=False)}))
if broken:
    trainer.model_accepts_loss_kwargs = False
trainer.train()
