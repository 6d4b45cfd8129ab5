"""Issue 51 item 2: Muon. Newton-Schulz once per optimizer step whatever the accumulation (a test counts the calls),
its groups (the blocks' matrices orthogonalised, AdamW for the rest), the RMS-matched LR, a clip that would push a
matrix under Newton-Schulz's epsilon said aloud, LoRA adapters, and what it refuses."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import prompt_completion_dataset, tiny_model

from cadence import Engine, iter_windows
from cadence.data import iterate_micro_batches
from cadence.optim import muon
from cadence.optim.muon import NS_EPS, Muon, newton_schulz, rms_scale
from cadence.optim.spec import OptimizerSpec


def test_newton_schulz_runs_once_per_matrix_per_optimizer_step_whatever_the_accumulation(monkeypatch) -> None:
    """DeepSpeed #8443 ran it once per micro-batch under ZeRO-3: 4 accumulation steps, 4 orthogonalisations."""
    calls = []
    original = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda matrix, **kw: calls.append(matrix.shape) or original(matrix, **kw))
    dataset = prompt_completion_dataset()
    for micro, accum in ((8, 1), (2, 4), (1, 8)):
        calls.clear()
        model = tiny_model()
        spec = OptimizerSpec(name="muon", lr=1e-2)
        engine = Engine(model, spec.build(model), precision="fp32", max_grad_norm=1.0)
        windows = iter_windows(iterate_micro_batches(dataset, micro, 0, 0), accum, micro_batch_size=micro)
        for window, _ in zip(windows, range(3), strict=False):
            engine.step(window)
        matrices = len(spec.param_groups(model)[0].params)
        assert matrices == 8  # 2 blocks x (qkv, projection, MLP in, MLP out)
        assert len(calls) == 3 * matrices, (micro, accum)


def test_the_groups_the_update_and_its_rms() -> None:
    model = tiny_model()
    spec = OptimizerSpec(name="muon", lr=1e-2)
    groups = spec.param_groups(model)
    assert [g.name for g in groups] == ["orthogonalised (Muon)", "AdamW decay", "AdamW no decay"]
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].startswith("blocks.") and p.ndim == 2 for p in groups[0].params)
    assert {names[id(p)] for p in groups[1].params} == {"tok_emb.weight", "pos_emb.weight"}  # the head is tied
    assert all(p.ndim == 1 for p in groups[2].params)
    assert "orthogonalised (Muon): 8 tensors" in spec.describe_groups(model)
    # Newton-Schulz maps the singular values near 1: an orthogonal-ish update of RMS 1/sqrt(max side), which the
    # RMS match scales to 0.2 (AdamW's typical update RMS) times the LR.
    torch.manual_seed(0)
    matrix = torch.randn(96, 32)
    singular = torch.linalg.svdvals(newton_schulz(matrix))
    assert 0.6 < float(singular.min()) and float(singular.max()) < 1.3
    update_rms = newton_schulz(matrix).pow(2).mean().sqrt() * rms_scale(matrix.shape)
    assert float(update_rms) == pytest.approx(0.2, rel=0.2)


def test_a_gradient_clipped_under_the_newton_schulz_epsilon_is_said_once() -> None:
    """Megatron-LM #5394: a clip coefficient near 2e-8 pushes the gradient under the epsilon and the updates vanish
    without a word. Here the step warns, once per run, and counts the steps."""
    weight = torch.nn.Parameter(torch.randn(16, 8))
    optimizer = Muon([{"params": [weight], "orthogonalise": True}], lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            weight.grad = torch.full_like(weight, NS_EPS / 1000)
            optimizer.step()
    said = [str(w.message) for w in caught if "Newton-Schulz's epsilon" in str(w.message)]
    assert len(said) == 1 and "--max-grad-norm" in said[0]
    assert optimizer.attenuated == [1, 1, 1]
    weight.grad = torch.randn(16, 8)
    optimizer.step()
    assert optimizer.attenuated == [1, 1, 1]  # a normal gradient is not counted


def test_muon_refuses_what_it_cannot_do_and_warns_on_a_pretrained_full_fine_tune() -> None:
    spec = OptimizerSpec(name="muon")
    assert [p.where for p in spec.problems(sharded=True)] == ["--optimizer"]
    assert [p.where for p in OptimizerSpec(name="muon", state="bf16", offload=True).problems()] == [
        "--optimizer-state", "--offload"]
    assert OptimizerSpec(name="muon", momentum=0.9, betas=(0.8, 0.99)).problems() == []
    assert spec.model_problem(tiny_model()) is None
    assert "no trained matrix" in spec.model_problem(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert "arXiv 2605.10468" in spec.notes(pretrained=True, adapters=False)[0]
    assert spec.notes(pretrained=True, adapters=True) == [] == spec.notes(pretrained=False, adapters=False)


def test_muon_on_lora_adapters_orthogonalises_the_adapters_and_trains(tmp_path) -> None:
    """The adapters are 2-D and inside the blocks: every one is orthogonalised; the frozen base has no group."""
    pytest.importorskip("peft")
    from helpers import run_cli, write_jsonl

    from cadence.models.hf import build_hf_model
    from cadence.models.lora import LoraSettings, apply_lora

    sizes = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 256, "max_position_embeddings": 128}
    torch.manual_seed(0)
    model = apply_lora(build_hf_model("hf:llama", dict(sizes)).model, LoraSettings(rank=8))
    groups = OptimizerSpec(name="muon").param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(groups[0].params) == 8 and all(".lora_" in names[id(p)] for p in groups[0].params)
    assert groups[1].params == [] and groups[2].params == []
    flags = [item for key, value in sizes.items() for item in ("--model-config", f"{key}={value}")]
    status, _, err = run_cli(["train", "--model", "hf:llama", *flags, "--lora-rank", "8", "--optimizer", "muon",
                              "--data", str(write_jsonl(tmp_path / "data.jsonl")), "--seq-len", "32",
                              "--max-steps", "2", "--val-fraction", "0", "--out", str(tmp_path / "run")])
    assert status == 0, err
    assert "orthogonalised (Muon): 8 tensors" in err and "arXiv" not in err
