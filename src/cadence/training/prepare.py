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
from typing import Any

import torch

from cadence.config import TrainConfig, resolve_device, validate
from cadence.config.schema import held_out_fraction
from cadence.data import DataSplits, default_cache_dir
from cadence.data.source import Source, open_source
from cadence.distributed.ranks import SINGLE, Ranks, broadcast_from_main, rank_device
from cadence.engine.cut import Cut
from cadence.engine.objective import Objective
from cadence.engine.precision import cpu_emulation_note
from cadence.engine.windows import Window, epoch_windows
from cadence.errors import UsageError
from cadence.models.family import BuiltModel
from cadence.models.heads import chunking_problem
from cadence.models.hf import save_hf_problem
from cadence.models.spec import ModelSpec
from cadence.optim.spec import OptimizerSpec
from cadence.output_files import timestamped_directory
from cadence.training.reference import reference_problem
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
    model: ModelSpec
    """What --model is (its family, shape, what it supports, its estimator): resolved once per command
    (``prep.model.shape``, ``prep.model.supports``)."""
    built: BuiltModel
    """The model built from ``model`` with the seed's initial weights (a variant builds its own)."""
    source: Source
    """What --data is and how its rows become examples, built once per command (``Source.from_flags``)."""
    cut: Cut
    """How every window of this run is cut into micro-batches: train's cut flags at the resolved micro-batch size
    (``--packing`` packs rows of the sequence length); built once, and again by :meth:`variant` for its settings."""
    ranks: Ranks = SINGLE
    """This process among the run's processes (one, unless torchrun started several)."""
    objective: Objective = Objective()
    """What every step minimises (engine/objective): built once from the flags, its loss sum's way of computing
    chosen for the model when the components are built."""
    optimizer: OptimizerSpec
    """The run's optimizer (its groups, state precision and offload), built once from train's flags."""

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

    def variant(self, **changes: Any) -> Prepared:
        """This run with some of its settings changed (``changes``: TrainConfig fields; a plan's trials change the
        decision and the cut), without validating or loading the data again: the checks this run passed hold for
        the variant, whose settings the caller chose among the valid ones. The model is the same spec built afresh,
        seeded as ``prepare`` built it, so every variant starts from the same weights."""
        if changed := sorted(set(changes) & set(self.model.flags())):
            raise ValueError(f"a variant keeps the run's model; {', '.join(changed)} would change it")
        config = dataclasses.replace(self.config, **changes)
        micro = config.resolved_micro_batch_size(self.world_size)
        accum = config.resolved_grad_accum_steps(self.world_size)
        return dataclasses.replace(
            self, config=config, objective=Objective.from_flags(config), optimizer=OptimizerSpec.from_flags(config),
            micro_batch_size=micro, grad_accum_steps=accum,
            cut=Cut.from_flags(config, micro_batch_size=micro, seq_len=self.seq_len),
            effective_batch_size=micro * accum * self.world_size, memory_budget_bytes=config.memory_budget_bytes(),
            built=self.model.build(seed=config.seed, precision=config.precision,
                                  base_precision=config.lora_base_precision))


def checked_run_directory(config: TrainConfig, *, ranks: Ranks = SINGLE) -> Path:
    """Validate the configuration (every problem at once) and return the run directory it names: --out, or
    ``runs/<time>`` (the same name on every rank). Reads no data and writes nothing."""
    # The default directory is named by the clock: rank 0's name for all, or ranks a second apart would disagree.
    default_out = broadcast_from_main(timestamped_directory(Path("runs"), datetime.now()), ranks)
    validate(config, world_size=ranks.world_size, launched=ranks.launched)
    return config.out or default_out


