"""Hugging Face batch conventions in the engine: unshifted labels refused or shifted, attention_mask passed, and left
padding giving every example the loss it has alone (issue 17 item 5)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from cadence import Engine, iter_windows, shift_hf_labels, token_cross_entropy_sum  # noqa: E402
from cadence.errors import CadenceFailure  # noqa: E402


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=64))


def examples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (length,), generator=generator) for length in (5, 12, 9)]


def hf_batch(rows: list[torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    """What a Hugging Face collator gives: labels = input_ids (-100 on padding), an attention_mask."""
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, where], mask[i, where] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def alone(model: torch.nn.Module, row: torch.Tensor) -> torch.Tensor:
    """transformers' own loss of one unpadded example, as a sum over its targets."""
    return model(row[None], labels=row[None]).loss * (len(row) - 1)


@pytest.mark.parametrize("build", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_hf_batches_give_every_example_its_own_loss(build, side: str) -> None:
    model = build()
    batch = shift_hf_labels(hf_batch(examples(), side))
    with torch.no_grad():
        together = token_cross_entropy_sum(model, batch)
        separately = sum(alone(model, row) for row in examples())
    assert together.item() == pytest.approx(separately.item(), rel=1e-5)


def test_left_padding_without_positions_would_be_wrong_for_absolute_positions() -> None:
    """What makes the test above sharp for gpt2: passing only the mask (positions counted from the pads) differs."""
    model = gpt2()
    batch = shift_hf_labels(hf_batch(examples(), "left"))
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        naive = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        right = token_cross_entropy_sum(model, batch)
    assert abs(naive.item() - right.item()) > 1e-3 * right.item()


def test_hf_labels_window_matches_transformers_own_loss_and_gradient() -> None:
    ours, theirs = gpt2(), gpt2()
    batch = hf_batch(examples(), "right")
    (window,) = iter_windows([batch], grad_accum_steps=1, hf_labels=True)
    assert window.targets == sum(len(row) - 1 for row in examples())  # counted as transformers counts them
    engine = Engine(ours, torch.optim.SGD(ours.parameters(), lr=1.0))  # one plain SGD step: weights - gradient
    result = engine.step(window)
    loss = theirs(**batch).loss  # transformers: mean over the shifted targets of the whole batch
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    with torch.no_grad():
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.allclose(a, b - b.grad, rtol=1e-5, atol=1e-6), name


def test_engine_shifts_plain_lists_when_told() -> None:
    model = gpt2()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), hf_labels=True)
    result = engine.step([hf_batch(examples(), "left")])
    assert result.targets == sum(len(row) - 1 for row in examples())


def test_unshifted_labels_given_to_the_default_loss_are_refused() -> None:
    model = gpt2()
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="hf_labels=True") as refused:
        engine.step([hf_batch(examples(), "right")])
    # In a cadence command: one line, no traceback (issue 29 item 10).
    assert isinstance(refused.value, CadenceFailure)
    assert [line.split(":", 1)[0] for line in refused.value.lines()] == ["training failed"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing trained
    assert engine.steps == 0


def test_labels_equal_to_inputs_are_refused_only_when_next_token_labels_cannot_explain_them() -> None:
    """Issue 29 item 10: text of one repeated character has next-token labels equal to its inputs; only a target
    followed by another token in the same example proves Hugging Face labels. Packed examples end where the position
    ids start again, padded ones where the attention mask does."""
    from cadence.engine.step import looks_like_hf_labels

    dashes = torch.full((2, 16), ord("-"))
    assert not looks_like_hf_labels({"input_ids": dashes, "labels": dashes.clone()})
    packed = torch.tensor([[ord("a")] * 8 + [ord("b")] * 8])
    two_examples = torch.tensor([list(range(8)) * 2])
    assert not looks_like_hf_labels({"input_ids": packed, "labels": packed.clone(), "position_ids": two_examples})
    assert looks_like_hf_labels({"input_ids": packed, "labels": packed.clone()})  # one example: a then b
    padded = torch.tensor([[ord("a")] * 10 + [0] * 6])
    labels = torch.where(padded == 0, -100, padded)
    mask = (padded != 0).long()
    assert not looks_like_hf_labels({"input_ids": padded, "labels": labels, "attention_mask": mask})
    varied = torch.arange(32).reshape(2, 16)
    assert looks_like_hf_labels({"input_ids": varied, "labels": varied.clone()})
