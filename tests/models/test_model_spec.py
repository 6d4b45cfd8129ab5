"""The model seam (issue 50 item 1): ``ModelSpec`` in the house style of Cut and Source (from the flags and back, in
words, its problems naming their flags), what it knows without building the model, its one build, and the memory
estimate chosen by its estimator value: an architecture no estimator knows is refused in one line, never estimated as
llama."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from helpers import run_cli, sample_text

from cadence.config import TrainConfig
from cadence.errors import UsageError
from cadence.memory.estimate import estimate_step_memory
from cadence.memory.estimate_for import estimate_for, estimate_problem
from cadence.models import GPT, MODEL_CONFIGS
from cadence.models.lora import lora_shape
from cadence.models.quantized import bitsandbytes_problem
from cadence.models.spec import ModelSpec, family_of
from cadence.profiling.flops import model_flops_per_token, spec_flops_per_token

LLAMA = ["hidden_size=64", "num_hidden_layers=2", "num_attention_heads=4", "num_key_value_heads=2",
         "intermediate_size=128", "vocab_size=256", "max_position_embeddings=128"]
MAMBA = ["hidden_size=32", "num_hidden_layers=2", "vocab_size=256"]


def llama(**flags: object) -> TrainConfig:
    return TrainConfig(model="hf:llama", model_config=LLAMA, **flags)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ the value
@pytest.mark.parametrize("flags", [
    {"model": "gpt-tiny"},
    {"model": "gpt-small"},
    {"model": "hf:llama", "model_config": LLAMA},
    {"model": "hf:llama", "model_config": LLAMA, "lora_rank": 4, "lora_alpha": 8.0, "lora_targets": ["q_proj,v_proj"],
     "lora_dropout": 0.1},
])
def test_from_flags_and_back_is_the_same_spec(flags: dict) -> None:
    pytest.importorskip("peft")
    spec = ModelSpec.from_flags(flags)
    assert ModelSpec.from_flags(spec.flags()) == spec
    assert ModelSpec.from_flags(TrainConfig(**{**TrainConfig().__dict__, **spec.flags()})) == spec
    assert set(spec.flags()) <= {field.name for field in dataclasses.fields(TrainConfig)}


def test_the_built_in_gpt_reports_the_shape_every_family_reports() -> None:
    spec = ModelSpec.from_flags({"model": "gpt-small"})
    config = MODEL_CONFIGS["gpt-small"]
    shape = spec.shape
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.head_dim, shape.vocab_size,
            shape.context_length) == (config.n_layer, config.n_embd, config.n_head, config.head_dim, 256, 512)
    assert shape.num_parameters == config.num_parameters() == sum(p.numel() for p in GPT(config).parameters())
    assert shape.tied_embeddings and spec.estimator == "gpt" and spec.supports.blocks == config.n_layer
    assert spec.supports.packing == "per-example" and not spec.takes("lora") and not spec.exports_pretrained
    # Its estimate and its FLOPs are the built-in GPT's, through the spec.
    options = {"micro_batch_size": 2, "seq_len": 64, "precision": "bf16", "checkpointing": "full"}
    assert estimate_for(spec, **options) == estimate_step_memory(config, **options)
    assert spec_flops_per_token(spec, 512) == model_flops_per_token(config, 512)


def test_a_transformers_spec_is_read_from_the_model_on_the_meta_device() -> None:
    pytest.importorskip("peft")
    spec = ModelSpec.from_flags(llama(lora_rank=8))
    built = spec.build(seed=0)
    assert spec.family == "transformers" and spec.architecture == "LlamaForCausalLM" and spec.estimator == "llama"
    adapters = lora_shape(built.module)
    assert adapters is not None and spec.shape.num_parameters == sum(
        p.numel() for p in built.module.parameters()) - adapters.adapter_parameters
    assert spec.shape.num_kv_heads == 2 and spec.shape.context_length == 128 and not spec.shape.tied_embeddings
    assert spec.adapters == adapters and spec.supports.blocks == 2 and spec.exports_pretrained


def test_resolving_draws_nothing_from_the_seeded_rng() -> None:
    pytest.importorskip("peft")
    torch.manual_seed(5)
    before = torch.get_rng_state()
    ModelSpec.from_flags(llama(lora_rank=8))
    assert torch.equal(before, torch.get_rng_state())


def test_describe_says_what_the_model_is() -> None:
    pytest.importorskip("peft")
    assert ModelSpec.from_flags({"model": "gpt-tiny"}).describe() == (
        "gpt-tiny: GPT, 1,057,152 parameters, 5 blocks of width 128, vocabulary 256, context 256")
    words = ModelSpec.from_flags(llama(lora_rank=8, lora_targets=["q_proj", "v_proj"])).describe()
    assert words.startswith("hf:llama with hidden_size=64, ") and ": LlamaForCausalLM, " in words
    assert words.endswith("; LoRA rank 8 on q_proj, v_proj (3,584 trained)")


def test_every_build_starts_from_the_same_weights() -> None:
    spec = ModelSpec.from_flags({"model": "gpt-tiny"})
    torch.manual_seed(0)
    reference = GPT(MODEL_CONFIGS["gpt-tiny"])  # what cadence built for --seed 0 before the spec
    for built in (spec.build(seed=0), spec.build(seed=0)):
        assert all(torch.equal(a, b) for a, b in zip(built.module.parameters(), reference.parameters(), strict=True))
    hf = ModelSpec.from_flags(llama())
    first, second = hf.build(seed=3).module, hf.build(seed=3).module
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


@pytest.mark.parametrize(("base", "precision", "model_config"), [
    ("bf16", "bf16", LLAMA),
    ("nf4", "fp32", LLAMA),
    # qwen2's q/k/v projections have biases: an nf4 base holds them in the compute dtype
    ("nf4", "bf16", ["hidden_size=64", "num_hidden_layers=2", "num_attention_heads=4", "num_key_value_heads=2",
                     "intermediate_size=128", "vocab_size=256"]),
])
def test_the_adapters_of_each_base_are_the_built_models(base: str, precision: str, model_config: list[str]) -> None:
    """The estimate of a base the plan never builds counts what the build would hold."""
    pytest.importorskip("peft")
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    name = "hf:llama" if model_config is LLAMA else "hf:qwen2"
    spec = ModelSpec.from_flags({"model": name, "model_config": model_config, "lora_rank": 8})
    built = spec.build(seed=0, precision=precision, base_precision=base)
    adapters = lora_shape(built.module)
    assert spec.adapters_for(base, precision) == adapters
    if name == "hf:qwen2":
        assert adapters is not None and adapters.bf16_base_parameters > 0  # the biases


# ------------------------------------------------------------------------------------------------ problems
PROBLEMS = [
    ({"model": "gpt-huge"}, "--model", "unknown model 'gpt-huge'; built-in models are gpt-tiny, gpt-small, gpt-base, "
                                       "or hf:TYPE, or a local model directory"),
    ({"model_config": ["hidden_size=8"]}, "--model-config", "overrides a Hugging Face model's config; gpt-tiny is "
                                                            "built in"),
    ({"seq_len": 257}, "--seq-len", "257 is above gpt-tiny's context length of 256"),
    ({"save_hf": Path("out")}, "--save-hf", "saves Hugging Face models; gpt-tiny is built in"),
    ({"lora_rank": 8}, "--lora-rank", "LoRA adapts Hugging Face models (hf:TYPE or a model directory, with peft); "
                                      "gpt-tiny is built in and trains whole (drop --lora-rank)"),
    ({"lora_rank": 8, "lora_base_precision": "nf4"}, "--lora-base-precision",
     "nf4 quantises a Hugging Face model's linear layers; gpt-tiny is built in"),
    ({"compile": True, "packing": True}, "--compile", "does not work with --packing on a built-in model"),
    ({"lora_rank": -1}, "--lora-rank", "must be at least 0 (0: no LoRA), got -1"),
    ({"lora_alpha": 4.0}, "--lora-alpha", "needs --lora-rank above 0 (LoRA is off)"),
    ({"lora_dropout": 0.1}, "--lora-dropout", "needs --lora-rank above 0 (LoRA is off)"),
    ({"model": "hf:llama", "lora_rank": 8, "lora_dropout": 1.0}, "--lora-dropout", "must be in [0, 1), got 1"),
    ({"model": "hf:llama", "lora_rank": 8, "lora_alpha": -1.0}, "--lora-alpha", "must be a positive number, got -1"),
    ({"lora_base_precision": "bf16"}, "--lora-base-precision", "needs --lora-rank above 0"),
    ({"model": "hf:llama", "lora_rank": 8, "lora_base_precision": "bf16"}, "--lora-base-precision",
     "bf16 needs --precision bf16 (got fp32)"),
    ({"model": "hf:llama", "lora_rank": 8, "lora_base_precision": "nf4", "precision": "fp16"},
     "--lora-base-precision", "nf4 computes in bf16 or fp32 (--precision bf16 or fp32), got fp16"),
    ({"model": "hf:llama", "lora_rank": 8, "lora_base_precision": "nf4", "strategy": "fsdp"},
     "--lora-base-precision", "nf4 does not work with --strategy fsdp"),
    ({"model": "hf:llama", "lora_rank": 8, "lora_targets": [" , "]}, "--lora-targets", "names no layer"),
]


@pytest.mark.parametrize(("flags", "where", "message"), PROBLEMS, ids=[f"{row[1]}-{i}" for i, row in
                                                                       enumerate(PROBLEMS)])
def test_each_model_rule_is_one_problem_naming_its_flag(flags: dict, where: str, message: str) -> None:
    pytest.importorskip("peft")
    found = [(problem.where, problem.message) for problem in ModelSpec.problems(TrainConfig(**flags))]
    assert any(found_where == where and message in text for found_where, text in found), found


def test_good_model_flags_have_no_problem_and_nothing_is_built_to_say_so() -> None:
    pytest.importorskip("peft")
    assert ModelSpec.problems(TrainConfig()) == []
    assert ModelSpec.problems(llama(lora_rank=8, lora_targets=["q_proj"], seq_len=4096)) == []  # context: once built
    assert ModelSpec.problems({"model": "gpt-base", "seq_len": 1024}) == []


def test_bitsandbytes_problem_has_one_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why bitsandbytes cannot be used here: not installed (the install line) or installed and failing (the repair);
    None when it can. One function, for --optimizer-state 8bit, the nf4 base and peft alike."""
    failure = OSError("libbitsandbytes_cpu.so: cannot open shared object file")
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "bitsandbytes", None)  # hidden from the import system: not installed
        assert bitsandbytes_problem() == ("needs bitsandbytes (pip install 'cadence[8bit]', or pip install "
                                          "bitsandbytes)")
        assert bitsandbytes_problem(failure=failure) == bitsandbytes_problem()
    if bitsandbytes_problem() is None:  # installed and working here: a failure it met elsewhere is its repair
        broken = bitsandbytes_problem(failure=failure)
        assert broken is not None and "bitsandbytes is installed but fails to be used (OSError: libbits" in broken
        assert broken.endswith("repair it with pip install --force-reinstall bitsandbytes")


