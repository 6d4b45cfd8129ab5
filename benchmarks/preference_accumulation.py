"""Benchmark (issue 52 item 7): how far TRL's gradient lies from the one-big-batch gradient where it accumulates
preference losses per micro-batch, and cadence's; and (item 3) the peak memory of the LoRA reference (the base with
its adapters off) against a frozen copy of the base.

Gradients. One window of preference rows (uneven lengths: completions of 2 to 30 bytes) on a 2-layer llama whose
tokenizer has no merges (a text's ids are its bytes, so TRL and cadence read the same ids), fp32 on CPU, from the
same initial weights, clipping off, DPO and KTO scored against a reference of other weights (a second llama, given to
TRL as ``ref_model`` and to cadence as ``--reference-model``: at the starting weights KTO's reference point would be 0
in every micro-batch). TRL's gradient is what its trainer hands its optimizer (captured in
``on_pre_optimizer_step``) when the window is cut into micro-batches, against the same trainer's gradient of the
window in one micro-batch (its own definition of the loss over one big batch); cadence's is the engine's accumulated
gradient of the same cut against its one-micro-batch gradient. Cases:

- DPO (sigmoid), 4 pairs as 2 + 2: equal micro-batches, where TRL is exact;
- DPO, 5 pairs as 2 + 2 + 1 (a short last micro-batch, as any epoch's end or a dropped pair gives): TRL weighs the
  lone pair twice;
- ORPO, 4 pairs as 2 + 2: equal pair counts, but the NLL term is a token mean per micro-batch in TRL;
- KTO, 6 rows as 2 + 2 + 2: the reference point is estimated per micro-batch in TRL, over the window in cadence.

Memory. `cadence train --objective dpo --lora-rank 8` on a llama of about 30M parameters, its reference the base with
the adapters off (no copy) against the same run with ``--reference-model`` naming the same base (a frozen copy),
each run in a process of its own: the peak of its steps from summary.json (the profiler's allocation replay on
CPU, the reference's weights counted as live), the process's peak RSS, and the two runs' losses.

    .venv/bin/python benchmarks/preference_accumulation.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_env import environment, write_results

from cadence.config import TrainConfig
from cadence.data.batching import epoch_order
from cadence.training.components import build_components
from cadence.training.prepare import prepare

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TRL and transformers read the local model; nothing is downloaded
CASES = (("dpo", 4, 2, "equal micro-batches"), ("dpo", 5, 2, "a short last micro-batch"),
         ("orpo", 4, 2, "equal pair counts"), ("kto", 6, 2, "equal micro-batches"))


def byte_llama(directory: Path, *, hidden: int, layers: int, seed: int = 0) -> Path:
    """A llama with a tokenizer of bytes and no merges, saved with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>", pad_token="<|pad|>")
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def rows(objective: str, count: int, seed: int = 3) -> list[dict[str, Any]]:
    """Preference rows of uneven lengths (completions of 2 to 30 bytes), in the order cadence draws them."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "step", "scale"]

    def completion(index: int) -> str:
        return "ok" if index % 3 == 0 else "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(20, 30)))

    made = []
    for index in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) + ":"
        made.append({"prompt": prompt, "completion": completion(index), "label": index % 3 != 2} if objective == "kto"
                    else {"prompt": prompt, "chosen": completion(index), "rejected": completion(index + 1) + "!"})
    return [made[i] for i in epoch_order(count, 0, 0).tolist()]


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].flatten().double() for name in sorted(grads)])


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float((flat(a) - flat(b)).norm() / flat(b).norm())


def trl_gradient(model_dir: Path, reference_dir: Path, objective: str, data: list[dict[str, Any]], micro: int,
                 work: Path) -> dict[str, torch.Tensor]:
    """The gradient TRL's trainer hands its optimizer for one window of ``data`` in micro-batches of ``micro``."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32)
    captured: dict[str, torch.Tensor] = {}

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not captured:
                captured.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    accumulation = -(-len(data) // micro)
    common = dict(output_dir=str(work / f"trl-{objective}-{micro}"), per_device_train_batch_size=micro,
                  gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1e-3, max_grad_norm=0.0,
                  train_sampling_strategy="sequential", report_to=[], save_strategy="no", use_cpu=True, seed=0,
                  dataloader_num_workers=0, bf16=False, fp16=False, logging_steps=1, beta=0.1)
    dataset = Dataset.from_list(data)
    if objective == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer: Any = DPOTrainer(model=model, ref_model=reference, train_dataset=dataset, processing_class=tokenizer,
                                  args=DPOConfig(**common, loss_type=["sigmoid"], max_length=None),
                                  callbacks=[Capture()])
    elif objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common, max_length=1024), train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Capture()])
    else:
        from trl import KTOConfig, KTOTrainer

        trainer = KTOTrainer(model=model, ref_model=reference, args=KTOConfig(**common, max_length=1024),
                             train_dataset=dataset, processing_class=tokenizer, callbacks=[Capture()])
    trainer.train()
    return captured


