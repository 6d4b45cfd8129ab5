"""Hugging Face models and datasets through `cadence train` (offline: configs built in the test)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import sigterm_at

from cadence.cli import main
from cadence.training.run_dir import read_metrics

LLAMA = ["--model", "hf:llama", "--model-config", "hidden_size=32", "--model-config", "intermediate_size=64",
         "--model-config", "num_hidden_layers=2", "--model-config", "num_attention_heads=4",
         "--model-config", "num_key_value_heads=2", "--model-config", "vocab_size=256",
         "--model-config", "max_position_embeddings=64"]


def uneven_jsonl(path: Path) -> Path:
    rng = random.Random(11)
    lines = []
    for index in range(32):
        completion = "ok" if index % 3 == 0 else "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(22, 30)))
        lines.append(json.dumps({"prompt": f"q{index}:", "completion": completion}))
    path.write_text("\n".join(lines) + "\n")
    return path


def train(tmp_path: Path, name: str, *extra: str) -> Path:
    out = tmp_path / name
    assert main(["train", *extra, "--seq-len", "48", "--max-steps", "3", "--val-fraction", "0", "--lr", "3e-3",
                 "--out", str(out)]) == 0
    return out


def test_llama_splits_agree_through_the_cli(tmp_path):
    data = uneven_jsonl(tmp_path / "pc.jsonl")
    big = train(tmp_path, "8x1", *LLAMA, "--data", str(data), "--micro-batch-size", "8", "--grad-accum-steps", "1")
    small = train(tmp_path, "1x8", *LLAMA, "--data", str(data), "--micro-batch-size", "1", "--grad-accum-steps", "8")
    rows_big, rows_small = read_metrics(big), read_metrics(small)
    assert len({row["targets"] for row in rows_big}) > 1
    for a, b in zip(rows_small, rows_big):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    config = json.loads((big / "config.json").read_text())
    assert config["model"] == "hf:llama" and config["model_parameters"] > 0
    # Length-aware cuts of the same windows (issue 15): by length, and by a token budget of 96 positions.
    # Packing: position ids restart at 0 per example; cadence's attention runs each example on its own.
    for name, extra in (("sorted", ("--micro-batch-order", "by-length")), ("budget", ("--micro-batch-tokens", "96")),
                        ("packed", ("--packing",))):
        cut = train(tmp_path, name, *LLAMA, "--data", str(data), "--micro-batch-size", "2", "--grad-accum-steps", "4",
                    *extra)
        for a, b in zip(read_metrics(cut), rows_big, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["tokens"] == b["tokens"]


def test_model_directory_round_trip_with_save_hf(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "start")
    data = uneven_jsonl(tmp_path / "pc.jsonl")
    out = train(tmp_path, "run", "--model", str(tmp_path / "start"), "--data", str(data),
                "--save-hf", str(tmp_path / "saved"))
    from safetensors.torch import load_file

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", local_files_only=True).eval()
    ours = AutoModelForCausalLM.from_config(config)
    ours.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    ours.eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ours(ids).logits)
        start = AutoModelForCausalLM.from_pretrained(tmp_path / "start", local_files_only=True).eval()
        assert not torch.equal(start(ids).logits, ours(ids).logits)  # it really trained


def test_a_byte_level_llama_exported_with_save_hf_has_the_tokenizer_it_trained_on(tmp_path):
    """Issue 30: --save-hf of a byte-level model writes a tokenizer whose ids are the ones cadence trained on, and the
    prompt/completion examples it trained on end with that tokenizer's EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cadence.data import BYTE_EOS_ID, IGNORE_INDEX
    from cadence.data.jsonl import read_jsonl

    data = uneven_jsonl(tmp_path / "pc.jsonl")
    train(tmp_path, "run", *LLAMA, "--data", str(data), "--save-hf", str(tmp_path / "saved"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    examples, _ = read_jsonl(data, 48)
    for line, example in zip(data.read_text().splitlines(), examples):
        record = json.loads(line)
        trained_on = example.input_ids.tolist() + example.labels.tolist()[-1:]
        assert tokenizer(record["prompt"] + record["completion"])["input_ids"] + [tokenizer.eos_token_id] == trained_on
        assert example.labels[-1] == BYTE_EOS_ID == tokenizer.eos_token_id
        assert (example.labels != IGNORE_INDEX).sum() == len(record["completion"]) + 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", local_files_only=True)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_saved_dataset_trains_and_a_missing_field_is_named(tmp_path, capsys):
    import datasets

    rows = {"text": [f"example number {i} " * (1 + i % 4) for i in range(40)]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    out = train(tmp_path, "run", "--data", f"hf:{tmp_path / 'ds'}", "--micro-batch-size", "4")
    assert len(read_metrics(out)) == 3
    # The tokens are in the default token-store cache (conftest points HOME at a throw-away folder), not the run.
    stored = json.loads((out / "config.json").read_text())["data_store"]
    assert Path(stored).parent == Path.home() / ".cache" / "cadence" / "data" / "stores"
    code = main(["train", "--data", f"hf:{tmp_path / 'ds'}", "--text-field", "body", "--seq-len", "48",
                 "--out", str(tmp_path / "bad")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--text-field" in err and "body" in err and "text" in err and not (tmp_path / "bad").exists()


def test_cli_llama_run_equals_a_hand_written_loop(tmp_path):
    """Acceptance: `cadence train` on a tiny llama equals a plain PyTorch loop (one big batch per step, mean loss over
    its targets) over the same transformers model, data order, AdamW, clipping and schedule."""
    import torch.nn.functional as F

    from cadence.config import TrainConfig
    from cadence.data import collate, epoch_order
    from cadence.data.jsonl import read_jsonl
    from cadence.engine.schedules import build_lr_scheduler
    from cadence.models.hf import build_hf_model, parse_model_overrides
    from cadence.training.components import build_optimizer

    data = uneven_jsonl(tmp_path / "pc.jsonl")
    run = train(tmp_path, "cli", *LLAMA, "--data", str(data), "--micro-batch-size", "2", "--grad-accum-steps", "4")
    overrides = parse_model_overrides([LLAMA[i + 1] for i, item in enumerate(LLAMA) if item == "--model-config"])
    torch.manual_seed(0)
    model = build_hf_model("hf:llama", overrides).model
    config = TrainConfig(lr=3e-3, max_steps=3)
    optimizer = build_optimizer(model, config)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=0, max_steps=3, min_lr_ratio=0.1)
    examples, _ = read_jsonl(data, 48)
    order = epoch_order(len(examples), 0, 0).tolist()
    losses = []
    for step in range(3):
        batch = collate([examples[i] for i in order[step * 8:(step + 1) * 8]])
        logits = model(batch["input_ids"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    for row, expected in zip(read_metrics(run), losses):
        assert row["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_resumed_run_replaces_its_own_export_and_a_foreign_one_is_refused_before_training(tmp_path, capsys):
    """Issue 30's scenario: a run with --save-hf stopped by SIGTERM exports too; its --resume then trained to the end
    and failed there ("export already exists"), leaving the final model unexported, exit 2. Now the resumed run
    replaces its own export (summary.json records it); any other non-empty --save-hf is refused before a step."""
    from safetensors.torch import load_file

    data = uneven_jsonl(tmp_path / "pc.jsonl")
    export = tmp_path / "export"
    common = ["train", *LLAMA, "--data", str(data), "--seq-len", "48", "--max-steps", "4", "--val-fraction", "0",
              "--checkpoint-every", "100", "--save-hf", str(export), "--out", str(tmp_path / "run")]
    with sigterm_at(2, 1):
        assert main(common) == 0
    first = load_file(str(export / "model.safetensors"))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["save_hf"] == str(export)
    assert main([*common, "--resume"]) == 0
    final = load_file(str(tmp_path / "run" / "model.safetensors"))
    exported = load_file(str(export / "model.safetensors"))
    assert len(read_metrics(tmp_path / "run")) == 4
    assert set(exported) & set(final) and all(torch.equal(exported[name], final[name]) for name in exported if name in final)
    assert any(not torch.equal(exported[name], first[name]) for name in exported)  # replaced by the final model
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export", "pc.jsonl", "run"]  # nothing left aside
    capsys.readouterr()
    other = [arg if arg != str(tmp_path / "run") else str(tmp_path / "other") for arg in common]
    assert main(other) == 2  # another run into the same export: refused up front
    assert "--save-hf" in capsys.readouterr().err and not (tmp_path / "other" / "metrics.jsonl").exists()