# ------------------------------------------------------------------------------------------------ the estimators
ESTIMATED = [("llama", "llama"), ("qwen2", "llama"), ("mistral", "llama"), ("gemma2", "llama"), ("gpt2", "gpt2"),
             ("gpt_bigcode", "gpt2"), ("gpt_neo", "gpt2"), ("gptj", "gpt2")]
REFUSED = [
    ("mamba", "MambaForCausalLM", "it keeps no list of repeated blocks the estimate knows"),
    ("falcon_mamba", "FalconMambaForCausalLM", "it keeps no list of repeated blocks the estimate knows"),
    ("jamba", "JambaForCausalLM", "(its blocks are not all alike)"),
    ("bamba", "BambaForCausalLM", "its blocks hold down_proj, gate_proj, in_proj, out_proj, up_proj"),
    ("recurrent_gemma", "RecurrentGemmaForCausalLM", "linear_x"),
    ("mixtral", "MixtralForCausalLM", "its blocks hold k_proj, o_proj, q_proj, v_proj, not"),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "shared_expert_gate"),
    ("falcon_h1", "FalconH1ForCausalLM", "in_proj"),
]


def _on_meta(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type)  # the family's defaults, built offline on the meta device
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("model_type", "estimator"), ESTIMATED)
def test_the_decoders_the_estimate_replays_are_recognised_by_their_blocks(model_type: str, estimator: str) -> None:
    pytest.importorskip("transformers")
    from cadence.models.hf import model_shape
    from cadence.models.transformers_family import block_estimator

    model = _on_meta(model_type)
    assert block_estimator(model, model_shape(model, model.config)) == (estimator, None)


