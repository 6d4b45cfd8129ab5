"""--lora-rank (issue 26 item 3): peft LoRA on a transformers model. Only the adapters get gradients and optimizer
state (and the summary counts them), --save-hf writes an adapter that peft loads onto its base with cadence's final
logits, a resumed run is the uninterrupted one, and the built-in GPT is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_cli, write_jsonl
from safetensors.torch import load_file

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.engine.step import Engine
from cadence.models.hf import build_hf_model
from cadence.models.lora import LoraSettings, apply_lora, parameter_counts
from cadence.optim.state import optimizer_state_bytes
from cadence.training.checkpoint import checkpoint_dirs
from cadence.training.components import build_optimizer
from cadence.training.run_dir import read_metrics

pytest.importorskip("peft")

SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 256, "max_position_embeddings": 128}
LLAMA = ["--model", "hf:llama", *[item for key, value in SIZES.items() for item in ("--model-config", f"{key}={value}")]]
BATCH = ["--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "2", "--val-fraction", "0",
         "--lr", "5e-3", "--checkpoint-every", "2"]


def base_model() -> torch.nn.Module:
    """hf:llama at SIZES as cadence builds it with --seed 0 (the base a saved adapter belongs to)."""
    torch.manual_seed(0)
    return build_hf_model("hf:llama", dict(SIZES)).model


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    data = write_jsonl(root / "data.jsonl", 64)
    common = [*LLAMA, "--data", str(data), "--data-cache", str(root / "cache"), *BATCH, "--max-steps", "4",
              "--lora-rank", "8"]
    status, _, err = run_cli(["train", *common, "--out", str(root / "run"), "--save-hf", str(root / "adapter")])
    assert status == 0, err
    return {"root": root, "run": root / "run", "adapter": root / "adapter", "common": common, "header": err}


def test_only_the_adapters_are_trained_and_the_summary_counts_them(lora_run) -> None:
    summary = json.loads((lora_run["run"] / "summary.json").read_text())
    model = apply_lora(base_model(), LoraSettings(rank=8))
    adapters = {name: p.numel() for name, p in model.named_parameters() if ".lora_" in name}
    # peft's default for llama: q_proj and v_proj of each of the 2 layers, an A (8 x 64) and a B (64 x 8) each.
    assert len(adapters) == 8 and sum(adapters.values()) == 2 * 2 * (8 * 64 + 64 * 8)
    assert summary["trainable_parameters"] == sum(adapters.values())
    assert summary["frozen_parameters"] == sum(p.numel() for p in base_model().parameters())
    assert summary["parameters"] == summary["trainable_parameters"] + summary["frozen_parameters"]
    # fp32 AdamW state: two moments per trained element, and a 4-byte step counter per trained tensor.
    assert summary["optimizer_state_bytes"] == 8 * summary["trainable_parameters"] + 4 * len(adapters)
    assert (f"{summary['trainable_parameters']:,} trained, {summary['frozen_parameters']:,} frozen"
            in lora_run["header"])
    # The frozen base did not move; the adapters did.
    final = load_file(str(lora_run["run"] / "model.safetensors"))
    start = model.state_dict()
    for name, tensor in final.items():
        assert torch.equal(tensor, start[name]) == (".lora_" not in name), name


def test_only_the_adapters_get_gradients_and_optimizer_state() -> None:
    model = apply_lora(base_model(), LoraSettings(rank=8, targets=("q_proj", "v_proj", "down_proj")))
    optimizer = build_optimizer(model, TrainConfig())
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    Engine(model, optimizer, precision="fp32", max_grad_norm=1.0).step([{"input_ids": ids[:, :-1],
                                                                        "labels": ids[:, 1:]}])
    with_state = {id(p) for p in optimizer.state}
    for name, param in model.named_parameters():
        assert (id(param) in with_state) == (".lora_" in name), name
        assert param.requires_grad == (".lora_" in name), name
    trained, frozen = parameter_counts(model)
    assert optimizer_state_bytes(optimizer) == 8 * trained + 4 * len(with_state) and frozen > 10 * trained
    # Gradients reach every adapter and no base weight (set_to_none after the step: run the backward alone).
    out = model(input_ids=ids[:, :-1]).logits
    torch.nn.functional.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten()).backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == (".lora_" in name), name


def test_the_saved_adapter_loads_with_peft_and_gives_cadences_logits(lora_run) -> None:
    from peft import PeftModel

    adapter = lora_run["adapter"]
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    loaded = PeftModel.from_pretrained(base_model(), str(adapter))
    ours = apply_lora(base_model(), LoraSettings(rank=8))
    ours.load_state_dict(load_file(str(lora_run["run"] / "model.safetensors")))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    loaded.eval()
    ours.eval()
    with torch.no_grad():
        theirs, mine = loaded(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(theirs, mine)
    assert not torch.equal(mine, base_model()(input_ids=ids).logits)  # the adapter changed the model


def test_a_resumed_lora_run_is_bitwise_the_uninterrupted_one(lora_run) -> None:
    cut = lora_run["root"] / "cut"
    common = lora_run["common"]
    assert main(["train", *common, "--out", str(cut)]) == 0
    for late in checkpoint_dirs(cut)[1:]:
        shutil.rmtree(late)
    assert main(["train", *common, "--out", str(cut), "--resume"]) == 0
    assert [r["loss"] for r in read_metrics(cut)] == [r["loss"] for r in read_metrics(lora_run["run"])]
    mine, theirs = load_file(str(cut / "model.safetensors")), load_file(str(lora_run["run"] / "model.safetensors"))
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    status, _, err = run_cli(["train", *common[:-1], "4", "--out", str(cut), "--resume"])  # --lora-rank 4
    assert status == 2 and "--lora-rank: 4 differs from the checkpoint's 8" in err


def test_lora_needs_a_transformers_model_and_names_its_flags(tmp_path) -> None:
    status, _, err = run_cli(["train", "--lora-rank", "8", "--max-steps", "1", "--out", str(tmp_path / "a")])
    assert status == 2 and "--lora-rank: LoRA adapts Hugging Face models" in err
    status, _, err = run_cli(["train", *LLAMA, "--lora-rank", "8", "--lora-targets", "nothing", "--max-steps", "1",
                              "--out", str(tmp_path / "b")])
    assert status == 2 and "--lora-targets:" in err and "q_proj" in err and "Traceback" not in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_bf16_base_is_the_same_math_in_less_memory(tmp_path) -> None:
    """--lora-base-precision bf16 under --precision bf16: autocast rounded the fp32 base weights to these very bf16
    values in every matmul, so the losses are bit for bit those of the fp32 base, at a lower peak."""
    data = write_jsonl(tmp_path / "data.jsonl", 32)
    runs = {}
    for base in ("fp32", "bf16"):
        runs[base] = tmp_path / base
        assert main(["train", *LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), *BATCH,
                     "--max-steps", "3", "--lora-rank", "8", "--precision", "bf16", "--lora-base-precision", base,
                     "--out", str(runs[base])]) == 0
    assert [r["loss"] for r in read_metrics(runs["bf16"])] == [r["loss"] for r in read_metrics(runs["fp32"])]
    peaks = {base: json.loads((run / "summary.json").read_text())["peak_memory_bytes"] for base, run in runs.items()}
    assert peaks["bf16"] < 0.85 * peaks["fp32"]
    weights = load_file(str(runs["bf16"] / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.base_layer.weight"].dtype == torch.bfloat16
    assert weights["model.layers.0.input_layernorm.weight"].dtype == torch.float32
    status, _, err = run_cli(["train", *LLAMA, "--lora-rank", "8", "--lora-base-precision", "bf16", "--max-steps",
                              "1", "--out", str(tmp_path / "refused")])
    assert status == 2 and "--lora-base-precision: bf16 needs --precision bf16" in err


def test_a_plan_with_lora_estimates_the_adapters_and_train_plan_trains_them(tmp_path) -> None:
    """LoRA is never a plan's candidate, but a plan asked for it measures with it: its estimates have a frozen base
    (no gradients, no optimizer state for it), plan.json records the adapters, and train --plan trains them."""
    data = write_jsonl(tmp_path / "data.jsonl", 32)
    common = [*LLAMA, "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "64",
              "--effective-batch-size", "4", "--memory-budget", "64MiB", "--precision", "fp32", "--max-trials", "1",
              "--trial-steps", "3", "--quality-steps", "3", "--rounds", "1"]
    status, _, err = run_cli(["plan", *common, "--lora-rank", "8", "--out", str(tmp_path / "lora")])
    assert status == 0, err
    status, _, err = run_cli(["plan", *common, "--out", str(tmp_path / "full")])
    assert status == 0, err
    lora, full = (json.loads((tmp_path / name / "plan.json").read_text()) for name in ("lora", "full"))
    assert lora["lora"]["lora_rank"] == 8 and full["lora"]["lora_rank"] == 0

    def state(plan: dict) -> int:
        return plan["candidates"][0]["estimated_by_category"]["optimizer_state"]

    assert 0 < state(lora) < state(full) / 20  # the adapters' moments only
    assert lora["candidates"][0]["estimated_by_category"]["gradients"] < \
        full["candidates"][0]["estimated_by_category"]["gradients"] / 20
    status, _, err = run_cli(["train", "--plan", str(tmp_path / "lora" / "plan.json"), "--data-cache",
                              str(tmp_path / "cache"), "--max-steps", "1", "--val-fraction", "0",
                              "--out", str(tmp_path / "run")])
    assert status == 0, err
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lora_rank"] == 8
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0 < summary["trainable_parameters"] < summary["frozen_parameters"]
    # A flag that contradicts the plan's adapters is an error, as any other.
    status, _, err = run_cli(["train", "--plan", str(tmp_path / "lora" / "plan.json"), "--lora-rank", "4",
                              "--out", str(tmp_path / "other")])
    assert status == 2 and "--lora-rank" in err


def test_an_adapter_of_a_model_directory_loads_with_auto_peft_from_another_directory(tmp_path, monkeypatch) -> None:
    """Issue 41 item 6: the exported adapter recorded its base as the path given (relative to where training ran),
    so AutoPeftModelForCausalLM failed from anywhere else; the base is now recorded as an absolute path. LoRA on a
    model built from its config (random weights) is said in a warning."""
    from peft import AutoPeftModelForCausalLM

    base = base_model()
    base.save_pretrained(tmp_path / "work" / "base")
    data = write_jsonl(tmp_path / "data.jsonl", 32)
    monkeypatch.chdir(tmp_path / "work")
    status, _, err = run_cli(["train", "--model", "base", "--data", str(data), *BATCH, "--max-steps", "2",
                              "--lora-rank", "4", "--out", str(tmp_path / "run"), "--save-hf", str(tmp_path / "adapter")])
    assert status == 0, err
    monkeypatch.chdir(tmp_path)
    recorded = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(tmp_path / "work" / "base")
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter"))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(loaded(ids).logits).all()
    status, _, err = run_cli(["train", *LLAMA, "--data", str(data), *BATCH, "--max-steps", "1", "--lora-rank", "4",
                              "--out", str(tmp_path / "random")])
    assert status == 0 and "the adapters are trained on a random model" in err
