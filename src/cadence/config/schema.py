"""The training configuration: one typed ``kw_only`` dataclass whose field docstrings are the flags' --help.

Each field's name is its TOML key; its flag is the name with dashes (``micro_batch_size`` -> ``--micro-batch-size``).
Flags win over the TOML file, which wins over the defaults (``cadence.config.sources``); ``cadence.config.validate``
checks every field and reports every problem at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from cadence.data.chat import TrainOn
from cadence.data.choices import TooLong
from cadence.engine.choices import (
    DEFAULT_MIN_LR_RATIO,
    BatchLRScaling,
    LastWindow,
    LRScheduleName,
    ObjectiveName,
    PrecisionName,
    ReferenceLogprobs,
)
from cadence.engine.cut import MicroBatchOrder
from cadence.memory.choices import CheckpointingMode, OffloadMode
from cadence.optim.choices import OptimizerName, OptimizerStateName

DeviceName = Literal["auto", "cpu", "cuda"]
DEVICE_CHOICES: tuple[DeviceName, ...] = ("auto", "cpu", "cuda")
Fp32Matmul = Literal["tf32", "exact"]
FP32_MATMUL_CHOICES: tuple[Fp32Matmul, ...] = ("tf32", "exact")
LoraBasePrecision = Literal["fp32", "bf16", "nf4"]
LORA_BASE_PRECISIONS: tuple[LoraBasePrecision, ...] = ("fp32", "bf16", "nf4")
Strategy = Literal["ddp", "fsdp"]
STRATEGIES: tuple[Strategy, ...] = ("ddp", "fsdp")
MAX_SEED = 2**64 - 1
"""torch.manual_seed takes at most 64 bits."""


def flag(name: str) -> str:
    """The command-line spelling of a config field."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Section:
    """A group of TrainConfig fields: one heading of every command's --help, and the unit in which the other
    commands take train's flags. ``cadence train`` takes every section; a new field joins a section and with it the
    commands that take that section (no list of field names per command to keep)."""

    title: str
    commands: frozenset[str]
    """The commands besides train that take the section's flags."""


def _section(title: str, *commands: str) -> Section:
    return Section(title=title, commands=frozenset(commands))


EVERYDAY: tuple[str, ...] = (
    "model", "data", "seq_len", "micro_batch_size", "effective_batch_size", "precision", "lr", "max_steps", "out",
    "resume", "lora_rank", "plan",
)
"""The flags most runs set, which `--help` shows first under their own heading (the rest follow by section): a new
user finds what to type for a first run without reading past the rare levers. Each still belongs to its section."""


# The run's math and shape, which every command that runs a step takes.
MODEL = _section("Model", "plan", "profile", "verify", "prepare-data")
DATA = _section("Data", "plan", "profile", "verify", "prepare-data")
BATCH = _section("Batch", "plan", "profile", "verify")
CUT = _section("Micro-batch cut", "plan", "profile", "verify")
PRECISION = _section("Precision and memory levers", "plan", "profile", "verify")
OPTIMIZER = _section("Optimizer", "plan", "profile", "verify")
LORA = _section("LoRA adapters", "plan", "profile", "verify")
OBJECTIVE = _section("Objective", "plan", "profile", "verify")
DEVICE = _section("Device and seed", "plan", "profile", "verify")
DISTRIBUTED = _section("Distributed", "verify")
# What a measurement of speed and memory also depends on (verify compares gradients exactly: fp32 matmuls stay exact).
MEMORY = _section("Memory budget and matmuls", "plan", "profile")
SCHEDULE = _section("LR schedule", "plan", "profile")
SPEED = _section("Compilation and input pipeline", "profile")
RUN_DIRECTORY = _section("Output", "plan", "profile")
FROM_PLAN = _section("From a file or a plan", "profile")
# A training run's own course.
LENGTH = _section("Training length and auto micro-batch")
ADAPTIVE = _section("Adaptive effective batch", "plan")
VALIDATION = _section("Validation")
# What a run measures about its own batch (profile reports it too).
NOISE_SCALE = _section("Gradient noise scale", "profile")
CHECKPOINTS = _section("Checkpoints, resume and export")

