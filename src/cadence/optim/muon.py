"""Muon (``--optimizer muon``): orthogonalised momentum for the 2-D weight matrices of the model's repeated blocks,
AdamW for the rest (embeddings, the LM head, norms and biases).

The rule (Keller Jordan's Muon, as torch.optim.Muon and Moonlight apply it): a matrix inside a block (an attention or
MLP projection, a LoRA adapter's A or B) keeps one momentum buffer ``B <- momentum x B + g``; its update is the
Newton-Schulz orthogonalisation of the Nesterov mix ``g + momentum x B`` (five quintic iterations, which map the
matrix's singular values near 1), scaled by ``0.2 x sqrt(max(rows, columns))`` so that its RMS matches AdamW's
typical update (Moonlight's rule, torch's ``adjust_lr_fn="match_rms_adamw"``): one ``--lr`` serves both groups, and
``--weight-decay`` (decoupled) applies to the matrices and the AdamW matrices alike. Every other trained tensor is
stepped by AdamW (``--adam-beta1``, ``--adam-beta2``; torch's formula to the bit).

Exact under accumulation: the engine calls ``step`` once per optimizer step, on the window's whole gradient, so
Newton-Schulz runs exactly once per matrix per step whatever the accumulation (DeepSpeed #8443 ran it per
micro-batch); the clip (``--max-grad-norm``) acts on the raw gradient before the momentum, once (clipping after the
orthogonalisation would divide each update by its own norm: DeepSpeed #8439). One clip over all groups: Newton-Schulz
normalises its input, so a clip only changes how much this step's gradient weighs against the momentum; but a clip
coefficient so small that the Nesterov mix of a matrix falls under Newton-Schulz's epsilon (1e-7) would shrink that
matrix's update silently (Megatron-LM #5394): the step detects it and warns once, naming the flag.

Newton-Schulz runs in fp32 on the CPU (exact: every split and rank computes the same update) and in bf16 on CUDA (the
reference implementations' choice: its matmuls are the optimizer's cost). Its state: one fp32 momentum buffer per
matrix element (4 bytes), AdamW's two moments (8 bytes) for the rest. Not with --strategy fsdp (each rank would
orthogonalise its own shard of a matrix: another update; the distributed Muons gather each matrix to one rank for
its Newton-Schulz), not offloaded, state in fp32 only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.adamw import adamw

from cadence.errors import Problem
from cadence.models.blocks import repeated_blocks
from cadence.optim.adamw import adamw_state_bytes
from cadence.optim.spec import (
    OPTIMIZER_REGION_PREFIX,
    OptimizerRule,
    OptimizerSpec,
    ParamGroup,
    TrainedTensor,
    trained_parameters,
)
from cadence.optim.state import MOMENT, STEP_TENSOR, check_state_shapes
from cadence.optim.stepping import closure_loss
from cadence.records import Record

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic iteration's coefficients (Keller Jordan's, torch.optim.Muon's): the largest slope at zero that still
maps every singular value into about [0.7, 1.2] in five steps."""
NS_STEPS = 5
NS_REGION = OPTIMIZER_REGION_PREFIX + "newton_schulz"
"""The profiler region of each orthogonalisation (``cadence profile``'s optimizer regions)."""
NS_EPS = 1e-7
"""Newton-Schulz divides its input by max(norm, NS_EPS): an input under it is not normalised, and its update shrinks
by norm / NS_EPS."""
RMS_MATCH = 0.2
"""Moonlight's update scale: 0.2 x sqrt(max(rows, columns)) gives an orthogonalised update AdamW's typical RMS."""
FP32_BYTES = 4


