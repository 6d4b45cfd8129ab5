"""The memory estimate for Hugging Face decoder models, from their shape (:class:`cadence.models.hf.ModelShape`).

The same replay as :mod:`cadence.memory.estimate` (same bookkeeping, same step: parameters, AdamW state, the window's
token ids, forward, backward, optimizer step), with the blocks transformers builds:

- ``llama``-style (llama, qwen2, mistral, ...): RMSNorm, which computes in fp32 and keeps its reciprocal RMS, its
  normalised fp32 input and (its output, before the gain) the gained output that the projections read; separate q /
  k / v / o projections with grouped-query attention (k and v have ``num_kv_heads`` heads; SDPA's ``enable_gqa``,
  so they are never repeated to the query heads); rotary embedding applied to q and k (the rotated copies are what
  attention keeps); a SwiGLU MLP whose gate and up outputs, SiLU output and product are all kept; an LM head of its
  own unless the embeddings are tied.
- ``gpt2``-style: LayerNorm (mean and rstd kept), the fused ``c_attn`` projection, whose q and v slices attention
  copies to contiguous tensors, GELU ("gelu_new": its tanh formula keeps four tensors of the MLP's width), learned
  positions and a tied head.

Under autocast each projection casts its (fp32) input to the compute dtype itself: q, k and v (and gate and up) each
keep a copy. Dropout masks are not modelled (set the dropouts to 0 for an exact comparison). Calibrated against
:func:`cadence.memory.measure.measure_step` on tiny llama and gpt2 configs (see tests/memory/test_memory_estimate_hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.memory.estimate import FP32_BYTES, MemoryEstimate, StepReplay, estimate_from_replay, input_problems
from cadence.models.hf import ModelShape

GPT2_TYPES = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "gptj"})
"""Model types whose blocks are gpt2-style; every other decoder is treated as llama-style."""


def block_style(model_type: str) -> str:
    return "gpt2" if model_type in GPT2_TYPES else "llama"


@dataclass(frozen=True)
class _Sizes:
    """What the generic replay reads from its config (``run`` asks for the parameter count)."""

    params: int
    vocab_size: int
    n_layer: int
    context_length: int
    n_embd: int

    def num_parameters(self) -> int:
        return self.params


def estimate_hf_step_memory(
    shape: ModelShape,
    *,
    model_type: str,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    checkpointing: str,
    offload: str = "none",
    device_type: str = "cpu",
    grad_accum_steps: int = 1,
    loss_chunk_tokens: int = 0,
    target_tokens: int | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of one step of the Hugging Face model ``shape`` describes, trained by the Engine;
    ``loss_chunk_tokens`` and ``target_tokens`` as in :func:`cadence.memory.estimate.estimate_step_memory`."""
    problems = input_problems(micro_batch_size=micro_batch_size, seq_len=seq_len, grad_accum_steps=grad_accum_steps,
                              context_length=shape.context_length, precision=precision,
                              checkpointing=checkpointing, offload=offload, loss_chunk_tokens=loss_chunk_tokens,
                              target_tokens=target_tokens)
    if not shape.num_heads or not shape.head_dim or not shape.intermediate_size:
        problems.append("the model's config gives no attention heads, head size or MLP width to estimate from")
    if problems:
        raise ValueError("; ".join(problems))
    on_device = device_type != "cpu"
    replay = HFStepReplay(
        shape, block_style(model_type), tokens=micro_batch_size * seq_len, seq_len=seq_len, precision=precision,
        checkpointing=checkpointing, offload_activations=on_device and offload == "activations",
        offload_optimizer=on_device and offload == "optimizer", on_device=on_device,
        loss_chunk_tokens=loss_chunk_tokens, target_tokens=target_tokens,
    )
    return estimate_from_replay(replay, grad_accum_steps=grad_accum_steps, precision=precision, offload=offload,
                                on_device=on_device)


