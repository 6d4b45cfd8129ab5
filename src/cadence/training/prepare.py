"""Everything checked and loaded before a run writes anything: the configuration, the model's context, the data.

Bad input (configuration AND data files) is found here, before the run directory is created, so it never leaves
anything half-written.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from cadence.config import TrainConfig, resolve_device, validate
from cadence.config.schema import held_out_fraction
from cadence.data import DataSplits, default_cache_dir
from cadence.data.source import Source, open_source
from cadence.distributed.ranks import SINGLE, Ranks, broadcast_from_main, rank_device
from cadence.engine.cut import Cut
from cadence.engine.precision import cpu_emulation_note
from cadence.engine.windows import Window, epoch_windows
from cadence.errors import UsageError
from cadence.models import MODEL_CONFIGS, MODEL_NAMES, model_context_length, repeated_blocks
from cadence.models.heads import chunking_problem
from cadence.models.hf import (
    HFModel,
    build_hf_model,
    packed_attention_supported,
    parse_model_overrides,
    save_hf_problem,
)
from cadence.models.lora import LoraSettings, apply_lora, hold_base_in_bf16, lora_shape, split_targets
from cadence.models.packed_attention import runs_packed_attention
from cadence.models.quantized import already_quantized, quantize_base_nf4
from cadence.optim.spec import OptimizerSpec
from cadence.training.run_dir import exported_before


@dataclass(kw_only=True)
class Prepared:
    """A validated configuration with its data loaded: everything needed before anything is written."""

    config: TrainConfig
    device: torch.device
    seq_len: int
    micro_batch_size: int
    grad_accum_steps: int
    effective_batch_size: int
    world_size: int
    data: DataSplits
    out: Path
    memory_budget_bytes: int | None
    hf: HFModel | None = None
    """The Hugging Face model (built, seeded) when --model is hf:TYPE or a directory."""
    ranks: Ranks = SINGLE
    """This process among the run's processes (one, unless torchrun started several)."""

    @property
    def cut(self) -> Cut:
        """How every window of this run is cut into micro-batches: train's cut flags at the resolved micro-batch size
        (``--packing`` packs rows of the sequence length)."""
        return Cut.from_flags(self.config, micro_batch_size=self.micro_batch_size, seq_len=self.seq_len)

    @property
    def optimizer(self) -> OptimizerSpec:
        """The run's optimizer (its groups, state precision and offload), from train's flags."""
        return OptimizerSpec.from_flags(self.config)

    def windows(self, epoch: int, *, whole: bool = False) -> Iterator[Window]:
        """This rank's windows of ``epoch``, exactly as ``cadence train`` runs them. ``whole``: every window whole
        (all ranks' samples, one micro-batch) on every rank, for a caller that re-cuts each window for the
        configurations it compares (``cadence verify``, the plan's quality check); the samples are the same."""
        if whole:
            return epoch_windows(self.data.train, cut=Cut(micro_batch_size=self.effective_batch_size),
                                 grad_accum_steps=1, seed=self.config.seed, epoch=epoch,
                                 last_window=self.config.last_window)
        return epoch_windows(self.data.train, cut=self.cut, grad_accum_steps=self.grad_accum_steps,
                             seed=self.config.seed, epoch=epoch, world_size=self.ranks.world_size,
                             rank=self.ranks.rank, last_window=self.config.last_window)

    def variant(self, **changes: object) -> Prepared:
        """This run with some of its settings changed (``changes``: TrainConfig fields; a plan's trials change the
        decision and the cut), without validating or loading the data again: the checks this run passed hold for
        the variant, whose settings the caller chose among the valid ones. A Hugging Face model is built afresh,
        seeded as ``prepare`` built it, so every variant starts from the same weights."""
        config = dataclasses.replace(self.config, **changes)  # type: ignore[arg-type]
        micro = config.resolved_micro_batch_size(self.world_size)
        accum = config.resolved_grad_accum_steps(self.world_size)
        return dataclasses.replace(
            self, config=config, micro_batch_size=micro, grad_accum_steps=accum,
            effective_batch_size=micro * accum * self.world_size, memory_budget_bytes=config.memory_budget_bytes(),
            hf=build_run_hf(config, warn=False) if self.hf is not None else None)


