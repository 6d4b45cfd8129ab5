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

from cadence.memory.estimate import (
    ADAMW,
    FP32_BYTES,
    MemoryEstimate,
    StepReplay,
    estimate_from_replay,
    input_problems,
)
from cadence.models.hf import ModelShape
from cadence.models.lora import LoraShape
from cadence.optim.spec import OptimizerSpec, TrainedTensor

GPT2_TYPES = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "gptj"})
"""Model types whose blocks are gpt2-style; every other decoder is treated as llama-style."""


def block_style(model_type: str) -> str:
    return "gpt2" if model_type in GPT2_TYPES else "llama"


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


def _adapters(lora: LoraShape, style: str) -> _Adapters:
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
    optimizer: OptimizerSpec = ADAMW,
    lora: LoraShape | None = None,
    packed: bool = False,
    full_logits: bool = False,
) -> MemoryEstimate:
    """Predict the peak memory of one step of the Hugging Face model ``shape`` describes, trained by the Engine;
    ``loss_chunk_tokens``, ``target_tokens``, ``optimizer`` and ``full_logits`` as in
    :func:`cadence.memory.estimate.estimate_step_memory` (``loss_chunk_tokens`` 0: the target positions' logits only,
    every position counted as a target unless ``target_tokens`` says otherwise). ``lora``: the adapters --lora-rank
    injected
    (:func:`cadence.models.lora.lora_shape`; ``shape`` stays the base model's): the base is frozen (no gradient, no
    optimizer state, and no saved inputs where only a weight gradient needed them), the adapters are trained.
    ``packed``: rows hold several examples (``--packing``): transformers builds a block-diagonal mask for the
    forward, which cadence's attention (:mod:`cadence.models.packed_attention`, one causal SDPA per example) does
    not keep."""
    problems = input_problems(micro_batch_size=micro_batch_size, seq_len=seq_len, grad_accum_steps=grad_accum_steps,
                              context_length=shape.context_length, precision=precision,
                              checkpointing=checkpointing, offload=offload, loss_chunk_tokens=loss_chunk_tokens,
                              target_tokens=target_tokens, full_logits=full_logits)
    if not shape.num_heads or not shape.head_dim or not shape.intermediate_size:
        problems.append("the model's config gives no attention heads, head size or MLP width to estimate from")
    if problems:
        raise ValueError("; ".join(problems))
    on_device = device_type != "cpu"
    replay = HFStepReplay(
        shape, block_style(model_type), tokens=micro_batch_size * seq_len, seq_len=seq_len, precision=precision,
        checkpointing=checkpointing, offload_activations=on_device and offload == "activations",
        offload_optimizer=on_device and offload == "optimizer", on_device=on_device,
        loss_chunk_tokens=loss_chunk_tokens, target_tokens=target_tokens, optimizer=optimizer,
        lora=lora, packed=packed, full_logits=full_logits,
    )
    return estimate_from_replay(replay, grad_accum_steps=grad_accum_steps, precision=precision, offload=offload,
                                on_device=on_device)


_SELECTIVE_SAVED = {
    "llama": frozenset({"q", "k", "v", "lse", "att", "po", "gate", "up", "mo"}),
    "gpt2": frozenset({"qkv", "lse", "att", "po", "f", "mo"}),
}
"""Per block style, the tensors selective recompute keeps: the outputs of the matmuls (q/k/v/o, gate/up/down;
gpt2's c_attn, c_proj, c_fc, mlp c_proj) and of attention (its output and log-sum-exp)."""