SECTIONS: tuple[Section, ...] = (MODEL, DATA, BATCH, CUT, PRECISION, MEMORY, SPEED, OPTIMIZER, LORA, OBJECTIVE, SCHEDULE,
                                 LENGTH, ADAPTIVE,
                                 VALIDATION, NOISE_SCALE, DEVICE, DISTRIBUTED, RUN_DIRECTORY, CHECKPOINTS, FROM_PLAN)
"""In --help order."""


def setting(default: Any, section: Section, *, changes_math: bool = False) -> Any:
    """A TrainConfig field: its default, its section, and whether it changes the math (the gradient, the update or
    the data order: a resume refuses another value of such a field; the micro-batch split, recompute or offload may
    change)."""
    return dataclasses.field(default=default, metadata={"section": section, "changes_math": changes_math})


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``cadence train`` needs. Field docstrings are the CLI help.

    A choice field is typed with its Literal (``precision: PrecisionName``) for readers and type checkers; its value
    comes from the command line or a TOML file at run time, so ``validate`` still checks it and names the flag."""

    model: str = setting("gpt-tiny", MODEL, changes_math=True)
    """Built-in model (gpt-tiny ~1M parameters, gpt-small ~10M, gpt-base ~85M); hf:TYPE, a Hugging Face causal LM
    built offline from its config class (hf:llama, hf:gpt2, hf:qwen2, hf:mistral ...; sizes from --model-config); or
    a local model directory saved by save_pretrained."""
    model_config: list[str] | None = setting(None, MODEL, changes_math=True)
    """KEY=VALUE overrides of a Hugging Face model's config (repeat the flag), e.g. hidden_size=256."""
    data: Path | None = setting(None, DATA)
    """Training data: omitted = the built-in corpus (Python's standard library source); a .txt file or a directory
    is packed into --seq-len sequences; a .jsonl file holds {"text"} or {"prompt", "completion"} examples, or chat
    conversations ({"messages": [...]}, conversational prompt/completion lists, ShareGPT "conversations");
    hf:PATH is a dataset saved by datasets' save_to_disk; .parquet, .csv and .json files are read with datasets; a
    token store directory written by cadence prepare-data --out."""
    data_cache: Path | None = setting(None, DATA)
    """Directory of token stores: every source is tokenised once into a memory-mapped store there and reopened in
    milliseconds while its content stays the same; default ~/.cache/cadence/data."""
    text_field: str = setting("text", DATA)
    """The key (a .jsonl row's, or a dataset's column) holding a text: the loss is on every token after the first."""
    prompt_field: str = setting("prompt", DATA)
    """The key holding a prompt (no loss on it). A row with a prompt and a completion trains on the completion, also
    when it holds a text as well; rows of both kinds may be mixed."""
    completion_field: str = setting("completion", DATA)
    """The key holding a completion (the loss is on it and on the end of sequence after it)."""
    messages_field: str | None = setting(None, DATA)
    """Chat data: the column holding each row's list of messages ({role, content}), when it is not "messages" (nor
    ShareGPT's "conversations"). Chat rows are found by themselves: "messages", a conversational "prompt" and
    "completion" of message lists, or ShareGPT "conversations" ({from, value})."""
    chat_template: Path | None = setting(None, DATA, changes_math=True)
    """Chat data: a Jinja chat template file to render the conversations with, instead of the model directory's own
    tokenizer template (or, for a built-in model or a tokenizer without one, cadence's ChatML default:
    <|im_start|>role, the content, <|im_end|>). Rendered in a sandbox: no code runs from a template."""
    train_on: TrainOn = setting("assistant", DATA, changes_math=True)
    """Chat data: which tokens carry the loss: assistant (the content and end-of-turn token of every assistant
    message), last (of the final assistant message only) or all (every token). A message's "train": true|false
    overrides it for that message."""
    seq_len: int | None = setting(None, DATA, changes_math=True)
    """Tokens per sequence (bytes); default: the model's context length."""
    too_long: TooLong = setting("skip", DATA, changes_math=True)
    """What becomes of a JSONL or datasets example longer than --seq-len: skip (left out, and counted on the
    console), truncate (cut to fit, keeping the completion: the prompt loses its start; a completion longer than
    --seq-len alone loses its end; a text loses its end) or error (refused, naming each one's file and line)."""
    micro_batch_size: int | Literal["auto"] = setting(8, BATCH)
    """Sequences per forward/backward pass (what must fit in memory), or auto: start at --effective-batch-size /
    (--grad-accum-steps x processes), halve it (doubling accumulation, same math) whenever a window runs out of
    memory, and try growing back after --auto-grow-after good steps."""
    grad_accum_steps: int | None = setting(None, BATCH)
    """Micro-batches accumulated per optimizer step; default 1, or derived from --effective-batch-size."""
    effective_batch_size: int | Literal["auto", "adaptive", "ramp"] | None = setting(None, BATCH, changes_math=True)
    """Sequences per optimizer step (micro-batch x accumulation x processes); derives --grad-accum-steps. auto
    (cadence plan only): chosen from the gradient noise scale measured at the start of training. adaptive (cadence
    train; cadence plan plans one micro-batch and set of levers for its whole range): starts at
    --min-effective-batch-size and doubles or halves the accumulation at window boundaries as the measured gradient
    noise scale says (docs/adaptive_batch.md). ramp (cadence train only): a preset ramp, doubling from
    --min-effective-batch-size at each of --batch-ramp-tokens, nothing measured (OLMo-core style)."""
    micro_batch_order: MicroBatchOrder = setting("by-length", CUT)
    """How a window's samples are cut into micro-batches: by-length (longest first, so each micro-batch pads little)
    or drawn (in the epoch's order). The window's samples and its gradient are the same either way; only the
    padding computed changes. Equal lengths (text) keep the drawn order."""
    micro_batch_tokens: int | None = setting(None, CUT)
    """Cut each window's length-sorted samples into micro-batches of at most N padded positions (rows x longest
    row) instead of --micro-batch-size rows: many short rows or few long ones, a memory peak set by N."""
    packing: bool = setting(False, CUT)
    """Pack each window's examples into rows of --seq-len tokens (several per row), with attention that never
    crosses from one example into another (position ids restart per example); --micro-batch-size then counts rows.
    The same samples and gradient as unpacked, with almost no padding."""
    precision: PrecisionName = setting("fp32", PRECISION, changes_math=True)
    """Compute precision: fp32, bf16 (autocast, no loss scaling) or fp16 (autocast with a GradScaler)."""
    activation_checkpointing: CheckpointingMode = setting("none", PRECISION)
    """Recompute activations in backward: none, full (each block keeps only its input) or selective (keep matmul and
    attention outputs, recompute norms, GELU and adds)."""
    offload: OffloadMode = setting("none", PRECISION)
    """none, activations (saved tensors in host memory) or optimizer (optimizer state and update on the CPU). On a
    CPU-only machine both run but save nothing: host and device memory are the same."""
    compile: bool = setting(False, SPEED)
    """Compile each transformer block with torch.compile (inductor), block by block as torchtitan does, so that
    recompute and FSDP2 wrap compiled blocks and parameter names stay the same. The first steps (and each new
    sequence length) pay the compile time, reported apart in the summary and the profile; CPU needs a C++ compiler."""
    prefetch_windows: int = setting(1, SPEED)
    """Windows prepared ahead in a background thread (cut into micro-batches, collated and, on CUDA, pinned for an
    asynchronous copy) while the current one computes; 0 prepares each window in the loop's own thread. The data
    order, and so every loss, is the same for any value; memory grows by one window of batches per step ahead (at
    most 64)."""
    fp32_matmul: Fp32Matmul = setting("tf32", MEMORY)
    """How CUDA runs fp32 matrix multiplies (and convolutions): tf32 (TensorFloat-32 tensor cores: about 1e-3
    relative error per product, several times faster on Ampere and later) or exact (full fp32). Under bf16/fp16 only
    the ops autocast leaves in fp32 are affected; CPU matmuls are always exact. Set for the run only."""
    loss_chunk_tokens: int = setting(0, PRECISION)
    """Compute the LM head and the cross-entropy N target tokens at a time, each chunk's logits recomputed in the
    backward, so that the [tokens x vocabulary] logits and their gradient never exist whole; only positions with a
    target reach the head. Same gradient (fp32: to rounding); a resume may change it. 0 (default): no chunks, but
    still only the target positions' logits (all logits for a model whose logits cadence cannot reproduce). Measured on CPU (BENCHMARKS.md), llama of width 256 with 32,000 tokens, 4 x 512 tokens: peak 1,146 -> 523
    MiB at 256 for 12% more compute; the byte-level models gain nothing. Transformers models whose forward changes
    the logits in a way cadence does not reproduce are refused."""
    memory_budget: str | None = setting(None, MEMORY)
    """Peak memory allowed per process, e.g. 512MiB or 2GiB. CUDA: the allocator is capped there (a real OOM past
    it); CPU: every step is measured by the profiler and a micro-batch past it counts as out of memory."""
    auto_grow_after: int = setting(50, LENGTH)
    """With --micro-batch-size auto: good optimizer steps after a halving before trying a larger micro-batch again."""
    max_grad_norm: float = setting(1.0, OPTIMIZER, changes_math=True)
    """Clip the total gradient norm to this, once per optimizer step after unscaling; 0 turns clipping off."""
    optimizer: OptimizerName = setting("adamw", OPTIMIZER, changes_math=True)
    """The optimizer: adamw (decoupled weight decay on matrices and embeddings); muon (orthogonalised momentum for
    the blocks' 2-D weight matrices, AdamW for the rest, one --lr for both); schedule-free (Schedule-Free AdamW: no
    decaying schedule, give --lr-schedule constant; evaluated, checkpointed and saved from its averaged weights);
    adafactor (factored second moment, no
    first moment: the smallest state; relative steps capped by --lr); sgd (momentum, --nesterov). Each applies
    --weight-decay to matrices and embeddings only; an option that does not apply to it is refused. A resume keeps
    the run's optimizer (docs/optimizers.md)."""
    lr: float = setting(1e-3, OPTIMIZER, changes_math=True)
    """Peak learning rate (AdamW)."""
    weight_decay: float = setting(0.1, OPTIMIZER, changes_math=True)
    """AdamW weight decay, applied to matrices and embeddings only (not to biases and norms)."""
    adam_beta1: float = setting(0.9, OPTIMIZER, changes_math=True)
    """AdamW beta1."""
    adam_beta2: float = setting(0.95, OPTIMIZER, changes_math=True)
    """AdamW beta2."""
    momentum: float | None = setting(None, OPTIMIZER, changes_math=True)
    """Momentum of --optimizer sgd (default 0.9; 0 turns it off) and of muon's matrices (default 0.95)."""
    nesterov: bool = setting(False, OPTIMIZER, changes_math=True)
    """Nesterov momentum for --optimizer sgd."""
    optimizer_state: OptimizerStateName = setting("fp32", OPTIMIZER, changes_math=True)
    """How AdamW stores its two moments: fp32 (8 bytes per trained parameter), bf16 (4 bytes: cadence's AdamW with
    stochastic rounding of the moments, so small updates are not lost) or 8bit (about 2 bytes: bitsandbytes'
    block-wise quantised AdamW8bit, pip install 'cadence[8bit]'). The weights and gradients stay fp32. Works with
    --offload optimizer and DDP; under --strategy fsdp only fp32 and bf16."""
    lora_rank: int = setting(0, LORA, changes_math=True)
    """Train LoRA adapters of rank R (with peft) instead of the whole model: a Hugging Face model's base is frozen
    (no gradients, no optimizer state) and only the adapters of the --lora-targets layers are trained; --save-hf
    then writes the adapter, which peft.PeftModel.from_pretrained(base, DIR) loads. 0 (default): train everything."""
    lora_alpha: float | None = setting(None, LORA, changes_math=True)
    """LoRA's alpha: the adapters' output is scaled by alpha / rank; default: the rank (scale 1)."""
    lora_targets: list[str] | None = setting(None, LORA, changes_math=True)
    """The layers to adapt, by module name (q_proj,v_proj or repeat the flag; all-linear for every linear layer but
    the head); default: peft's choice for the model type (llama, qwen2, mistral: q_proj and v_proj; gpt2: c_attn)."""
    lora_dropout: float = setting(0.0, LORA, changes_math=True)
    """Dropout on the adapters' input (0 keeps every step deterministic, so splits agree exactly)."""
    lora_base_precision: LoraBasePrecision = setting("fp32", LORA, changes_math=True)
    """How the frozen base's linear layers are held: fp32, or bf16 (with --precision bf16 only): half their bytes and
    no autocast copies, for the same math (autocast rounds an fp32 weight to the same bf16 weight in every matmul;
    the norms, embeddings and adapters stay fp32). model.safetensors then holds those weights in bf16. nf4 (QLoRA,
    bitsandbytes: pip install 'cadence[8bit]'): every linear layer of the blocks (q/k/v/o and the MLP's, adapted or
    not) held as 4-bit NormalFloat, block-wise (64 weights per absmax) with the absmaxes double-quantised to 8 bits,
    about 0.52 bytes a weight; each matmul dequantises its weight to the compute dtype (--precision bf16 or fp32)
    in the forward and again in the backward. Embeddings, norms and the LM head stay fp32. Not the same math as the
    full-precision base (4-bit weights); not with --strategy fsdp; model.safetensors holds the packed codes and
    their scales, and --save-hf the adapter alone, for the original base."""
    objective: ObjectiveName = setting("sft", OBJECTIVE, changes_math=True)
    """What training minimises: sft (next-token cross-entropy on the targets), or on preference rows (TRL's
    formats: {"prompt", "chosen", "rejected"} pairs, strings or message lists) dpo (sigmoid DPO against a reference
    model), ipo, simpo (length-normalised, no reference) or orpo (the chosen completion's NLL plus the odds-ratio
    term, no reference); kto on {"prompt", "completion", "label"} rows. Each divides by its unit counted over the
    whole window and every process (pairs; KTO: examples; ORPO's NLL: chosen targets), so any split gives one big
    batch's gradient."""
    beta: float = setting(0.1, OBJECTIVE, changes_math=True)
    """dpo, ipo, simpo, orpo, kto: beta, TRL's name and default (IPO's tau; ORPO's lambda, the weight of its
    odds-ratio term)."""
    simpo_gamma: float = setting(0.5, OBJECTIVE, changes_math=True)
    """simpo: the target reward margin gamma (TRL's CPOConfig default)."""
    desirable_weight: float = setting(1.0, OBJECTIVE, changes_math=True)
    """kto: the weight of a desirable example's loss."""
    undesirable_weight: float = setting(1.0, OBJECTIVE, changes_math=True)
    """kto: the weight of an undesirable example's loss."""
    reference_model: Path | None = setting(None, OBJECTIVE, changes_math=True)
    """dpo, ipo, kto: score against this model directory (save_pretrained; the same tokenizer) instead of the
    starting weights. Default: the starting weights, which under --lora-rank are the base with the adapters turned
    off (no second copy in memory) and otherwise a frozen copy made before training."""
    reference_logprobs: ReferenceLogprobs = setting("live", OBJECTIVE)
    """dpo, ipo, kto without --lora-rank: live (the reference, a frozen model, scores each micro-batch through
    training: one more copy of the weights in memory) or precomputed (its log-probabilities of every train and
    validation sequence computed in one no-gradient pass before step 1, kept beside the token store and reused by a
    resume or a later run on the same data and reference: no reference model in memory while training; the same
    losses)."""
    lr_schedule: LRScheduleName = setting("cosine", SCHEDULE, changes_math=True)
    """LR schedule after warmup, counted in optimizer steps: constant, linear or cosine."""
    warmup_steps: int = setting(0, SCHEDULE, changes_math=True)
    """Optimizer steps of linear LR warmup."""
    min_lr_ratio: float = setting(DEFAULT_MIN_LR_RATIO, SCHEDULE, changes_math=True)
    """Floor of the linear and cosine decay, as a fraction of --lr."""
    max_steps: int = setting(100, LENGTH, changes_math=True)
    """Optimizer steps to train (skipped fp16 steps do not count)."""
    epochs: int | None = setting(None, LENGTH, changes_math=True)
    """Train N passes over the training split instead of --max-steps: the steps are N x the windows of an epoch
    (the LR schedule runs over them all); not with --max-steps."""
    seed: int = setting(0, DEVICE, changes_math=True)
    """Seed for weights and data order."""
    last_window: LastWindow = setting("step", LENGTH, changes_math=True)
    """The short last window of an epoch: step (normalised by its own target count) or drop."""
    val_fraction: float | None = setting(None, VALIDATION, changes_math=True)
    """Fraction of the data held out for validation (the last examples); default 0.05 when the run evaluates
    (--eval-every without --eval-data) and 0 when nothing would use it (all of the data trains); 0 = no split."""
    eval_every: int = setting(0, VALIDATION)
    """Evaluate the validation loss every N optimizer steps and at the end; 0 = never."""
    eval_batches: int = setting(0, VALIDATION)
    """Validation micro-batches per evaluation: 0 = the whole validation set; N = its first N micro-batches (always
    the same ones, so evaluations compare). The console says how many examples that is."""
    eval_data: Path | None = setting(None, VALIDATION)
    """Evaluate on this file (read as --data is) instead of a held-out split of --data: --val-fraction is then not
    used, and all of --data trains."""
    early_stop_after: int = setting(0, VALIDATION)
    """Stop after N evaluations in a row without a lower validation loss (needs --eval-every); 0 = never."""
    noise_scale_ema: float = setting(0.99, NOISE_SCALE)
    """Measure the gradient noise scale (McCandlish et al. 2018), about the critical batch past which more sequences
    per step mostly cost tokens, from each window's first micro-batch against the whole window, averaged over windows
    with this moving-average decay (0.99: about the last 100 windows); 0 = off. Costs one gradient norm per window;
    needs 2 or more micro-batches per window, or several DDP processes. Logged as grad_noise_scale (sequences) and
    grad_noise_scale_tokens."""
    device: DeviceName = setting("auto", DEVICE)
    """auto (CUDA when available, else CPU), cpu or cuda."""
    out: Path | None = setting(None, RUN_DIRECTORY)
    """Run directory to create; default runs/<date>-<time> (with -2, -3, ... when that name is taken). An existing non-empty directory is refused."""
    checkpoint_every: int = setting(0, CHECKPOINTS)
    """Save a checkpoint every N optimizer steps (and at the end) into OUT/checkpoints/step-N; 0 = none."""
    keep_checkpoints: int = setting(0, CHECKPOINTS)
    """Keep only the newest N checkpoints; 0 keeps all."""
    keep_best: bool = setting(False, CHECKPOINTS)
    """Keep the weights of the evaluation with the lowest validation loss in OUT/best (model.safetensors and
    best.json), apart from the checkpoints and their pruning (needs --eval-every); cadence sample --weights best."""
    resume: bool = setting(False, CHECKPOINTS)
    """Continue the run in --out from its newest intact checkpoint, as if it had never stopped (same losses, data
    order and LR); with no checkpoint yet, start fresh. Refused when the configuration changes the math."""
    checkpoint_mid_window: bool = setting(False, CHECKPOINTS)
    """On SIGTERM/SIGINT in the middle of a window, stop after the current micro-batch and checkpoint the gradients
    accumulated so far (each DDP rank its own; under --strategy fsdp, with --sync-every-micro-step, each rank its
    shard of them), so that no micro-batch's work is lost; --resume continues the window there (on the same number of
    processes)."""
    async_checkpoint: bool = setting(False, CHECKPOINTS)
    """Write checkpoints in the background: the state is copied (under FSDP2 each rank its shard) and training goes
    on while a thread writes it. A checkpoint counts only once complete (its manifest is written last); the next
    save, the end of the run and a stop wait for the write in flight."""
    min_effective_batch_size: int | None = setting(None, ADAPTIVE, changes_math=True)
    """With --effective-batch-size adaptive or ramp: the starting and smallest effective batch (a multiple of
    --micro-batch-size x processes). --max-steps, --warmup-steps and --eval-every then count windows of this batch,
    so that the schedule and the evaluations follow the examples seen, not the optimizer steps (a grown batch does
    not shorten them). cadence plan: with adaptive, the micro-batch it chooses serves this batch (at least two
    micro-batches per window); with auto, the smallest batch it may choose (default 1)."""
    max_effective_batch_size: int | None = setting(None, ADAPTIVE, changes_math=True)
    """With --effective-batch-size adaptive or ramp: the largest effective batch (a multiple of the minimum); default
    for a LoRA run 32 ("LoRA Without Regret": LoRA loses above about 32 sequences per step), required otherwise.
    cadence plan with auto: the largest batch it may choose (default 4096, and at most the training split's
    sequences)."""
    batch_lr_scaling: BatchLRScaling | None = setting(None, ADAPTIVE, changes_math=True)
    """With --effective-batch-size adaptive or ramp: the LR multiplier when the batch is r times the minimum: sqrt (sqrt(r),
    the default for Adam-type optimizers), linear (r, the default for SGD) or none. AdamW's beta2 also follows the
    batch (beta2 ** r, at least 0.9), keeping its averaging half-life in examples."""
    batch_ramp_tokens: list[str] | None = setting(None, ADAPTIVE, changes_math=True)
    """With --effective-batch-size ramp: the token counts (sequences x --seq-len, comma-separated or repeated) at
    which the batch doubles from --min-effective-batch-size, at most to --max-effective-batch-size; each doubling
    takes effect at the first window boundary at or past its count (OLMo-core's batch size scheduler: a preset,
    nothing measured)."""
    batch_branch_test: int | None = setting(None, ADAPTIVE, changes_math=True)
    """With --effective-batch-size adaptive: before a grow is kept, branch from an in-memory snapshot and train the
    next K grown windows' examples at the larger batch and, from the same snapshot, at the current batch (the same
    tokens), then compare their loss on the first 4 validation micro-batches (needs --eval-every); the grow is kept
    only when the larger batch is not worse by more than --batch-branch-tolerance, otherwise the run goes on at the
    current batch and does not try to grow for 16 windows. The run continues from the snapshot either way (so it is
    the run that made that choice without a branch); the branches' extra tokens and time are in summary.json. With
    several processes (DDP or FSDP2) every rank branches on its own windows and the probe loss is all-reduced, so
    all take the same verdict."""
    batch_branch_tolerance: float | None = setting(None, ADAPTIVE, changes_math=True)
    """With --batch-branch-test: how much worse the larger batch's probe loss may be, relative to the current batch's,
    and the grow still be kept (default 0.01: 1%; 0: it must not be worse at all)."""
    max_skipped_steps: int = setting(50, LENGTH)
    """Stop (exit status 1) after this many optimizer steps in a row were skipped (fp16 overflow or non-finite
    gradients): the run has diverged."""
    log_every: int = setting(10, CHECKPOINTS)
    """Print a progress line every N optimizer steps when the output is not a terminal."""
    save_hf: Path | None = setting(None, CHECKPOINTS)
    """Also save the final model with save_pretrained into this directory (Hugging Face models), so that it loads in
    transformers unchanged."""
    strategy: Strategy = setting("ddp", DISTRIBUTED)
    """With several processes (--nproc-per-node or torchrun): ddp (each rank holds the whole model; gradients are
    all-reduced once per window) or fsdp (FSDP2 fully_shard: parameters, gradients and optimizer state sharded over
    the ranks, gathered block by block)."""
    sync_every_micro_step: bool = setting(False, DISTRIBUTED)
    """With --strategy fsdp: reduce-scatter gradients after every micro-batch instead of once per window. Each rank
    then keeps 1/world of the gradients instead of all of them, at accumulation-times the communication; worth it
    when memory matters more than bandwidth."""
    collective_timeout: float = setting(600.0, DISTRIBUTED)
    """Seconds a collective waits for the other ranks before the run fails (a rank that hangs; one that dies is
    noticed at once)."""
    plan: Path | None = setting(None, FROM_PLAN)
    """A plan.json from cadence plan: train with its decision (micro-batch, accumulation, precision, recompute,
    offload, model and seq-len). A flag that contradicts the plan is an error."""

    # ------------------------------------------------------------------------------------------------ derived
    @property
    def auto_micro_batch(self) -> bool:
        return self.micro_batch_size == "auto"

    def resolved_grad_accum_steps(self, world_size: int = 1) -> int:
        """The accumulation actually used at the start (call after ``validate``)."""
        if self.grad_accum_steps is not None:
            return self.grad_accum_steps
        if self.effective_batch_size in ("adaptive", "ramp"):  # windows of the minimum; the controller groups them
            return int(self.min_effective_batch_size or 0) // (int(self.micro_batch_size) * world_size)
        if self.effective_batch_size is not None and not self.auto_micro_batch:
            return int(self.effective_batch_size) // (int(self.micro_batch_size) * world_size)
        return 1

    def resolved_micro_batch_size(self, world_size: int = 1) -> int:
        """The micro-batch actually used at the start; auto starts at the largest the accumulation allows."""
        if not self.auto_micro_batch:
            return int(self.micro_batch_size)
        return int(self.effective_batch_size or 0) // (self.resolved_grad_accum_steps(world_size) * world_size)

    def resolved_effective_batch_size(self, world_size: int = 1) -> int:
        return self.resolved_micro_batch_size(world_size) * self.resolved_grad_accum_steps(world_size) * world_size

    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_size(self.memory_budget)

    def to_json_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {key: (str(value) if isinstance(value, Path) else value) for key, value in out.items()}


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainConfig))