def newton_schulz(matrix: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``matrix`` orthogonalised: its singular vectors with singular values near 1 (five quintic iterations on the
    matrix divided by its Frobenius norm, computed on the wider side's Gram matrix), in ``matrix``'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(matrix.dtype)


def rms_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor of --lr for an orthogonalised update of a matrix of ``shape`` (Moonlight's RMS match)."""
    return RMS_MATCH * math.sqrt(max(shape[0], shape[1]))


class Muon(torch.optim.Optimizer):
    """Muon over the groups whose ``orthogonalise`` is True, AdamW over the others: one optimizer, one state dict
    (a matrix's ``momentum_buffer``; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``), so the LR schedule, the clip,
    the fp16 scaler and both checkpoint formats see an ordinary optimizer. See the module docstring."""

    def __init__(self, params: Any, lr: float = 1e-3, *, momentum: float = 0.95, betas: tuple[float, float] = (0.9,
                 0.95), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        defaults = {"lr": lr, "momentum": momentum, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "orthogonalise": False}
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["orthogonalise"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalises 2-D parameters only")
        self.attenuated: list[int] = []
        """Per step that had any: how many matrices' Newton-Schulz input fell under its epsilon."""
        self._warned = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("attenuated", [])
        self.__dict__.setdefault("_warned", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure_loss(closure)
        norms: list[torch.Tensor] = []
        for group in self.param_groups:
            if group["orthogonalise"]:
                norms += self._orthogonalised_step(group)
            else:
                self._adamw_step(group)
        if norms:
            # One read-back per step (a sync on CUDA, after every update is queued): how many inputs were too small.
            under = int((torch.stack(norms) < NS_EPS).sum().item())
            if under:
                self._warn(under, len(norms))
        return loss

    def _orthogonalised_step(self, group: dict[str, Any]) -> list[torch.Tensor]:
        lr, momentum, decay = float(group["lr"]), float(group["momentum"]), float(group["weight_decay"])
        norms = []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.mul_(momentum).add_(param.grad)
            mix = param.grad.add(buffer, alpha=momentum)  # Nesterov
            norms.append(mix.norm())
            # A named region: `cadence profile` reports Newton-Schulz's own time inside the optimizer step.
            with torch.profiler.record_function(NS_REGION):
                update = newton_schulz(mix, dtype=torch.bfloat16 if param.device.type == "cuda" else torch.float32)
            param.mul_(1 - lr * decay)
            param.add_(update, alpha=-lr * rms_scale(param.shape))
        return norms

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                # As torch's AdamW keeps them: a float32 scalar step on the CPU, moments like the parameter.
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, amsgrad=False, beta1=beta1,
                  beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _warn(self, under: int, matrices: int) -> None:
        self.attenuated.append(under)
        if self._warned:
            return
        self._warned = True
        warnings.warn(f"Muon: the gradient of {under} of {matrices} orthogonalised matrices (after the clip, "
                      f"--max-grad-norm, and the momentum) was under Newton-Schulz's epsilon {NS_EPS:g}, so their "
                      f"updates shrank instead of being normalised (Megatron-LM #5394's silent stall): raise "
                      f"--max-grad-norm or give 0, or look for a gradient that dwarfs the others (said once per run; "
                      f"Muon.attenuated counts the steps)", stacklevel=2)


def _block_parameters(model: torch.nn.Module) -> set[int]:
    """The ids of the parameters inside the model's repeated blocks (empty when it has none)."""
    inner = getattr(model, "module", model)  # DDP
    try:
        blocks = repeated_blocks(inner)
    except ValueError:
        return set()
    return {id(param) for block in blocks for param in block.parameters()}


class MuonRule(OptimizerRule):
    """Muon: see the module docstring."""

    title = "Muon"
    options = frozenset({"weight_decay", "adam_beta1", "adam_beta2", "momentum"})
    default_momentum = 0.95

    def param_groups(self, spec: OptimizerSpec, model: torch.nn.Module) -> list[ParamGroup]:
        inside = _block_parameters(model)
        orthogonalised: list[torch.Tensor] = []
        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        for _, param in trained_parameters(model):
            if param.ndim == 2 and id(param) in inside:
                orthogonalised.append(param)
            else:
                (decay if param.ndim >= 2 else no_decay).append(param)
        return [ParamGroup("orthogonalised (Muon)", orthogonalised,
                           {"weight_decay": spec.weight_decay, "orthogonalise": True}),
                ParamGroup("AdamW decay", decay, {"weight_decay": spec.weight_decay}),
                ParamGroup("AdamW no decay", no_decay, {"weight_decay": 0.0})]

    def constructor(self, spec: OptimizerSpec, *, device_type: str) -> tuple[type[torch.optim.Optimizer],
                                                                              dict[str, Any]]:
        return Muon, {"lr": spec.lr, "momentum": spec.momentum_value, "betas": spec.betas}

    def describe(self, spec: OptimizerSpec) -> str:
        return (f"Muon (momentum {spec.momentum_value:g}, Nesterov, Newton-Schulz once per step on the blocks' "
                f"matrices, their --lr scaled to AdamW's RMS; AdamW with betas {spec.betas[0]:g}, {spec.betas[1]:g} for "
                f"the rest; weight decay {spec.weight_decay:g})")

    def problems(self, spec: OptimizerSpec, *, sharded: bool) -> list[Problem]:
        if sharded:
            return [Problem(where="--optimizer", message=(
                "muon with --strategy fsdp is not supported: Newton-Schulz orthogonalises a whole matrix, and FSDP2 "
                "shards each matrix over the ranks (each rank would orthogonalise its own rows: another update); "
                "use --strategy ddp, where every rank holds whole matrices"))]
        return []

    def model_problem(self, spec: OptimizerSpec, model: torch.nn.Module) -> str | None:
        inside = _block_parameters(model)
        if any(param.ndim == 2 and id(param) in inside for _, param in trained_parameters(model)):
            return None
        return ("muon orthogonalises the trained 2-D weight matrices of the model's repeated blocks, and this model "
                "trains none (no block list found, or no trained matrix in its blocks); use another --optimizer")

    def notes(self, spec: OptimizerSpec, *, pretrained: bool, adapters: bool) -> list[str]:
        if pretrained and not adapters:
            return ["--optimizer muon fine-tunes every weight of a model pretrained (most likely) with AdamW: Muon's "
                    "full fine-tuning of Adam-pretrained models is reported to degrade them, while Muon on LoRA "
                    "adapters does not (\"Can Muon Fine-tune Adam-Pretrained Models?\", arXiv 2605.10468); consider "
                    "--lora-rank, or --optimizer adamw"]
        return []

    def state_bytes(self, spec: OptimizerSpec, tensors: list[TrainedTensor], *, on_device: bool
                    ) -> tuple[int, int | None]:
        """A block matrix: its fp32 momentum buffer; the rest: AdamW's two fp32 moments. The step's scratch, one
        matrix at a time: the Nesterov mix (fp32), Newton-Schulz's copy and its iterate (fp32 on the CPU, bf16 on
        CUDA), its Gram matrices (the shorter side squared, two of them) and the next iterate."""
        matrices = [t for t in tensors if t.in_blocks and len(t.shape) == 2]
        rest = [t.numel for t in tensors if not (t.in_blocks and len(t.shape) == 2)]
        state = FP32_BYTES * sum(t.numel for t in matrices) + adamw_state_bytes("fp32", rest, on_device=on_device)[0]
        width = 2 if on_device else FP32_BYTES
        scratch = max((FP32_BYTES * t.numel + width * (3 * t.numel + 2 * min(t.shape) ** 2) for t in matrices),
                      default=0)
        adam = 3 * FP32_BYTES * max(rest, default=0)  # torch's per-tensor AdamW: sqrt and quotient of one tensor
        return state, max(scratch, adam)

    def check_saved(self, spec: OptimizerSpec, optimizer: Record) -> None:
        states = optimizer.record("state")
        for key in states.data:
            entry = states.record(key)
            if entry.get("momentum_buffer") is not None:
                entry.take("momentum_buffer", MOMENT)
                continue
            entry.take("step", STEP_TENSOR)
            for moment in ("exp_avg", "exp_avg_sq"):
                entry.take(moment, MOMENT)

    def check_loaded(self, spec: OptimizerSpec, optimizer: torch.optim.Optimizer) -> None:
        check_state_shapes(optimizer, lambda name, parameter: None if name == "step" else tuple(parameter.shape))


RULE = MuonRule()
