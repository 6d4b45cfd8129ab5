"""Issue 37: chat conversations through `cadence train`: the model directory's own chat template (ChatML without
generation markers), an exact assistant-only loss, the same losses under any split or cut, two ranks, and bad chat
data refused in one line before anything is written."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli

from cadence.cli import main
from cadence.training.run_dir import read_metrics

pytest.importorskip("jinja2")
pytest.importorskip("transformers")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Qwen-style ChatML with no {% generation %} markers: transformers' assistant mask is all zeros on it."""


def conversations(count: int = 24, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    words = ["step", "chain", "window", "clip", "norm", "micro", "batch", "loss", "token", "mean"]
    rows = []
    for index in range(count):
        messages = [{"role": "system", "content": "Answer briefly."}] if index % 3 == 0 else []
        for turn in range(1 + index % 3):
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 9))) + "?"})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))})
        if index % 4 == 1:
            rows.append({"conversations": [{"from": {"user": "human", "assistant": "gpt", "system": "system"}[m["role"]],
                                            "value": m["content"]} for m in messages]})
        else:
            rows.append({"messages": messages})
    return rows


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama saved with a ChatML tokenizer (special <|im_start|>, <|im_end|>; its chat template has no
    generation markers), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(str(m.get("content", m.get("value"))) for m in row.get("messages",
                                 row.get("conversations", []))) for row in conversations()] * 3, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id))
    directory = tmp_path_factory.mktemp("chat_model") / "model"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def independent_loss(directory: Path, rows: list[dict]) -> float:
    """The token-mean loss over exactly each assistant message's content and its <|im_end|>, computed apart from
    cadence: transformers' own apply_chat_template renders the conversation, a string search finds each assistant
    turn, the tokenizer's offsets say which tokens fall in it, and the model scores them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    losses = []
    for row in rows:
        messages = row.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]),
                                            "content": m["value"]} for m in row["conversations"]]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
        trained, at = [], 0
        for message in messages:
            turn = f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>"
            start = text.index(turn, at)
            at = start + len(turn)
            if message["role"] == "assistant":
                trained.append((start + len(f"<|im_start|>{message['role']}\n"), at))
        positions = [k for k, (a, _) in enumerate(offsets) if k > 0 and any(s <= a < e for s, e in trained)]
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]])).logits[0]
        targets = torch.tensor(positions)
        losses.append(F.cross_entropy(logits[targets - 1], torch.tensor(ids)[targets], reduction="none"))
    return float(torch.cat(losses).mean())


def test_the_first_step_loss_is_the_mean_over_assistant_replies_and_their_end_of_turn(model_dir, tmp_path):
    """The acceptance: multi-turn messages (and ShareGPT rows) on a model directory whose ChatML template has no
    generation markers; all examples in one window, fp32: the first step's loss equals the independent one."""
    rows = conversations(16)
    data = write_rows(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "run"
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--seq-len", "200",
                 "--micro-batch-size", "16", "--grad-accum-steps", "1", "--max-steps", "1", "--val-fraction", "0",
                 "--out", str(out), "--data-cache", str(tmp_path / "cache")]) == 0
    (row,) = read_metrics(out)
    assert row["loss"] == pytest.approx(independent_loss(model_dir, rows), rel=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert "chat JSONL file" in config["data_description"] and "ChatML" not in config["data_description"]


CUTS = [("8x1", ["--micro-batch-size", "8", "--grad-accum-steps", "1"]),
        ("2x4", ["--micro-batch-size", "2", "--grad-accum-steps", "4"]),
        ("1x8", ["--micro-batch-size", "1", "--grad-accum-steps", "8"]),
        ("by-length", ["--micro-batch-size", "2", "--grad-accum-steps", "4", "--micro-batch-order", "by-length"]),
        ("budget", ["--micro-batch-size", "2", "--grad-accum-steps", "4", "--micro-batch-tokens", "400"]),
        ("packed", ["--micro-batch-size", "2", "--grad-accum-steps", "4", "--packing"])]


@pytest.mark.slow
def test_splits_and_cuts_give_the_same_losses_on_chat_data(tmp_path):
    """8x1 / 2x4 / 1x8, by length, a token budget and packing: the same losses (fp32, 1e-6) on chat data with the
    byte-level model and the ChatML default, where examples have several trained spans each."""
    data = write_rows(tmp_path / "chat.jsonl", conversations(32))
    losses = {}
    for name, cut in CUTS:
        out = tmp_path / name
        assert main(["train", "--data", str(data), "--seq-len", "256", "--too-long", "truncate", "--max-steps", "3",
                     "--val-fraction", "0", "--lr", "3e-3", *cut, "--out", str(out),
                     "--data-cache", str(tmp_path / "cache")]) == 0
        losses[name] = [row["loss"] for row in read_metrics(out)]
    for name, values in losses.items():
        assert values == pytest.approx(losses["8x1"], rel=1e-6), name


@pytest.mark.slow
def test_two_ranks_give_the_one_process_losses_on_chat_data(tmp_path):
    data = write_rows(tmp_path / "chat.jsonl", conversations(32))
    common = ["--data", str(data), "--seq-len", "256", "--too-long", "truncate", "--max-steps", "3",
              "--val-fraction", "0", "--lr", "3e-3", "--data-cache", str(tmp_path / "cache")]
    assert main(["train", *common, "--micro-batch-size", "4", "--grad-accum-steps", "2", "--out",
                 str(tmp_path / "one")]) == 0
    result = subprocess.run([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", *common,
                             "--micro-batch-size", "2", "--grad-accum-steps", "2", "--out", str(tmp_path / "two")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    one, two = ([row["loss"] for row in read_metrics(tmp_path / name)] for name in ("one", "two"))
    assert two == pytest.approx(one, rel=1e-6)


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_DATA = [
    ("messages not a list", {"messages": "hi"}, "--data", "not a list"),
    ("unknown role", {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "--data", "unknown role 'robot'"),
    ("content not a string", {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
     "--data", "not a string"),
    ("empty messages", {"messages": []}, "--data", "empty"),
]


@pytest.mark.parametrize("name, bad, flag, words", BAD_DATA, ids=[case[0] for case in BAD_DATA])
def test_bad_chat_rows_are_refused_in_one_line_and_nothing_is_written(tmp_path, name, bad, flag, words):
    data = write_rows(tmp_path / "chat.jsonl", [GOOD, GOOD, bad, GOOD])
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "64", "--max-steps", "1",
                              "--out", str(tmp_path / "run"), "--data-cache", str(tmp_path / "cache")])
    assert status == 2 and f"{data}:3" in err and words in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
    assert not [p for p in (tmp_path / "cache" / "stores").iterdir() if not p.name.startswith(".")]


TEMPLATES = [
    ("raises", "{{ raise_exception('this template takes no system turn') }}", "this template takes no system turn"),
    ("sandbox escape", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "cannot be used"),
    ("no turn end", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}", "cannot be used"),
]


@pytest.mark.parametrize("name, template, words", TEMPLATES, ids=[case[0] for case in TEMPLATES])
def test_a_template_that_cannot_be_used_is_refused_naming_it(tmp_path, name, template, words):
    data = write_rows(tmp_path / "chat.jsonl", [GOOD] * 4)
    (tmp_path / "t.jinja").write_text(template)
    status, _, err = run_cli(["train", "--data", str(data), "--chat-template", str(tmp_path / "t.jinja"),
                              "--seq-len", "64", "--max-steps", "1", "--out", str(tmp_path / "run"),
                              "--data-cache", str(tmp_path / "cache")])
    assert status == 2 and "--chat-template" in err and words in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_no_assistant_turn_anywhere_is_refused_and_some_are_skipped_and_counted(tmp_path):
    user_only = {"messages": [{"role": "user", "content": "hi"}]}
    data = write_rows(tmp_path / "none.jsonl", [user_only] * 3)
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "64", "--max-steps", "1",
                              "--out", str(tmp_path / "run")])
    assert status == 2 and "has no examples" in err and "line 1" in err and not (tmp_path / "run").exists()
    data = write_rows(tmp_path / "some.jsonl", [GOOD, user_only] * 4)
    status, _, err = run_cli(["train", "--data", str(data), "--seq-len", "128", "--max-steps", "1",
                              "--val-fraction", "0", "--out", str(tmp_path / "ok")])
    assert status == 0, err
    description = json.loads((tmp_path / "ok" / "config.json").read_text())["data_description"]
    assert "8 conversations" in description and ", 4 examples" in description


@pytest.mark.parametrize("data_kind, flag", [("text", "--train-on"), ("text", "--messages-field"),
                                             ("chat", "--text-field"), ("chat", "--prompt-field")])
def test_a_data_flag_that_does_not_apply_is_refused(tmp_path, data_kind, flag):
    if data_kind == "text":
        data = tmp_path / "d.jsonl"
        data.write_text("".join(json.dumps({"text": "some text here"}) + "\n" for _ in range(8)))
    else:
        data = write_rows(tmp_path / "d.jsonl", [GOOD] * 8)
    value = {"--train-on": "last"}.get(flag, "other")
    status, _, err = run_cli(["train", "--data", str(data), flag, value, "--seq-len", "64", "--max-steps", "1",
                              "--out", str(tmp_path / "run")])
    assert status == 2 and flag in err and "Traceback" not in err and not (tmp_path / "run").exists()


def test_train_on_last_trains_only_the_final_reply(tmp_path):
    data = write_rows(tmp_path / "chat.jsonl", conversations(12))
    counts = {}
    for train_on in ("assistant", "last", "all"):
        out = tmp_path / train_on
        assert main(["train", "--data", str(data), "--train-on", train_on, "--seq-len", "256", "--too-long",
                     "truncate", "--micro-batch-size", "12", "--grad-accum-steps", "1", "--max-steps", "1",
                     "--val-fraction", "0", "--out", str(out), "--data-cache", str(tmp_path / "cache")]) == 0
        counts[train_on] = read_metrics(out)[0]["targets"]
    assert counts["last"] < counts["assistant"] < counts["all"]


def test_save_hf_exports_the_template_the_model_was_trained_under(model_dir, tmp_path):
    """The exported tokenizer renders conversations as the run did: the byte-level llama gets the ChatML default,
    the model directory keeps its own template (so transformers' apply_chat_template works unchanged)."""
    from transformers import AutoTokenizer

    from cadence.data.chat_template import ChatTemplate

    llama = ["--model", "hf:llama", "--model-config", "hidden_size=32", "--model-config", "intermediate_size=64",
             "--model-config", "num_hidden_layers=2", "--model-config", "num_attention_heads=4",
             "--model-config", "num_key_value_heads=2", "--model-config", "vocab_size=256",
             "--model-config", "max_position_embeddings=256"]
    data = write_rows(tmp_path / "chat.jsonl", conversations(8))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    for name, model in (("bytes", llama), ("own", ["--model", str(model_dir)])):
        export = tmp_path / f"export-{name}"
        assert main(["train", *model, "--data", str(data), "--seq-len", "200", "--too-long", "truncate",
                     "--max-steps", "1", "--val-fraction", "0", "--save-hf", str(export),
                     "--out", str(tmp_path / f"run-{name}")]) == 0
        rendered = AutoTokenizer.from_pretrained(export).apply_chat_template(messages, tokenize=False)
        expected = ChatTemplate.chatml().render(messages) if name == "bytes" else \
            AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, tokenize=False)
        assert rendered == expected


