"""Where the memory of one training step of the built-in GPT goes, predicted without running it.

The estimate is a replay, not a sum: it walks the step op by op (forward, backward, optimizer step) the way PyTorch
runs it, allocating each tensor when the op that makes it runs and freeing it when the last user lets it go, and
reports the highest total and what made it. The peak therefore sits where the real one does: at the end of the forward
(all saved activations plus the fp32 logits), early in backward (activations not yet released plus the gradients
flowing back), or in the optimizer step (parameters + gradients + AdamW state + its scratch).

What each op keeps for backward is PyTorch's own choice and is written out below: a pre-norm block saves its input
and mid residual (fp32: the residual stream stays fp32 under autocast, because a bf16 branch added to an fp32 stream
promotes), both layer norms' statistics, the compute-dtype inputs of its four matmuls, the fused qkv output and the
attention output and log-sum-exp (flash attention, on CPU too, never stores the T x T matrix), and both MLP
activations (4x wide). Under autocast every matmul also keeps the compute-dtype copy of its weight.

Checked against :func:`cadence.memory.measure.measure_step` on CPU (gpt-tiny / small / base x fp32 / bf16 / fp16 x
none / selective / full, with and without accumulation): the peak within 1.5%, activation memory within 0.5%. On CUDA
the same ops save the same tensors, but the allocator's rounding and the CUDA context are not modelled.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from cadence.formatting import format_mib
from cadence.memory.choices import CheckpointingMode, OffloadMode
from cadence.models.gpt import GPTConfig
from cadence.optim.spec import OptimizerSpec, TrainedTensor

PrecisionName = Literal["fp32", "bf16", "fp16"]
"""cadence.engine.precision.PrecisionName, repeated here: the engine is a layer above memory."""

ADAMW = OptimizerSpec()
"""The default optimizer of an estimate: ``cadence train``'s (AdamW, fp32 moments)."""

ESTIMATE_CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs")
"""Device categories of :attr:`MemoryEstimate.by_category`, in report order."""

FP32_BYTES = 4
_INDEX = 8  # int64 token ids and labels
_STATS = 2  # a layer norm saves its mean and reciprocal std: two fp32 values per token

# What a block keeps for its backward, by checkpointing mode (names as in StepReplay._block_forward).
_SAVED_NONE = frozenset(
    {"ln1.stats", "h1", "qkv", "att", "lse", "x1", "ln2.stats", "h2", "f", "g", "w.qkv", "w.proj", "w.fc", "w.mlp"}
)
# Selective keeps the outputs of matmuls and attention (cadence.memory.recompute's policy) and recomputes the cheap ops.
_SAVED_SELECTIVE = frozenset({"qkv", "att", "lse", "po", "f", "mo"})
_SAVED_FULL: frozenset[str] = frozenset()  # the checkpoint keeps only the block's input (the residual, always kept)
_WEIGHTS = ("w.qkv", "w.proj", "w.fc", "w.mlp")  # autocast's compute-dtype copies of a block's matmul weights


