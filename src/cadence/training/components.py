"""The objects one training run is made of, built from a prepared configuration: the model (with recompute, compiled
with --compile, then wrapped by DDP or sharded by FSDP2), the optimizer (the run's OptimizerSpec builds it), the LR
schedule and the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.config import TrainConfig
from cadence.distributed.ranks import SINGLE, ProcessGroupCollective, Ranks, wrap_model
from cadence.engine.adaptive_batch import LORA_MAX_BATCH, AdaptiveBatch
from cadence.engine.noise_scale import GradientNoiseScale
from cadence.engine.objective import Objective
from cadence.engine.schedules import BatchScaledLR, build_lr_scheduler
from cadence.engine.step import Engine, LossFn
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models import CompileClock, compile_blocks
from cadence.models.pretrained import load_shards
from cadence.optim.spec import OptimizerSpec
from cadence.training.adaptive_batch import BatchController
from cadence.training.branch_test import BranchTest
from cadence.training.evaluation import validation_batches
from cadence.training.prepare import Prepared
from cadence.training.reference import build_reference, precomputed_reference, starting_copy


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer the configuration names, over ``model``'s trained parameters only (frozen ones, a LoRA run's
    base, get no state): :meth:`cadence.optim.spec.OptimizerSpec.build` (its groups, state precision, offload)."""
    return OptimizerSpec.from_flags(config).build(model)


def build_loss(config: TrainConfig, model: torch.nn.Module | None = None, *, vocab_size: int | None = None
               ) -> LossFn:
    """The next-token loss of ``model`` (as built, before any wrapping), whose vocabulary has ``vocab_size`` tokens:
    the sft objective's way of computing its loss sum, chosen for the model as every command chooses it
    (:meth:`cadence.engine.objective.Objective.for_model`)."""
    return Objective.from_flags(config).for_model(model, vocab_size=vocab_size).loss_fn


@dataclass(kw_only=True)
class Components:
    """The objects one training run is made of."""

    model: torch.nn.Module
    """What the engine runs: the user's model, or DDP around it, or the model sharded in place by FSDP2."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine
    ranks: Ranks = SINGLE
    compile_clock: CompileClock | None = None
    """With --compile: torch.compile's cost since the blocks were compiled (None without --compile)."""
    batch: BatchController | None = None
    """With --effective-batch-size adaptive: the controller that groups windows and grows or shrinks the batch."""


def build_components(prep: Prepared) -> Components:
    """Model (with recompute), optimizer (possibly offloaded), schedule and engine, as the configuration says."""
    config = prep.config
    torch.manual_seed(config.seed)
    # The model prepare built (seeded). A model directory under FSDP2 is still on the meta device (its pending
    # files): sharded as it is, then each rank reads its own rows of the weights.
    pending = prep.built.pending
    model = prep.built.module
    if pending is None:
        model = model.to(prep.device)
    # Chosen (and the model probed: a pending model's 1-layer twin) before recompute, compilation and wrapping change
    # what a forward runs.
    probe, vocab_size = prep.built.probe
    objective = prep.objective.for_model(probe, vocab_size=vocab_size)
    starting = starting_copy(objective, config, model)  # a preference objective's frozen reference, if it needs one
    # --reference-logprobs precomputed: scored now, by the starting weights as they are (no copy), before training.
    precomputed = precomputed_reference(objective, config, starting=model, data=prep.data, device=prep.device,
                                        vocab_size=vocab_size, main=prep.ranks.is_main)
    apply_activation_checkpointing(model, config.activation_checkpointing)
    # After recompute (the checkpointed forward is what compiles), before wrapping (FSDP2's hooks stay eager around
    # each compiled block); parameter names stay the model's.
    compile_clock = None
    if config.compile:  # prepare() has checked that the model has a list of blocks
        compile_blocks(model)
        compile_clock = CompileClock()
    # Wrapped before the optimizer is built: FSDP2 replaces the parameters with their shards.
    model = wrap_model(model, prep.ranks, prep.device, precision=config.precision)
    if pending is not None:
        load_shards(model, pending, prep.device)
    objective = objective.with_reference(precomputed or build_reference(
        objective, config, policy=model, starting=starting, device=prep.device, vocab_size=vocab_size))
    optimizer = prep.optimizer.build(model)
    policy = AdaptiveBatch.from_flags(config, lr_scaling=prep.optimizer.batch_lr_scaling,
                                      maximum=LORA_MAX_BATCH if config.lora_rank else None)
    # Adaptive: the schedule counts windows of the minimum batch (examples), times the batch's LR multiplier.
    scheduler = (BatchScaledLR if policy is not None else build_lr_scheduler)(
        optimizer, schedule=config.lr_schedule, warmup_steps=config.warmup_steps,
        max_steps=config.max_steps, min_lr_ratio=config.min_lr_ratio,
    )
    budget = prep.memory_budget_bytes
    if budget is not None and prep.device.type == "cuda":
        # A real cap: the caching allocator raises torch.OutOfMemoryError past it, exactly like a smaller GPU.
        total = torch.cuda.get_device_properties(prep.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), prep.device)
    collective = ProcessGroupCollective(prep.ranks, prep.device) if prep.ranks.launched else None
    measured = config.noise_scale_ema > 0
    if measured and collective is not None:
        collective.watch_local_gradients(model)  # DDP, one micro-batch per window: this rank's norm before the sync
    engine = Engine(
        model, optimizer, scheduler=scheduler, precision=config.precision, objective=objective,
        max_grad_norm=config.max_grad_norm, offload_activations=config.offload == "activations",
        memory_budget_bytes=budget if prep.device.type == "cpu" else None,
        collective=collective,
        # --micro-batch-size auto retries out-of-memory windows: with several ranks, all must retry together.
        agree_on_out_of_memory=config.auto_micro_batch,
        noise_scale=GradientNoiseScale(ema=config.noise_scale_ema) if measured else None,
    )
    batch = None
    if policy is not None and isinstance(scheduler, BatchScaledLR):
        beta2 = prep.optimizer.betas[1] if "adam_beta2" in prep.optimizer.rule.options else None
        # --batch-branch-test: scored on the evaluation's first validation micro-batches.
        branch = BranchTest(engine, validation_batches(prep)[0]) if policy.branch_windows is not None else None
        batch = BatchController(policy, scheduler=scheduler, optimizer=optimizer, noise_scale=engine.noise_scale,
                                beta2=beta2, budget=config.max_steps, branch=branch)
    return Components(model=model, optimizer=optimizer, scheduler=scheduler, engine=engine, ranks=prep.ranks,
                      compile_clock=compile_clock, batch=batch)
