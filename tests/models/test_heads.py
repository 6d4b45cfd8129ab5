"""A model split at its output head for --loss-chunk-tokens: which module is the head, the post-processing of the
logits cadence reproduces (soft-capping, scaling), and the models it refuses, with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import relative_l2
from torch import nn

from cadence.engine import ChunkedCrossEntropy, token_cross_entropy_sum
from cadence.models import GPT, GPTConfig
from cadence.models.heads import chunking_problem, head_bypassed, output_head
from cadence.models.hf import build_hf_model

pytest.importorskip("transformers")

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 64, "vocab_size": 512, "max_position_embeddings": 64}


def hf(model_type: str, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    return build_hf_model(f"hf:{model_type}", {**SMALL, **overrides}).model


def micro_batch(vocab: int = 512) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 17), generator=generator)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    return {"input_ids": ids[:, :-1], "labels": labels}


def assert_chunked_equals_whole(model: nn.Module, vocab: int = 512) -> None:
    """Loss and every gradient of the chunked loss against the model's own logits (fp32: to rounding)."""
    results = []
    for loss_fn in (token_cross_entropy_sum, ChunkedCrossEntropy(5)):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, micro_batch(vocab))
        loss.backward()
        results.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}))
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert relative_l2(chunked_grads, whole_grads) < 1e-5


def test_the_built_in_gpt_head_is_its_tied_lm_head() -> None:
    gpt = GPT(GPTConfig(vocab_size=256, context_length=16, n_layer=1, n_head=2, n_embd=16))
    head = output_head(gpt)
    assert head.module is gpt.lm_head and head.module.weight is gpt.tok_emb.weight and head.transform is None


@pytest.mark.parametrize(("model_type", "overrides", "tied"), [
    ("llama", {}, False), ("qwen2", {"tie_word_embeddings": True}, True),
    ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "attn_pdrop": 0.0}, True),
])
def test_a_transformers_head_is_its_output_embeddings(model_type: str, overrides: dict, tied: bool) -> None:
    if model_type == "gpt2":
        torch.manual_seed(0)
        model = build_hf_model("hf:gpt2", {"vocab_size": 512, **overrides}).model
    else:
        model = hf(model_type, **overrides)
    head = output_head(model)
    assert head.module is model.get_output_embeddings()
    assert (head.module.weight is model.get_input_embeddings().weight) is tied  # tied: nothing to do, same module
    assert chunking_problem(model, 512) is None
    assert_chunked_equals_whole(model)


@pytest.mark.parametrize(("model_type", "overrides"), [
    # A cap of 0.5 (the families use 30): the logits are far into tanh's curve, so a loss that skipped or misplaced
    # the cap would be far off.
    ("gemma2", {"head_dim": 16, "final_logit_softcapping": 0.5}),
    ("gemma3_text", {"head_dim": 16, "final_logit_softcapping": 0.5}),
    ("cohere", {"logit_scale": 3.0}),
    ("granite", {"logits_scaling": 0.25}),
])
def test_soft_capped_and_scaled_logits_are_reproduced_exactly(model_type: str, overrides: dict) -> None:
    model = hf(model_type, **overrides)
    assert output_head(model).transform is not None
    assert chunking_problem(model, 512) is None
    assert_chunked_equals_whole(model)


def test_a_family_cadence_does_not_reproduce_is_refused_by_its_config() -> None:
    model = hf("inkling2_text", head_dim=16)
    problem = chunking_problem(model, 512)
    assert problem is not None and "unpadded_vocab_size" in problem and "trims" in problem


class TinyLM(nn.Module):
    """A causal LM with a transformers-style head, whose forward does ``post`` to the logits: stands in for a family
    nobody has listed."""

    def __init__(self, post: str = "none", **config: object) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="tiny", **config)
        self.embed = nn.Embedding(64, 8)
        self.lm_head = nn.Linear(8, 64, bias=False)
        self.post = post

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.cumsum(self.embed(input_ids), dim=1)  # causal: position t sees tokens 0..t
        logits = self.lm_head(hidden)
        if self.post == "scaled":
            return logits * 0.5
        if self.post == "twice":
            return logits + self.lm_head(hidden)
        if self.post == "trimmed":
            return logits[..., :60]
        return logits


@pytest.mark.parametrize(("model", "reason"), [
    (TinyLM("scaled"), "changes the logits after the output head"),
    (TinyLM("trimmed"), "changes the logits after the output head"),
    (TinyLM("twice"), "calls the output head 2 times"),
    # The config says Cohere-style scaling, but this forward does not scale: the stand-in logits give it away.
    (TinyLM("none", logit_scale=0.5), "beyond what cadence reproduces (multiplies the logits by logit_scale"),
    (TinyLM("none", final_logit_softcapping=30.0, logit_scale=2.0), "more than one post-processing"),
    (TinyLM("none", logit_scale=float("nan")), "not a finite non-zero number"),
])
def test_a_forward_that_post_processes_the_logits_unknowably_is_refused(model: TinyLM, reason: str) -> None:
    problem = chunking_problem(model, 64)
    assert problem is not None and reason in problem, problem
    assert model.training and "forward" not in model.lm_head.__dict__  # the probe put everything back


def test_a_plain_head_passes_the_probe_and_a_headless_model_is_refused() -> None:
    assert chunking_problem(TinyLM(), 64) is None
    headless = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))
    assert "no output head module" in str(chunking_problem(headless, 64))


def test_the_bypassed_head_gives_its_input_back_and_is_restored_after_an_error() -> None:
    model = TinyLM()
    ids = torch.randint(0, 64, (2, 5))
    with pytest.raises(RuntimeError, match="inside"), head_bypassed(model.lm_head) as captured:
        out = model(ids)
        assert out is captured[0] and out.shape == (2, 5, 8)
        raise RuntimeError("inside")
    assert "forward" not in model.lm_head.__dict__ and model(ids).shape == (2, 5, 64)
