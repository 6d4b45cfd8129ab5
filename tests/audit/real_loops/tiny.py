"""Shared by the real-loop scripts: a 2-layer hidden-64 llama and a word-level tokenizer, both built offline (nothing
downloads), and small text / token data whose micro-batches hold uneven or equal target counts."""

from __future__ import annotations

import random

import torch

WORDS = ("the cat sat on a mat and then ran to see dog who was under big red tree near old house by river "
         "while sun rose over hill").split()
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


def tokenizer():  # type: ignore[no-untyped-def]
    """A word-level PreTrainedTokenizerFast over WORDS (pad, unk, bos, eos specials)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def llama(vocab_size: int, seed: int = 0):  # type: ignore[no-untyped-def]
    """LlamaForCausalLM: 2 layers, hidden 64, 4 heads, random weights (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def texts(count: int, *, equal: bool, seed: int = 0) -> list[str]:
    """``count`` sentences: of 3 to 14 words (uneven target counts once padded), or all of 8 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(8 if equal else rng.randint(3, 14))) for _ in range(count)]


def token_rows(count: int, *, length: int = 12, vocab_size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` examples of ``length`` random token ids, labels = input ids (the model shifts them): equal counts."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(4, vocab_size, (length,), generator=generator)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows
