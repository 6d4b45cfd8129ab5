"""The replay of one training step of a transformers decoder under ``--lora-rank``: the base frozen (in fp32, bf16
or nf4), peft's adapters trained (:mod:`cadence.memory.decoder_replay` replays the model trained whole).

Under LoRA the base is frozen, and autograd saves a tensor only for a gradient it will compute: a frozen projection
keeps no input (its input's gradient needs only the weight), a frozen norm gain keeps no normalised input, and nothing
before the first adapter needs a gradient at all (the embedding's output, block 0's first norm). Each adapted
projection adds peft's path: its lora_A keeps the projection's input (its own cast under autocast; with dropout the
dropped copy and the mask instead), lora_B keeps lora_A's rank-wide output, and the adapter's output (scaled, then
added to the base output) exists for a moment beside the base output. An nf4 base (``--lora-base-precision nf4``)
dequantises each weight inside its matmul (never cached); a bf16 base is used as it is (no autocast copy).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from cadence.memory.decoder_replay import BlockStyle, DecoderReplay, adamw_scratch
from cadence.memory.estimate import FP32_BYTES
from cadence.models.lora import LoraShape
from cadence.models.shape import ModelShape
from cadence.optim.spec import TrainedTensor

_REPLAY_WEIGHTS = {
    "llama": {"q_proj": "w.q", "k_proj": "w.k", "v_proj": "w.v", "o_proj": "w.o", "gate_proj": "w.gate",
              "up_proj": "w.up", "down_proj": "w.down"},
    "gpt2": {"attn.c_attn": "w.qkv", "attn.c_proj": "w.proj", "mlp.c_fc": "w.fc", "mlp.c_proj": "w.mlp"},
}
"""The replay's name of each block projection peft may adapt (llama: by the module's name; gpt2: by the last two
parts of its path, since both attention and MLP have a c_proj)."""


@dataclass(frozen=True)
class _Adapters:
    """--lora-rank's adapters as the replay sees them: which block projections carry one, and the trained tensors."""

    rank: int
    targets: frozenset[str]
    """Replay weight names (w.q, w.v, ...) adapted in the blocks."""
    dropout: float
    tensors: tuple[int, ...]
    """Element counts of every lora_A and lora_B, in the optimizer's order."""
    shapes: tuple[TrainedTensor, ...]
    """The same tensors' shapes (lora_A: rank x in, lora_B: out x rank), in the blocks or not."""
    unmodelled: tuple[str, ...]
    """Adapted modules outside the blocks' projections (an lm_head named explicitly, ...): counted, not replayed."""


def _adapters(lora: LoraShape, style: BlockStyle) -> _Adapters:
    names = _REPLAY_WEIGHTS[style]
    targets: set[str] = set()
    unmodelled: list[str] = []
    tensors: list[int] = []
    shapes: list[TrainedTensor] = []
    for path, width_in, width_out in lora.adapted:
        tensors += [lora.rank * width_in, width_out * lora.rank]
        in_blocks = ".layers." in f".{path}." or ".h." in f".{path}."
        shapes += [TrainedTensor((lora.rank, width_in), in_blocks=in_blocks),
                   TrainedTensor((width_out, lora.rank), in_blocks=in_blocks)]
        key = path.rsplit(".", 1)[-1] if style == "llama" else ".".join(path.split(".")[-2:])
        if key in names and ".layers." in f".{path}." or key in names and ".h." in f".{path}.":
            targets.add(names[key])
        else:
            unmodelled.append(path)
    return _Adapters(rank=lora.rank, targets=frozenset(targets), dropout=lora.dropout, tensors=tuple(tensors),
                     shapes=tuple(shapes), unmodelled=tuple(unmodelled))



