"""Issue 37 (part): chat conversations through the token store. The trained tokens the chat mask finds are stored as
spans, read back as labels, and the loss over them equals an independent computation: the token mean over exactly each
assistant message's content and its end-of-turn marker, found in the rendered text by string search alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cadence.data.batching import IGNORE_INDEX, collate
from cadence.data.chat import tokenize_conversation
from cadence.data.chat_template import ChatTemplate
from cadence.data.conversation import parse_conversation
from cadence.data.hf import ByteTokenizer
from cadence.data.splits import splits_from_store
from cadence.data.store import StoreWriter, TokenStore
from cadence.models.gpt import GPT, GPTConfig

pytest.importorskip("jinja2")

CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?"},
                  {"role": "assistant", "content": "Rome, of course."}]},
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
    {"prompt": [{"role": "user", "content": "Say hi"}], "completion": [{"role": "assistant", "content": "hi!"}]},
    {"messages": [{"role": "user", "content": "Count to three"},
                  {"role": "assistant", "content": "one two", "train": False},
                  {"role": "user", "content": "go on"},
                  {"role": "assistant", "content": "three"}]},
]


def _store(tmp_path: Path) -> tuple[TokenStore, list[str]]:
    template, tokenizer = ChatTemplate.chatml(), ByteTokenizer()
    writer = StoreWriter(tmp_path / "chat", kind="examples", vocab_size=256)
    texts = []
    for row, record in enumerate(CONVERSATIONS, start=1):
        for example in tokenize_conversation(parse_conversation(record), template, tokenizer):
            writer.add_example("train", list(example.ids), loss_start=0, row=row, spans=example.trained)
            texts.append(example.text)
    writer.finish({"fingerprint": "sha256:test"})
    return TokenStore.open(tmp_path / "chat"), texts


def _expected_targets(text: str, record: dict) -> list[int]:
    """Byte positions of the trained tokens, found without the mask code: each trained assistant reply and the
    <|im_end|> after it, located in the ChatML rendering by searching for the whole turn."""
    messages = record.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]}
                                          for m in record.get("conversations", [])] \
        or record["prompt"] + record["completion"]
    targets, at = [], 0
    for message in messages:
        turn = f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>"
        start = text.index(turn, at)
        at = start + len(turn)
        if message["role"] == "assistant" and message.get("train", True):
            content_start = start + len(f"<|im_start|>{message['role']}\n")
            targets += range(content_start, at)  # the content and the end-of-turn marker, not the "\n" after it
    return targets


def test_the_first_step_loss_is_the_token_mean_over_each_assistant_reply_and_its_end_of_turn(tmp_path: Path) -> None:
    store, texts = _store(tmp_path)
    dataset = splits_from_store(store, seq_len=256, val_fraction=0.0, from_cache=False).train
    examples = list(dataset)
    assert len(examples) == len(CONVERSATIONS)
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=256, context_length=256, n_layer=1, n_head=2, n_embd=16))
    batch = collate(examples)
    with torch.no_grad():
        logits = model(batch["input_ids"])
    ours = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    # Independent: ids are the rendering's bytes; token k is a target of position k - 1.
    losses = []
    for row, (text, record) in enumerate(zip(texts, CONVERSATIONS)):
        ids = torch.tensor(list(text.encode("utf-8")))
        assert examples[row].input_ids.tolist() == ids[:-1].tolist()
        with torch.no_grad():
            row_logits = model(ids[None, :-1])[0]
        positions = torch.tensor(_expected_targets(text, record))
        losses.append(F.cross_entropy(row_logits[positions - 1], ids[positions], reduction="none"))
    independent = torch.cat(losses).mean()
    assert dataset.num_targets == sum(len(loss) for loss in losses)
    assert ours.item() == pytest.approx(independent.item(), rel=1e-5)