@pytest.mark.parametrize(("model_type", "architecture", "why"), REFUSED)
def test_an_architecture_no_estimator_knows_is_refused_never_estimated_as_llama(model_type: str, architecture: str,
                                                                                why: str) -> None:
    """State-space (Mamba), hybrid (Jamba, Bamba, Falcon-H1, RecurrentGemma) and mixture-of-experts models: the
    transformers classes themselves, on the meta device."""
    pytest.importorskip("transformers")
    from cadence.models.hf import model_shape
    from cadence.models.transformers_family import block_estimator

    model = _on_meta(model_type)
    estimator, line = block_estimator(model, model_shape(model, model.config))
    assert estimator is None and line is not None
    assert line.startswith(f"no memory estimate for {architecture}: ") and why in line and "\n" not in line


def test_the_estimate_of_a_mamba_is_one_line_naming_it() -> None:
    pytest.importorskip("transformers")
    spec = ModelSpec.from_flags({"model": "hf:mamba", "model_config": MAMBA})
    assert spec.architecture == "MambaForCausalLM" and spec.estimator is None
    with pytest.raises(UsageError) as refused:
        estimate_for(spec, micro_batch_size=1, seq_len=32, precision="fp32", checkpointing="none")
    [problem] = refused.value.problems
    assert problem.where == "--model" and problem.message == estimate_problem(spec)
    assert problem.message.startswith("no memory estimate for MambaForCausalLM: ")
    assert "--micro-batch-size auto --memory-budget" in problem.message
    # What it cannot take is said before anything is built: nothing runs its blocks or keeps packed rows apart.
    config = TrainConfig(model="hf:mamba", model_config=MAMBA, compile=True, activation_checkpointing="full",
                         packing=True)
    wheres = [problem.where for problem in spec.run_problems(config, fsdp=True)]
    assert wheres == ["--packing", "--compile", "--activation-checkpointing", "--strategy"]