def test_prepare_data_shows_the_mask_before_training(tmp_path):
    data = write_rows(tmp_path / "chat.jsonl", [GOOD] * 3)
    status, out, err = run_cli(["prepare-data", "--data", str(data), "--data-cache", str(tmp_path / "cache")])
    assert status == 0, err
    assert "chat: 3 conversations, 3 assistant turns" in out
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n[[hello<|im_end|>]]\n" in out


def test_a_pad_token_that_is_the_eos_never_masks_a_real_eos(model_dir, tmp_path):
    """cadence pads by position: with pad == EOS (a common setting, trl#1623) every assistant turn's real end is
    still a target after padding; a warning says so."""
    from transformers import AutoTokenizer

    from cadence.data.batching import collate
    from cadence.data.source import Source, open_source

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.eos_token
    rows = conversations(6)
    data = write_rows(tmp_path / "chat.jsonl", rows)
    with pytest.warns(UserWarning, match="pad token is its end of sequence"):
        splits = open_source(Source.from_flags({"data": data}), tokenizer, seq_len=200, val_fraction=0.0,
                             cache_dir=tmp_path / "cache")
    batch = collate(list(splits.train))
    turns = sum(1 for row in rows for m in row.get("messages", row.get("conversations", []))
                if m.get("role", m.get("from")) in ("assistant", "gpt"))
    assert int((batch["labels"] == tokenizer.eos_token_id).sum()) == turns
    assert len({len(example.input_ids) for example in splits.train}) > 1  # the batch was padded


