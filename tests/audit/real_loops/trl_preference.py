"""TRL's preference trainers on a tiny llama, each the right way and the buggy way (issue 52 item 6).

    python trl_preference.py OUT_DIR dpo            8 pairs in micro-batches of 2, accumulation 2: every
                                                    micro-batch holds 2 pairs (TRL is exact there)
    python trl_preference.py OUT_DIR dpo --broken   5 pairs in micro-batches of 2, accumulation 3: 2 + 2 + 1, each
                                                    micro-batch's pair mean divided by 3 (the lone pair weighs 2x)
    python trl_preference.py OUT_DIR orpo           one micro-batch of 4 pairs per optimizer step
    python trl_preference.py OUT_DIR orpo --broken  micro-batches of 2, accumulation 2: the NLL term is a token mean
                                                    per micro-batch over chosen completions of uneven lengths
    python trl_preference.py OUT_DIR kto            one micro-batch of 4 rows per optimizer step
    python trl_preference.py OUT_DIR kto --broken   micro-batches of 2, accumulation 2: each micro-batch estimates its
                                                    own reference point z
"""
import sys

from datasets import Dataset
from tiny import llama, texts, tokenizer

out, objective, broken = sys.argv[1], sys.argv[2], "--broken" in sys.argv
tok = tokenizer()
count = {"dpo": 5 if broken else 8, "orpo": 4, "kto": 4}[objective]
micro, accumulation = {"dpo": (2, 3 if broken else 2), "orpo": (2, 2) if broken else (4, 1),
                       "kto": (2, 2) if broken else (4, 1)}[objective]
prompts = texts(count, equal=True, seed=1)
# completions of 3 to 14 words: uneven chosen lengths
chosen, rejected = texts(count, equal=False, seed=2), texts(count, equal=False, seed=3)
common = dict(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
              num_train_epochs=1, learning_rate=1e-3, report_to="none", save_strategy="no", logging_steps=100,
              use_cpu=True, bf16=False, dataloader_num_workers=0, seed=0, disable_tqdm=True,
              train_sampling_strategy="sequential")
if objective == "dpo":
    from trl import DPOConfig, DPOTrainer

    rows = {"prompt": prompts, "chosen": [" " + c for c in chosen], "rejected": [" " + r for r in rejected]}
    # ref_model given: TRL would otherwise rebuild the reference from a hub name this in-memory model does not have
    trainer = DPOTrainer(model=llama(len(tok)), ref_model=llama(len(tok)), args=DPOConfig(**common),
                         processing_class=tok, train_dataset=Dataset.from_dict(rows))
elif objective == "orpo":
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    rows = {"prompt": prompts, "chosen": [" " + c for c in chosen], "rejected": [" " + r for r in rejected]}
    trainer = ORPOTrainer(model=llama(len(tok)), args=ORPOConfig(**common, max_length=64), processing_class=tok,
                          train_dataset=Dataset.from_dict(rows))
else:
    from trl import KTOConfig, KTOTrainer

    rows = {"prompt": prompts, "completion": [" " + c for c in chosen], "label": [i % 2 == 0 for i in range(count)]}
    trainer = KTOTrainer(model=llama(len(tok)), ref_model=llama(len(tok)), args=KTOConfig(**common, max_length=64),
                         processing_class=tok, train_dataset=Dataset.from_dict(rows))
trainer.train()
