"""The analytic estimate for Hugging Face decoders (llama-style and gpt2-style blocks, from their ModelShape): within
15% of the measured peak on tiny configs, and it moves the right way with micro-batch, recompute, precision and
grouped-query attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import cpu_has_bf16

from cadence.config import TrainConfig
from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
from cadence.engine.step import Engine, token_cross_entropy_sum
from cadence.memory.estimate import ESTIMATE_CATEGORIES, MemoryEstimate
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.memory.measure import MeasuredMemory, measure_step
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models.hf import HFModel, ModelShape, build_hf_model
from cadence.optim.spec import OptimizerSpec
from cadence.training.components import build_optimizer

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 2**20
LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 256}
GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # dropout masks are not modelled
TABLE = [  # (spec, overrides, micro-batch, seq_len)
    ("hf:llama", LLAMA, 4, 128),
    ("hf:llama", {**LLAMA, "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 352}, 8, 64),
    ("hf:gpt2", GPT2, 4, 128),
    ("hf:gpt2", {**GPT2, "n_embd": 128, "n_layer": 3}, 8, 64),
]


def make_window(batch: int, seq: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, seq), generator=generator)
    return [{"input_ids": ids, "labels": torch.randint(0, 256, (batch, seq), generator=generator)}]


def build(spec: str, overrides: dict) -> HFModel:
    torch.manual_seed(0)
    return build_hf_model(spec, overrides)


def estimate(hf: HFModel, **options: object) -> MemoryEstimate:
    settings: dict[str, object] = {"micro_batch_size": 4, "seq_len": 64, "precision": "fp32", "checkpointing": "none",
                                   **options}
    return estimate_hf_step_memory(hf.shape, style=hf.config.model_type, **settings)  # type: ignore[arg-type]


def measure(spec: str, overrides: dict, batch: int, seq: int, precision: str, checkpointing: str
            ) -> tuple[MemoryEstimate, MeasuredMemory]:
    hf = build(spec, overrides)
    apply_activation_checkpointing(hf.model, checkpointing)  # type: ignore[arg-type]
    optimizer = build_optimizer(hf.model, TrainConfig())
    Engine(hf.model, optimizer, precision="fp32", max_grad_norm=1.0).step(make_window(batch, seq, seed=0))
    engine = Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0)  # type: ignore[arg-type]
    window = make_window(batch, seq)
    measured = measure_step(hf.model, optimizer, lambda: engine.step(window), "cpu")
    return estimate(hf, micro_batch_size=batch, seq_len=seq, precision=precision, checkpointing=checkpointing), measured


def relative_error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(TABLE)))  # one test per row: pytest-xdist spreads them over the cores
def test_hf_estimate_is_within_15_percent_of_the_measured_peak(index: int) -> None:
    rows = []
    for spec, overrides, batch, seq in [TABLE[index]]:
        # Without bf16 instructions (emulated bf16, ~10x slower) the bf16 rows run on the smaller config of each
        # model type (the first of each pair), which exercises the same bf16 estimate code.
        precisions = ("fp32", "bf16") if index % 2 == 0 or cpu_has_bf16() else ("fp32",)
        for checkpointing in ("none", "full"):
            for precision in precisions:
                predicted, measured = measure(spec, overrides, batch, seq, precision, checkpointing)
                label = f"{spec[3:]} d{overrides.get('hidden_size', overrides.get('n_embd'))} {batch}x{seq}"
                rows.append((label, precision, checkpointing, predicted, measured))
    print(f"\n{'model':20} {'prec':5} {'ckpt':5} {'est MiB':>8} {'meas MiB':>8} {'error':>7}   "
          f"{'act est':>7} {'act meas':>8} {'error':>7}   peak in")
    for label, precision, checkpointing, predicted, measured in rows:
        peak_error = relative_error(predicted.peak_bytes, measured.peak_bytes)
        act_error = relative_error(predicted.activation_bytes, measured.activation_peak_bytes)
        print(f"{label:20} {precision:5} {checkpointing:5} {predicted.peak_bytes / MiB:8.2f} "
              f"{measured.peak_bytes / MiB:8.2f} {peak_error:+7.1%}   {predicted.activation_bytes / MiB:7.2f} "
              f"{measured.activation_peak_bytes / MiB:8.2f} {act_error:+7.1%}   {predicted.peak_phase}")
    for label, precision, checkpointing, predicted, measured in rows:
        assert abs(relative_error(predicted.peak_bytes, measured.peak_bytes)) <= 0.15, (label, precision,
                                                                                        checkpointing)


@pytest.mark.parametrize(("spec", "overrides", "precision", "checkpointing"), [
    ("hf:llama", LLAMA, "fp32", "none"), ("hf:llama", LLAMA, "bf16", "full"),
    ("hf:gpt2", GPT2, "bf16", "none"), ("hf:gpt2", GPT2, "fp32", "full"),
])
def test_hf_estimate_matches_a_quick_measurement(spec, overrides, precision, checkpointing) -> None:
    predicted, measured = measure(spec, overrides, 4, 64, precision, checkpointing)
    assert abs(relative_error(predicted.peak_bytes, measured.peak_bytes)) <= 0.15


@pytest.mark.parametrize(("spec", "overrides"), [("hf:llama", LLAMA), ("hf:gpt2", GPT2)], ids=["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_selective_recompute_is_estimated_as_what_it_keeps(spec, overrides, precision) -> None:
    """Issue 28 item 4: selective recompute was estimated as full (measured 6.47 MiB against 5.19 estimated on the
    llama, fp32, 4 x 128: -20%; gpt2 -12%). It keeps the outputs of the block's matmuls and of attention: now within
    6% (measured: llama +4.7% fp32, -1.5% bf16; gpt2 +4.7%, -0.5%), between none and full."""
    if precision == "bf16" and not cpu_has_bf16():
        pytest.skip("bf16 on this CPU is emulated: minutes, not seconds")
    predicted, measured = measure(spec, overrides, 4, 128, precision, "selective")
    assert abs(relative_error(predicted.peak_bytes, measured.peak_bytes)) <= 0.06, (predicted.summary(),
                                                                                   measured.summary())
    hf = build(spec, overrides)
    full, none = (estimate(hf, micro_batch_size=4, seq_len=128, precision=precision, checkpointing=mode).peak_bytes
                  for mode in ("full", "none"))
    assert full < predicted.peak_bytes < none


@pytest.fixture(scope="module")
def llama() -> HFModel:
    return build("hf:llama", LLAMA)


def test_categories_sum_to_the_peak_and_count_the_parameters(llama: HFModel) -> None:
    result = estimate(llama)
    assert set(result.by_category) == set(ESTIMATE_CATEGORIES)
    assert sum(result.by_category.values()) == result.peak_bytes
    assert result.by_category["parameters"] == 4 * llama.shape.num_parameters
    assert result.by_category["optimizer_state"] == 8 * llama.shape.num_parameters


def test_estimate_moves_the_right_way(llama: HFModel) -> None:
    activations = [estimate(llama, micro_batch_size=b).activation_bytes for b in (1, 2, 4, 8)]
    assert activations == sorted(activations) and activations[-1] > 4 * activations[0]
    for precision in ("fp32", "bf16"):
        none = estimate(llama, precision=precision, micro_batch_size=8)
        full = estimate(llama, precision=precision, micro_batch_size=8, checkpointing="full")
        assert full.activation_bytes < none.activation_bytes and full.peak_bytes < none.peak_bytes
    assert estimate(llama, precision="bf16").activation_bytes < estimate(llama).activation_bytes
    # Grouped-query attention: fewer kv heads, smaller k and v.
    mha = dataclasses.replace(llama.shape, num_kv_heads=llama.shape.num_heads)
    gqa_act = estimate(llama).activation_bytes
    mha_act = estimate_hf_step_memory(mha, style="llama", micro_batch_size=4, seq_len=64, precision="fp32",
                                      checkpointing="none").activation_bytes
    assert mha_act > gqa_act
    # Accumulation holds the gradients during the second forward.
    assert estimate(llama, grad_accum_steps=2).peak_bytes >= estimate(llama).peak_bytes


def test_block_styles_and_bad_input(llama: HFModel) -> None:
    # Which style a model's blocks are is the model's spec's to say (tests/models/test_spec.py); the estimate takes
    # the two it replays and no other.
    with pytest.raises(ValueError, match="block style 'mamba'"):
        estimate_hf_step_memory(llama.shape, style="mamba", micro_batch_size=1, seq_len=8,  # type: ignore[arg-type]  # a style the replay does not know, on purpose
                                precision="fp32", checkpointing="none")
    with pytest.raises(ValueError, match="context length"):
        estimate(llama, seq_len=10_000)
    with pytest.raises(ValueError, match="precision"):
        estimate(llama, precision="fp8")
    shapeless = ModelShape(num_layers=2, hidden_size=64, num_heads=None, num_kv_heads=None, head_dim=None,
                           intermediate_size=None, vocab_size=256, context_length=64, num_parameters=1,
                           tied_embeddings=True)
    with pytest.raises(ValueError, match="heads"):
        estimate_hf_step_memory(shapeless, style="llama", micro_batch_size=1, seq_len=8, precision="fp32",
                                checkpointing="none")


# ---------------------------------------------------------------------------------------------------- --loss-chunk-tokens
LARGE_VOCAB = {**LLAMA, "vocab_size": 32000, "intermediate_size": 128, "max_position_embeddings": 512}
"""Issue 26's shape: width 64, a 32,000-token vocabulary, so the logits are most of the peak."""


