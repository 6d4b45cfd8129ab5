"""The replay of one training step of a transformers decoder (the estimate of :mod:`cadence.memory.estimate_hf`),
block by block, for a model trained whole (its LoRA form is :mod:`cadence.memory.lora_replay`).

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
keep a copy. Dropout masks are not modelled (set the dropouts to 0 for an exact comparison). Which style a model's
blocks are is the model's to say (:attr:`cadence.models.spec.ModelSpec.estimator`): a model whose blocks are neither
has no estimate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from cadence.memory.estimate import FP32_BYTES, StepReplay
from cadence.models.shape import ModelShape
from cadence.optim.spec import TrainedTensor

BlockStyle = Literal["llama", "gpt2"]
BLOCK_STYLES: tuple[BlockStyle, ...] = ("llama", "gpt2")
"""The decoder blocks the replay knows."""


@dataclass(frozen=True)
class _Sizes:
    """What the generic replay reads from its config (``run`` asks for the parameter count)."""

    params: int
    vocab_size: int
    n_layer: int
    context_length: int
    n_embd: int
    n_head: int

    def num_parameters(self) -> int:
        return self.params


_SELECTIVE_SAVED = {
    "llama": frozenset({"q", "k", "v", "lse", "att", "po", "gate", "up", "mo"}),
    "gpt2": frozenset({"qkv", "lse", "att", "po", "f", "mo"}),
}
"""Per block style, the tensors selective recompute keeps: the outputs of the matmuls (q/k/v/o, gate/up/down;
gpt2's c_attn, c_proj, c_fc, mlp c_proj) and of attention (its output and log-sum-exp)."""


class DecoderReplay(StepReplay):
    """The generic replay with transformers' blocks; bookkeeping, the step and the loss are the parent's."""

    def __init__(self, shape: ModelShape, style: BlockStyle, *, packed: bool = False, **kwargs: Any) -> None:
        """``kwargs``: the generic replay's settings (StepReplay's keyword arguments), passed on as they are."""
        sizes = _Sizes(shape.num_parameters, shape.vocab_size, shape.num_layers, shape.context_length,
                       shape.hidden_size, int(shape.num_heads or 1))
        super().__init__(sizes, **kwargs)
        self.embedding_lookup = False
        """True while the embedding lookup's gradient arrives (the last of a tied weight's two contributions)."""
        self.tied_head_held = False
        self.shape, self.style = shape, style
        self.packed = packed
        self.c = shape.hidden_size
        heads, kv = int(shape.num_heads or 1), int(shape.num_kv_heads or shape.num_heads or 1)
        self.dq, self.dkv = heads * int(shape.head_dim or 1), kv * int(shape.head_dim or 1)  # q and k/v widths
        self.heads = heads
        self.inner = int(shape.intermediate_size or 4 * self.c)

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


    # ------------------------------------------------------------------------------------------------ trained
    def parameter_count(self) -> int:
        return self.shape.num_parameters

    def trained_tensors(self) -> list[int]:
        v, c = self.shape.vocab_size, self.c
        tensors = [v * c] + ([self.shape.context_length * c] if self.style == "gpt2" else [])
        tensors += [p for _ in range(self.shape.num_layers) for p in self._block_params()]
        tensors += [2 * c] if self.style == "gpt2" else [c]  # the final norm
        if self.style != "gpt2" and not self.shape.tied_embeddings:
            tensors.append(v * c)
        return tensors

    def trained_shapes(self) -> list[TrainedTensor]:
        """As :meth:`trained_tensors` counts them: the embedding (gpt2: and the positions), each block's matrices
        (``nn.Linear``: out x in; gpt2's ``Conv1D``: in x out) and vectors, the final norm, an untied head."""
        v, c, i = self.shape.vocab_size, self.c, self.inner
        tensors = [TrainedTensor((v, c))] + ([TrainedTensor((self.shape.context_length, c))]
                                             if self.style == "gpt2" else [])
        if self.style == "gpt2":
            matrices = [(c, 3 * c), (c, c), (c, i), (i, c)]
            vectors = [c, c, 3 * c, c, c, c, i, c]
        else:
            matrices = [(self.dq, c), (self.dkv, c), (self.dkv, c), (c, self.dq), (i, c), (i, c), (c, i)]
            vectors = list(self._block_params()[len(matrices):])
        block = [TrainedTensor(shape, in_blocks=True) for shape in matrices]
        block += [TrainedTensor((n,), in_blocks=True) for n in vectors]
        tensors += block * self.shape.num_layers
        tensors += [TrainedTensor((2 * c,))] if self.style == "gpt2" else [TrainedTensor((c,))]
        if self.style != "gpt2" and not self.shape.tied_embeddings:
            tensors.append(TrainedTensor((v, c)))
        return tensors

    def _optimizer_scratch(self) -> int:
        """As for the built-in GPT: CPU AdamW's sqrt and quotient of one tensor next to the previous one's denom;
        CUDA's foreach step: a whole group's worth."""
        v, c = self.shape.vocab_size, self.c
        tensors = [v * c] + ([self.shape.context_length * c] if self.style == "gpt2" else [])
        tensors += [p for _ in range(self.shape.num_layers) for p in self._block_params() if p > 2 * c]
        if self.style != "gpt2" and not self.shape.tied_embeddings:
            tensors.append(v * c)
        return adamw_scratch(tensors, on_device=self.on_device)

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
        if self.packed:  # the block-diagonal mask transformers still builds for packed rows: one bool per (row,
            self.alloc("mask", self.n * self.t, "activations")  # query, key), unused by cadence's attention
        for layer in range(self.shape.num_layers):
            self._decoder_block_forward(layer)
        if self.gathered:
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
        self.free("mask")  # the model's forward returns: nothing saved the mask
        for name in [k for k, (_, category) in self.tensors.items() if category == "activations"]:
            self._keep(name)

    def _norm_statistics(self, p: str) -> None:
        """What a norm makes: RMSNorm its reciprocal RMS and normalised fp32 input (``.hs``), LayerNorm its mean and
        rstd; then its fp32 output (``.out``, or under autocast ``.out.f32``, whose casts its readers make)."""
        n, c = self.n, self.c
        if self.style == "gpt2":
            self.alloc(p + ".stats", 2 * n * FP32_BYTES, "activations")
        else:
            self.alloc(p + ".stats", n * FP32_BYTES, "activations")
            self.alloc(p + ".hs", n * c * FP32_BYTES, "activations")
        self.alloc(p + ".out" + (".f32" if self.lowp else ""), n * c * FP32_BYTES, "activations")

    def _norm_forward(self, p: str, *, users: int) -> None:
        """RMSNorm (fp32: reciprocal RMS, the normalised input and the gained output) or LayerNorm (mean, rstd and
        the output). Under autocast each of the ``users`` projections reading it keeps its own compute-dtype cast;
        the fp32 output lives until the module that reads it returns."""
        self._norm_statistics(p)
        if self.lowp:
            for user in range(users):
                self.alloc(f"{p}.out{'' if user == 0 else user}", self.n * self.c * self.act, "activations")

    def _decoder_block_forward(self, layer: int, *, recompute: bool = False) -> None:
        """One transformers block's forward (``recompute``: checkpointing re-running it in the backward). Under
        selective recompute the outputs of its matmuls and of attention stay saved through the backward (the policy
        of cadence.memory.recompute, which keeps them even where the forward's own code lets go of them), everything
        else is recomputed; under full only the block's input stays."""
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        saved = _SELECTIVE_SAVED[self.style] if self.mode == "selective" else frozenset()
        weights = self._block_weights()
        for name, numel in weights.items():
            if p + name not in self.tensors:
                self._weight(p + name, numel, saved=self.mode == "none")

        def out(name: str, size: int) -> None:  # a saved output already there (selective's cache) is reused
            if p + name not in self.tensors:
                self.alloc(p + name, size, "activations")

        def release(*names: str) -> None:  # what the forward lets go of, unless selective keeps it
            self.free(*(p + name for name in names if name not in saved))

        if self.style == "gpt2":
            self._norm_forward(p + "n1", users=1)
            out("qkv", 3 * n * c * a)
            out("qc", n * c * a)  # attention's contiguous copies of q and v
            out("vc", n * c * a)
            out("lse", self.heads * n * FP32_BYTES)
            out("att", n * c * a)  # also c_proj's input
            self.free(p + "n1.out.f32")
            out("po", n * c * a)
        else:
            self._norm_forward(p + "n1", users=3)
            out("q", n * self.dq * a)  # q projection, then rotated into a new tensor
            out("qr", n * self.dq * a)
            release("q")
            out("k", n * self.dkv * a)
            out("kr", n * self.dkv * a)
            release("k")
            out("v", n * self.dkv * a)
            out("lse", self.heads * n * FP32_BYTES)
            out("att", n * self.dq * a)  # also o_proj's input
            self.free(p + "n1.out.f32")
            out("po", n * c * a)
        out("x1", n * c * FP32_BYTES)  # residual add: fp32 stream + branch -> fp32
        release("po")
        if self.style == "gpt2":
            self._norm_forward(p + "n2", users=1)
            out("f", n * i * a)
            # gelu_new = 0.5 x (1 + tanh(k (x + 0.044715 x^3))): keeps tanh's output, 0.5 x and 1 + tanh
            out("g1", 3 * n * i * a)
            out("g", n * i * a)
        else:
            self._norm_forward(p + "n2", users=2)
            out("gate", n * i * a)
            out("up", n * i * a)
            out("silu", n * i * a)
            out("g", n * i * a)  # silu(gate) * up: down_proj's input
        if recompute:  # non-reentrant checkpointing stops once the last saved tensor exists
            self.free(p + "n2.out.f32")
            return
        out("mo", n * c * a)
        self.free(p + "n2.out.f32")
        self.alloc(f"r{layer + 1}", n * c * FP32_BYTES, "activations")
        release("mo")
        if self.mode != "none":  # the checkpoint keeps the block's input (and the next one's), selective its cache
            self.free(*[name for name in self.tensors if name.startswith(p) and self.tensors[name][1] == "activations"
                        and name[len(p):] not in saved])

    # ------------------------------------------------------------------------------------------------ backward
    def _backward(self) -> None:
        n, c, v, a = self.n, self.c, self.shape.vocab_size, self.act
        head = "lm_head" if not self.shape.tied_embeddings else "embed"
        if self.gathered:
            self._chunked_loss_backward(head)
            self.alloc("dres", n * c * FP32_BYTES, "temporaries")  # the final norm's backward (fp32 gradient in)
            self.free("dhf")
        else:
            self._log_softmax_backward(n)
            self.alloc("dhf", n * c * a, "temporaries")
            self.param_grad(head, v * c, in_place=self.head_in_place)
            self.free("dlogits", "dlogits.f32", "w.head")
            self._norm_backward("dhf", "dres")
        self.param_grad("norm_f", 2 * c)
        last = self.shape.num_layers
        self.free(*[k for k in self.tensors if k.startswith("nf.")], f"r{last}")
        for layer in reversed(range(last)):
            self._decoder_block_backward(layer)
        if self.style == "gpt2":
            self.alloc("dpos", self.t * c * FP32_BYTES, "temporaries")
            self.param_grad("pos_emb", self.shape.context_length * c)
        self.embedding_lookup = True
        self.param_grad("embed", v * c, in_place=True)  # the lookup: cadence.memory.grad_in_place
        self.embedding_lookup = False
        self.free("dres", "dpos", "rope", "r0")

    def param_grad(self, name: str, numel: int, *, in_place: bool = False) -> None:
        """A tied embedding is one weight used twice. Where both contributions are added straight into ``.grad``
        (cadence.memory.grad_in_place: fp32, the head's in place too) nothing is held: the parent's in-place rule.
        Under autocast the head's contribution takes autograd's path, and autograd holds it until the lookup's has
        arrived (measured on CPU, one contribution's size each): the head's, from the start of the backward, is held
        apart from an existing ``.grad`` (a later micro-batch) until the end; the lookup then adds its rows into
        ``.grad`` in place (or, the first micro-batch, makes it: zeros + ``index_add_``), and the held one is added
        into it in place. Every other parameter: the parent's rule."""
        if name != "embed" or not self.shape.tied_embeddings or self.frozen(name) or self.head_in_place:
            super().param_grad(name, numel, in_place=in_place)
            return
        if not self.embedding_lookup:  # the head's contribution (one per loss chunk)
            if name in self.grads and not self.tied_head_held:
                if self.lowp:
                    self.alloc("pg.low", numel * self.act, "temporaries")
                self.alloc("tied.head", numel * FP32_BYTES, "temporaries")
                self.free("pg.low")
                self.tied_head_held = True
                return
            super().param_grad(name, numel)
            return
        if not self.tied_head_held:  # the first micro-batch: the head's contribution stood for .grad until now
            self.alloc("tied.dense", numel * FP32_BYTES, "temporaries")  # the lookup's .grad: zeros + index_add_
        self.free("tied.dense", "tied.head")  # the held contribution added into .grad in place
        self.tied_head_held = False

    def _temporary(self, p: str, name: str, size: int) -> None:
        """A temporary of block ``p``'s backward (a gradient flowing back), ``size`` bytes."""
        self.alloc(p + name, size, "temporaries")

    def _release(self, p: str, *names: str) -> None:
        """What block ``p``'s backward lets go of (a backward node frees what it saved once it has run)."""
        self.free(*(p + name for name in names))

    def _gelu_new_backward(self, p: str) -> None:
        """gpt2's gelu_new backward, from ``p + "dg"`` (the gradient of its output) to ``p + "df"`` (of its input):
        it goes through the formula, so the gradients of both factors of 0.5 x * (1 + tanh) exist together with the
        incoming one, then tanh's, then the three paths summed into x's."""
        size = self.n * self.inner * self.act
        self.alloc(p + "da", size, "temporaries")
        self.alloc(p + "dt", size, "temporaries")
        self.free(p + "dg")
        self.alloc(p + "dtanh", size, "temporaries")
        self.free(p + "dt", p + "g1")
        self.alloc(p + "df", size, "temporaries")
        self.free(p + "da", p + "dtanh", p + "f")

    def _swiglu_backward(self, p: str) -> None:
        """SwiGLU's backward, from ``p + "dg"`` (the gradient of silu(gate) x up) to ``p + "dgate"`` and ``p + "dup"``:
        the product's gradient to each factor (each kept the other), then SiLU's (it kept its input)."""
        size = self.n * self.inner * self.act
        self._temporary(p, "dup", size)
        self._temporary(p, "dsilu", size)
        self._release(p, "dg", "silu", "up")
        self._temporary(p, "dgate", size)
        self._release(p, "dsilu", "gate")

    def _decoder_block_backward(self, layer: int) -> None:
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        weights = self._block_weights()
        if self.mode != "none":  # non-reentrant checkpointing re-runs the block's forward, keeping what it saves
            self._decoder_block_forward(layer, recompute=True)

        grad, release = functools.partial(self._temporary, p), functools.partial(self._release, p)

        # MLP: the compute-dtype copy of the residual gradient, then the gradients of down's input, the product's
        # two factors (SwiGLU) or GELU's terms, and the two (one) input gradients of the up-projections.
        if self.lowp:
            grad("dres.c", n * c * a)
        grad("dg", n * i * a)
        self.param_grad(p + "down", weights.get("w.down", weights.get("w.mlp", 0)))
        release("dres.c", "g", "w.down", "w.mlp")
        if self.style == "gpt2":
            self._gelu_new_backward(p)
            grad("dh2", n * c * a)
            self.param_grad(p + "fc", weights["w.fc"])
            release("df", "w.fc")
        else:
            self._swiglu_backward(p)
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



def adamw_scratch(tensors: list[int], *, on_device: bool) -> int:
    """AdamW's step scratch over trained ``tensors`` (element counts, the decay group, in order): CUDA's foreach
    step holds a whole group's worth; CPU's, the sqrt and quotient of one tensor next to the previous one's denom."""
    if on_device:
        return sum(tensors) * FP32_BYTES
    return max((2 * cur + prev for prev, cur in zip([0] + tensors[:-1], tensors, strict=True)), default=0) * FP32_BYTES


__all__ = ["BLOCK_STYLES", "BlockStyle", "DecoderReplay", "adamw_scratch"]