class HFStepReplay(StepReplay):
    """The generic replay with transformers' blocks; bookkeeping, the step and the loss are the parent's."""

    def __init__(self, shape: ModelShape, style: str, **kwargs: object) -> None:
        sizes = _Sizes(shape.num_parameters, shape.vocab_size, shape.num_layers, shape.context_length,
                       shape.hidden_size)
        super().__init__(sizes, **kwargs)  # type: ignore[arg-type]
        self.shape, self.style = shape, style
        self.c = shape.hidden_size
        heads, kv = int(shape.num_heads or 1), int(shape.num_kv_heads or shape.num_heads or 1)
        self.dq, self.dkv = heads * int(shape.head_dim or 1), kv * int(shape.head_dim or 1)  # q and k/v widths
        self.heads = heads
        self.inner = int(shape.intermediate_size or 4 * self.c)
        if self.mode == "selective":
            self.notes.append("selective recompute of Hugging Face blocks is estimated as full recompute (a lower "
                              "bound: selective also keeps the matmul and attention outputs); trials measure it")

    # ------------------------------------------------------------------------------------------------ shapes
    def _block_weights(self) -> dict[str, int]:
        c, i = self.c, self.inner
        if self.style == "gpt2":
            return {"w.qkv": 3 * c * c, "w.proj": c * c, "w.fc": c * i, "w.mlp": i * c}
        return {"w.q": c * self.dq, "w.k": c * self.dkv, "w.v": c * self.dkv, "w.o": self.dq * c,
                "w.gate": c * i, "w.up": c * i, "w.down": i * c}

    def _block_params(self) -> list[int]:
        """A block's parameter tensors, in the order the optimizer walks them (matrices first: the decay group)."""
        c, i = self.c, self.inner
        matrices = list(self._block_weights().values())
        if self.style == "gpt2":
            return matrices + [c, c, 3 * c, c, c, c, i, c]  # two LayerNorms, four biases
        return matrices + [c, c]  # two RMSNorm gains

    def _optimizer_scratch(self) -> int:
        """As for the built-in GPT: CPU AdamW's sqrt and quotient of one tensor next to the previous one's denom;
        CUDA's foreach step: a whole group's worth."""
        v, c = self.shape.vocab_size, self.c
        tensors = [v * c] + ([self.shape.context_length * c] if self.style == "gpt2" else [])
        tensors += [p for _ in range(self.shape.num_layers) for p in self._block_params() if p > 2 * c]
        if self.style != "gpt2" and not self.shape.tied_embeddings:
            tensors.append(v * c)
        if self.on_device:
            return sum(tensors) * FP32_BYTES
        return max(2 * cur + prev for prev, cur in zip([0] + tensors[:-1], tensors, strict=True)) * FP32_BYTES

    # ------------------------------------------------------------------------------------------------ forward
    def _forward(self) -> None:
        n, c, v, a = self.n, self.c, self.shape.vocab_size, self.act
        # The embedding lookup (fp32) is the residual stream; gpt2 adds the learned positions (a second lookup).
        self.alloc("r0", n * c * FP32_BYTES, "activations")
        if self.style == "gpt2":
            self.alloc("pos", self.t * c * FP32_BYTES, "activations")
            self.alloc("tok", n * c * FP32_BYTES, "activations")
            self.free("pos", "tok")
        else:
            # Rotary embedding: cos and sin of (seq_len, head_dim), computed once per forward in fp32, kept by
            # every block's rotation.
            self.alloc("rope", 2 * self.t * int(self.shape.head_dim or 1) * FP32_BYTES, "activations")
        for layer in range(self.shape.num_layers):
            self._hf_block_forward(layer)
        if self.chunk:
            self._norm_forward("nf", users=0)  # the head's input stays fp32: each chunk casts its own rows
            self._chunked_loss_forward("nf.out.f32" if self.lowp else "nf.out")
        else:
            self._norm_forward("nf", users=1)
            self._weight("w.head", v * c, saved=True)
            self.alloc("logits", n * v * a, "activations")
            self.free("nf.out", "nf.out.f32")
            if self.lowp:
                self.alloc("logits.f32", n * v * FP32_BYTES, "activations")  # the loss is computed in fp32
            self.alloc("lsm", n * v * FP32_BYTES, "activations")  # log_softmax output, saved by cross-entropy
            self.free("logits", "logits.f32")
        # Leaving autocast clears its cast cache: copies of checkpointed blocks' weights are freed.
        if self.mode != "none":
            self.free(*(f"b{i}.{w}" for i in range(self.shape.num_layers) for w in self._block_weights()))
        for name in [k for k, (_, category) in self.tensors.items() if category == "activations"]:
            self._keep(name)

    def _norm_forward(self, p: str, *, users: int) -> None:
        """RMSNorm (fp32: reciprocal RMS, the normalised input and the gained output) or LayerNorm (mean, rstd and
        the output). Under autocast each of the ``users`` projections reading it keeps its own compute-dtype cast;
        the fp32 output lives until the module that reads it returns."""
        n, c = self.n, self.c
        if self.style == "gpt2":
            self.alloc(p + ".stats", 2 * n * FP32_BYTES, "activations")
        else:
            self.alloc(p + ".stats", n * FP32_BYTES, "activations")
            self.alloc(p + ".hs", n * c * FP32_BYTES, "activations")
        self.alloc(p + ".out" + (".f32" if self.lowp else ""), n * c * FP32_BYTES, "activations")
        if self.lowp:
            for user in range(users):
                self.alloc(f"{p}.out{'' if user == 0 else user}", n * c * self.act, "activations")

    def _hf_block_forward(self, layer: int, *, recompute: bool = False) -> None:
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        weights = self._block_weights()
        for name, numel in weights.items():
            if p + name not in self.tensors:
                self._weight(p + name, numel, saved=self.mode == "none")
        if self.style == "gpt2":
            self._norm_forward(p + "n1", users=1)
            self.alloc(p + "qkv", 3 * n * c * a, "activations")
            self.alloc(p + "qc", n * c * a, "activations")  # attention's contiguous copies of q and v
            self.alloc(p + "vc", n * c * a, "activations")
            self.alloc(p + "lse", self.heads * n * FP32_BYTES, "activations")
            self.alloc(p + "att", n * c * a, "activations")  # also c_proj's input
            self.free(p + "n1.out.f32")
            self.alloc(p + "po", n * c * a, "activations")
        else:
            self._norm_forward(p + "n1", users=3)
            self.alloc(p + "q", n * self.dq * a, "activations")  # q projection, then rotated into a new tensor
            self.alloc(p + "qr", n * self.dq * a, "activations")
            self.free(p + "q")
            self.alloc(p + "k", n * self.dkv * a, "activations")
            self.alloc(p + "kr", n * self.dkv * a, "activations")
            self.free(p + "k")
            self.alloc(p + "v", n * self.dkv * a, "activations")
            self.alloc(p + "lse", self.heads * n * FP32_BYTES, "activations")
            self.alloc(p + "att", n * self.dq * a, "activations")  # also o_proj's input
            self.free(p + "n1.out.f32")
            self.alloc(p + "po", n * c * a, "activations")
        self.alloc(p + "x1", n * c * FP32_BYTES, "activations")  # residual add: fp32 stream + branch -> fp32
        self.free(p + "po")
        if self.style == "gpt2":
            self._norm_forward(p + "n2", users=1)
            self.alloc(p + "f", n * i * a, "activations")
            # gelu_new = 0.5 x (1 + tanh(k (x + 0.044715 x^3))): keeps tanh's output, 0.5 x and 1 + tanh
            self.alloc(p + "g1", 3 * n * i * a, "activations")
            self.alloc(p + "g", n * i * a, "activations")
        else:
            self._norm_forward(p + "n2", users=2)
            self.alloc(p + "gate", n * i * a, "activations")
            self.alloc(p + "up", n * i * a, "activations")
            self.alloc(p + "silu", n * i * a, "activations")
            self.alloc(p + "g", n * i * a, "activations")  # silu(gate) * up: down_proj's input
        if recompute:  # non-reentrant checkpointing stops once the last saved tensor exists
            self.free(p + "n2.out.f32")
            return
        self.alloc(p + "mo", n * c * a, "activations")
        self.free(p + "n2.out.f32")
        self.alloc(f"r{layer + 1}", n * c * FP32_BYTES, "activations")
        self.free(p + "mo")
        if self.mode != "none":  # the checkpoint keeps only the block's input (and the next one's)
            self.free(*[name for name in self.tensors if name.startswith(p) and self.tensors[name][1] == "activations"])

    # ------------------------------------------------------------------------------------------------ backward
    def _backward(self) -> None:
        n, c, v, a = self.n, self.c, self.shape.vocab_size, self.act
        head = "lm_head" if not self.shape.tied_embeddings else "embed"
        if self.chunk:
            self._chunked_loss_backward(head)
            self.alloc("dres", n * c * FP32_BYTES, "temporaries")  # the final norm's backward (fp32 gradient in)
            self.free("dhf")
        else:
            self.alloc("dlsm", n * v * FP32_BYTES, "temporaries")  # nll_loss backward
            self.alloc("dlogits.f32", n * v * FP32_BYTES, "temporaries")  # log_softmax backward
            self.free("dlsm", "lsm")
            if self.lowp:
                self.alloc("dlogits", n * v * a, "temporaries")
                self.free("dlogits.f32")
            self.alloc("dhf", n * c * a, "temporaries")
            self.param_grad(head, v * c)
            self.free("dlogits", "dlogits.f32", "w.head")
            self._norm_backward("dhf", "dres")
        self.param_grad("norm_f", 2 * c)
        last = self.shape.num_layers
        self.free(*[k for k in self.tensors if k.startswith("nf.")], f"r{last}")
        for layer in reversed(range(last)):
            self._hf_block_backward(layer)
        if self.style == "gpt2":
            self.alloc("dpos", self.t * c * FP32_BYTES, "temporaries")
            self.param_grad("pos_emb", self.shape.context_length * c)
        self.param_grad("embed", v * c)
        self.free("dres", "dpos", "rope", "r0")

    def _hf_block_backward(self, layer: int) -> None:
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        weights = self._block_weights()
        if self.mode != "none":  # non-reentrant checkpointing re-runs the block's forward, keeping what it saves
            self._hf_block_forward(layer, recompute=True)

        def grad(name: str, size: int) -> None:
            self.alloc(p + name, size, "temporaries")

        def release(*names: str) -> None:
            self.free(*(p + name for name in names))

        # MLP: the compute-dtype copy of the residual gradient, then the gradients of down's input, the product's
        # two factors (SwiGLU) or GELU's terms, and the two (one) input gradients of the up-projections.
        if self.lowp:
            grad("dres.c", n * c * a)
        grad("dg", n * i * a)
        self.param_grad(p + "down", weights.get("w.down", weights.get("w.mlp", 0)))
        release("dres.c", "g", "w.down", "w.mlp")
        if self.style == "gpt2":
            # gelu_new's backward goes through its formula: the gradients of both factors of 0.5 x * (1 + tanh)
            # exist together with the incoming one, then tanh's, then the three paths summed into x's.
            grad("da", n * i * a)
            grad("dt", n * i * a)
            release("dg")
            grad("dtanh", n * i * a)
            release("dt", "g1")
            grad("df", n * i * a)
            release("da", "dtanh", "f")
            grad("dh2", n * c * a)
            self.param_grad(p + "fc", weights["w.fc"])
            release("df", "w.fc")
        else:
            grad("dup", n * i * a)
            grad("dsilu", n * i * a)
            release("dg", "silu", "up")
            grad("dgate", n * i * a)
            release("dsilu", "gate")
            grad("dh2", n * c * a)
            self.param_grad(p + "gate", weights["w.gate"])
            grad("dh2b", n * c * a)
            self.param_grad(p + "up", weights["w.up"])
            release("dgate", "dup", "w.gate", "w.up")
        self._norm_backward(p + "dh2", p + "dx1")
        release("dh2b")
        self.param_grad(p + "n2", c)
        release(*(k[len(p):] for k in list(self.tensors) if k.startswith(p + "n2.")), "x1", "dx1")
        # Attention
        if self.lowp:
            grad("dres.c", n * c * a)
        grad("dy", n * self.dq * a)
        self.param_grad(p + "o", weights.get("w.o", weights.get("w.proj", 0)))
        release("dres.c", "w.o", "w.proj")
        if self.style == "gpt2":
            grad("dqkv.parts", 3 * n * c * a)
            release("dy", "att", "lse", "qc", "vc")
            grad("dqkv", 3 * n * c * a)
            release("dqkv.parts", "qkv")
            grad("dh1", n * c * a)
            self.param_grad(p + "qkv", weights["w.qkv"])
            release("dqkv", "w.qkv")
        else:
            grad("dqkv.parts", n * (self.dq + 2 * self.dkv) * a)
            release("dy", "att", "lse", "qr", "kr", "v")
            grad("dh1", 3 * n * c * a)  # q, k and v each give their input a gradient, summed into one
            self.param_grad(p + "q", weights["w.q"])
            self.param_grad(p + "k", weights["w.k"])
            self.param_grad(p + "v", weights["w.v"])
            release("dqkv.parts", "w.q", "w.k", "w.v")
        self._norm_backward(p + "dh1", p + "dx")
        self.param_grad(p + "n1", c)
        release(*(k[len(p):] for k in list(self.tensors) if k.startswith(p + "n1.")), "dx")
        self.free(f"r{layer + 1}")
        self.free(*[k for k in list(self.tensors) if k.startswith(p)])


__all__ = ["GPT2_TYPES", "block_style", "estimate_hf_step_memory"]