@pytest.mark.parametrize(("precision", "checkpointing", "chunk", "prompt", "batch", "seq"), [
    ("fp32", "none", 256, 0, 2, 512), ("fp32", "full", 300, 100, 2, 256),
    pytest.param("bf16", "none", 256, 0, 2, 256, marks=pytest.mark.slow),  # bf16 is emulated on most CPUs: slow
    ("fp32", "none", 0, 0, 2, 256),
])
def test_the_chunked_loss_estimate_matches_a_measurement(precision: str, checkpointing: str, chunk: int,
                                                         prompt: int, batch: int, seq: int) -> None:
    """Within 10% of the measured peak (measured: within 0.1%), with whole logits (chunk 0) too at this vocabulary."""
    hf = build("hf:llama", LARGE_VOCAB)
    apply_activation_checkpointing(hf.model, checkpointing)  # type: ignore[arg-type]
    optimizer = build_optimizer(hf.model, TrainConfig())
    loss = ChunkedCrossEntropy(chunk) if chunk else token_cross_entropy_sum
    window = make_window(batch, seq)
    window[0]["labels"][:, :prompt] = -100
    Engine(hf.model, optimizer, precision="fp32", max_grad_norm=1.0, loss_fn=loss).step(window)
    engine = Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0, loss_fn=loss)  # type: ignore[arg-type]
    measured = measure_step(hf.model, optimizer, lambda: engine.step(window), "cpu")
    predicted = estimate(hf, micro_batch_size=batch, seq_len=seq, precision=precision, checkpointing=checkpointing,
                         loss_chunk_tokens=chunk, target_tokens=batch * (seq - prompt))
    assert abs(relative_error(predicted.peak_bytes, measured.peak_bytes)) <= 0.10, (predicted.summary(),
                                                                                   measured.summary())