class LoraDecoderReplay(DecoderReplay):
    """The decoder replay with a frozen base and peft's adapters in its blocks."""

    def __init__(self, shape: ModelShape, style: BlockStyle, *, lora: LoraShape, **kwargs: Any) -> None:
        super().__init__(shape, style, **kwargs)
        self.lora = _adapters(lora, style)
        self.lora_parameters = lora.adapter_parameters
        self.bf16_base = lora.bf16_base_parameters
        """--lora-base-precision bf16: frozen linear-layer elements held in bf16 (and never copied by autocast)."""
        self.nf4_base = lora.nf4_base_parameters
        self.nf4_base_bytes = lora.nf4_base_bytes
        """--lora-base-precision nf4: the blocks' linear-layer elements held as NF4, and the bytes they take."""
        self.grad = False
        """Whether the residual stream needs a gradient here (the frozen embedding's output does not; a block's
        output does once an adapter is upstream)."""
        self.grad_in: dict[int, bool] = {}
        if self.lora.unmodelled:
            self.notes.append(f"adapters on {', '.join(self.lora.unmodelled[:3])} are counted (parameters, "
                              f"gradients, state) but their activations are not modelled")

    # ------------------------------------------------------------------------------------------------ trained
    def frozen(self, name: str) -> bool:
        """Every base parameter is frozen; the adapters (``*.lora_A``, ``*.lora_B``) are trained."""
        return not name.endswith((".lora_A", ".lora_B"))

    def parameter_count(self) -> int:
        return self.shape.num_parameters + self.lora_parameters

    def parameter_bytes(self) -> int:
        return (self.parameter_count() * FP32_BYTES - 2 * self.bf16_base
                - (FP32_BYTES * self.nf4_base - self.nf4_base_bytes))

    def _weight(self, name: str, numel: int, *, saved: bool) -> None:
        """As the parent's; a frozen bf16 weight (--lora-base-precision bf16) is used as it is: no autocast copy."""
        frozen_linear = not self.shape.tied_embeddings if name == "w.head" else name.split(".")[-2:-1] == ["w"]
        if self.bf16_base and frozen_linear:
            return
        if self.nf4_base and name.startswith("b") and frozen_linear:
            return  # an NF4 weight is dequantised inside each matmul (:meth:`_dequantised`), never cached
        super()._weight(name, numel, saved=saved)

    def _dequantised(self, p: str, weight: str) -> str | None:
        """--lora-base-precision nf4: the compute-dtype weight bitsandbytes dequantises for one matmul of
        ``weight`` (forward, recompute, or the input's gradient in the backward), with the fp32 absmaxes it
        dequantises first; allocated here, freed by the caller once the matmul's output exists. None otherwise."""
        if not self.nf4_base:
            return None
        numel = self._block_weights()[weight]
        name = f"{p}{weight}.dq"
        self.alloc(name, numel * self.act + -(-numel // 64) * FP32_BYTES, "temporaries")
        return name

    def _through_base(self, p: str, weight: str, name: str, size: int) -> None:
        """A gradient (``p + name``, ``size`` bytes) made by a matmul with the frozen ``weight``: an nf4 weight is
        dequantised for it and let go once it exists."""
        dq = self._dequantised(p, weight)
        self.alloc(p + name, size, "temporaries")
        self.free(*([dq] if dq else []))

    def trained_tensors(self) -> list[int]:
        return list(self.lora.tensors)

    def trained_shapes(self) -> list[TrainedTensor]:
        return list(self.lora.shapes)

    def _optimizer_scratch(self) -> int:
        return adamw_scratch(list(self.lora.tensors), on_device=self.on_device)  # all matrices, one decay group

    # ------------------------------------------------------------------------------------------------ forward
    def _forward(self) -> None:
        self.grad = False  # the frozen embedding's output needs no gradient
        super()._forward()

    def _norm_forward(self, p: str, *, users: int) -> None:
        """The final norm, frozen (:meth:`_lora_norm`); the head's cast of it, when the head reads every position,
        is made as the parent makes it."""
        self._lora_norm(p, grad_in=self.grad)
        if self.lowp and users:
            self.alloc(p + ".out", self.n * self.c * self.act, "activations")

    # ------------------------------------------------------------------------------------------------ blocks
    def _lora_norm(self, p: str, *, grad_in: bool) -> None:
        """A frozen RMSNorm or LayerNorm: its statistics saved only when its input needs a gradient; the normalised
        input (RMSNorm) made and let go; the fp32 output, kept by whoever saves it."""
        self._norm_statistics(p)
        self.free(p + ".hs")
        if not grad_in:
            self.free(p + ".stats")

    def _projection(self, p: str, weight: str, out: str, width_in: int, width_out: int, *, fp32_input: bool,
                    last_saved: bool = False) -> None:
        """A frozen projection (``weight``) making ``p + out`` from an input of ``width_in`` (fp32: a norm's output,
        which autocast casts; else already in the compute dtype), and its adapter when ``weight`` is adapted."""
        n, a, r = self.n, self.act, self.lora.rank
        cast = self.lowp and fp32_input
        if cast:
            self.alloc(p + weight + ".in", n * width_in * a, "activations")  # the base layer's cast: not saved
        dq = self._dequantised(p, weight)
        self.alloc(p + out, n * width_out * a, "activations")
        self.free(p + weight + ".in", *([dq] if dq else []))
        if weight not in self.lora.targets:
            return
        if dq:  # peft's bitsandbytes layer clones the base output before adding the adapter's
            self.alloc(p + out + ".clone", n * width_out * a, "activations")
            self.free(p + out)
            self.tensors[p + out] = self.tensors.pop(p + out + ".clone")
        # peft casts the adapter's input to lora_A's dtype (fp32): a compute-dtype input (o_proj's, down_proj's)
        # gets an fp32 copy for a moment, and dropout works on fp32 either way. Not peft's layer for a 4-bit base:
        # under autocast it leaves the input as it is.
        if self.lowp and not fp32_input and not self.nf4_base:
            self.alloc(p + weight + ".in32", n * width_in * FP32_BYTES, "activations")
        if self.lora.dropout > 0:
            self.alloc(p + weight + ".mask", n * width_in, "activations")  # dropout's bool mask, saved
            self.alloc(p + weight + ".drop", n * width_in * FP32_BYTES, "activations")  # the dropped input
        if self.lowp:  # autocast casts that fp32 input back for lora_A's matmul: the copy lora_A saves
            self.alloc(p + weight + ".la.in", n * width_in * a, "activations")
            self.free(p + weight + ".drop", p + weight + ".in32")
        self.alloc(p + weight + ".la", n * r * a, "activations")  # lora_A's output, saved by lora_B
        if last_saved:  # a checkpoint's recompute stops at the last tensor the forward saved: this one
            return
        self.alloc(p + weight + ".lb", n * width_out * a, "activations")
        self.alloc(p + weight + ".ls", n * width_out * a, "activations")  # times alpha / rank
        self.free(p + weight + ".lb")
        self.alloc(p + weight + ".sum", n * width_out * a, "activations")  # base output + adapter output
        self.free(p + weight + ".ls", p + out)
        self.tensors[p + out] = self.tensors.pop(p + weight + ".sum")

    def _keeps_input(self, weights: tuple[str, ...]) -> bool:
        """Whether an adapter among ``weights`` keeps their shared fp32 input itself (no autocast, no dropout)."""
        return not self.lowp and self.lora.dropout == 0 and any(w in self.lora.targets for w in weights)

    def _decoder_block_forward(self, layer: int, *, recompute: bool = False) -> None:
        """One adapted block's forward (``recompute``: checkpointing re-running it in the backward)."""
        p = f"b{layer}."
        # Autocast caches only the casts of weights that need a gradient: a frozen weight's compute-dtype copy
        # lives on only where backward saved it (the input's gradient needs it): not in a checkpointed block's
        # forward, where each copy is made and let go within its matmul, but again in its recompute.
        for name, numel in self._block_weights().items():
            if p + name not in self.tensors and (self.mode == "none" or recompute):
                self._weight(p + name, numel, saved=True)
        if not recompute:
            self.grad_in[layer] = self.grad
        attention_grad = self._attention_forward(layer)
        self._mlp_forward(layer, attention_grad, recompute=recompute)

    def _attention_forward(self, layer: int) -> bool:
        """The block's first norm, its attention and the residual add; returns whether the stream after them needs
        a gradient (its input did, or an adapter is in the attention)."""
        n, c, a, p = self.n, self.c, self.act, f"b{layer}."
        targets, grad_in = self.lora.targets, self.grad_in[layer]
        attention, _ = self._lora_groups()
        attention_grad = grad_in or any(w in targets for w in attention)
        self._lora_norm(p + "n1", grad_in=grad_in)
        source = p + "n1.out" + (".f32" if self.lowp else "")
        if self.style == "gpt2":
            self._projection(p, "w.qkv", "qkv", c, 3 * c, fp32_input=True)
            self.alloc(p + "qc", n * c * a, "activations")  # attention's contiguous copies of q and v
            self.alloc(p + "vc", n * c * a, "activations")
            saved_by_attention = ["qkv", "qc", "vc", "lse"]
        else:
            for weight, out, width in (("w.q", "q", self.dq), ("w.k", "k", self.dkv), ("w.v", "v", self.dkv)):
                self._projection(p, weight, out, c, width, fp32_input=True)
                if out != "v":  # rotated into a new tensor (what attention keeps)
                    self.alloc(p + out + "r", n * width * a, "activations")
                    self.free(p + out)
            saved_by_attention = ["qr", "kr", "v", "lse"]
        self.alloc(p + "lse", self.heads * n * FP32_BYTES, "activations")
        self.alloc(p + "att", n * self.dq * a, "activations")  # also the output projection's input
        if self.lowp or not self._keeps_input(attention[:-1]):
            self.free(source)  # the attention module returns; only an fp32 adapter input outlives it
        self._projection(p, attention[-1], "po", self.dq, c, fp32_input=False)
        if not attention_grad:  # nothing upstream needs a gradient: attention saved nothing
            self.free(*(p + name for name in saved_by_attention))
            if attention[-1] not in targets:
                self.free(p + "att")
        self.alloc(p + "x1", n * c * FP32_BYTES, "activations")
        self.free(p + "po")
        if not grad_in and self.mode == "none":
            self.free(f"r{layer}")  # no norm saved the frozen embedding's output
        return attention_grad

    def _mlp_forward(self, layer: int, attention_grad: bool, *, recompute: bool) -> None:
        """The block's second norm, its MLP and the residual add, then what a checkpoint keeps of the block."""
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        targets = self.lora.targets
        _, mlp = self._lora_groups()
        self._lora_norm(p + "n2", grad_in=attention_grad)
        source = p + "n2.out" + (".f32" if self.lowp else "")
        keep_source = self._keeps_input(mlp[:-1])
        if self.style == "gpt2":
            self._projection(p, "w.fc", "f", c, i, fp32_input=True)
            if not keep_source and not self.lowp:
                self.free(source)
            self.alloc(p + "g1", 3 * n * i * a, "activations")  # gelu_new's saved terms
            self.alloc(p + "g", n * i * a, "activations")
            if not (attention_grad or "w.fc" in targets):
                self.free(p + "g1", p + "f")
        else:
            self._projection(p, "w.gate", "gate", c, i, fp32_input=True)
            self._projection(p, "w.up", "up", c, i, fp32_input=True)
            if not keep_source and not self.lowp:
                self.free(source)
            self.alloc(p + "silu", n * i * a, "activations")
            self.alloc(p + "g", n * i * a, "activations")  # silu(gate) * up: down_proj's input
            # SiLU keeps its input when it needs a gradient; the product keeps each factor for the other's.
            gate_grad, up_grad = attention_grad or "w.gate" in targets, attention_grad or "w.up" in targets
            self.free(*([p + "gate", p + "up"] if not gate_grad else []), *([p + "silu"] if not up_grad else []))
        if recompute:  # non-reentrant checkpointing stops once the last saved tensor exists
            if mlp[-1] in targets:  # ... which is the down projection adapter's input, past its base output
                # (peft's layer on a 4-bit base under autocast: lora_A's output, its input left in bf16)
                nf4_lowp = bool(self.nf4_base) and self.lowp
                self._projection(p, mlp[-1], "mo", i, c, fp32_input=False, last_saved=nf4_lowp)
                if self.lowp and not nf4_lowp:  # measured: under autocast the recompute runs on to the block's fp32 output
                    self.alloc(p + "rec.out", n * c * FP32_BYTES, "activations")
                self.free(p + "mo")
            self.free(p + "n2.out.f32")
            return
        self._projection(p, mlp[-1], "mo", i, c, fp32_input=False)
        if not (mlp[-1] in targets and self.lora.dropout == 0) or self.lowp:
            self.free(p + "g")  # a frozen down projection keeps no input (its adapter keeps its own copy)
        self.free(p + "n2.out.f32")
        self.alloc(f"r{layer + 1}", n * c * FP32_BYTES, "activations")
        self.free(p + "mo")
        if not attention_grad:
            self.free(p + "x1")  # no norm saved it: the residual is let go once added
        self.grad = attention_grad or any(w in targets for w in mlp)
        if self.mode != "none":  # the checkpoint keeps only the block's input (and the next one's)
            self.free(*[name for name in self.tensors if name.startswith(p) and self.tensors[name][1] == "activations"])
        if self.mode == "selective":  # ... and selective, the outputs of the block's matmuls and of attention
            self.alloc(p + "selective", self._lora_selective_cache(), "activations")

    def _lora_selective_cache(self) -> int:
        """Bytes one adapted block's selective-recompute cache holds through the backward: every base projection's
        output, each adapter's lora_A (rank-wide) and lora_B outputs, attention's output and log-sum-exp."""
        n, c, a, i, r = self.n, self.c, self.act, self.inner, self.lora.rank
        if self.style == "gpt2":
            widths = {"w.qkv": 3 * c, "w.proj": c, "w.fc": i, "w.mlp": c}
        else:
            widths = {"w.q": self.dq, "w.k": self.dkv, "w.v": self.dkv, "w.o": c, "w.gate": i, "w.up": i,
                      "w.down": c}
        elements = sum(widths.values()) + sum(r + widths[w] for w in self.lora.targets if w in widths)
        return n * (elements + self.dq) * a + self.heads * n * FP32_BYTES

    def _lora_groups(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The attention and MLP projections, each group's output projection last."""
        if self.style == "gpt2":
            return ("w.qkv", "w.proj"), ("w.fc", "w.mlp")
        return ("w.q", "w.k", "w.v", "w.o"), ("w.gate", "w.up", "w.down")

    def _adapter_backward(self, p: str, weight: str, width_in: int, width_out: int, *, input_grad: bool) -> None:
        """An adapted projection's backward beyond its frozen base: the scaled gradient, lora_B's and lora_A's
        weight gradients, and (when the input needs one) lora_A's part of the input gradient, added at once."""
        if weight not in self.lora.targets:
            return
        n, a, r = self.n, self.act, self.lora.rank
        self.alloc(p + weight + ".dls", n * width_out * a, "temporaries")  # times alpha / rank
        self.param_grad(p + weight + ".lora_B", width_out * r)
        self.alloc(p + weight + ".dla", n * r * a, "temporaries")
        self.free(p + weight + ".dls")
        self.param_grad(p + weight + ".lora_A", r * width_in)
        if input_grad:
            self.alloc(p + weight + ".dx", n * width_in * a, "temporaries")
            self.free(p + weight + ".dx")
        self.free(*(p + weight + suffix for suffix in (".dla", ".la", ".la.in", ".drop", ".mask")))

    # ------------------------------------------------------------------------------------------------ backward
    def _decoder_block_backward(self, layer: int) -> None:
        p = f"b{layer}."
        if self.mode != "none":
            # Selective: the recompute's matmuls return the cached outputs, so the re-run forward's tensors are
            # counted in place of the cache (not beside it).
            self.free(p + "selective")
            self._decoder_block_forward(layer, recompute=True)
        grad_in = self.grad_in[layer]
        targets = self.lora.targets
        attention, mlp = self._lora_groups()
        attention_grad = grad_in or any(w in targets for w in attention)
        if attention_grad or any(w in targets for w in mlp):
            self._mlp_backward(p, attention_grad)
        if attention_grad:
            self._attention_backward(p, grad_in)
        self.free(f"r{layer + 1}")
        self.free(*[k for k in list(self.tensors) if k.startswith(p)])

    def _mlp_backward(self, p: str, attention_grad: bool) -> None:
        """The MLP's backward: its adapters' gradients, and its input's when the attention before it needs one."""
        n, c, a, i = self.n, self.c, self.act, self.inner
        _, mlp = self._lora_groups()

        grad, release = functools.partial(self._temporary, p), functools.partial(self._release, p)

        if self.lowp:
            grad("dres.c", n * c * a)
        self._through_base(p, mlp[-1], "dg", n * i * a)
        self._adapter_backward(p, mlp[-1], i, c, input_grad=True)
        release("dres.c", "g", mlp[-1])
        if self.style == "gpt2":
            self._gelu_new_backward(p)
            self._adapter_backward(p, "w.fc", c, i, input_grad=attention_grad)
            if attention_grad:
                grad("dh2", n * c * a)
            release("df", "w.fc")
        else:
            self._swiglu_backward(p)
            self._adapter_backward(p, "w.gate", c, i, input_grad=attention_grad)
            self._adapter_backward(p, "w.up", c, i, input_grad=attention_grad)
            if attention_grad:
                self._through_base(p, "w.gate", "dh2", n * c * a)
                self._through_base(p, "w.up", "dh2b", n * c * a)
            release("dgate", "dup", "w.gate", "w.up")
        if attention_grad:
            self._norm_backward(p + "dh2", p + "dx1")
            release("dh2b")
        release(*(k[len(p):] for k in list(self.tensors) if k.startswith(p + "n2.")), "x1", "dx1")

    def _attention_backward(self, p: str, grad_in: bool) -> None:
        """The attention's backward: its adapters' gradients, and its input's when the block's input needs one."""
        n, c, a = self.n, self.c, self.act
        attention, _ = self._lora_groups()

        grad, release = functools.partial(self._temporary, p), functools.partial(self._release, p)

        if self.lowp:
            grad("dres.c", n * c * a)
        self._through_base(p, attention[-1], "dy", n * self.dq * a)
        self._adapter_backward(p, attention[-1], self.dq, c, input_grad=True)
        release("dres.c", attention[-1])
        widths = (3 * c,) if self.style == "gpt2" else (self.dq, self.dkv, self.dkv)
        grad("dqkv.parts", n * sum(widths) * a)
        release("dy", "att", "lse", "qr", "kr", "v", "qc", "vc")
        if self.style == "gpt2":
            grad("dqkv", 3 * n * c * a)
            release("dqkv.parts", "qkv")
        for weight, width in zip(attention[:-1], widths, strict=True):
            self._adapter_backward(p, weight, c, width, input_grad=grad_in)
        if grad_in:  # each projection gives its input a gradient, summed into one; one at a time, the largest
            # (q's) dequantised weight stands for them
            self._through_base(p, attention[0], "dh1", (1 if self.style == "gpt2" else 3) * n * c * a)
        release("dqkv.parts", "dqkv", *attention[:-1])
        if grad_in:
            self._norm_backward(p + "dh1", p + "dx")
        release(*(k[len(p):] for k in list(self.tensors) if k.startswith(p + "n1.")), "dx")


__all__ = ["LoraDecoderReplay"]
