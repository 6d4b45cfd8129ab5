"""Lower-precision optimizer state (``--optimizer-state``): AdamW's two moments in fewer bytes per parameter.

- ``fp32`` (default): ``torch.optim.AdamW``, two fp32 moments: 8 bytes per trained parameter.
- ``bf16``: :class:`BF16StateAdamW` (here): both moments stored in bf16 with stochastic rounding: 4 bytes.
- ``8bit``: bitsandbytes' ``AdamW8bit`` (:func:`adamw_8bit_class`): both moments block-wise quantised to one byte
  with an fp32 absmax per block of 256 (and a 256-entry code book shared by all tensors): about 2.03 bytes. Tensors
  under 4,096 elements (biases, norm gains) keep fp32 moments, as bitsandbytes decides; they are few bytes.

The parameters (the fp32 master weights) and the gradients are unchanged in every mode: only the state shrinks.

Why bitsandbytes for 8 bits, not torchao's ``AdamW8bit``: both are maintained and both run with torch 2.13 on CPU
and CUDA, but bitsandbytes runs its native kernels on both (a C library on CPU, CUDA kernels on the GPU) with no
compilation, and keeps its state as plain tensors (``state1``/``state2`` uint8 codes, ``absmax1``/``absmax2`` fp32
scales, ``qmap1``/``qmap2`` code books), which go into cadence's safetensors checkpoint as they are. torchao compiles
its update with ``torch.compile`` (about 25 s per process on a 2-core CPU, and a C++ compiler needed there) and keeps
its state as a tensor subclass, which would need unpacking to be stored without pickle. What torchao has and
bitsandbytes lacks is DTensor support: ``8bit`` is refused under ``--strategy fsdp`` (``bf16`` works there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from cadence.models.quantized import bitsandbytes_problem, quiet_bitsandbytes
from cadence.optim.stepping import closure_loss, local, shard_index

EIGHT_BIT_BLOCK = 256
"""Elements per quantisation block of bitsandbytes' block-wise 8-bit state (one fp32 absmax each)."""
EIGHT_BIT_MIN_SIZE = 4096
"""bitsandbytes' ``min_8bit_size``: smaller tensors keep fp32 moments (their bytes do not matter)."""
EIGHT_BIT_CODE_BOOK = 256 * 4
"""Bytes of one code book (256 fp32 values); two (signed for exp_avg, unsigned for exp_avg_sq) per device."""

EIGHT_BIT_QUANT_STATE = "__bnb_optimizer_quant_state__"
"""Where bitsandbytes' state dict wraps a parameter's quantisation state (for FSDP's sake)."""

CHUNK_ELEMENTS = 1 << 20
"""BF16StateAdamW updates a tensor this many elements at a time, so the fp32 working copies of a large embedding
never exist whole (16 bytes per element of a chunk at most, instead of per element of the tensor)."""

_MASK64 = (1 << 64) - 1