DEFAULT_VAL_FRACTION = 0.05
"""What --val-fraction holds out when the run evaluates and the flag is not given."""


def held_out_fraction(config: TrainConfig) -> float:
    """The validation fraction a run holds out: --val-fraction when given; else 0.05 when it evaluates on a split of
    --data (--eval-every without --eval-data), and 0 when nothing would ever use the held-out examples."""
    if config.val_fraction is not None:
        return config.val_fraction
    return DEFAULT_VAL_FRACTION if config.eval_every > 0 and config.eval_data is None else 0.0


def section_of(name: str) -> Section:
    """The section of the TrainConfig field ``name``."""
    return {f.name: f.metadata["section"] for f in dataclasses.fields(TrainConfig)}[name]


def command_fields(command: str) -> tuple[str, ...]:
    """The TrainConfig fields (train's flags) that ``command`` takes: every field for train, else the fields of the
    sections that name the command."""
    return tuple(f.name for f in dataclasses.fields(TrainConfig)
                 if command == "train" or command in f.metadata["section"].commands)


MATH_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata["changes_math"])
"""The fields a resume must find unchanged (see :func:`setting`)."""


def hint_types(hint: Any) -> set[Any]:
    """The run-time types a field's type hint admits, for parsing a flag or a TOML value: ``int | None`` ->
    {int, NoneType}; a Literal's choices count as their type (``PrecisionName`` -> {str}), because parsing takes any
    string and ``validate`` then says which choices there are."""
    members = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    found: set[Any] = set()
    for member in members:
        found |= {type(choice) for choice in get_args(member)} if get_origin(member) is Literal else {member}
    return found


