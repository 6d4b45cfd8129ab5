"""Shared fixtures: a tiny GPT, packed text and variable-length prompt/completion data."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from cadence.data import TokenDataset, make_example, pack_bytes
from cadence.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=256, context_length=40, n_layer=2, n_head=2, n_embd=32)


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def sample_text(num_bytes: int = 4000) -> bytes:
    rng = random.Random(1)
    words = ["window", "micro", "batch", "scale", "clip", "step", "token", "loss", "grad", "norm", "def", "return"]
    text = " ".join(rng.choice(words) for _ in range(num_bytes // 4))
    return text.encode()[:num_bytes]


@pytest.fixture
def packed_dataset() -> TokenDataset:
    """40 packed sequences of 16 tokens: every position is a target."""
    return pack_bytes(sample_text(40 * 16 + 1), 16)


def prompt_completion_dataset(count: int = 40, seed: int = 3) -> TokenDataset:
    """Variable-length examples whose target counts differ by 10x or more (2 .. 28 targets)."""
    rng = random.Random(seed)
    examples = []
    for index in range(count):
        prompt_len = rng.randint(1, 8)
        completion_len = 2 if index % 3 == 0 else rng.randint(20, 28)  # short and long completions mixed
        tokens = [rng.randrange(256) for _ in range(prompt_len + completion_len)]
        labels = [tokens[i + 1] if i + 1 >= prompt_len else -100 for i in range(len(tokens) - 1)]
        examples.append(make_example(tokens[:-1], labels))
    return TokenDataset(examples)


@pytest.fixture
def variable_dataset() -> TokenDataset:
    return prompt_completion_dataset()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while profiling: on 2 shared cores, OpenMP threads that spin-wait for a busy core make
    steps several times slower whenever another process runs. The memory measured does not depend on it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