def cadence_gradient(model_dir: Path, reference_dir: Path, objective: str, data_file: Path, count: int, micro: int,
                     work: Path) -> dict[str, torch.Tensor]:
    """The engine's accumulated gradient of the window (all ``count`` rows) in micro-batches of ``micro``."""
    config = TrainConfig(model=str(model_dir), data=data_file, data_cache=work / "cache", objective=objective,
                         micro_batch_size=micro, grad_accum_steps=-(-count // micro), micro_batch_order="drawn",
                         seq_len=128, max_steps=1, out=work / f"unused-{objective}-{micro}", max_grad_norm=0.0,
                         noise_scale_ema=0.0, reference_model=reference_dir if objective != "orpo" else None)
    prep = prepare(config)
    parts = build_components(prep)
    window = next(prep.windows(0))
    parts.engine.accumulate(window, parts.engine.objective.window_units(window))
    return {name: p.grad.detach().clone() for name, p in parts.model.named_parameters() if p.grad is not None}


def gradients(model_dir: Path, reference_dir: Path, work: Path) -> list[dict[str, Any]]:
    found = []
    for objective, count, micro, what in CASES:
        data = rows(objective, count)
        data_file = work / f"{objective}-{count}.jsonl"
        data_file.write_text("".join(json.dumps(row) + "\n" for row in data))
        trl_split, trl_whole = (trl_gradient(model_dir, reference_dir, objective, data, m, work) for m in (micro, count))
        ours_split, ours_whole = (cadence_gradient(model_dir, reference_dir, objective, data_file, count, m, work)
                                  for m in (micro, count))
        sizes = [min(micro, count - at) for at in range(0, count, micro)]
        found.append({"objective": objective, "rows": count, "micro_batches": sizes, "case": what,
                      "trl": distance(trl_split, trl_whole), "cadence": distance(ours_split, ours_whole)})
        print(found[-1], flush=True)
    return found


def reference_memory(work: Path, *, hidden: int, layers: int) -> dict[str, Any]:
    """Peak memory and losses of a LoRA DPO run scored against its base with the adapters off, and against a frozen
    copy of the same base (--reference-model naming it)."""
    base = byte_llama(work / "base", hidden=hidden, layers=layers)
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows("dpo", 16)))
    found: dict[str, Any] = {}
    for name, extra in (("adapters off", []), ("frozen copy", ["--reference-model", str(base)])):
        out = work / name.replace(" ", "-")
        # A process of its own: its peak RSS is this run's alone.
        subprocess.run([sys.executable, "-m", "cadence", "train", "--model", str(base), "--data", str(data),
                        "--data-cache", str(work / "cache"), "--objective", "dpo", "--lora-rank", "8", "--seq-len",
                        "128", "--micro-batch-size", "2", "--grad-accum-steps", "2", "--max-steps", "3", "--out",
                        str(out), *extra], check=True, capture_output=True)
        summary = json.loads((out / "summary.json").read_text())
        losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        found[name] = {"peak_memory_bytes": summary["peak_memory_bytes"], "max_rss_bytes": summary["max_rss_bytes"],
                       "losses": losses}
    from transformers import AutoModelForCausalLM

    found["parameters"] = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base).parameters())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model for the memory comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = byte_llama(work / "model", hidden=32, layers=2)
        reference_dir = byte_llama(work / "reference", hidden=32, layers=2, seed=1)
        output = {"environment": environment(("transformers", "trl", "peft")),
                  "gradients": gradients(model_dir, reference_dir, work),
                  "memory": reference_memory(work, hidden=64 if args.quick else 384, layers=2 if args.quick else 6)}
    write_results("preference_accumulation", output, quick=args.quick)


if __name__ == "__main__":
    main()