def prepare(config: TrainConfig, *, ranks: Ranks = SINGLE, out: Path | None = None) -> Prepared:
    """Validate the configuration, resolve and build the model (its :class:`~cadence.models.spec.ModelSpec`, seeded)
    and load the data; raises UsageError naming every problem. Writes nothing into --out. Every rank of a distributed run calls it (all hold the data).

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
    spec, built = prepare_model(config, ranks=ranks)
    context = spec.shape.context_length
    seq_len = config.seq_len or context
    if seq_len > context:
        raise UsageError.single("--seq-len", f"{seq_len} is above {config.model}'s context length of {context}")
    if config.micro_batch_tokens is not None and config.micro_batch_tokens < seq_len:
        raise UsageError.single("--micro-batch-tokens", f"{config.micro_batch_tokens} is below the sequence length "
                                                        f"{seq_len}: the longest example must fit one micro-batch")
    source, data = load_sources(config, seq_len, built.tokenizer, spec.shape.vocab_size, ranks=ranks)
    objective = Objective.from_flags(config)
    if (problem := objective.data_problem(data.train)) is not None:
        raise UsageError.single("--objective", problem)
    if (problem := reference_problem(config, spec.shape.vocab_size)) is not None:
        raise UsageError.single("--reference-model", problem)
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
        memory_budget_bytes=config.memory_budget_bytes(), model=spec, built=built, ranks=ranks, source=source,
        cut=Cut.from_flags(config, micro_batch_size=micro, seq_len=seq_len), objective=objective,
        optimizer=OptimizerSpec.from_flags(config),
    )


def prepare_model(config: TrainConfig, *, ranks: Ranks = SINGLE) -> tuple[ModelSpec, BuiltModel]:
    """The run's model: its spec resolved once, the run flags it cannot take refused before it is built, then built
    with the run's seed (its notes said once), and what its built form decides (loss chunking, how packed rows go)."""
    spec = ModelSpec.from_flags(config)
    sharded = ranks.launched and ranks.strategy == "fsdp"
    if problems := spec.run_problems(config, fsdp=sharded):
        raise UsageError(problems)
    # Under FSDP2 a model directory is built on the meta device and each rank reads its own shard of the weights
    # once the model is sharded (build_components).
    built = spec.build(seed=config.seed, precision=config.precision, base_precision=config.lora_base_precision,
                       shard_later=sharded)
    # With the adapters in place: an optimizer that cannot train the model (Muon on blocks without a trained
    # matrix) is refused before anything is written; what it warns about is said once.
    if (problem := OptimizerSpec.from_flags(config).model_problem(built.module)) is not None:
        raise UsageError.single("--optimizer", problem)
    # Its notes (dropout left on, adapters on a random base, ...) said once, after every refusal: a refused run
    # says its error alone.
    for note in built.notes:
        warnings.warn(note, stacklevel=3)
    if ranks.is_main:
        for note in OptimizerSpec.from_flags(config).notes(pretrained=spec.pretrained, adapters=config.lora_rank > 0):
            warnings.warn(note, stacklevel=3)
    check_chunking(config, *built.probe)
    if config.packing and (config.compile or spec.supports.packing == "dense-mask"):
        why = ("its blocks are compiled (--compile), which keeps transformers' attention" if config.compile else
               f"{config.model} runs {spec.supports.attention} attention, not cadence's per-example attention (an "
               f"sdpa model's)")
        warnings.warn(f"--packing: {why}, so packed rows go through transformers' dense block mask: attention over "
                      f"whole rows, which can make packing slower than --micro-batch-order by-length although it "
                      f"computes less padding", stacklevel=3)
    return spec, built


def check_chunking(config: TrainConfig, model: torch.nn.Module, vocab_size: int) -> None:
    """--loss-chunk-tokens on a family whose logits cadence cannot make chunk by chunk is refused (``model``: what
    the probe runs, ``BuiltModel.probe``)."""
    if config.loss_chunk_tokens > 0 and (problem := chunking_problem(model, vocab_size)) is not None:
        raise UsageError.single("--loss-chunk-tokens", (
            f"{config.model}: {problem}; train it with --loss-chunk-tokens 0 (all logits at once)"))


def load_sources(config: TrainConfig, seq_len: int, tokenizer: Any | None, vocab_size: int, *,
                 ranks: Ranks = SINGLE) -> tuple[Source, DataSplits]:
    """The run's source (built once per command: a .jsonl file's first row tells chat from text) and its data, with
    --eval-data's as the validation split; a store whose ids pass the model's vocabulary is refused."""
    source = Source.from_flags(config)
    if config.eval_data is not None:
        # --eval-data: all of --data trains; the evaluation file, read the same way, is the validation split.
        data = load_run_data(source, dataclasses.replace(config, val_fraction=0.0), seq_len, tokenizer, ranks=ranks)
        evaluated = Source.from_flags(dataclasses.replace(config, data=config.eval_data))
        held = load_run_data(evaluated, dataclasses.replace(config, data=config.eval_data, val_fraction=0.0), seq_len,
                             tokenizer, ranks=ranks)
        data = dataclasses.replace(data, val=held.train, description=f"{data.description}; evaluated on "
                                                                      f"{held.description}")
    else:
        data = load_run_data(source, config, seq_len, tokenizer, ranks=ranks)
    if data.vocab_size is not None and data.vocab_size > vocab_size:
        # An id past the embedding would be an IndexError mid-run (a crafted store, or one made for another model).
        raise UsageError.single("--data", f"{data.store or config.data} holds token ids up to {data.vocab_size - 1}, "
                                          f"beyond {config.model}'s vocabulary of {vocab_size}; build the store for "
                                          f"this model (cadence prepare-data --model ...)")
    return source, data


def load_run_data(source: Source, config: TrainConfig, seq_len: int, tokenizer: Any | None, *,
                  ranks: Ranks = SINGLE) -> DataSplits:
    """The data of ``source`` (the run's, from ``config``) through the token store in --data-cache, read with the
    model's tokenizer (None: bytes). Every rank opens the same store; the first to need it builds it
    while the others wait (cadence.data.cache)."""
    # Only the main rank reports a long build; another rank that happens to build is just as correct, but silent.
    return open_source(source, tokenizer, seq_len=seq_len,
                       val_fraction=held_out_fraction(config), cache_dir=config.data_cache or default_cache_dir(),
                       progress=sys.stderr if ranks.is_main else None, too_long=config.too_long)