def test_chunking_a_large_vocabulary_cuts_the_estimate_to_a_fraction() -> None:
    hf = build("hf:llama", LARGE_VOCAB)
    whole = estimate(hf, micro_batch_size=4, seq_len=512)
    chunked = estimate(hf, micro_batch_size=4, seq_len=512, loss_chunk_tokens=256)
    assert chunked.peak_bytes < 0.25 * whole.peak_bytes
    tied = dataclasses.replace(hf.shape, tied_embeddings=True)
    assert estimate_hf_step_memory(tied, style="llama", micro_batch_size=4, seq_len=512, precision="fp32",
                                   checkpointing="none", loss_chunk_tokens=256).peak_bytes > 0


# ---------------------------------------------------------------------------------------------------- --lora-rank
@pytest.mark.parametrize(("spec", "overrides", "precision", "checkpointing", "lora", "state"), [
    ("hf:llama", LLAMA, "fp32", "none", {}, "fp32"),
    ("hf:llama", LLAMA, "bf16", "full", {}, "fp32"),
    ("hf:llama", LLAMA, "bf16", "none", {"dropout": 0.1}, "8bit"),
    ("hf:llama", LLAMA, "fp32", "none", {"targets": ("gate_proj", "down_proj")}, "bf16"),
    ("hf:llama", LLAMA, "fp32", "full", {"targets": ("all-linear",)}, "fp32"),
    ("hf:gpt2", GPT2, "fp32", "none", {}, "fp32"),
    ("hf:llama", LLAMA, "bf16", "none", {"bf16_base": True}, "fp32"),
    ("hf:llama", LLAMA, "fp32", "none", None, "bf16"),
    ("hf:llama", LLAMA, "fp32", "none", None, "8bit"),
    ("hf:llama", LLAMA, "fp32", "selective", {}, "fp32"),
    ("hf:llama", LLAMA, "bf16", "selective", {"targets": ("all-linear",)}, "fp32"),
    ("hf:gpt2", GPT2, "fp32", "selective", {"targets": ("all-linear",)}, "fp32"),
    ("hf:llama", LLAMA, "bf16", "full", {"targets": ("gate_proj", "down_proj")}, "fp32"),
    ("hf:gpt2", GPT2, "bf16", "full", {"targets": ("all-linear",)}, "fp32"),
], ids=["llama-fp32", "llama-bf16-recompute", "llama-dropout-8bit", "llama-mlp-targets", "llama-all-linear",
        "gpt2", "bf16-base", "full-model-bf16-state", "full-model-8bit-state", "llama-selective",
        "llama-all-linear-bf16-selective", "gpt2-all-linear-selective", "llama-bf16-recompute-down-proj",
        "gpt2-all-linear-bf16-recompute"])