@dataclass(kw_only=True)
class MemoryEstimate:
    """The predicted memory of one optimizer step (bytes of tensors; the allocator's own overhead excluded)."""

    peak_bytes: int
    """Device bytes at the predicted peak: the sum of the device categories of ``by_category``."""
    by_category: dict[str, int]
    """parameters, gradients, optimizer_state, activations, temporaries, inputs at the peak (summing to
    ``peak_bytes``), plus ``offloaded_to_host`` (host memory, not part of the peak) when offload moves something."""
    peak_phase: str
    """Where the peak happens: ``"forward"``, ``"backward"`` or ``"optimizer step"``."""
    activation_bytes: int
    """Most activation bytes alive at once over the step (recomputed ones included): "activation memory"."""
    dominant: str
    """The largest part of the peak, its share, and what would shrink it."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the peak, where it happens, and its largest parts."""
        parts = sorted(((k, v) for k, v in self.by_category.items() if k in ESTIMATE_CATEGORIES), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {format_mib(value)}" for name, value in parts if value > 0)
        return f"peak {format_mib(self.peak_bytes)} in the {self.peak_phase} ({shown})"


def estimate_step_memory(
    config: GPTConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    precision: PrecisionName,
    checkpointing: CheckpointingMode,
    offload: OffloadMode = "none",
    device_type: str = "cpu",
    optimizer: OptimizerSpec = ADAMW,
    grad_accum_steps: int = 1,
    loss_chunk_tokens: int = 0,
    target_tokens: int | None = None,
    full_logits: bool = False,
) -> MemoryEstimate:
    """Predict the peak memory of one step of ``GPT(config)`` trained the way :class:`cadence.engine.step.Engine` does.

    ``grad_accum_steps`` > 1 adds the fp32 gradients, held from the second micro-batch on, to the forward's peak;
    beyond 2 only the window's token ids grow (on cpu, where the whole window sits in the same memory). The
    optimizer is the one :func:`cadence.training.components.build_optimizer` makes (AdamW, matrices and biases in two groups).
    ``loss_chunk_tokens`` > 0: the loss of :class:`cadence.engine.chunked_loss.ChunkedCrossEntropy` (--loss-chunk-tokens),
    whose head sees only the micro-batch's ``target_tokens`` loss-bearing positions (None: every position has one).
    0: the default loss of ``cadence train``, :class:`cadence.engine.chunked_loss.TargetsOnlyCrossEntropy`: one chunk
    of the ``target_tokens`` positions, nothing recomputed, so the logits are the target positions' only. None counts
    every position as a target: the conservative choice, and the one ``cadence plan`` gets, since its estimates know
    the data's shapes, not its share of targets (assistant-only chat data has far fewer; the measured trials see it).
    ``full_logits``: the loss makes every position's logits instead
    (:func:`cadence.engine.step.token_cross_entropy_sum`, the ``Engine``'s own default, which ``cadence train`` keeps
    for a model whose logits cannot be made from its head's input); with every position a target the two differ by
    the gather's few bytes per token.
    ``optimizer``: the run's optimizer (:class:`cadence.optim.spec.OptimizerSpec`: which one, and how it stores its
    state, --optimizer-state), which sets the state's bytes and the optimizer step's scratch
    (:meth:`OptimizerSpec.state_bytes`); whether it lives on the host is ``offload``'s to say.
    """
    problems = input_problems(micro_batch_size=micro_batch_size, seq_len=seq_len, grad_accum_steps=grad_accum_steps,
                              context_length=config.context_length, precision=precision,
                              checkpointing=checkpointing, offload=offload,
                              loss_chunk_tokens=loss_chunk_tokens, target_tokens=target_tokens,
                              full_logits=full_logits)
    if problems:
        raise ValueError("; ".join(problems))

    on_device = device_type != "cpu"
    replay = StepReplay(
        config, tokens=micro_batch_size * seq_len, seq_len=seq_len, precision=precision,
        checkpointing=checkpointing, offload_activations=on_device and offload == "activations",
        offload_optimizer=on_device and offload == "optimizer", on_device=on_device,
        loss_chunk_tokens=loss_chunk_tokens, target_tokens=target_tokens, optimizer=optimizer,
        full_logits=full_logits,
    )
    return estimate_from_replay(replay, grad_accum_steps=grad_accum_steps, precision=precision, offload=offload,
                                on_device=on_device)


def input_problems(*, micro_batch_size: int, seq_len: int, grad_accum_steps: int, context_length: int,
                   precision: str, checkpointing: str, offload: str, loss_chunk_tokens: int = 0,
                   target_tokens: int | None = None, full_logits: bool = False) -> list[str]:
    """What is wrong with an estimate's arguments (shared by the built-in and the Hugging Face estimates; the
    optimizer is an OptimizerSpec, checked when it was made)."""
    choices = {"precision": (precision, ("fp32", "bf16", "fp16")),
               "checkpointing": (checkpointing, ("none", "full", "selective")),
               "offload": (offload, ("none", "activations", "optimizer"))}
    problems = [f"unknown {key} {value!r} (one of {', '.join(ok)})" for key, (value, ok) in choices.items()
                if value not in ok]
    if min(micro_batch_size, seq_len, grad_accum_steps) < 1:
        problems.append("micro_batch_size, seq_len and grad_accum_steps must be >= 1")
    if seq_len > context_length:
        problems.append(f"seq_len {seq_len} exceeds the model's context length {context_length}")
    if loss_chunk_tokens < 0:
        problems.append(f"loss_chunk_tokens must be >= 0 (0: the target positions' logits at once), got "
                        f"{loss_chunk_tokens}")
    if full_logits and loss_chunk_tokens > 0:
        problems.append("full_logits and loss_chunk_tokens > 0 are two different losses: give one")
    if target_tokens is not None and not 0 <= target_tokens <= micro_batch_size * seq_len:
        problems.append(f"target_tokens {target_tokens} is not between 0 and micro_batch_size x seq_len")
    return problems


def estimate_from_replay(replay: Any, *, grad_accum_steps: int, precision: str, offload: str,
                         on_device: bool) -> MemoryEstimate:
    """Run a step replay (built-in GPT or a Hugging Face block style) and read the estimate off its peak."""
    notes: list[str] = []
    if offload != "none" and not on_device:
        notes.append(f"offload {offload} saves nothing on cpu: the host is the device, so nothing moves")
    replay.run(grad_accum_steps)
    notes += replay.notes
    if on_device:
        notes.append("the CUDA context and the caching allocator's reserve come on top (see nvidia-smi, not this)")
    by_category = {name: int(replay.at_peak.get(name, 0)) for name in ESTIMATE_CATEGORIES}
    peak = sum(by_category.values())
    if replay.host_bytes:
        by_category["offloaded_to_host"] = int(replay.host_bytes)
    return MemoryEstimate(
        peak_bytes=peak, by_category=by_category, peak_phase=replay.peak_phase, activation_bytes=replay.activation_peak,
        dominant=_dominant(by_category, peak, replay.peak_phase, precision), notes=notes,
    )


_WHY = {  # what each category is made of, and what would shrink it
    "activations": "they grow with micro-batch x seq_len; recompute or a smaller micro-batch (accumulate) cuts them",
    "optimizer_state": "AdamW keeps two moments per trained parameter (fp32: 8 bytes); --optimizer-state bf16 or 8bit "
                       "shrinks them to 4 or about 2, --offload optimizer (on a GPU) moves them",
    "parameters": "fp32 master weights{copies}; fixed by the model size",
    "gradients": "one fp32 gradient per parameter, from the first backward to the optimizer step; fixed by the model",
    "temporaries": "gradients flowing back, the logits' fp32 softmax, optimizer scratch; a smaller micro-batch cuts",
    "inputs": "the window's int64 token ids and labels, held for the whole step; they grow with accumulation",
}


def _dominant(by_category: dict[str, int], peak: int, phase: str, precision: str) -> str:
    name = max(ESTIMATE_CATEGORIES, key=lambda key: by_category[key])
    why = _WHY[name].format(copies="" if precision == "fp32" else f" plus autocast's {precision} copies")
    return f"{name}: {by_category[name] / peak:.0%} of the peak (in the {phase}) — {why}"


class ReplaySizes(Protocol):
    """What the replay reads of its model's sizes: a GPTConfig, or a transformers decoder's (``decoder_replay``)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def n_layer(self) -> int: ...

    @property
    def n_head(self) -> int: ...

    @property
    def n_embd(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    def num_parameters(self) -> int: ...


class StepReplay:
    """Walks one step op by op, tracking live device bytes by category and remembering the highest total."""

    def __init__(
        self, config: ReplaySizes, *, tokens: int, seq_len: int, precision: str, checkpointing: str,
        offload_activations: bool, offload_optimizer: bool, on_device: bool, loss_chunk_tokens: int = 0,
        target_tokens: int | None = None, optimizer: OptimizerSpec = ADAMW, full_logits: bool = False,
    ) -> None:
        self.cfg, self.n, self.t, self.c = config, tokens, seq_len, config.n_embd
        self.optimizer = optimizer
        """The run's optimizer: its state bytes and its step's scratch."""
        self.chunk = loss_chunk_tokens
        """--loss-chunk-tokens: N > 0 the head and loss N target tokens at a time; 0 all target tokens at once."""
        self.gathered = not full_logits
        """The target positions' hidden states are gathered before the head (the chunked and the targets-only loss);
        False: every position's logits are made (``token_cross_entropy_sum``)."""
        self.targets = tokens if target_tokens is None else target_tokens
        """Loss-bearing positions of a micro-batch: the only ones the gathering losses give the head."""
        self.lowp = precision != "fp32"
        self.head_in_place = not self.lowp
        """The head's weight gradient is added straight into ``.grad`` (cadence.memory.grad_in_place: in fp32; under
        autocast the head keeps autograd's path). The token embedding's always is (it runs in fp32)."""
        self.act = 2 if self.lowp else FP32_BYTES  # bytes per element of the compute dtype
        self.mode = checkpointing
        self.saved = {"none": _SAVED_NONE, "selective": _SAVED_SELECTIVE, "full": _SAVED_FULL}[checkpointing]
        self.offload_activations, self.offload_optimizer = offload_activations, offload_optimizer
        self.on_device = on_device
        self.notes: list[str] = []
        self.live: collections.Counter[str] = collections.Counter()
        self.tensors: dict[str, tuple[int, str]] = {}  # live tensors by name: (bytes, category)
        self.grads: set[str] = set()  # parameters whose .grad exists
        self.offloaded: dict[str, tuple[int, str]] = {}  # saved tensors waiting in host memory
        self.held: set[str] = set()  # kept on the device even under offload (a checkpoint's own references)
        self.host_bytes = self.peak = self.activation_peak = 0
        # set by run(): the optimizer step's scratch under --optimizer-state bf16 / 8bit (None: the replay's own)
        self.step_scratch: int | None = 0
        self.at_peak: dict[str, int] = {}
        self.peak_phase = self.phase = ""

    # ---------------------------------------------------------------------------------------------- bookkeeping
    def alloc(self, name: str, size: int, category: str) -> None:
        self.tensors[name] = (size, category)
        self.live[category] += size
        total = sum(self.live.values())
        self.activation_peak = max(self.activation_peak, self.live["activations"])
        if total > self.peak:
            self.peak, self.at_peak, self.peak_phase = total, dict(self.live), self.phase

    def free(self, *names: str) -> None:
        for name in names:
            if name in self.tensors:
                size, category = self.tensors.pop(name)
                self.live[category] -= size

    def param_grad(self, name: str, numel: int, *, in_place: bool = False) -> None:
        """A parameter's gradient arrives: the first becomes ``.grad`` (fp32), later ones are made beside it and
        added into it (autograd's AccumulateGrad). Under autocast the matmul makes it in the compute dtype and autograd
        casts it: both exist for a moment. ``in_place``: the token embedding's and the fp32 head's contributions,
        which cadence.memory.grad_in_place adds straight into ``.grad`` (index_add_, addmm_): nothing is made beside
        it. A frozen parameter (:meth:`frozen`) gets none: autograd computes no weight gradient for it."""
        if self.frozen(name):
            return
        if in_place:
            if name not in self.grads:  # the first contribution becomes .grad, as autograd's would
                self.grads.add(name)
                self.alloc("grad." + name, numel * FP32_BYTES, "gradients")
            return
        if self.lowp:
            self.alloc("pg.low", numel * self.act, "temporaries")
        if name in self.grads:
            self.alloc("pg.new", numel * FP32_BYTES, "temporaries")
            self.free("pg.new")
        else:
            self.grads.add(name)
            self.alloc("grad." + name, numel * FP32_BYTES, "gradients")
        self.free("pg.low")

    def frozen(self, name: str) -> bool:
        """Whether the parameter ``name`` is frozen (no gradient, no optimizer state); the built-in GPT trains all."""
        return False

    def parameter_count(self) -> int:
        """Every parameter of the model, trained or frozen (fp32 on the device)."""
        return self.cfg.num_parameters()

    def parameter_bytes(self) -> int:
        """The parameters' bytes on the device (fp32; a LoRA base may hold some in bf16)."""
        return self.parameter_count() * FP32_BYTES

    def trained_shapes(self) -> list[TrainedTensor]:
        """The trained parameter tensors' shapes, as :meth:`trained_tensors` counts them (the same order): the token
        and position embeddings, each block's qkv, projection and MLP matrices (``nn.Linear``: out x in), then the
        norms and biases (the blocks', then the final norm's)."""
        c, cfg = self.c, self.cfg
        block = [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)]
        matrices = [TrainedTensor((cfg.vocab_size, c)), TrainedTensor((cfg.context_length, c))]
        matrices += [TrainedTensor(shape, in_blocks=True) for _ in range(cfg.n_layer) for shape in block]
        vectors = [TrainedTensor((n,), in_blocks=True) for _ in range(cfg.n_layer)
                   for n in (c, c, 3 * c, c, c, c, 4 * c, c)]
        return matrices + vectors + [TrainedTensor((c,)), TrainedTensor((c,))]

    def trained_tensors(self) -> list[int]:
        """Element counts of the trained parameter tensors, in the optimizer's order (the decay group first)."""
        c, cfg = self.c, self.cfg
        block = [3 * c * c, c * c, 4 * c * c, 4 * c * c]
        matrices = [cfg.vocab_size * c, cfg.context_length * c] + block * cfg.n_layer
        vectors = [c, c, 3 * c, c, c, c, 4 * c, c] * cfg.n_layer + [c, c]  # norms and biases
        return matrices + vectors

    # ------------------------------------------------------------------------------------------------ the step
    def run(self, grad_accum_steps: int) -> None:
        self.phase = "forward"
        self.alloc("params", self.parameter_bytes(), "parameters")
        trained = self.trained_tensors()
        # The optimizer's state (AdamW's exp_avg and exp_avg_sq: fp32 like the parameters, or bf16 / 8-bit).
        state, self.step_scratch = self.optimizer.state_bytes(self.trained_shapes(), on_device=self.on_device)
        if self.offload_optimizer:
            # cadence.optim.offload.OffloadedOptimizer: the state, an fp32 master copy the host step updates, and the
            # (pinned) buffers the gradients are copied into, for the trained parameters.
            self.host_bytes += state + 2 * sum(trained) * FP32_BYTES
            self.notes.append("offload optimizer: AdamW state, an fp32 master copy and a gradient buffer live on the "
                              "host; the step runs there and copies the parameters back")
        else:
            self.alloc("adam", state, "optimizer_state")
        # The engine holds the whole window (it counts its targets before the first backward). On a GPU it sits in
        # host memory and each micro-batch is copied over when its turn comes.
        window = 1 if self.on_device else grad_accum_steps
        self.alloc("inputs", window * 2 * self.n * _INDEX, "inputs")
        # From the second micro-batch on the fp32 gradients exist during the forward; later ones repeat the second.
        for _ in range(min(grad_accum_steps, 2)):
            self.phase = "forward"
            self._forward()
            self.phase = "backward"
            self._backward()
        self.free("inputs")
        self.phase = "optimizer step"
        if not self.offload_optimizer:
            # None: the elementwise fp32 update, whose scratch depends on this model's tensors and their order.
            scratch = self._optimizer_scratch() if self.step_scratch is None else self.step_scratch
            self.alloc("adam.scratch", scratch, "temporaries")
            self.free("adam.scratch")
        for name in list(self.grads):
            self.free("grad." + name)  # zero_grad(set_to_none=True)
        if self.offload_activations:
            self.notes.append("offload activations: saved tensors wait in host memory; each block's come back for "
                              "its backward")

    def _optimizer_scratch(self) -> int:
        """AdamW's scratch at the largest moment of its step. CUDA (foreach kernels): ``_foreach_sqrt`` of a whole
        param group's ``exp_avg_sq``. CPU (one tensor at a time): ``sqrt`` and the quotient of one tensor while the
        previous tensor's ``denom`` is still bound to the loop variable."""
        cfg, c = self.cfg, self.c
        matrices = [cfg.vocab_size * c, cfg.context_length * c] + [3 * c * c, c * c, 4 * c * c, 4 * c * c] * cfg.n_layer
        if self.on_device:
            return sum(matrices) * FP32_BYTES  # the weight-decay group (matrices and embeddings) is the larger group
        worst = max(2 * cur + prev for prev, cur in zip([0] + matrices[:-1], matrices, strict=True))
        return worst * FP32_BYTES

    def _forward(self) -> None:
        n, c, v, a = self.n, self.c, self.cfg.vocab_size, self.act
        # Embeddings run in fp32 even under autocast; the sum is the fp32 residual stream.
        self.alloc("tok", n * c * FP32_BYTES, "activations")
        self.alloc("pos", self.t * c * FP32_BYTES, "activations")
        self.alloc("r0", n * c * FP32_BYTES, "activations")
        self.free("tok", "pos")
        for layer in range(self.cfg.n_layer):
            self._block_forward(layer)
        self.alloc("lnf.stats", _STATS * n * FP32_BYTES, "activations")
        if self.gathered:
            self.alloc("hf.f32", n * c * FP32_BYTES, "activations")  # ln_f's output (fp32), the head's input
            self._chunked_loss_forward("hf.f32")
        else:
            self._normalised("hf")
            self._weight("w.head", v * c, saved=True)
            self.alloc("logits", n * v * a, "activations")
            self.free("hf.f32")
            if self.lowp:
                self.alloc("logits.f32", n * v * FP32_BYTES, "activations")  # the loss is computed in fp32
            self.alloc("lsm", n * v * FP32_BYTES, "activations")  # log_softmax output, saved by cross-entropy
            self.free("logits", "logits.f32")  # the loss function returns: the logits were never saved
        # Leaving autocast clears its cast cache: weight copies that nothing saved (checkpointed blocks) or that
        # were saved to the host are freed.
        self.free(*(f"b{i}.{w}" for i in range(self.cfg.n_layer) for w in _WEIGHTS if w not in self.saved))
        self.free(*(name for name, (_, category) in self.offloaded.items() if category == "parameters"))
        for name in [k for k, (_, category) in self.tensors.items() if category == "activations"]:
            self._keep(name)  # what is left is saved for backward (ln_f, lm_head, cross-entropy)

    def _normalised(self, name: str) -> None:
        """A layer norm's output as the next matmul keeps it: fp32, or (autocast) an fp32 result and its cast.
        The fp32 result is the argument of the submodule that casts it, so it lives until that call returns."""
        if self.lowp:
            self.alloc(name + ".f32", self.n * self.c * FP32_BYTES, "activations")
        self.alloc(name, self.n * self.c * self.act, "activations")

    def _block_forward(self, layer: int, *, recompute: bool = False) -> None:
        """One pre-norm block's forward. ``recompute``: checkpointing re-running it at the start of its backward.

        A recompute keeps everything a plain block saves, reuses tensors still alive (the block input; selective's
        cached matmul and attention outputs, consumed once) and stops as soon as the last saved tensor (GELU's
        output, kept by mlp.proj) exists: non-reentrant checkpointing's early stop.
        """
        n, c, a, p = self.n, self.c, self.act, f"b{layer}."
        saved = _SAVED_NONE if recompute else self.saved

        def out(name: str, size: int, category: str = "activations") -> None:
            if p + name not in self.tensors:
                self.alloc(p + name, size, category)

        def drop(*names: str) -> None:  # the forward code lets go of these; only what backward keeps survives
            for name in names:
                if name not in saved:
                    self.free(p + name)
                elif not recompute:
                    self._keep(p + name)

        def weight(name: str, numel: int) -> None:
            if p + name not in self.tensors:
                self._weight(p + name, numel, saved=name in saved and not recompute)

        out("ln1.stats", _STATS * n * FP32_BYTES)
        self._normalised(p + "h1")
        weight("w.qkv", 3 * c * c)
        out("qkv", 3 * n * c * a)  # q, k, v are views of it
        out("att", n * c * a)  # flash attention keeps its output ...
        out("lse", self.cfg.n_head * n * FP32_BYTES)  # ... and the log-sum-exp, never the T x T matrix
        drop("h1", "qkv", "ln1.stats")
        weight("w.proj", c * c)
        out("po", n * c * a)  # output projection; its input is ``att`` itself (the transpose back is free)
        self.free(p + "h1.f32")  # the attention call returns
        drop("att", "lse")
        out("x1", n * c * FP32_BYTES)  # residual add: fp32 stream + compute-dtype branch -> fp32
        drop("po")
        out("ln2.stats", _STATS * n * FP32_BYTES)
        self._normalised(p + "h2")
        weight("w.fc", 4 * c * c)
        out("f", 4 * n * c * a)
        drop("h2", "ln2.stats")
        out("g", 4 * n * c * a)  # GELU
        drop("f")
        weight("w.mlp", 4 * c * c)
        if recompute:
            self.free(p + "mo", p + "h2.f32")
            return
        out("mo", n * c * a)
        self.free(p + "h2.f32")  # the MLP call returns
        drop("g")
        self.alloc(f"r{layer + 1}", n * c * FP32_BYTES, "activations")
        drop("mo", "x1")
        self._keep(f"r{layer}")  # the block's input: kept by ln1 (none) or by the checkpoint (full, selective)

    def _weight(self, name: str, numel: int, *, saved: bool) -> None:
        """A matmul's weight: under autocast a compute-dtype copy, cached until autocast exits. ``save_on_cpu``
        (offload activations) copies every saved tensor to the host, weights included (fp32: the parameter)."""
        if self.lowp:
            self.alloc(name, numel * self.act, "parameters")
        if saved and self.offload_activations:
            self.host_bytes += numel * self.act
            if self.lowp:
                self.offloaded[name] = (numel * self.act, "parameters")

    def _keep(self, name: str) -> None:
        """A tensor saved for backward stays on the device, or (offload activations) waits in host memory."""
        if name in self.held:
            return
        if self.offload_activations and name in self.tensors and self.tensors[name][1] == "activations":
            self.offloaded[name] = self.tensors[name]
            self.host_bytes += self.tensors[name][0]
            self.free(name)

    # ------------------------------------------------------------------------------------------------ chunked loss
    def _chunks(self) -> list[int]:
        """The chunks' sizes (target positions each), in the order the forward makes them (the targets-only loss:
        one chunk of every target)."""
        if not self.chunk:
            return [self.targets]
        full, rest = divmod(self.targets, self.chunk)
        return [self.chunk] * full + ([rest] if rest or not full else [])

    def _chunked_loss_forward(self, head_input: str) -> None:
        """--loss-chunk-tokens: the head's input (``head_input``, fp32, every position) is gathered at the target
        positions and freed; each chunk then makes its logits, their fp32 copy and the log-softmax, and lets them go
        (the checkpoint keeps only its input rows: views of the gathered tensor, which it holds itself). A single
        chunk (every target in it: the targets-only loss, or a chunk size above the target count) is not
        checkpointed: it keeps what the whole-logits loss keeps, for its rows: the head's input (fp32: the gathered
        rows themselves; under autocast their cast, and the gathered rows go when the loss returns), the labels
        (cross-entropy's) and the log-softmax."""
        v, c, a, targets = self.cfg.vocab_size, self.c, self.act, self.targets
        single = len(self._chunks()) == 1
        self.alloc("positions", targets * _INDEX, "activations")  # nonzero: kept by index_select's backward
        self.alloc("targets", targets * _INDEX, "activations")  # the gathered labels, held by the checkpoints
        self.alloc("hg", targets * c * FP32_BYTES, "activations")  # the gathered hidden states
        if not single:  # a checkpoint's own references: on the device even under offload
            self.held.update({"hg", "targets"})
        self.free(head_input)  # index_select keeps only the positions: nothing holds every position's state
        self._weight("w.head", v * c, saved=single)  # autocast's copy, cached over the chunks until autocast exits
        size = self._chunks()[0]  # the first chunk is the largest; every chunk lets everything go
        if self.lowp:
            self.alloc("rows", size * c * a, "activations")  # the head's cast of the chunk's rows
        self.alloc("logits", size * v * a, "activations")
        if self.lowp:
            self.alloc("logits.f32", size * v * FP32_BYTES, "activations")  # the loss is computed in fp32
            self.free("logits")  # nothing holds the head's own output once it is cast
        self.alloc("lsm", size * v * FP32_BYTES, "activations")  # log_softmax
        self.free("logits", "logits.f32")
        if not single:
            self.free("rows", "lsm", "w.head")  # the chunk's loss is a scalar; the checkpoint saved nothing
        elif self.lowp:
            self.free("hg")  # the head saved its cast ("rows"): nothing holds the fp32 rows once the loss returns

    def _chunked_loss_backward(self, head_param: str) -> None:
        """The chunks in backward, last first: each recomputes its logits (the head's weight cast again under
        autocast: the recompute's own autocast has its own cache), runs the loss's backward and the head's, and lets
        go of everything but its rows' gradient and the head weight's gradient, which add up over the chunks. Ends
        with ``dhf``: the fp32 gradient of the head's input at every position (index_select's backward)."""
        v, c, a = self.cfg.vocab_size, self.c, self.act
        self._bring_back("positions", "targets")
        chunks = list(reversed(self._chunks()))
        for index, size in enumerate(chunks):
            if len(chunks) == 1:
                # kept by the forward, as the whole-logits loss keeps them (fp32: the head kept its input, hg)
                self._bring_back("lsm", "rows", "w.head", "hg")
            else:
                if self.lowp:
                    self._weight("w.head", v * c, saved=False)
                    self.alloc("rows", size * c * a, "activations")
                self.alloc("logits", size * v * a, "activations")
                if self.lowp:
                    self.alloc("logits.f32", size * v * FP32_BYTES, "activations")
                    self.free("logits")
                self.alloc("lsm", size * v * FP32_BYTES, "activations")  # the last tensor the backward needs: the
                self.free("logits", "logits.f32")  # recompute stops here and lets its intermediates go
            self._log_softmax_backward(size)
            self.alloc(f"dh{index}", size * c * a, "temporaries")  # the head's input gradient, this chunk's rows
            if self.lowp:
                # The weight's gradient in the compute dtype adds up in the cast's backward, over all chunks
                # (none for a frozen head: LoRA).
                if not self.frozen(head_param):
                    self.alloc("dw.new" if index else "dw.low", v * c * a, "temporaries")
                    self.free("dw.new")
                self.alloc(f"dh{index}.f32", size * c * FP32_BYTES, "temporaries")  # the rows' cast, backward
                self.free(f"dh{index}")
            else:
                self.param_grad(head_param, v * c, in_place=self.head_in_place)
            self.free("dlogits", "dlogits.f32", "rows", "w.head")
        if self.lowp:  # all chunks are in: the cast's backward makes the fp32 gradient of the parameter
            self.free("dw.low")
            self.param_grad(head_param, v * c)
        pieces = [f"dh{i}" + (".f32" if self.lowp else "") for i in range(len(chunks))]
        if self.chunk:
            self.alloc("dhg", self.targets * c * FP32_BYTES, "temporaries")  # split's backward: the pieces joined
            self.free(*pieces, "hg")
            pieces = ["dhg"]
        else:  # the targets-only loss splits nothing: its one piece is the gathered rows' gradient
            self.free("hg")
        self.alloc("dhf", self.n * c * FP32_BYTES, "temporaries")  # index_select's backward: zeros + index_add
        self.free(*pieces, "positions", "targets")

    # ------------------------------------------------------------------------------------------------ backward
    def _backward(self) -> None:
        n, c, v, a = self.n, self.c, self.cfg.vocab_size, self.act
        last = f"r{self.cfg.n_layer}"
        if self.gathered:
            self._chunked_loss_backward("tok_emb")  # lm_head is tied to the token embedding
            self._bring_back(last, "lnf.stats")
            self.alloc("dres", n * c * FP32_BYTES, "temporaries")  # ln_f backward (its input gradient is fp32)
            self.free("dhf")
        else:
            self._bring_back("lsm")
            self._log_softmax_backward(n)
            self._bring_back("hf", "w.head")
            self.alloc("dhf", n * c * a, "temporaries")  # lm_head (tied to the token embedding)
            self.param_grad("tok_emb", v * c, in_place=self.head_in_place)
            self.free("dlogits", "dlogits.f32", "hf", "w.head")
            self._bring_back(last, "lnf.stats")
            self._norm_backward("dhf", "dres")
        self.param_grad("ln_f", 2 * c)
        self.free(last, "lnf.stats")
        for layer in reversed(range(self.cfg.n_layer)):
            self._block_backward(layer)
        self.alloc("dpos", self.t * c * FP32_BYTES, "temporaries")  # the position term's gradient, summed over batch
        self.param_grad("tok_emb", v * c, in_place=True)  # the lookup: cadence.memory.grad_in_place
        self.param_grad("pos_emb", self.cfg.context_length * c)
        self.free("dres", "dpos")

    def _log_softmax_backward(self, rows: int) -> None:
        """Cross-entropy's backward over ``rows`` positions' logits, from the saved log-softmax (``lsm``, freed): the
        gradient of nll_loss and of log_softmax (fp32), then under autocast its cast back to the logits' dtype: what
        the head's backward reads as ``dlogits`` (or ``dlogits.f32`` in fp32)."""
        v = self.cfg.vocab_size
        self.alloc("dlsm", rows * v * FP32_BYTES, "temporaries")  # nll_loss backward
        self.alloc("dlogits.f32", rows * v * FP32_BYTES, "temporaries")  # log_softmax backward
        self.free("dlsm", "lsm")
        if self.lowp:
            self.alloc("dlogits", rows * v * self.act, "temporaries")  # back to the logits' dtype
            self.free("dlogits.f32")

    def _bring_back(self, *names: str) -> None:
        """Offloaded activations return to the device for the ops that need them (released by those ops)."""
        for name in names:
            if name in self.offloaded and name not in self.tensors:
                self.alloc(name, *self.offloaded.pop(name))

    def _norm_backward(self, grad_in: str, grad_out: str) -> None:
        """Layer-norm backward: under autocast the incoming gradient is first cast back to fp32."""
        if self.lowp:
            self.alloc(grad_in + ".f32", self.n * self.c * FP32_BYTES, "temporaries")
            self.free(grad_in)
        self.alloc(grad_out, self.n * self.c * FP32_BYTES, "temporaries")
        self.free(grad_in, grad_in + ".f32")

    def _block_backward(self, layer: int) -> None:
        n, c, a, p = self.n, self.c, self.act, f"b{layer}."
        self._bring_back(f"r{layer}", *(p + name for name in sorted(self.saved)))
        if self.mode != "none":
            self._block_forward(layer, recompute=True)

        def grad(name: str, size: int) -> None:
            self.alloc(p + name, size, "temporaries")

        def release(*names: str) -> None:  # a backward node frees what it saved once it has run
            self.free(*(p + name for name in names))

        # The residual gradient ``dres`` (fp32) stays alive through the block; under autocast each branch gets a
        # compute-dtype copy of it.
        if self.lowp:
            grad("dres.c", n * c * a)
        grad("dg", 4 * n * c * a)  # mlp.proj
        self.param_grad(p + "mlp.proj", 4 * c * c + c)
        release("dres.c", "g", "w.mlp")
        grad("df", 4 * n * c * a)  # GELU
        release("dg", "f")
        grad("dh2", n * c * a)  # mlp.fc
        self.param_grad(p + "mlp.fc", 4 * c * c + 4 * c)
        release("df", "w.fc")
        self._norm_backward(p + "dh2", p + "dx1")  # ln2
        self.param_grad(p + "ln2", 2 * c)
        release("h2", "x1", "ln2.stats", "dx1")  # added into dres in place
        if self.lowp:
            grad("dres.c", n * c * a)
        grad("dy", n * c * a)  # attention output projection
        self.param_grad(p + "attn.proj", c * c + c)
        release("dres.c", "w.proj")
        grad("dqkv.parts", 3 * n * c * a)  # attention backward: dq, dk, dv
        release("dy", "att", "lse")
        grad("dqkv", 3 * n * c * a)  # the split's backward concatenates them
        release("dqkv.parts", "qkv")
        grad("dh1", n * c * a)  # qkv projection
        self.param_grad(p + "attn.qkv", 3 * c * c + 3 * c)
        release("dqkv", "w.qkv")
        self._norm_backward(p + "dh1", p + "dx")  # ln1
        self.param_grad(p + "ln1", 2 * c)
        release("h1", "ln1.stats", "dx", "po", "mo")
        self.free(f"r{layer}")  # the block's input, kept by ln1 or by the checkpoint