def test_a_parquet_of_conversations_trains_as_the_same_jsonl_does(model_dir, tmp_path):
    """Chat rows in a datasets source (parquet here) go through the same conversation writer: the same examples and
    the same first loss as the .jsonl file of the same rows; a chat flag on a dataset without conversations is
    refused naming it."""
    import datasets

    rows = [row for row in conversations(12) if "messages" in row]
    jsonl = write_rows(tmp_path / "chat.jsonl", rows)
    parquet = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    losses = []
    for data in (jsonl, parquet):
        out = tmp_path / data.suffix[1:]
        assert main(["train", "--model", str(model_dir), "--data", str(data), "--seq-len", "200",
                     "--micro-batch-size", str(len(rows)), "--grad-accum-steps", "1", "--max-steps", "1",
                     "--val-fraction", "0", "--out", str(out), "--data-cache", str(tmp_path / "cache")]) == 0
        losses.append(read_metrics(out)[0]["loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    text = tmp_path / "text.parquet"
    datasets.Dataset.from_list([{"text": "plain text"}] * 8).to_parquet(str(text))
    status, _, err = run_cli(["train", "--model", str(model_dir), "--data", str(text), "--train-on", "last",
                              "--max-steps", "1", "--out", str(tmp_path / "refused"),
                              "--data-cache", str(tmp_path / "cache")])
    assert status == 2 and "--train-on" in err and not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_a_chat_run_resumed_after_sigterm_is_the_uninterrupted_one_and_plan_measures_chat_data(tmp_path):
    """Issue 37 item 8: exact resume on chat data (the spans come back from the same store), and cadence plan
    prepares and measures chat data like any other."""
    from helpers import sigterm_at

    data = write_rows(tmp_path / "chat.jsonl", conversations(32))
    common = ["train", "--data", str(data), "--seq-len", "256", "--too-long", "truncate", "--micro-batch-size", "2",
              "--grad-accum-steps", "2", "--max-steps", "4", "--val-fraction", "0", "--checkpoint-every", "100",
              "--data-cache", str(tmp_path / "cache")]
    assert main([*common, "--out", str(tmp_path / "whole")]) == 0
    with sigterm_at(2, 1):
        assert main([*common, "--out", str(tmp_path / "cut")]) == 0
    assert main([*common, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    whole, cut = (read_metrics(tmp_path / name) for name in ("whole", "cut"))
    assert [row["loss"] for row in cut] == [row["loss"] for row in whole]
    status, _, err = run_cli(["plan", "--data", str(data), "--seq-len", "256", "--too-long", "truncate",
                              "--memory-budget", "256MiB", "--effective-batch-size", "4", "--time-budget", "60",
                              "--out", str(tmp_path / "plan"), "--data-cache", str(tmp_path / "cache")])
    assert status == 0, err
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["source"]["train_on"] == "assistant" and "chat JSONL file" in plan["data"]
