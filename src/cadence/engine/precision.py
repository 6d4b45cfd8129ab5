"""Mixed precision as one small object: autocast, the loss scaler, unscale-before-clip, and its own state.

fp32 has neither autocast nor scaler; bf16 autocasts and needs no scaler (its exponent range is fp32's); fp16 always
has a GradScaler, because fp16 gradients underflow without one. Parameters and their gradients stay in the
parameters' dtype (fp32), so accumulation over a window happens in fp32 whatever the compute precision.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from cadence.engine.choices import PRECISIONS, PrecisionName

_AUTOCAST_DTYPE: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Owns autocast, the GradScaler (fp16 only) and the unscale -> clip -> step -> update order.

    The engine calls, per micro-batch, ``autocast()`` around the forward and ``backward(loss)``; once per window
    ``unscale_and_clip(...)`` then ``step(optimizer)``, which returns whether the optimizer really stepped.
    """

    def __init__(self, name: PrecisionName, device: torch.device | str, *, init_scale: float = 2.0**16) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r}; expected one of {PRECISIONS}")
        self.name: PrecisionName = name
        self.device = torch.device(device)
        self._scaler: torch.amp.GradScaler | None = None
        if name == "fp16":
            self._scaler = torch.amp.GradScaler(self.device.type, init_scale=init_scale)

    # ----------------------------------------------------------------------------------------------- per micro-batch
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context for the forward pass and the loss (not for backward, which follows the forward's dtypes)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_AUTOCAST_DTYPE[self.name])

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss``; under fp16 through the scaler so that small gradients do not flush to zero."""
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()

    # ---------------------------------------------------------------------------------------------------- per window
    def unscale_and_clip(
        self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor], max_norm: float
    ) -> float:
        """Unscale (fp16), then measure the total gradient norm and clip it to ``max_norm`` (0 = no clipping).

        Returns the total norm BEFORE clipping, in true (unscaled) units; ``inf``/``nan`` when a gradient overflowed.
        Unscaling must come first: clipping scaled gradients would compare a norm inflated by the loss scale
        (2**16 by default) against ``max_norm`` and clip almost everything away.
        """
        if self._scaler is not None:
            self._scaler.unscale_(optimizer)
        with_grads = [p for p in parameters if p.grad is not None]
        if not with_grads:
            return 0.0
        # clip_grad_norm_ (public since torch 1.x) returns the norm before clipping. With clipping off it is given
        # max_norm=inf, so its coefficient clamps to exactly 1.0 and the gradients are unchanged. Non-finite norms
        # are expected now and then under fp16 and the scaler skips that step, so they are not an error here.
        total = torch.nn.utils.clip_grad_norm_(
            with_grads, max_norm if max_norm > 0 else math.inf, error_if_nonfinite=False
        )
        if hasattr(total, "full_tensor"):  # FSDP2: a replicated DTensor holding the norm over all shards
            total = total.full_tensor()
        # One host sync per optimizer step: the norm is a reported metric and decides nothing on the device.
        return float(total.item())

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer unless fp16 found inf/nan gradients; update the loss scale. Returns ``did_step``.

        GradScaler.step silently skips the optimizer on overflow and returns nothing that says so. The scale only
        ever goes down in ``update()`` when that step found inf/nan (by ``backoff_factor`` < 1), so comparing the
        scale before and after is an exact, public-API test for "the optimizer did not step".
        """
        if self._scaler is None:
            optimizer.step()
            return True
        scale_before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        return not self._scaler.get_scale() < scale_before

    # ------------------------------------------------------------------------------------------------------ state
    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None for fp32 and bf16, which have no scaler."""
        return None if self._scaler is None else float(self._scaler.get_scale())

    @property
    def has_scaler(self) -> bool:
        return self._scaler is not None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"name": self.name}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"precision state is for {state.get('name')!r}, this run uses {self.name!r}")
        if self._scaler is not None:
            self._scaler.load_state_dict(state["scaler"])


def precision_problem(name: PrecisionName, device: torch.device) -> str | None:
    """Why ``name`` cannot run on ``device`` (None if it can), found by actually running a tiny autocast step.

    A probe beats a table of capabilities: CPU builds, older GPUs (no bf16 before Ampere) and other backends differ,
    and the real op is the ground truth.
    """
    if name == "fp32":
        return None
    if device.type == "cuda" and name == "bf16" and not torch.cuda.is_bf16_supported():
        return f"this GPU ({torch.cuda.get_device_name(device)}) has no bf16 support; use fp16 or fp32"
    try:
        layer = torch.nn.Linear(8, 8).to(device)
        probe = Precision(name, device)
        with probe.autocast():
            out = layer(torch.randn(2, 8, device=device))
        if out.dtype != _AUTOCAST_DTYPE[name]:
            return f"autocast on {device.type} does not produce {name}"
        out.float().sum().backward()  # unscaled: the scaler's 2**16 alone would overflow fp16 here
        if not all(p.grad is not None and math.isfinite(float(p.grad.abs().sum())) for p in layer.parameters()):
            return f"{name} backward on {device.type} produced no finite gradients"
    except (RuntimeError, TypeError, ValueError) as err:  # the backend's own refusal is the message we pass on
        return f"{name} is not supported on {device.type}: {str(err).splitlines()[0]}"
    return None


_CPU_FLAGS_FOR = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
"""The CPU instructions that multiply each half precision in hardware (x86; other CPUs are not judged)."""


def cpu_emulation_note(name: PrecisionName, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """A one-line warning when ``name`` would be emulated on this CPU (None when it is fp32, native, or the CPU's
    flags cannot be read): without avx512_bf16/amx_bf16 torch computes bf16 in software, measured 5-10x slower than
    fp32 on a 2-core AVX2 machine (issue 41: 156-227 tokens/s for gpt-tiny against about 30,000 with them)."""
    if name not in _CPU_FLAGS_FOR:
        return None
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None or set(_CPU_FLAGS_FOR[name]) & set(flags):
        return None
    return (f"--precision {name}: this CPU has no {' or '.join(_CPU_FLAGS_FOR[name])}, so {name} is emulated in "
            f"software, typically 5-10x slower than fp32 here (it saves memory, not time); --precision fp32 is the "
            f"fast choice on this machine")


Fp32MatmulMode = Literal["tf32", "exact"]


@contextlib.contextmanager
def fp32_matmul(mode: Fp32MatmulMode) -> Iterator[None]:
    """Run CUDA's fp32 matrix multiplies and convolutions as ``mode`` says inside the context, then restore them.

    ``tf32``: TensorFloat-32 tensor cores (10 mantissa bits per product, fp32 accumulation), several times faster on
    Ampere and later, about 1e-3 relative error per product; what most training code turns on. ``exact``: full fp32,
    PyTorch's own default for matmuls. These are process-wide PyTorch switches, so they are set for the run and put
    back afterwards rather than left changed behind the caller's back. CPU matmuls are exact either way."""
    if mode not in ("tf32", "exact"):
        raise ValueError(f"unknown fp32 matmul mode {mode!r}; expected tf32 or exact")
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
