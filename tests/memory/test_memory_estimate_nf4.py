"""--lora-base-precision nf4 in the memory estimate (issue 39): the base's linear weights at about half a byte per
parameter plus their scales, no autocast copies, the dequantised weight each matmul makes (forward, recompute, and
again for the input's gradient in the backward, one layer at a time) and peft's clone of a 4-bit layer's output.
Within 10% of the measured peak (the profiler's, cadence.memory.measure) on several shapes and modes (measured: within
1.5%). Known gap: bf16 with full recompute and an adapted down_proj is estimated high (4%; all-linear 15%): the
recompute of peft's 4-bit layer under autocast stops earlier than modelled; high, so a plan stays in budget."""

from __future__ import annotations

import pytest
import torch

from cadence.config import TrainConfig
from cadence.engine.step import Engine
from cadence.memory.estimate_hf import estimate_hf_step_memory
from cadence.memory.measure import measure_step
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models.hf import build_hf_model
from cadence.training.components import build_optimizer

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 256}
WIDE = {**LLAMA, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3, "num_attention_heads": 8}
"""Linear layers dominate: 2.4M of its 2.5M parameters are the blocks' projections."""


def window(batch: int, seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, seq), generator=generator)
    return [{"input_ids": ids, "labels": torch.randint(0, 256, (batch, seq), generator=generator)}]


def measured_and_estimated(overrides: dict, *, precision: str, checkpointing: str, targets: tuple[str, ...] | None,
                           batch: int, seq: int, base: str = "nf4") -> tuple[int, int]:
    from cadence.models.lora import LoraSettings, apply_lora, hold_base_in_bf16, lora_shape
    from cadence.models.quantized import quantize_base_nf4

    torch.manual_seed(0)
    hf = build_hf_model("hf:llama", overrides)
    if base == "nf4":
        quantize_base_nf4(hf.model, torch.bfloat16 if precision == "bf16" else torch.float32)
    apply_lora(hf.model, LoraSettings(rank=8, targets=targets))
    if base == "bf16":
        hold_base_in_bf16(hf.model)
    apply_activation_checkpointing(hf.model, checkpointing)  # type: ignore[arg-type]
    optimizer = build_optimizer(hf.model, TrainConfig())
    Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0).step(window(batch, seq, 0))  # type: ignore[arg-type]
    engine = Engine(hf.model, optimizer, precision=precision, max_grad_norm=1.0)  # type: ignore[arg-type]
    batch_window = window(batch, seq, 1)
    measured = measure_step(hf.model, optimizer, lambda: engine.step(batch_window), "cpu")
    predicted = estimate_hf_step_memory(hf.shape, style="llama", micro_batch_size=batch, seq_len=seq,
                                        precision=precision, checkpointing=checkpointing, lora=lora_shape(hf.model))
    return predicted.peak_bytes, measured.peak_bytes


@pytest.mark.parametrize(("overrides", "precision", "checkpointing", "targets", "batch", "seq"), [
    (LLAMA, "fp32", "none", None, 4, 128),
    (LLAMA, "bf16", "full", None, 4, 128),
    (LLAMA, "bf16", "full", ("o_proj", "up_proj"), 4, 128),
    pytest.param(WIDE, "fp32", "none", ("all-linear",), 2, 64, marks=pytest.mark.slow),
    pytest.param(WIDE, "bf16", "none", None, 2, 128, marks=pytest.mark.slow),
    pytest.param(WIDE, "fp32", "full", ("q_proj", "down_proj"), 4, 64, marks=pytest.mark.slow),
], ids=["llama-fp32", "llama-bf16-recompute", "llama-bf16-recompute-o-up", "wide-fp32-all-linear", "wide-bf16", "wide-fp32-recompute"])
def test_the_nf4_estimate_is_within_10_percent_of_the_measured_peak(overrides, precision, checkpointing, targets,
                                                                   batch, seq) -> None:
    predicted, measured = measured_and_estimated(overrides, precision=precision, checkpointing=checkpointing,
                                                 targets=targets, batch=batch, seq=seq)
    assert abs(predicted - measured) / measured <= 0.10, (predicted, measured)
