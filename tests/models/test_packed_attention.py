"""cadence's attention for packed rows of transformers models (issue 30 item 5): one causal SDPA per example gives
what transformers' masked SDPA gives, and what each example gives alone; other batches keep transformers' own path;
a saved model says sdpa."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cadence.models.packed_attention import ATTENTION_NAME, example_spans

pytest.importorskip("transformers")

LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 256}
GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LENGTHS = ((40, 50, 30, 8), (128,), (1, 127))  # three rows of 128: four examples, one, two (one of length 1)


@pytest.mark.parametrize(("positions", "expected"), [
    ([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]], [[(0, 3), (3, 5)], [(0, 5)]]),
    ([[0, 0, 0]], [[(0, 1), (1, 2), (2, 3)]]),
    ([[0, 1, 2, 3]], None),  # one example per row: nothing packed
    ([[1, 1, 0, 1, 2]], None),  # left padding's positions (cadence.engine.step.attention_inputs)
    ([[0, 1, 5, 0, 1]], None),  # not a run 0, 1, 2, ...
    ([[2, 3, 4]], None),  # a cache's continuation
], ids=["two-rows", "length-one-examples", "unpacked", "left-padding", "not-a-run", "continuation"])
def test_example_spans_are_the_runs_of_positions_from_zero(positions, expected) -> None:
    assert example_spans(torch.tensor(positions)) == expected


def packed_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for lengths in LENGTHS:
        rows.append(torch.cat([torch.arange(length) for length in lengths]))
    positions = torch.stack(rows)
    return torch.randint(0, 256, positions.shape, generator=generator), positions


def build(spec: str, overrides: dict, attention: str):
    from cadence.models.hf import build_hf_model

    torch.manual_seed(0)
    hf = build_hf_model(spec, overrides)
    assert hf.model.config._attn_implementation == ATTENTION_NAME  # what cadence runs every sdpa model with
    hf.model.set_attn_implementation(attention)
    return hf.model


@pytest.mark.parametrize(("spec", "overrides"), [("hf:llama", LLAMA), ("hf:gpt2", GPT2)], ids=["llama", "gpt2"])
def test_packed_rows_give_transformers_masked_attention_and_each_example_alone(spec, overrides) -> None:
    ids, positions = packed_batch(torch.Generator().manual_seed(3))
    outputs, grads = {}, {}
    for attention in ("sdpa", ATTENTION_NAME):
        model = build(spec, overrides, attention)
        logits = model(ids, position_ids=positions).logits
        weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
        (logits * weights).sum().backward()
        outputs[attention] = logits.detach()
        grads[attention] = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.testing.assert_close(outputs[ATTENTION_NAME], outputs["sdpa"], rtol=1e-5, atol=1e-5)
    for name, grad in grads["sdpa"].items():
        torch.testing.assert_close(grads[ATTENTION_NAME][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # ... and each example as if it were alone in its row (what packing promises).
    model = build(spec, overrides, ATTENTION_NAME)
    with torch.no_grad():
        at = 0
        for length in LENGTHS[0]:
            alone = model(ids[:1, at:at + length]).logits
            torch.testing.assert_close(outputs[ATTENTION_NAME][:1, at:at + length], alone, rtol=1e-5, atol=1e-5)
            at += length


def test_only_packed_rows_leave_transformers_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """No packed positions: transformers' own SDPA function runs (counted), with its result. Packed positions: it
    does not, and the kernel runs once per example, causal and unmasked."""
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    original = sdpa.sdpa_attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", counting)
    model = build("hf:llama", LLAMA, ATTENTION_NAME)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model(ids)
        assert len(calls) == LLAMA["num_hidden_layers"]
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # left padding
        model(ids, attention_mask=mask)
        assert len(calls) == 2 * LLAMA["num_hidden_layers"]
        generated = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert generated.shape == (1, 7)
        before = len(calls)
        packed_ids, positions = packed_batch(torch.Generator().manual_seed(7))
        with monkeypatch.context() as patch:  # packed rows: one causal SDPA per example, no masked one
            kernel_calls = []
            original_sdpa = torch.nn.functional.scaled_dot_product_attention

            def counting_kernel(*args, **kwargs):
                kernel_calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
                return original_sdpa(*args, **kwargs)

            patch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_kernel)
            model(packed_ids, position_ids=positions)
    assert len(calls) == before  # transformers' masked SDPA was not used
    assert len(kernel_calls) == LLAMA["num_hidden_layers"] * sum(len(lengths) for lengths in LENGTHS)
    assert all(mask is None and causal for mask, causal in kernel_calls)


def test_a_saved_model_says_sdpa_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from cadence.models.hf import build_hf_model, save_hf

    torch.manual_seed(0)
    hf = build_hf_model("hf:llama", LLAMA)
    save_hf(hf.model, tmp_path / "saved")
    assert ATTENTION_NAME not in (tmp_path / "saved" / "config.json").read_text()
    assert hf.model.config._attn_implementation == ATTENTION_NAME  # cadence's again after the save
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert loaded.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hf.model(ids).logits)
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == "llama"


def test_packing_with_compiled_blocks_says_it_keeps_transformers_mask(tmp_path: Path) -> None:
    """Compiled blocks keep transformers' masked attention (per-example slicing would recompile for every new set of
    lengths): the run says so, once, before it starts."""
    from helpers import write_jsonl

    from cadence.config import TrainConfig
    from cadence.training.prepare import prepare

    config = TrainConfig(model="hf:llama", model_config=[f"{key}={value}" for key, value in LLAMA.items()],
                         data=write_jsonl(tmp_path / "pc.jsonl"), packing=True, compile=True, seq_len=64,
                         too_long="truncate", out=tmp_path / "run")
    with pytest.warns(UserWarning, match="compiled .*--compile.* dense block mask"):
        prepare(config)
    assert not (tmp_path / "run").exists()