def test_the_lora_and_optimizer_state_estimates_match_a_measurement(spec, overrides, precision, checkpointing, lora,
                                                                    state) -> None:
    """LoRA (rank 8, peft's default targets unless given): the frozen base has no gradients and no state and keeps
    no inputs for weight gradients; the adapters add their own. With --optimizer-state the state shrinks. Within 10%
    of the measured peak (measured: within 2.5%, gpt2 within 7% as its full-model estimate is 4% high). Selective
    recompute keeps each block's matmul outputs, the adapters' included (it was once estimated as full: 40% low).
    Under bf16 an adapter whose input is already bf16 (down_proj, o_proj) gets peft's fp32 copy of it and
    autocast's bf16 copy saved by lora_A, and with full recompute the recompute runs on to the block's output (once
    13-17% low).
    --lora-base-precision bf16: the frozen linear weights in bf16, with no autocast copies."""
    pytest.importorskip("peft")
    from cadence.models.lora import LoraSettings, apply_lora, hold_base_in_bf16, lora_shape

    hf = build(spec, overrides)
    if lora is not None:
        settings = {key: value for key, value in lora.items() if key != "bf16_base"}
        apply_lora(hf.model, LoraSettings(rank=8, **settings))
        if lora.get("bf16_base"):
            hold_base_in_bf16(hf.model)
    apply_activation_checkpointing(hf.model, checkpointing)  # type: ignore[arg-type]
    optimizer = build_optimizer(hf.model, TrainConfig(optimizer_state=state))
    warm_up = precision if lora and lora.get("bf16_base") else "fp32"  # a bf16 base runs under bf16 autocast only
    Engine(hf.model, optimizer, precision=warm_up, max_grad_norm=1.0).step(make_window(4, 128, seed=0))  # type: ignore[arg-type]
    engine = Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0)  # type: ignore[arg-type]
    window = make_window(4, 128)
    measured = measure_step(hf.model, optimizer, lambda: engine.step(window), "cpu")
    predicted = estimate(hf, micro_batch_size=4, seq_len=128, precision=precision, checkpointing=checkpointing,
                         optimizer=OptimizerSpec(state=state), lora=lora_shape(hf.model))
    assert abs(relative_error(predicted.peak_bytes, measured.peak_bytes)) <= 0.10, (predicted.summary(),
                                                                                   measured.summary())


def test_lora_leaves_gradients_and_state_to_the_adapters(llama: HFModel) -> None:
    pytest.importorskip("peft")
    from cadence.models.lora import LoraSettings, apply_lora, lora_shape

    torch.manual_seed(0)
    model = build_hf_model("hf:llama", LLAMA).model
    adapters = lora_shape(apply_lora(model, LoraSettings(rank=8)))
    assert adapters is not None and adapters.trainable_parameters == adapters.adapter_parameters
    full = estimate(llama, micro_batch_size=8)
    lora = estimate(llama, micro_batch_size=8, lora=adapters)
    assert lora.by_category["optimizer_state"] == 8 * adapters.adapter_parameters
    assert lora.by_category["parameters"] == 4 * (llama.shape.num_parameters + adapters.adapter_parameters)
    assert lora.activation_bytes < full.activation_bytes and lora.peak_bytes < full.peak_bytes
    # Adapters of this width are under bitsandbytes' 4,096 elements: their moments stay fp32.
    eight_bit = estimate(llama, micro_batch_size=8, lora=adapters, optimizer=OptimizerSpec(state="8bit"))
    assert eight_bit.by_category["optimizer_state"] == lora.by_category["optimizer_state"]


@pytest.mark.parametrize(("tied", "state", "accumulation"), [
    (True, "fp32", 4), (True, "bf16", 1), (True, "bf16", 4), (False, "bf16", 4)])
