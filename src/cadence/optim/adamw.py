"""AdamW (``--optimizer adamw``, the default): decoupled weight decay on matrices and embeddings only, its two
moments in fp32, bf16 or 8 bits (``--optimizer-state``, :mod:`cadence.optim.low_precision`), offloadable."""

from __future__ import annotations

from typing import Any

import torch

from cadence.errors import Problem
from cadence.optim.low_precision import (
    CHUNK_ELEMENTS,
    EIGHT_BIT_BLOCK,
    EIGHT_BIT_CODE_BOOK,
    EIGHT_BIT_MIN_SIZE,
    EIGHT_BIT_QUANT_STATE,
    BF16StateAdamW,
    adamw_8bit_class,
    eight_bit_problem,
    state_bytes_per_parameter,
)
from cadence.optim.spec import OptimizerRule, OptimizerSpec, ParamGroup, trained_parameters
from cadence.optim.state import MOMENT, STEP_TENSOR, check_state_shapes
from cadence.records import COUNT, Record, tensor_kind

FP32_BYTES = 4
_CODE_BOOK = tensor_kind(dtypes=(torch.float32,), elements=256, words="a float32 code book of 256 entries")
_SCALES = tensor_kind(dtypes=(torch.float32,), words="a float32 tensor of per-block scales")
_PER_BLOCK_STATE = ("absmax1", "absmax2")
"""bitsandbytes' 8-bit state: one fp32 scale per block of its moments' elements."""
_UNSHAPED_STATE = ("step", "qmap1", "qmap2", "unorm_vec")
"""State that has no parameter's shape: step counters, bitsandbytes' code books."""


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[ParamGroup]:
    """Weight decay on matrices and embeddings only (decaying biases and norm gains only hurts): AdamW's groups, and
    those of the optimizers that decay as AdamW does."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for _, param in trained_parameters(model):
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [ParamGroup("decay", decay, {"weight_decay": weight_decay}),
            ParamGroup("no decay", no_decay, {"weight_decay": 0.0})]


class AdamWRule(OptimizerRule):
    """AdamW: two moments per trained parameter; see the module docstring."""

    title = "AdamW"
    options = frozenset({"weight_decay", "adam_beta1", "adam_beta2"})
    states = ("fp32", "bf16", "8bit")
    offloadable = True

    def param_groups(self, spec: OptimizerSpec, model: torch.nn.Module) -> list[ParamGroup]:
        return decay_groups(model, spec.weight_decay)

    def constructor(self, spec: OptimizerSpec, *, device_type: str) -> tuple[type[torch.optim.Optimizer],
                                                                              dict[str, Any]]:
        options: dict[str, Any] = {"lr": spec.lr, "betas": spec.betas}
        if spec.state == "8bit":  # validate() has checked that bitsandbytes is installed
            options["eps"] = 1e-8  # torch's AdamW default (bitsandbytes' is the same today; pinned, as it is the math)
            return adamw_8bit_class(), options
        if spec.state == "bf16":
            return BF16StateAdamW, options
        if device_type == "cuda":
            # One fused kernel updates every parameter of a group (a few launches per step instead of several per
            # tensor); it also takes the fp16 scaler's inf check on the device. CPU keeps PyTorch's default.
            options["fused"] = True
        return torch.optim.AdamW, options

    def describe(self, spec: OptimizerSpec) -> str:
        moments = {"fp32": "fp32 moments", "bf16": "bf16 moments, stochastically rounded",
                   "8bit": "8-bit block-wise moments"}[spec.state]
        return (f"AdamW ({moments}; betas {spec.betas[0]:g}, {spec.betas[1]:g}; weight decay {spec.weight_decay:g} on "
                f"matrices and embeddings)")

    def problems(self, spec: OptimizerSpec, *, sharded: bool) -> list[Problem]:
        problems = []
        if spec.state == "8bit" and (reason := eight_bit_problem()) is not None:
            problems.append(Problem(where="--optimizer-state", message=f"8bit {reason}"))
        if sharded and spec.state == "8bit":
            problems.append(Problem(where="--optimizer-state", message=(
                "8bit with --strategy fsdp is not supported: bitsandbytes' 8-bit AdamW updates whole tensors and "
                "cannot update FSDP2's sharded (DTensor) parameters; use --optimizer-state bf16 (which shards like "
                "fp32), or --strategy ddp")))
        return problems

    def state_bytes(self, spec: OptimizerSpec, trained: list[int], *, on_device: bool) -> tuple[int, int | None]:
        """- ``fp32``: two fp32 moments, 8 bytes per element (the scratch is the replay's own, model by model);
        - ``bf16``: two bf16 moments, 4 bytes; :class:`cadence.optim.low_precision.BF16StateAdamW` works on one chunk
          of one tensor at a time: fp32 copies of both moments plus the denominator (then the rounding noise), 12
          bytes per element of the largest chunk;
        - ``8bit``: one byte per moment and an fp32 absmax per block of 256 (tensors under 4,096 elements keep fp32
          moments), plus the two shared code books. bitsandbytes' CPU update dequantises both moments of a tensor to
          fp32, scales a copy of its gradient and takes the square root and the quotient: five fp32 copies of the
          largest 8-bit tensor (20 bytes per element); its CUDA kernel updates in place (no scratch)."""
        state = sum(int(state_bytes_per_parameter(spec.state, numel) * numel) for numel in trained)
        if spec.state == "8bit":
            quantised = [numel for numel in trained if numel >= EIGHT_BIT_MIN_SIZE]
            state += 2 * EIGHT_BIT_CODE_BOOK if quantised else 0  # held (and counted) once some tensor is quantised
            return state, 0 if on_device or not quantised else 5 * FP32_BYTES * max(quantised)
        if spec.state == "bf16":
            return state, 3 * FP32_BYTES * min(max(trained, default=0), CHUNK_ELEMENTS)
        return state, None

    def check_saved(self, spec: OptimizerSpec, optimizer: Record) -> None:
        """A step that is not a count, a missing moment, or an 8-bit state without its scales or code books: torch's
        ``load_state_dict`` takes any of these as they are (and turns a string step into a generator), so each would
        otherwise end the resumed run at its first step with a traceback; shapes are checked after loading."""
        states = optimizer.record("state")
        for key in states.data:
            entry = states.record(key)
            if spec.state == "8bit":
                entry.count("step")
                _check_eight_bit(entry.record(EIGHT_BIT_QUANT_STATE, default=entry))
                continue
            entry.take("step", STEP_TENSOR if spec.state == "fp32" else COUNT)
            for moment in ("exp_avg", "exp_avg_sq"):
                entry.take(moment, MOMENT)

    def check_loaded(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> None:
        check_state_shapes(optimizer, _expected_shape)

    def lossy_states(self, notes: list[str]) -> list[Any]:
        """bf16, and 8bit where bitsandbytes is installed."""
        missing = eight_bit_problem()
        if missing is not None:
            notes.append(f"8bit optimizer state was not a candidate: it {missing}")
            return ["bf16"]
        return ["bf16", "8bit"]


def _expected_shape(name: str, parameter: torch.Tensor) -> tuple[int, ...] | None:
    if name in _UNSHAPED_STATE:
        return None
    return (-(-parameter.numel() // EIGHT_BIT_BLOCK),) if name in _PER_BLOCK_STATE else tuple(parameter.shape)


def _check_eight_bit(state: Record) -> None:
    """bitsandbytes' state of one parameter: two moments of one dtype, fp32 (a small tensor) or uint8 codes with
    their per-block scales and code books (``update_step`` picks its kernel by ``state1``'s dtype)."""
    first = state.take("state1", tensor_kind(dtypes=(torch.float32, torch.uint8), words="a float32 or uint8 tensor"))
    state.take("state2", tensor_kind(dtypes=(first.dtype,), words=f"a {str(first.dtype).replace('torch.', '')} tensor "
                                                             f"(as state1)"))
    if first.dtype == torch.uint8:
        for name in ("qmap1", "qmap2"):
            state.take(name, _CODE_BOOK)
        for name in ("absmax1", "absmax2"):
            state.take(name, _SCALES)


RULE = AdamWRule()