def state_bytes_per_parameter(name: str, numel: int) -> float:
    """Bytes of optimizer state one tensor of ``numel`` trained elements costs under ``--optimizer-state name``
    (the code books, shared by all tensors, excluded)."""
    if name == "fp32":
        return 8.0
    if name == "bf16":
        return 4.0
    if numel < EIGHT_BIT_MIN_SIZE:
        return 8.0
    blocks = -(-numel // EIGHT_BIT_BLOCK)
    return 2.0 + 2 * 4 * blocks / numel


def eight_bit_problem() -> str | None:
    """Why ``--optimizer-state 8bit`` cannot run here (bitsandbytes missing, or installed but failing), or None."""
    return bitsandbytes_problem(needs=("optim.AdamW8bit",))


def adamw_8bit_class() -> type[torch.optim.Optimizer]:
    """bitsandbytes' block-wise 8-bit AdamW (decoupled weight decay, as torch's AdamW).

    Imported only when asked for: it is a large optional dependency. Its CPU backend logs a warning at import about
    an unrelated 4-bit matmul kernel it could not fetch; that is silenced (cadence never uses 4-bit matmuls)."""
    with quiet_bitsandbytes():
        import bitsandbytes
    return bitsandbytes.optim.AdamW8bit


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, exactly torch's single-tensor formula) with both moments STORED in bf16.

    The numerics. A moment is read into fp32, updated in fp32 (``m <- lerp(m, g, 1 - beta1)``,
    ``v <- beta2 v + (1 - beta2) g^2``), used in fp32 for this step's update of the (fp32) parameter, and only then
    written back to bf16. Writing it back with round-to-nearest would stall: bf16 keeps 8 significant bits, so a
    moment changes only if the step moves it by more than half a unit in the last place, 2^-9 of its value. With
    beta2 = 0.999 the second moment moves by 0.1% of (g^2 - v) per step: every step with g^2 within about 2x of v
    rounds back to the old value, so v stops following the gradients (and the first moment freezes the same way
    whenever |g - m| is small against m). Kahan-style compensation would fix this with a second bf16 buffer per
    moment, i.e. back to 8 bytes per parameter. Stochastic rounding fixes it for free: the fp32 value is rounded up
    or down to a neighbouring bf16 value with probabilities proportional to its distance from each, so the stored
    moment is unbiased (E[stored] = the fp32 value) and small updates accumulate in expectation instead of
    vanishing. Implemented on the bits: add 16 uniformly random bits to the fp32 bit pattern, then clear the low 16
    (the carry into bit 16 happens with exactly the probability the discarded bits stand for; for a negative value
    the pattern's magnitude bits behave the same way, so it is symmetric), and the result is exactly a bf16 value.

    The random bits come from a generator seeded from (step, the tensor's index among the parameters, the chunk,
    the shard) alone, never from a state that would need saving: a resumed run draws the same bits as the
    uninterrupted one (exact resume from the usual state dict: two bf16 moments and the step count), every DDP rank
    draws the same bits (their moments stay identical), and the run's own random streams (dropout, data order) are
    untouched.

    Parameters keep their dtype; FSDP2-sharded (DTensor) parameters are updated through their local shards.
    ``state_dtype=torch.float32`` turns the rounding off: the same code is then bitwise ``torch.optim.AdamW``
    (the test that pins the formula).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 state_dtype: torch.dtype = torch.bfloat16, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"state_dtype must be torch.bfloat16 or torch.float32, got {state_dtype}")
        if chunk_elements < 1:
            raise ValueError("chunk_elements must be at least 1")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.chunk_elements = chunk_elements
        self._generators: dict[torch.device, torch.Generator] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Unpickled or deep-copied: the generators are not state (they are reseeded for every chunk).
        self.__dict__.setdefault("_generators", {})
        self.__dict__.setdefault("state_dtype", torch.bfloat16)
        self.__dict__.setdefault("chunk_elements", CHUNK_ELEMENTS)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts every floating state tensor to its parameter's dtype (fp32) when loading; the moments go
        back to bf16, exactly (they were bf16 values)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure_loss(closure)
        index = -1
        for group in self.param_groups:
            lr, eps, weight_decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
            beta1, beta2 = (float(beta) for beta in group["betas"])
            for param in group["params"]:
                index += 1  # counted over every parameter, so that a tensor's index never depends on the gradients
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("BF16StateAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    # A Python int, as bitsandbytes keeps it: no tensor (4 bytes each) for a counter.
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype,
                                                        memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype,
                                                           memory_format=torch.preserve_format)
                state["step"] = int(state["step"]) + 1
                step = float(state["step"])
                # torch's single-tensor AdamW, term for term (Python floats, the same order of operations).
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                tensors = [local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
                if weight_decay != 0:
                    tensors[0].mul_(1 - lr * weight_decay)
                for chunk, pieces in enumerate(self._chunks(*tensors)):
                    seed = _noise_seed(int(step), index, chunk, shard_index(param))
                    # A function of its own: its fp32 working copies are freed when it returns, so the step's
                    # scratch is one chunk's (m, v and denom, then m, v and the noise: 12 bytes per element).
                    self._update_chunk(*pieces, beta1=beta1, beta2=beta2, eps=eps, step_size=step_size,
                                       bias_correction2_sqrt=bias_correction2_sqrt, seed=seed)
        return loss

    def _update_chunk(self, p: torch.Tensor, g: torch.Tensor, m_low: torch.Tensor, v_low: torch.Tensor, *,
                      beta1: float, beta2: float, eps: float, step_size: float, bias_correction2_sqrt: float,
                      seed: int) -> None:
        """One chunk: the moments read into fp32, updated, used, and stored back (stochastically rounded)."""
        m = m_low.to(torch.float32, copy=True)
        v = v_low.to(torch.float32, copy=True)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = v.sqrt()
        denom.div_(bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        del denom
        if self.state_dtype == torch.float32:
            m_low.copy_(m)
            v_low.copy_(v)
            return
        generator = self._generator(p.device)
        generator.manual_seed(seed)
        noise = torch.empty(m.shape, dtype=torch.int32, device=m.device)
        noise.random_(0, 1 << 16, generator=generator)
        _round_stochastically(m, noise)
        m_low.copy_(m)  # exact: the low 16 bits are zero, so the value is a bf16 value
        noise.random_(0, 1 << 16, generator=generator)
        _round_stochastically(v, noise)
        v_low.copy_(v)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    def _chunks(self, *tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        """The tensors (same shape) as aligned flat pieces of at most ``chunk_elements``; whole when any of them is
        not contiguous (a flat view would then not pair the same elements)."""
        if not all(t.is_contiguous() for t in tensors):
            yield tensors
            return
        flats = [t.view(-1) for t in tensors]
        total = flats[0].numel()
        for start in range(0, max(total, 1), self.chunk_elements):
            yield tuple(flat[start:start + self.chunk_elements] for flat in flats)


def _round_stochastically(values: torch.Tensor, noise: torch.Tensor) -> None:
    """Round fp32 ``values`` in place to bf16-representable values, stochastically (``noise``: int32 in [0, 2^16)).

    On the int32 view of the bits: adding the noise carries into bit 16 with probability (low 16 bits) / 2^16, then
    the low 16 bits are cleared. Finite values cannot overflow the int32 (the largest magnitude pattern, inf's
    0x7F800000, plus 0xFFFF stays below 2^31); a negative value's pattern carries in its magnitude bits the same way."""
    bits = values.view(torch.int32)
    bits.add_(noise).bitwise_and_(-(1 << 16))


def _noise_seed(step: int, index: int, chunk: int, shard: int) -> int:
    """A well-mixed 63-bit seed from the four counters (splitmix64's finaliser over their combination)."""
    x = (step * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + chunk * 0x94D049BB133111EB
         + shard * 0xD6E8FEB86659FD93) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)