def test_a_tied_embedding_s_two_gradients_are_estimated_with_accumulation(tmp_path, tied, state, accumulation):
    """A tied embedding's two gradient contributions (the head's, the lookup's) are summed by autograd before its
    .grad sees them: with a .grad already there (a later micro-batch) the head's is held apart through the whole
    backward. Unmodelled, a 32,000-token tied llama at micro-batch 1 x 4 measured 114 MiB against 99 estimated (fp32
    state) and 97.5 against 75 (bf16 state); cadence train's own peak (summary.json) against the estimate."""
    import json

    from cadence.cli import main
    from cadence.memory.estimate_for import estimate_for
    from cadence.models.spec import ModelSpec

    overrides = [f"{k}={v}" for k, v in {"vocab_size": 32000, "hidden_size": 128, "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "intermediate_size": 256,
                                          "max_position_embeddings": 128,
                                          "tie_word_embeddings": str(tied).lower()}.items()]
    model_flags = ["--model", "hf:llama", *[arg for item in overrides for arg in ("--model-config", item)]]
    assert main(["train", *model_flags, "--seq-len", "64", "--micro-batch-size", "1", "--grad-accum-steps",
                 str(accumulation), "--max-steps", "3", "--optimizer-state", state, "--val-fraction", "0",
                 "--out", str(tmp_path / "run")]) == 0
    measured = json.loads((tmp_path / "run" / "summary.json").read_text())["peak_memory_bytes"]
    predicted = estimate_for(
        ModelSpec.from_flags(TrainConfig(model="hf:llama", model_config=overrides)), micro_batch_size=1, seq_len=64,
        precision="fp32", checkpointing="none", grad_accum_steps=accumulation,
        optimizer=OptimizerSpec(state=state)).peak_bytes
    assert abs(relative_error(predicted, measured)) < 0.02, (predicted / MiB, measured / MiB)


# ------------------------------------------------------------------------------------ packed rows, token budgets
def packed_window(seed: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """4 packed rows of 128 positions as --packing collates them: three prompt/completion examples (40, 50 and 30
    tokens, the first half of each a prompt) and the padding, with position_ids restarting at each example."""
    from cadence.data.batching import Example
    from cadence.engine.windows import collate_packed

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(4):
        row = []
        for length in (40, 50, 30, 8):  # the last one fills the row to 128
            labels = torch.randint(0, 256, (length,), generator=generator)
            labels[: length // 2] = -100
            row.append(Example(input_ids=torch.randint(0, 256, (length,), generator=generator), labels=labels))
        rows.append(row)
    batch = collate_packed(rows)
    return [batch], int((batch["labels"] != -100).sum())


@pytest.mark.parametrize(("spec", "overrides", "precision", "checkpointing", "cut"), [
    ("hf:llama", LLAMA, "fp32", "none", "packed"),
    ("hf:llama", LLAMA, "fp32", "full", "packed"),
    ("hf:llama", LLAMA, "bf16", "selective", "packed"),
    ("hf:gpt2", GPT2, "fp32", "none", "packed"),
    ("hf:llama", LLAMA, "fp32", "none", "budget"),
    ("hf:llama", LLAMA, "bf16", "full", "budget"),
    ("hf:gpt2", GPT2, "fp32", "selective", "budget"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_packed_rows_and_token_budgets_are_estimated_within_10_percent(spec, overrides, precision, checkpointing,
                                                                      cut) -> None:
    """Issue 28 item 4. Packed rows: cadence's attention runs each example on its own (no repeated k and v, no
    mask kept; transformers' own masked SDPA measured 6-10% above the unpacked estimate). A token budget of 512 as
    16 rows of 32: the estimate of its tokens."""
    hf = build(spec, overrides)
    apply_activation_checkpointing(hf.model, checkpointing)  # type: ignore[arg-type]
    optimizer = build_optimizer(hf.model, TrainConfig())
    if cut == "packed":
        rows, seq = 4, 128
        warm, _ = packed_window(0)
        window, targets = packed_window(1)
    else:
        rows, seq = 16, 32
        warm, window = make_window(rows, seq, seed=0), make_window(rows, seq)
        targets = rows * seq
    # The loss cadence train runs (issue 37 item 7: the target positions gathered before the head), which is what
    # the estimate at --loss-chunk-tokens 0 models once it is given the target count; the Engine's own default
    # (every position's logits) is estimated with full_logits=True.
    loss = TargetsOnlyCrossEntropy()
    Engine(hf.model, optimizer, precision="fp32", max_grad_norm=1.0, loss_fn=loss).step(warm)
    engine = Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0, loss_fn=loss)  # type: ignore[arg-type]
    measured = measure_step(hf.model, optimizer, lambda: engine.step(window), "cpu")
    predicted = estimate(hf, micro_batch_size=rows, seq_len=seq, precision=precision, checkpointing=checkpointing,
                         target_tokens=targets, packed=cut == "packed")
    assert abs(relative_error(predicted.peak_bytes, measured.peak_bytes)) <= 0.10, (predicted.summary(),
                                                                                   measured.summary())