def field_help(name: str, cls: type | None = None) -> str:
    """The docstring under a field, used as its --help text (one source of truth for both)."""
    return read_field_docs(cls or TrainConfig).get(name, "")


@functools.cache
def read_field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it) in a dataclass's source.

    Cached: the command line asks for TrainConfig's once per command that shares its flags, and parsing the source
    each time is a visible part of every start-up. Callers must not modify the returned dict."""
    import ast

    docs: dict[str, str] = {}
    body = _class_bodies(sys.modules[cls.__module__].__file__ or "")[cls.__qualname__]
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


@functools.cache
def _class_bodies(module_file: str) -> dict[str, list[Any]]:
    """The statements of each top-level class in a module's source, by name: the module parsed once for all its
    classes (inspect.getsource searched the file again for each class, about 20 ms each at every start-up)."""
    import ast

    tree = ast.parse(Path(module_file).read_text(encoding="utf-8"))
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
               "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5G' (K/M/G are binary, like KiB/MiB/GiB), '3GB' (decimal) or a byte count -> bytes."""
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = cleaned[len(number):]
    if unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} has an unknown unit; use e.g. 512MiB, 2GiB, 1.5G or a number of bytes")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size; use e.g. 512MiB, 2GiB, 1.5G or a number of bytes") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite size")
    return int(value * _SIZE_UNITS[unit])