def test_plan_on_a_model_without_an_estimate_says_so_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(4000))
    status, _, err = run_cli(["plan", "--model", "hf:mamba", *[a for item in MAMBA for a in ("--model-config", item)],
                              "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "32",
                              "--effective-batch-size", "4", "--memory-budget", "64MiB", "--out", str(tmp_path / "plan")])
    lines = err.strip().splitlines()
    assert status == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("cadence: error: --model: no memory estimate for MambaForCausalLM: ")
    assert not (tmp_path / "plan").exists()


def test_family_names_are_claimed_in_the_registry_order(tmp_path: Path) -> None:
    (tmp_path / "gpt-tiny").mkdir()
    assert family_of("gpt-tiny").key == "built-in"  # type: ignore[union-attr]
    assert family_of(str(tmp_path / "gpt-tiny")).key == "transformers"  # type: ignore[union-attr]
    assert family_of("hf:llama").key == "transformers" and family_of("nothing") is None  # type: ignore[union-attr]


def test_a_variant_is_the_same_model_built_afresh(tmp_path: Path) -> None:
    """prepare() resolves the spec once; a plan's variant reuses it, builds its own model from the same seed, and
    may not change the model."""
    from cadence.training.prepare import prepare

    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(4000))
    prep = prepare(TrainConfig(data=data, seq_len=32, micro_batch_size=2, max_steps=1, val_fraction=0.0,
                               data_cache=tmp_path / "cache", out=tmp_path / "run"))
    variant = prep.variant(micro_batch_size=1)
    assert variant.model is prep.model and variant.built.module is not prep.built.module
    assert all(torch.equal(a, b) for a, b in zip(variant.built.module.parameters(), prep.built.module.parameters(),
                                                   strict=True))
    with pytest.raises(ValueError, match="model"):
        prep.variant(model="gpt-small")


@pytest.mark.slow  # a Mamba's sequential scan on the CPU: tens of seconds for two steps
def test_train_under_a_budget_measures_a_model_without_an_estimate(tmp_path: Path) -> None:
    """What the refusal points to: --micro-batch-size auto --memory-budget never estimates, it measures every step,
    so a model no estimator knows trains under a budget as any other."""
    pytest.importorskip("transformers")
    data = tmp_path / "text.txt"
    data.write_bytes(sample_text(4000))
    status, _, err = run_cli(["train", "--model", "hf:mamba", *[a for item in MAMBA for a in ("--model-config", item)],
                              "--data", str(data), "--seq-len", "32", "--micro-batch-size", "auto",
                              "--effective-batch-size", "4", "--memory-budget", "64MiB", "--max-steps", "2",
                              "--val-fraction", "0", "--out", str(tmp_path / "run")])
    assert status == 0, err
    assert (tmp_path / "run" / "summary.json").is_file()