def checked_run_directory(config: TrainConfig, *, ranks: Ranks = SINGLE) -> Path:
    """Validate the configuration (every problem at once) and return the run directory it names: --out, or
    ``runs/<time>`` (the same name on every rank). Reads no data and writes nothing."""
    # The default directory is named by the clock: rank 0's name for all, or ranks a second apart would disagree.
    default_out = broadcast_from_main(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"), ranks)
    validate(config, world_size=ranks.world_size, launched=ranks.launched)
    out = config.out or default_out
    if config.out is None and out.exists():
        raise UsageError.single("--out", f"default {out} already exists; give --out")
    return out


def prepare(config: TrainConfig, *, ranks: Ranks = SINGLE, out: Path | None = None) -> Prepared:
    """Validate the configuration, build a Hugging Face model (if asked) and load the data; raises UsageError naming
    every problem. Writes nothing into --out. Every rank of a distributed run calls it (all hold the data).

    ``out``: the run directory that :func:`checked_run_directory` returned for this configuration (train has claimed
    it by then); None: validated here."""
    world_size = ranks.world_size
    if out is None:
        out = checked_run_directory(config, ranks=ranks)
    if config.save_hf is not None and (problem := save_hf_problem(config.save_hf)) is not None:
        # Checked before anything trains (it used to fail after the last step). A resumed run may replace its own
        # earlier export: a segment stopped by a signal exports too.
        if not (config.resume and exported_before(out, config.save_hf)):
            if config.resume:
                # Only the export this run wrote, exactly as it wrote it, is the run's to replace.
                problem = (f"{config.save_hf} is not empty and is not the export this run wrote (files were added or "
                           f"changed there, or it is another folder); nothing was changed: move it, or give a new "
                           f"--save-hf directory")
            raise UsageError.single("--save-hf", problem)
    # Under FSDP2 a model directory is built on the meta device and each rank reads its own shard of the weights
    # once the model is sharded (build_components).
    hf = build_run_hf(config, warn=True, shard_later=ranks.launched and ranks.strategy == "fsdp")
    if ranks.is_main:
        optimizer_notes(config)
    if hf is not None:
        check_chunking(config, *hf.probe)
        if config.compile:  # checked here, before the run directory is created
            try:
                repeated_blocks(hf.model)
            except ValueError as err:
                raise UsageError.single("--compile", f"{err}; --compile compiles a model block by block") from None
    context = hf.context_length if hf else model_context_length(config.model)
    seq_len = config.seq_len or context
    if seq_len > context:
        raise UsageError.single("--seq-len", f"{seq_len} is above {config.model}'s context length of {context}")
    if config.micro_batch_tokens is not None and config.micro_batch_tokens < seq_len:
        raise UsageError.single("--micro-batch-tokens", f"{config.micro_batch_tokens} is below the sequence length "
                                                        f"{seq_len}: the longest example must fit one micro-batch")
    if config.packing and hf is not None and not packed_attention_supported():
        raise UsageError.single("--packing", "this transformers cannot keep packed examples apart (it needs "
                                             "masking_utils.find_packed_sequence_indices, transformers 4.54 or later); "
                                             "use --micro-batch-order by-length instead")
    if config.packing and hf is not None and (config.compile or not runs_packed_attention(hf.model)):
        why = ("its blocks are compiled (--compile), which keeps transformers' attention" if config.compile else
               f"{config.model} runs {hf.model.config._attn_implementation} attention, not cadence's per-example "
               f"attention (an sdpa model's)")
        warnings.warn(f"--packing: {why}, so packed rows go through transformers' dense block mask: attention over "
                      f"whole rows, which can make packing slower than --micro-batch-order by-length although it "
                      f"computes less padding", stacklevel=2)
    if config.eval_data is not None:
        # --eval-data: all of --data trains; the evaluation file, read the same way, is the validation split.
        data = load_run_data(dataclasses.replace(config, val_fraction=0.0), seq_len, hf, ranks=ranks)
        held = load_run_data(dataclasses.replace(config, data=config.eval_data, val_fraction=0.0), seq_len, hf,
                             ranks=ranks)
        data = dataclasses.replace(data, val=held.train, description=f"{data.description}; evaluated on "
                                                                      f"{held.description}")
    else:
        data = load_run_data(config, seq_len, hf, ranks=ranks)
    model_vocab = hf.vocab_size if hf else MODEL_CONFIGS[config.model].vocab_size
    if data.vocab_size is not None and data.vocab_size > model_vocab:
        # An id past the embedding would be an IndexError mid-run (a crafted store, or one made for another model).
        raise UsageError.single("--data", f"{data.store or config.data} holds token ids up to {data.vocab_size - 1}, "
                                          f"beyond {config.model}'s vocabulary of {model_vocab}; build the store for "
                                          f"this model (cadence prepare-data --model ...)")
    micro = config.resolved_micro_batch_size(world_size)
    grad_accum_steps = config.resolved_grad_accum_steps(world_size)
    effective = micro * grad_accum_steps * world_size
    if config.epochs is not None:
        # --epochs: the steps follow from the data (an epoch's windows, a short last one included unless dropped).
        per_epoch = len(data.train) // effective if config.last_window == "drop" else -(-len(data.train) // effective)
        steps = max(1, per_epoch) * config.epochs
        if config.warmup_steps >= steps > 1:
            raise UsageError.single("--warmup-steps", f"{config.warmup_steps} leaves no steps after warmup: "
                                                      f"--epochs {config.epochs} is {steps} steps")
        config = dataclasses.replace(config, max_steps=steps)
    if config.last_window == "drop" and len(data.train) < effective:
        raise UsageError.single(
            "--last-window",
            f"drop leaves nothing to train on: the training split has {len(data.train)} sequences, fewer than one "
            f"window of {effective}; use --last-window step or a smaller --effective-batch-size",
        )
    device = rank_device(resolve_device(config.device), ranks)
    if device.type == "cpu" and ranks.is_main and (note := cpu_emulation_note(config.precision)) is not None:
        warnings.warn(note, stacklevel=2)  # once per run, before its first step: the cost is known up front
    return Prepared(
        config=config, device=device, seq_len=seq_len, micro_batch_size=micro,
        grad_accum_steps=grad_accum_steps, effective_batch_size=effective, world_size=world_size, data=data, out=out,
        memory_budget_bytes=config.memory_budget_bytes(), hf=hf, ranks=ranks,
    )


def optimizer_notes(config: TrainConfig) -> None:
    """What the optimizer warns about, said once per run (Muon fine-tuning a whole pretrained model)."""
    pretrained = config.model not in MODEL_NAMES and not config.model.startswith("hf:")
    for note in OptimizerSpec.from_flags(config).notes(pretrained=pretrained, adapters=config.lora_rank > 0):
        warnings.warn(note, stacklevel=3)


def refuse_unfit_optimizer(config: TrainConfig, model: torch.nn.Module) -> None:
    """An optimizer that cannot train the model is refused before anything is written (Muon on a model whose blocks
    train no matrix)."""
    if (problem := OptimizerSpec.from_flags(config).model_problem(model)) is not None:
        raise UsageError.single("--optimizer", problem)


def check_chunking(config: TrainConfig, model: torch.nn.Module, vocab_size: int) -> None:
    """--loss-chunk-tokens on a family whose logits cadence cannot make chunk by chunk is refused (``model``: what
    the probe runs, ``HFModel.probe``)."""
    if config.loss_chunk_tokens > 0 and (problem := chunking_problem(model, vocab_size)) is not None:
        raise UsageError.single("--loss-chunk-tokens", (
            f"{config.model}: {problem}; train it with --loss-chunk-tokens 0 (all logits at once)"))


def build_run_hf(config: TrainConfig, *, warn: bool, shard_later: bool = False) -> HFModel | None:
    """The run's Hugging Face model (``--model hf:TYPE --model-config K=V``, or a local directory), built with the
    run's seed so every build has the same initial weights; None for a built-in model. ``warn``: say its notes
    (dropout left on, ...) as warnings, once per run. ``shard_later`` (FSDP2): a model directory without LoRA is
    built on the meta device, its weights read by each rank for its own shard after sharding (``HFModel.pending``)."""
    if config.model in MODEL_NAMES:
        return None
    if not config.model.startswith("hf:") and (quantized := already_quantized(Path(config.model) / "config.json")):
        # Its weights are packed codes and scales, not the parameters its architecture lists: reading them as such
        # would be garbage, and quantising or de-quantising them again is not what the user has.
        raise UsageError.single("--model", (
            f"{config.model} holds an already quantised model ({quantized}: its config.json has quantization_config); "
            f"cadence reads full-precision weights only: give the original model directory (with --lora-rank and "
            f"--lora-base-precision nf4 to train LoRA on a 4-bit base)"))
    torch.manual_seed(config.seed)
    hf = build_hf_model(config.model, parse_model_overrides(list(config.model_config or [])),
                        shard_later=shard_later and config.lora_rank == 0)
    for note in hf.notes if warn else ():
        warnings.warn(note, stacklevel=3)
    if config.lora_rank > 0:
        if config.lora_base_precision == "nf4":
            # Before the adapters, so that peft wraps the 4-bit layers with its bitsandbytes LoRA layer; the
            # quantisation draws nothing from the RNG, so lora_A's init is the same as on a full-precision base.
            quantize_base_nf4(hf.model, torch.bfloat16 if config.precision == "bf16" else torch.float32)
        # Right after the build, under the same seeded RNG: lora_A's random init is the same in every build. The base
        # is recorded as an absolute path, so the exported adapter loads with peft from any working directory.
        apply_lora(hf.model, LoraSettings(
            rank=config.lora_rank, alpha=config.lora_alpha, targets=split_targets(config.lora_targets),
            dropout=config.lora_dropout,
            base_name_or_path=None if config.model.startswith("hf:") else str(Path(config.model).resolve())))
        if config.lora_base_precision == "bf16":
            hold_base_in_bf16(hf.model)
        hf.lora = lora_shape(hf.model)
        refuse_unfit_optimizer(config, hf.model)  # with the adapters in place; a refused run says its error alone
        if warn and config.model.startswith("hf:"):
            # Adapters on a base of random weights learn nothing a real model could use (issue 41); said once the
            # adapters are in place, so that a refused --lora-rank is its one line alone.
            warnings.warn(f"--lora-rank on {config.model}: the base is built from its config with random weights, so "
                          f"the adapters are trained on a random model; give a model directory (save_pretrained) for "
                          f"a real fine-tune", stacklevel=3)
    if config.lora_rank == 0:
        refuse_unfit_optimizer(config, hf.model)
    return hf


def load_run_data(config: TrainConfig, seq_len: int, hf: HFModel | None, *, ranks: Ranks = SINGLE) -> DataSplits:
    """The run's data (its :class:`cadence.data.source.Source`) through the token store in --data-cache, read with the
    model's tokenizer (bytes for a built-in model). Every rank opens the same store; the first to need it builds it
    while the others wait (cadence.data.cache)."""
    # Only the main rank reports a long build; another rank that happens to build is just as correct, but silent.
    return open_source(Source.from_flags(config), hf.tokenizer if hf else None, seq_len=seq_len,
                       val_fraction=held_out_fraction(config), cache_dir=config.data_cache or default_cache_dir(),
                       progress=sys.stderr if ranks.is_main else None, too_long=config.too_long)