class HFStepReplay(StepReplay):
    """The generic replay with transformers' blocks; bookkeeping, the step and the loss are the parent's."""

    def __init__(self, shape: ModelShape, style: str, *, lora: LoraShape | None = None, packed: bool = False,
                 **kwargs: object) -> None:
        sizes = _Sizes(shape.num_parameters, shape.vocab_size, shape.num_layers, shape.context_length,
                       shape.hidden_size)
        super().__init__(sizes, **kwargs)  # type: ignore[arg-type]
        self.lora = None if lora is None else _adapters(lora, style)
        self.lora_parameters = 0 if lora is None else lora.adapter_parameters
        self.bf16_base = 0 if lora is None else lora.bf16_base_parameters
        """--lora-base-precision bf16: frozen linear-layer elements held in bf16 (and never copied by autocast)."""
        self.nf4_base = 0 if lora is None else lora.nf4_base_parameters
        self.nf4_base_bytes = 0 if lora is None else lora.nf4_base_bytes
        """--lora-base-precision nf4: the blocks' linear-layer elements held as NF4, and the bytes they take."""
        self.grad = False
        """Under LoRA: whether the residual stream needs a gradient here (the frozen embedding's output does not;
        a block's output does once an adapter is upstream)."""
        self.grad_in: dict[int, bool] = {}
        self.embedding_lookup = False
        """True while the embedding lookup's gradient arrives (the last of a tied weight's two contributions)."""
        self.tied_head_held = False
        if self.lora is not None and self.lora.unmodelled:
            self.notes.append(f"adapters on {', '.join(self.lora.unmodelled[:3])} are counted (parameters, "
                              f"gradients, state) but their activations are not modelled")
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
    def frozen(self, name: str) -> bool:
        """Under LoRA every base parameter is frozen; the adapters (``*.lora_A``, ``*.lora_B``) are trained."""
        return self.lora is not None and not name.endswith((".lora_A", ".lora_B"))

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

    def trained_shapes(self) -> list[TrainedTensor]:
        """As :meth:`trained_tensors` counts them: the embedding (gpt2: and the positions), each block's matrices
        (``nn.Linear``: out x in; gpt2's ``Conv1D``: in x out) and vectors, the final norm, an untied head."""
        if self.lora is not None:
            return list(self.lora.shapes)
        v, c, i = self.shape.vocab_size, self.c, self.inner
        tensors = [TrainedTensor((v, c))] + ([TrainedTensor((self.shape.context_length, c))]
                                             if self.style == "gpt2" else [])
        if self.style == "gpt2":
            matrices = [(c, 3 * c), (c, c), (c, i), (i, c)]
            vectors = [c, c, 3 * c, c, c, c, i, c]
        else:
            matrices = [(self.dq, c), (self.dkv, c), (self.dkv, c), (c, self.dq), (i, c), (i, c), (c, i)]
            vectors = [n for n in self._block_params()[len(matrices):]]
        block = [TrainedTensor(shape, in_blocks=True) for shape in matrices]
        block += [TrainedTensor((n,), in_blocks=True) for n in vectors]
        tensors += block * self.shape.num_layers
        tensors += [TrainedTensor((2 * c,))] if self.style == "gpt2" else [TrainedTensor((c,))]
        if self.style != "gpt2" and not self.shape.tied_embeddings:
            tensors.append(TrainedTensor((v, c)))
        return tensors

    def trained_tensors(self) -> list[int]:
        if self.lora is not None:
            return list(self.lora.tensors)
        v, c = self.shape.vocab_size, self.c
        tensors = [v * c] + ([self.shape.context_length * c] if self.style == "gpt2" else [])
        tensors += [p for _ in range(self.shape.num_layers) for p in self._block_params()]
        tensors += [2 * c] if self.style == "gpt2" else [c]  # the final norm
        if self.style != "gpt2" and not self.shape.tied_embeddings:
            tensors.append(v * c)
        return tensors

    def _optimizer_scratch(self) -> int:
        """As for the built-in GPT: CPU AdamW's sqrt and quotient of one tensor next to the previous one's denom;
        CUDA's foreach step: a whole group's worth."""
        if self.lora is not None:  # the adapters: all matrices, one decay group
            tensors = list(self.lora.tensors)
            if self.on_device:
                return sum(tensors) * FP32_BYTES
            return max((2 * cur + prev for prev, cur in zip([0] + tensors[:-1], tensors, strict=True)),
                       default=0) * FP32_BYTES
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
        if self.packed:  # the block-diagonal mask transformers still builds for packed rows: one bool per (row,
            self.alloc("mask", self.n * self.t, "activations")  # query, key), unused by cadence's attention
        self.grad = False  # LoRA: the frozen embedding's output needs no gradient
        for layer in range(self.shape.num_layers):
            if self.lora is not None:
                self._lora_block_forward(layer)
            else:
                self._hf_block_forward(layer)
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

    def _norm_forward(self, p: str, *, users: int) -> None:
        """RMSNorm (fp32: reciprocal RMS, the normalised input and the gained output) or LayerNorm (mean, rstd and
        the output). Under autocast each of the ``users`` projections reading it keeps its own compute-dtype cast;
        the fp32 output lives until the module that reads it returns. Under LoRA the gain is frozen: see
        :meth:`_lora_norm` (the head's cast of the final norm, when the head reads every position, is made as here)."""
        if self.lora is not None:
            self._lora_norm(p, grad_in=self.grad)
            if self.lowp and users:
                self.alloc(p + ".out", self.n * self.c * self.act, "activations")
            return
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
            self.alloc("dlsm", n * v * FP32_BYTES, "temporaries")  # nll_loss backward
            self.alloc("dlogits.f32", n * v * FP32_BYTES, "temporaries")  # log_softmax backward
            self.free("dlsm", "lsm")
            if self.lowp:
                self.alloc("dlogits", n * v * a, "temporaries")
                self.free("dlogits.f32")
            self.alloc("dhf", n * c * a, "temporaries")
            self.param_grad(head, v * c, in_place=self.head_in_place)
            self.free("dlogits", "dlogits.f32", "w.head")
            self._norm_backward("dhf", "dres")
        self.param_grad("norm_f", 2 * c)
        last = self.shape.num_layers
        self.free(*[k for k in self.tensors if k.startswith("nf.")], f"r{last}")
        for layer in reversed(range(last)):
            if self.lora is not None:
                self._lora_block_backward(layer)
            else:
                self._hf_block_backward(layer)
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
            self._gelu_new_backward(p)
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

    # ------------------------------------------------------------------------------------------------ LoRA
    # Under --lora-rank the base is frozen, and autograd saves a tensor only for a gradient it will compute: a frozen
    # projection keeps no input (its input's gradient needs only the weight), a frozen norm gain keeps no normalised
    # input, and nothing before the first adapter needs a gradient at all (the embedding's output, block 0's first
    # norm). Each adapted projection adds peft's path: its lora_A keeps the projection's input (its own cast under
    # autocast; with dropout the dropped copy and the mask instead), lora_B keeps lora_A's rank-wide output, and
    # the adapter's output (scaled, then added to the base output) exists for a moment beside the base output.
    def _lora_norm(self, p: str, *, grad_in: bool) -> None:
        """A frozen RMSNorm or LayerNorm: its statistics saved only when its input needs a gradient; the normalised
        input (RMSNorm) made and let go; the fp32 output, kept by whoever saves it."""
        n, c = self.n, self.c
        if self.style == "gpt2":
            self.alloc(p + ".stats", 2 * n * FP32_BYTES, "activations")
        else:
            self.alloc(p + ".stats", n * FP32_BYTES, "activations")
            self.alloc(p + ".hs", n * c * FP32_BYTES, "activations")
        self.alloc(p + ".out" + (".f32" if self.lowp else ""), n * c * FP32_BYTES, "activations")
        self.free(p + ".hs")
        if not grad_in:
            self.free(p + ".stats")

    def _projection(self, p: str, weight: str, out: str, width_in: int, width_out: int, *, fp32_input: bool,
                    last_saved: bool = False) -> None:
        """A frozen projection (``weight``) making ``p + out`` from an input of ``width_in`` (fp32: a norm's output,
        which autocast casts; else already in the compute dtype), and its adapter when ``weight`` is adapted."""
        assert self.lora is not None
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
        assert self.lora is not None
        return not self.lowp and self.lora.dropout == 0 and any(w in self.lora.targets for w in weights)

    def _lora_block_forward(self, layer: int, *, recompute: bool = False) -> None:
        assert self.lora is not None
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        targets = self.lora.targets
        # Autocast caches only the casts of weights that need a gradient: a frozen weight's compute-dtype copy
        # lives on only where backward saved it (the input's gradient needs it): not in a checkpointed block's
        # forward, where each copy is made and let go within its matmul, but again in its recompute.
        for name, numel in self._block_weights().items():
            if p + name not in self.tensors and (self.mode == "none" or recompute):
                self._weight(p + name, numel, saved=True)
        if not recompute:
            self.grad_in[layer] = self.grad
        grad_in = self.grad_in[layer]
        attention, mlp = self._lora_groups()
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
        assert self.lora is not None
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
        assert self.lora is not None
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

    def _lora_block_backward(self, layer: int) -> None:
        assert self.lora is not None
        n, c, a, i, p = self.n, self.c, self.act, self.inner, f"b{layer}."
        if self.mode != "none":
            # Selective: the recompute's matmuls return the cached outputs, so the re-run forward's tensors are
            # counted in place of the cache (not beside it).
            self.free(p + "selective")
            self._lora_block_forward(layer, recompute=True)
        grad_in = self.grad_in[layer]
        targets = self.lora.targets
        attention, mlp = self._lora_groups()
        attention_grad = grad_in or any(w in targets for w in attention)

        def grad(name: str, size: int) -> None:
            self.alloc(p + name, size, "temporaries")

        def release(*names: str) -> None:
            self.free(*(p + name for name in names))

        if attention_grad or any(w in targets for w in mlp):
            if self.lowp:
                grad("dres.c", n * c * a)
            dq = self._dequantised(p, mlp[-1])
            grad("dg", n * i * a)
            release(*([dq[len(p):]] if dq else []))
            self._adapter_backward(p, mlp[-1], i, c, input_grad=True)
            release("dres.c", "g", mlp[-1])
            if self.style == "gpt2":
                self._gelu_new_backward(p)
                self._adapter_backward(p, "w.fc", c, i, input_grad=attention_grad)
                if attention_grad:
                    grad("dh2", n * c * a)
                release("df", "w.fc")
            else:
                grad("dup", n * i * a)
                grad("dsilu", n * i * a)
                release("dg", "silu", "up")
                grad("dgate", n * i * a)
                release("dsilu", "gate")
                self._adapter_backward(p, "w.gate", c, i, input_grad=attention_grad)
                self._adapter_backward(p, "w.up", c, i, input_grad=attention_grad)
                if attention_grad:
                    dq = self._dequantised(p, "w.gate")
                    grad("dh2", n * c * a)
                    release(*([dq[len(p):]] if dq else []))
                    dq = self._dequantised(p, "w.up")
                    grad("dh2b", n * c * a)
                    release(*([dq[len(p):]] if dq else []))
                release("dgate", "dup", "w.gate", "w.up")
            if attention_grad:
                self._norm_backward(p + "dh2", p + "dx1")
                release("dh2b")
            release(*(k[len(p):] for k in list(self.tensors) if k.startswith(p + "n2.")), "x1", "dx1")
        if attention_grad:
            if self.lowp:
                grad("dres.c", n * c * a)
            dq = self._dequantised(p, attention[-1])
            grad("dy", n * self.dq * a)
            release(*([dq[len(p):]] if dq else []))
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
            if grad_in:  # each projection gives its input a gradient, summed into one
                dq = self._dequantised(p, attention[0])  # one at a time: the largest (q's) stands for them
                grad("dh1", (1 if self.style == "gpt2" else 3) * n * c * a)
                release(*([dq[len(p):]] if dq else []))
            release("dqkv.parts", "dqkv", *attention[:-1])
            if grad_in:
                self._norm_backward(p + "dh1", p + "dx")
            release(*(k[len(p):] for k in list(self.tensors) if k.startswith(p + "n1.")), "dx")
        self.free(f"r{layer + 1}")
        self.free(*[k for k in list(self.tensors) if k.startswith(p)])


__all__ = ["GPT2_TYPES", "block_style", "estimate_hf_step_memory"]
