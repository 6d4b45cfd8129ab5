"""Issue 52 item 7, agreement where the peer is right: on equal micro-batches, cadence's sigmoid DPO, IPO and SimPO
losses equal TRL's (DPOTrainer; SimPO: CPOTrainer with loss_type="simpo" and no NLL term) over 5 steps, fp32, from the
same initial weights, in the same data order, with the same optimizer and learning rate (1e-5 relative).

The model is a 2-layer llama whose tokenizer has no merges (a text's ids are its bytes), so TRL, which tokenizes the
prompt and each completion together, and cadence, which tokenizes them apart, read the same ids. TRL walks the rows
in file order (train_sampling_strategy "sequential"): its file holds them in the order cadence draws them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import run_cli, write_preference_jsonl

from cadence.data.batching import epoch_order
from cadence.training.run_dir import read_metrics

pytest.importorskip("trl")
MICRO, ACCUM = 2, 2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    work = tmp_path_factory.mktemp("trl")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>", pad_token="<|pad|>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    write_preference_jsonl(work / "pairs.jsonl", 20)  # 5 steps of 2 x 2 pairs: every micro-batch holds 2
    rows = (work / "pairs.jsonl").read_text().splitlines()
    (work / "ordered.jsonl").write_text("".join(rows[i] + "\n" for i in epoch_order(len(rows), 0, 0).tolist()))
    return work


def cadence_losses(work: Path, objective: str, steps: int) -> list[float]:
    out = work / f"cadence-{objective}-{steps}"
    status, _, err = run_cli([
        "train", "--model", str(work / "model"), "--data", str(work / "pairs.jsonl"), "--data-cache",
        str(work / "cache"), "--objective", objective, "--micro-batch-size", str(MICRO), "--grad-accum-steps",
        str(ACCUM), "--max-steps", str(steps), "--lr", "1e-3", "--lr-schedule", "constant", "--weight-decay", "0",
        "--adam-beta2", "0.999", "--micro-batch-order", "drawn", "--seq-len", "128", "--out", str(out)])
    assert status == 0, err
    return [float(row["loss"]) for row in read_metrics(out)]


def trl_losses(work: Path, objective: str, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model and tokenizer are local
    rows = [json.loads(line) for line in (work / "ordered.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    common = dict(output_dir=str(work / f"trl-{objective}"), per_device_train_batch_size=MICRO,
                  gradient_accumulation_steps=ACCUM, max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant",
                  weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                  logging_steps=1, beta=0.1, train_sampling_strategy="sequential", report_to=[], save_strategy="no",
                  use_cpu=True, seed=0, dataloader_num_workers=0, bf16=False, fp16=False, warmup_steps=0)
    if objective == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer = CPOTrainer(model=model, args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5,
                                                         max_length=1024), train_dataset=Dataset.from_list(rows),
                             processing_class=tokenizer)
    else:
        from trl import DPOConfig, DPOTrainer

        loss_type = {"dpo": "sigmoid", "ipo": "ipo"}[objective]
        trainer = DPOTrainer(model=model, args=DPOConfig(**common, loss_type=[loss_type], max_length=None),
                             train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    return [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize(("objective", "steps"), [
    ("dpo", 2),
    pytest.param("dpo", 5, marks=pytest.mark.slow),
    pytest.param("ipo", 5, marks=pytest.mark.slow),
    pytest.param("simpo", 5, marks=pytest.mark.slow),
])
def test_on_equal_micro_batches_the_losses_are_trls(workspace, objective, steps):
    expected = trl_losses(workspace, objective, steps)
    assert len(expected) == steps
    assert cadence_losses(workspace, objective, steps) == pytest.approx(expected, rel=1e-5)
