"""``cadence plan``: which micro-batch, accumulation, recompute, offload and precision under a memory budget?

diagnose (the analytic estimate of the configuration one would naively try: the whole batch at once, fp32)
-> candidates (every micro-batch that divides the effective batch x precision x recompute [x offload on a GPU],
   each with its estimated peak)
-> measured trials (per precision/recompute/offload group, the largest micro-batch the estimate admits; when the
   measurement says it does not fit after all, the next smaller one)
-> decision (the front-runners timed again in alternating rounds (plan/measure.py); the highest median throughput
   whose measured peak is within the budget, candidates tied with it within the rounds' noise going to the lower
   peak: the effective batch is the same for every candidate, so the math is too), all within --time-budget
-> quality check (the decision's window gradient against fp32 accumulation of the same window, and a short loss
   comparison against fp32).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, get_type_hints

import torch

from cadence.config import TrainConfig, validate
from cadence.config.commands import PlanOptions
from cadence.config.schema import FIELD_NAMES, LORA, section_of
from cadence.config.sources import field_kind
from cadence.data import DataSplits
from cadence.data.source import FIELD_DEFAULTS, TRAIN_ON, Source
from cadence.data.text import PackedSequences
from cadence.engine.choices import PRECISIONS
from cadence.engine.cut import CUT_FLAG_DEFAULTS, Cut
from cadence.engine.precision import precision_problem
from cadence.errors import CadenceFailure, Problem, UsageError
from cadence.formatting import format_bytes
from cadence.input_files import read_regular_file
from cadence.memory.choices import CHECKPOINTING_MODES, OFFLOAD_MODES
from cadence.memory.estimate import MemoryEstimate
from cadence.memory.estimate_for import estimate_for
from cadence.memory.optimizer_state import eight_bit_problem
from cadence.models.quantized import bitsandbytes_problem
from cadence.models.spec import ModelSpec
from cadence.output_files import atomic_write_json
from cadence.plan.batch import BatchChoice, choose_effective_batch
from cadence.plan.measure import (
    DISAGREE,
    Deadline,
    Rates,
    agree,
    alternate,
    probe_precisions,
    ranked_with_ties,
    tied,
)
from cadence.plan.report import plan_report
from cadence.plan.trials import (
    DECISION_DEFAULTS,
    DECISION_FIELDS,
    MIN_TRIAL_STEPS,
    TrialResult,
    TrialSetup,
    run_trial,
    timed_round,
)
from cadence.records import Record
from cadence.report.document import write_report
from cadence.training.prepare import Prepared, prepare
from cadence.verify.equivalence import compare_gradients, compare_losses

PLAN_FILE = "plan.json"
ESTIMATE_MARGIN = 1.15
"""Candidates whose estimate is up to 15% over the budget are still worth measuring: the estimate's tolerance."""
CONFIRM_TOP = 4
"""Front-runners timed again in alternating rounds before the decision."""
FRONT_RUNNER_SHARE = 0.2
"""Candidates whose first measurement is at least this share of the best one's are front-runners. A busy machine
slows one trial by several times (measured: 109 against 714 tokens/s for two gpt-tiny candidates with another
process on the cores, in the order opposite to the quiet machine's), so a first measurement only rules out a
candidate that is behind by more than such noise."""
RECOMPUTE_COST = {"none": 1.0, "selective": 1.1, "full": 1.35}
OFFLOAD_COST = {"none": 1.0, "activations": 1.3, "optimizer": 1.5}
CHUNK_COST = 1.15
"""Prior relative cost per token, used only to order which candidates to measure first, never to decide."""
NF4_COST = 1.2
"""Prior relative cost per token of an nf4 base (each matmul dequantises its weight in the forward, the recompute and
the backward), only to order what to measure."""


class PlanFailed(CadenceFailure):
    """No candidate fits the budget (the CLI exits with status 1 and this message)."""

    label = "plan failed"


@dataclass(kw_only=True)
class Candidate:
    id: str
    setup: TrialSetup
    estimate: MemoryEstimate
    status: str = "not measured"
    measured: TrialResult | None = None
    rates: Rates | None = None
    """The throughputs of its alternating rounds (front-runners and cuts), the first trial's included."""
    seconds_per_step: float | None = None
    """Its trial's whole time over its steps: the step with its share of the trial's building (the model, the
    optimizer, the data), which is what the quality check's short runs spend per step too."""
    accumulation_bytes: int | None = None
    """What accumulation adds to its estimated peak (against the same micro-batch as a whole window): the gradients
    held through the later micro-batches, and each new gradient made beside the accumulated one, except the token
    embedding's and (fp32) the head's, which go straight into ``.grad`` (cadence.memory.grad_in_place). None: no
    accumulation."""

    @property
    def group(self) -> tuple[str, str, str, int, str, str]:
        return (self.setup.precision, self.setup.activation_checkpointing, self.setup.offload,
                self.setup.loss_chunk_tokens, self.setup.optimizer_state, self.setup.lora_base_precision)


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def validate_plan(config: TrainConfig, options: PlanOptions, constrained: Collection[str] = ()) -> None:
    """Every problem of a plan request, each naming its flag."""
    problems: list[Problem] = []
    auto = config.effective_batch_size == "auto"
    if config.effective_batch_size is None:
        problems.append(Problem(where="--effective-batch-size", message="is required: the batch the plan keeps fixed, "
                                                                        "or auto (chosen from the gradient noise "
                                                                        "scale)"))
    auto_only = ("noise_scale_windows", "noise_scale_training", "min_effective_batch_size", "max_effective_batch_size",
                 "lr_reference_batch")
    for name in auto_only if not auto else ():
        if getattr(options, name) != getattr(PlanOptions(), name):
            problems.append(Problem(where="--" + name.replace("_", "-"),
                                    message="is for --effective-batch-size auto, which this plan is not"))
    if auto:
        for name in ("noise_scale_windows", "min_effective_batch_size", "max_effective_batch_size"):
            if getattr(options, name) < 1:
                problems.append(Problem(where="--" + name.replace("_", "-"),
                                        message=f"must be at least 1, got {getattr(options, name)}"))
        if options.lr_reference_batch is not None and options.lr_reference_batch < 1:
            problems.append(Problem(where="--lr-reference-batch",
                                    message=f"must be at least 1, got {options.lr_reference_batch}"))
        if options.min_effective_batch_size > options.max_effective_batch_size:
            problems.append(Problem(where="--min-effective-batch-size", message=(
                f"{options.min_effective_batch_size} is above --max-effective-batch-size "
                f"{options.max_effective_batch_size}")))
        if "micro_batch_size" in constrained:
            problems.append(Problem(where="--micro-batch-size", message=(
                "cannot constrain an effective batch that is not chosen yet (auto); leave it out, or give "
                "--effective-batch-size N")))
    if config.memory_budget is None:
        problems.append(Problem(where="--memory-budget", message="is required, e.g. 512MiB or 2GiB"))
    if config.micro_batch_size == "auto":
        problems.append(Problem(where="--micro-batch-size", message="auto is what a plan decides; give a number "
                                                                     "to constrain the plan, or leave it out"))
    if "grad_accum_steps" in constrained:
        problems.append(Problem(where="--grad-accum-steps", message="is what a plan decides from "
                                "--effective-batch-size; give --micro-batch-size to constrain the split"))
    for name, minimum in (("trial_steps", 3), ("max_trials", 0), ("quality_steps", 1), ("rounds", 1)):
        if getattr(options, name) < minimum:
            problems.append(Problem(where="--" + name.replace("_", "-"),
                                    message=f"must be at least {minimum}, got {getattr(options, name)}"))
    if not (options.time_budget > 0 and math.isfinite(options.time_budget)):
        problems.append(Problem(where="--time-budget", message=f"must be a positive number of seconds, got "
                                                                f"{options.time_budget}"))
    try:
        # auto is resolved before anything runs at a batch: the rest is checked as for any batch.
        validate(dataclasses.replace(config, effective_batch_size=None) if auto else config)
    except UsageError as err:
        problems += err.problems
    if problems:
        raise UsageError(problems)


CUT_FLAGS = tuple(CUT_FLAG_DEFAULTS)
"""Train's cut flags beyond the micro-batch size: a plan keeps the cut the user gave, or measures cuts itself."""


def given_cut(config: TrainConfig, constrained: set[str], micro_batch_size: int, seq_len: int) -> Cut:
    """The cut the user gave (--micro-batch-order, --micro-batch-tokens, --packing), kept for every candidate; with
    none given, candidates are measured in drawn order and :func:`_compare_cuts` measures the cuts for the choice."""
    if not constrained & set(CUT_FLAGS):
        return Cut(micro_batch_size=micro_batch_size)
    return Cut.from_flags(config, micro_batch_size=micro_batch_size, seq_len=seq_len)


def build_candidates(config: TrainConfig, constrained: set[str], device: torch.device, seq_len: int,
                     notes: list[str], model: ModelSpec | None = None, *, states: list[str] | None = None,
                     first_number: int = 1, longest: int | None = None,
                     precisions: list[str] | None = None, bases: list[str] | None = None) -> list[Candidate]:
    """Every combination of the levers the user left open, each with its estimated peak; ``states``: the optimizer
    states (default: the given one, else fp32), ``bases``: the --lora-base-precision values (default: the given
    one; only bf16 and fp32 compute an nf4 base), numbered from ``first_number``. ``longest``: the data's longest
    example (positions; default ``seq_len``), the row length of its longest micro-batch, where each is estimated
    (packed rows are ``seq_len`` long whatever the examples). ``precisions``: the ones a first call kept (the matmul
    probe that chooses them takes seconds: it runs once per plan)."""
    model = model or ModelSpec.from_flags(config)
    rows = seq_len if config.packing and "packing" in constrained else min(seq_len, longest or seq_len)
    effective = int(config.effective_batch_size or 0)
    micro_sizes = [int(config.micro_batch_size)] if "micro_batch_size" in constrained else divisors(effective)
    if precisions is not None:
        pass
    elif "precision" in constrained:
        precisions = [config.precision]
    else:
        probe = probe_precisions([name for name in PRECISIONS if precision_problem(name, device) is None], device)
        precisions = probe.kept
        notes += probe.notes
    recomputes = [config.activation_checkpointing] if "activation_checkpointing" in constrained else list(
        CHECKPOINTING_MODES)
    if "offload" in constrained:
        offloads = [config.offload]
    elif device.type == "cuda":
        offloads = list(OFFLOAD_MODES)
    else:
        offloads = ["none"]
        notes.append("offload (activations or optimizer) saves nothing on a CPU-only machine: host memory is the "
                     "device memory. Offload candidates were left out rather than measured as if they helped.")
    chunks = loss_chunk_options(config, constrained, model, rows, int(config.memory_budget_bytes() or 0), device,
                                notes)
    states = states or [config.optimizer_state if "optimizer_state" in constrained else "fp32"]
    combinations = [(state, base, precision) for state in states for base in bases or [config.lora_base_precision]
                    for precision in precisions if base != "nf4" or precision in NF4_PRECISIONS]
    candidates: list[Candidate] = []
    for state, base, precision in combinations:
        for recompute in recomputes:
            for offload in offloads:
                for chunk in chunks:
                    for micro in micro_sizes:
                        setup = TrialSetup(cut=given_cut(config, constrained, micro, seq_len),
                                           grad_accum_steps=effective // micro, precision=precision,
                                           activation_checkpointing=recompute, offload=offload,
                                           loss_chunk_tokens=chunk, optimizer_state=state,
                                           lora_base_precision=base)
                        estimate = estimate_for(
                            model, micro_batch_size=micro, seq_len=rows, precision=precision,
                            checkpointing=recompute, offload=offload, device_type=device.type,
                            grad_accum_steps=setup.grad_accum_steps, loss_chunk_tokens=chunk,
                            optimizer_state=state, lora_base_precision=base, packed=config.packing,
                        )
                        alone = estimate if setup.grad_accum_steps == 1 else estimate_for(
                            model, micro_batch_size=micro, seq_len=rows, precision=precision, checkpointing=recompute,
                            offload=offload, device_type=device.type, grad_accum_steps=1, loss_chunk_tokens=chunk,
                            optimizer_state=state, lora_base_precision=base, packed=config.packing)
                        candidates.append(Candidate(
                            id=f"c{len(candidates) + first_number:02d}", setup=setup, estimate=estimate,
                            accumulation_bytes=(estimate.peak_bytes - alone.peak_bytes
                                                if setup.grad_accum_steps > 1 else None)))
    return candidates


STATE_TOLERANCE = 0.01
"""A lower-precision optimizer state is kept only when, over the quality check's steps, every loss is within 1%
(relative) of the same configuration's with fp32 state. Measured: gpt-small over 200 steps keeps the mean loss of its
last 20 steps within 0.1% (bf16) and 0.1% (8bit) of fp32's (BENCHMARKS.md); a slow test checks the same on gpt-tiny at 1%."""


def lossy_optimizer_states(notes: list[str]) -> list[str]:
    """The lower-precision optimizer states this machine can run: bf16, and 8bit where bitsandbytes is installed."""
    missing = eight_bit_problem()
    if missing is not None:
        notes.append(f"8bit optimizer state was not a candidate: it {missing}")
        return ["bf16"]
    return ["bf16", "8bit"]


BASE_TOLERANCE = 0.01
"""An nf4 base is kept only when, over the quality check's steps, every loss is within 1% (relative) of the same
configuration's with the full-precision base (as QLoRA's paper finds 4-bit NormalFloat matching 16-bit LoRA).
Measured: the 49.9M-parameter llama of BENCHMARKS.md ends 20 steps 0.17% from the fp32 base's loss."""
NF4_PRECISIONS = ("fp32", "bf16")
"""The --precision values an nf4 base computes in (its layers dequantise to that dtype)."""


def nf4_problem(config: TrainConfig, constrained: Collection[str], model: ModelSpec,
                precisions: Collection[str]) -> str | None:
    """Why an nf4 base cannot be this plan's candidate (in words that follow "it"), or None when it can: LoRA on a
    Hugging Face model whose blocks have linear layers, bitsandbytes installed, the base not given, a precision it
    computes in (``precisions``: the ones the plan kept)."""
    if not model.takes("nf4"):
        return (f"holds the frozen base of LoRA adapters on a Hugging Face model, and {config.model} is built in "
                f"(it trains whole)")
    if config.lora_rank <= 0:
        return ("holds the frozen base of LoRA adapters, and this plan trains the whole model (--lora-rank R plans "
                "adapters)")
    if "lora_base_precision" in constrained:
        return f"was not asked for: --lora-base-precision {config.lora_base_precision} was given"
    if (missing := bitsandbytes_problem()) is not None:
        return missing
    if config.strategy == "fsdp":
        return "does not work with --strategy fsdp (bitsandbytes' packed weights are not DTensors)"
    if not model.supports.nf4_linears:
        return f"quantises the nn.Linear layers of the model's blocks, and {config.model}'s blocks have none"
    if not set(precisions) & set(NF4_PRECISIONS):
        return f"computes in bf16 or fp32, and the plan's precisions are {', '.join(precisions)}"
    return None


def lossy_bases(config: TrainConfig, constrained: Collection[str], model: ModelSpec, precisions: Collection[str],
                notes: list[str]) -> list[str]:
    """["nf4"] where a 4-bit NormalFloat base can be a candidate of this plan (:func:`nf4_problem`), else [] with the
    reason in ``notes`` (the report's notes, and a failed plan's message)."""
    problem = nf4_problem(config, constrained, model, precisions)
    if problem is None:
        return ["nf4"]
    notes.append(f"an nf4 base (--lora-base-precision nf4) was not a candidate: it {problem}")
    return []


def lossy_candidates(config: TrainConfig, constrained: set[str], device: torch.device, seq_len: int,
                     model: ModelSpec, *, longest: int, precisions: list[str], first_number: int, notes: list[str],
                     say: Callable[[str], None]) -> list[Candidate]:
    """The candidates of the lossy levers, for a plan where nothing exact fits (measured): lower-precision optimizer
    state (unless --optimizer-state was given) and, under LoRA, an nf4 base with the exact optimizer state (unless
    it cannot be here: :func:`lossy_bases`). Each is kept only after its loss check; numbered from
    ``first_number``. Here because nothing else fits; where a full-precision base fits, an nf4 base is measured
    only for what its freed memory buys (:func:`_compare_nf4_base`): it dequantises every weight in each matmul,
    forward, recompute and backward, so at the same levers it is slower (measured on this CPU, a 49.9M llama: 229
    against 272 tokens/s, 0.84x, BENCHMARKS.md)."""
    more: list[Candidate] = []
    if "optimizer_state" not in constrained:
        lossy = lossy_optimizer_states(notes)
        notes.append(f"no configuration with fp32 optimizer state fits (measured): {' and '.join(lossy)} optimizer "
                     f"state were candidates too, each kept only if its losses stay within {STATE_TOLERANCE:.0%} "
                     f"of fp32 state's over the quality check's steps")
        say(f"nothing with fp32 optimizer state fits: measuring {' and '.join(lossy)} optimizer state (lossy: kept "
            f"only after a loss check)")
        more += build_candidates(config, constrained, device, seq_len, [], model, states=lossy,
                                 first_number=first_number, longest=longest, precisions=precisions)
    bases = lossy_bases(config, constrained, model, precisions, notes)
    if bases:
        base = config.lora_base_precision
        notes.append(f"no configuration with the {base} base fits (measured): an nf4 base (the blocks' linear layers "
                     f"in 4-bit NormalFloat, QLoRA) was a candidate too, kept only if its losses stay within "
                     f"{BASE_TOLERANCE:.0%} of the {base} base's over the quality check's steps")
        say(f"nothing with the {base} base fits: measuring an nf4 base (lossy: kept only after a loss check)")
        more += build_candidates(config, constrained, device, seq_len, [], model, bases=bases,
                                 first_number=first_number + len(more), longest=longest, precisions=precisions)
    return more


LOSSY_LEVERS = ("optimizer_state", "lora_base_precision")
"""The setup's lossy levers, in the order a decision's are checked."""


def _unchecked_lossy_lever(setup: TrialSetup, checks: dict[str, list[dict[str, Any]]]) -> str | None:
    """The first lossy lever ``setup`` pulls whose value has not passed its loss check yet (None: all have)."""
    pulled = {"optimizer_state": setup.optimizer_state != "fp32",
              "lora_base_precision": setup.lora_base_precision == "nf4"}
    for lever in LOSSY_LEVERS:
        value = getattr(setup, lever)
        if pulled[lever] and not any(c.get(lever) == value and c["passed"] for c in checks[lever]):
            return lever
    return None


def _lossy_words(lever: str, check: dict[str, Any]) -> tuple[str, str, str, float]:
    """A loss check in words: its label, the lever's value, its reference, and its tolerance."""
    if lever == "optimizer_state":
        state = check["optimizer_state"]
        return f"optimizer state {state}", f"{state} optimizer state", "fp32 state's", STATE_TOLERANCE
    base = check["lora_base_precision"]
    return f"{base} base", f"the {base} base", f"the {check['reference_base']} base's", BASE_TOLERANCE


LOSS_CHUNKS = (1024, 256, 64)
"""Loss chunk sizes a plan may try, largest (cheapest: fewest recomputed head matmuls) first."""
CHUNK_SAVING = 0.9
"""Loss chunking is a candidate only where the estimate says it cuts the peak of the smallest micro-batch by more
than 10%: with a byte vocabulary the logits are a sliver of the memory, and chunking only costs time."""


def loss_chunk_options(config: TrainConfig, constrained: set[str], model: ModelSpec, seq_len: int, budget: int,
                       device: torch.device, notes: list[str]) -> list[int]:
    """The --loss-chunk-tokens values worth measuring: 0 (all logits at once) and, where the logits matter, the
    largest chunk whose estimate at micro-batch 1 fits the budget (the smallest size when none does)."""
    if "loss_chunk_tokens" in constrained:
        return [config.loss_chunk_tokens]
    def peak(chunk: int) -> int:
        return estimate_for(model, micro_batch_size=1, seq_len=seq_len, precision="fp32", checkpointing="none",
                            device_type=device.type, loss_chunk_tokens=chunk, packed=config.packing,
                            lora_base_precision=config.lora_base_precision).peak_bytes
    whole = peak(0)
    sizes = [size for size in LOSS_CHUNKS if size < seq_len]
    if not sizes or peak(sizes[-1]) > CHUNK_SAVING * whole:
        notes.append(f"loss chunking was not a candidate: with a vocabulary of {model.shape.vocab_size:,} the logits are "
                     f"a small part of the estimated peak, so chunking them would only cost time")
        return [0]
    fitting = [size for size in sizes if peak(size) <= budget]
    return [0, fitting[0] if fitting else sizes[-1]]


def precision_prior(device: torch.device) -> dict[str, float]:
    """CPUs without bf16/fp16 matrix units run fp32 fastest; GPUs with tensor cores run bf16 and fp16 fastest."""
    if device.type == "cuda":
        return {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}
    return {"fp32": 1.0, "bf16": 1.5, "fp16": 2.0}


def choose_trials(candidates: list[Candidate], budget: int, max_trials: int, device: torch.device, *,
                  fitting_known: bool = True) -> list[Candidate]:
    """Per group, the largest micro-batch the estimate admits, groups in prior order (cheapest first); with
    ``fitting_known`` False (nothing measured fits yet), in :func:`fit_first` order, so that the ``max_trials`` taken
    are the ones most likely to fit."""
    if max_trials == 0:
        return list(candidates)
    leaders: dict[tuple[str, str, str, int, str, str], Candidate] = {}
    for candidate in candidates:
        if candidate.estimate.peak_bytes > budget * ESTIMATE_MARGIN:
            continue
        best = leaders.get(candidate.group)
        if best is None or _leads(candidate, best, budget, fitting_known):
            leaders[candidate.group] = candidate
    ordered = sorted(leaders.values(), key=lambda c: measuring_cost(c, device))
    return ordered[:max_trials] if fitting_known else fit_first(ordered, budget, device)[:max_trials]


def measuring_cost(candidate: Candidate, device: torch.device) -> float:
    """The prior relative seconds of measuring ``candidate`` (every candidate computes the same effective batch, so
    a trial's time follows its cost per token): only for ordering, never for deciding."""
    setup = candidate.setup
    return (precision_prior(device)[setup.precision] * RECOMPUTE_COST[setup.activation_checkpointing]
            * OFFLOAD_COST[setup.offload] * (CHUNK_COST if setup.loss_chunk_tokens else 1.0)
            * (NF4_COST if setup.lora_base_precision == "nf4" else 1.0))


def fit_first(queue: list[Candidate], budget: int, device: torch.device) -> list[Candidate]:
    """The order to measure ``queue`` in while nothing measured fits: a search that fits before it ranks.

    Candidates the estimate puts within the budget come first; among them, and among the rest, the most memory
    saved (below the largest estimate of the queue) per relative second of measuring. So the levers that change the
    fit (lower-precision optimizer state, an nf4 base, loss chunks, recompute) are measured before precisions that change only
    the speed (bf16 autocast keeps fp32 weights, gradients and state: its estimate is about fp32's, its saving about
    none), and a plan that runs out of time has measured what could fit."""
    if not queue:
        return []
    top = max(c.estimate.peak_bytes for c in queue)
    def key(candidate: Candidate) -> tuple[bool, float]:
        saved = top - candidate.estimate.peak_bytes
        return (candidate.estimate.peak_bytes > budget, -saved / measuring_cost(candidate, device))
    return sorted(queue, key=key)


def speed_first(queue: list[Candidate], device: torch.device) -> list[Candidate]:
    """The order to measure ``queue`` in once something fits: the cheapest prior cost first (the likely fastest)."""
    return sorted(queue, key=lambda c: measuring_cost(c, device))


def accumulation_diagnosis(candidates: list[Candidate], model: ModelSpec) -> dict[str, Any]:
    """Whether accumulation raises the peak on this model, from the candidates' estimates: within each group of
    levers, a candidate that accumulates estimated above the group's whole batch at once (micro N x accum 1). From the
    second micro-batch on, autograd makes each parameter's new gradient beside the one accumulated so far; for the
    largest tensors (a large vocabulary's embedding and head) the engine avoids that by adding their gradients
    straight into ``.grad`` (cadence.memory.grad_in_place: the embedding in every precision, the head in fp32), so
    what accumulation still adds is the accumulated gradients held through the later micro-batches, and under
    autocast the head's gradient made beside them. Where that outweighs the activations the smaller micro-batch
    saves, "accumulate to save memory" is wrong, and the diagnosis says so."""
    whole = {c.group: c for c in candidates if c.setup.grad_accum_steps == 1}
    worse = [(c, whole[c.group]) for c in candidates if c.accumulation_bytes is not None and c.group in whole
             and c.estimate.peak_bytes > whole[c.group].estimate.peak_bytes]
    largest = model.shape.embedding_bytes
    added = [c.accumulation_bytes for c in candidates if c.accumulation_bytes is not None]
    text = ((f"accumulation adds {format_bytes(min(added))} to {format_bytes(max(added))} to the candidates' estimated "
             f"peaks: the gradients accumulated so far are held through the later micro-batches. The largest tensors' "
             f"new gradients are not made a second time beside them: the token embedding's ({format_bytes(largest)}) "
             f"and, in fp32, the head's are added straight into the accumulated ones (under bf16 or fp16 the head's "
             f"is still made beside them, and on several processes so is the synchronising last micro-batch's). ")
            if added else "no candidate accumulates. ")
    case: dict[str, Any] | None = None
    if worse:
        accumulated, at_once = max(worse, key=lambda pair: pair[0].estimate.peak_bytes - pair[1].estimate.peak_bytes)
        case = {"accumulated": accumulated.id, "whole_batch": at_once.id,
                "accumulated_bytes": accumulated.estimate.peak_bytes, "whole_batch_bytes": at_once.estimate.peak_bytes}
        text += (f"On this model that can outweigh the activations a smaller micro-batch saves: "
                 f"{accumulated.id} ({accumulated.setup.describe()}) is estimated at "
                 f"{format_bytes(accumulated.estimate.peak_bytes)}, {format_bytes(accumulated.estimate.peak_bytes - at_once.estimate.peak_bytes)} "
                 f"above {at_once.id}, the same levers with the whole batch at once "
                 f"({format_bytes(at_once.estimate.peak_bytes)}): accumulation raises the peak there "
                 f"({len(worse)} candidates in all), and loss chunks, recompute or a lower-precision optimizer state "
                 f"are what cut it.")
    elif added:
        text += "Every accumulating candidate is estimated below its whole batch at once: accumulation lowers the peak."
    return {"raises_peak": bool(worse), "case": case, "largest_tensor_bytes": largest, "explanation": text,
            "avoided": "the token embedding's and (fp32) the head's second gradient: added straight into .grad"}


def longest_example(data: DataSplits, seq_len: int) -> int:
    """Positions in the training split's longest example (``seq_len`` for text cut into full sequences)."""
    train = data.train
    if isinstance(train, PackedSequences):
        return seq_len
    return min(seq_len, int(getattr(train, "max_length", seq_len)) or seq_len)


def _leads(candidate: Candidate, best: Candidate, budget: int, fitting_known: bool) -> bool:
    """Whether ``candidate`` replaces ``best`` as its group's trial: the larger micro-batch (the faster, likely);
    while nothing measured fits, the largest the estimate puts within the budget itself (not only within its
    margin), or, where none is, the smallest."""
    larger = candidate.setup.micro_batch_size > best.setup.micro_batch_size
    if fitting_known:
        return larger
    within, best_within = candidate.estimate.peak_bytes <= budget, best.estimate.peak_bytes <= budget
    if within != best_within:
        return within
    return larger if within else not larger


def epoch_tokens(data: DataSplits) -> int:
    train = data.train
    if isinstance(train, PackedSequences):
        return len(train) * train.max_length
    return sum(len(example.input_ids) for example in train)


def make_plan(config: TrainConfig, options: PlanOptions, *, constrained: set[str], stream: IO[str] | None = None,
              log: Callable[[str], None] | None = None, started: float | None = None) -> dict[str, Any]:
    """Diagnose, measure, decide, check; write OUT/plan.json (and its report) and return the plan. ``started``: the
    ``time.perf_counter()`` the command started at (its start-up counts in --time-budget); default now."""
    stream = stream or sys.stderr
    say = log or (lambda text: print(text, file=stream, flush=True))
    if "micro_batch_size" not in constrained:  # the plan decides it; the default 8 must not constrain validation
        config = dataclasses.replace(config, micro_batch_size=1, grad_accum_steps=None)
    validate_plan(config, options, constrained)
    started = time.perf_counter() if started is None else started
    out = config.out or Path("plans") / datetime.now().strftime("%Y%m%d-%H%M%S")
    # The run the plan is about, assembled as train assembles it (the model, its checks, the data through the token
    # store); every trial is a variant of it.
    auto = config.effective_batch_size == "auto"
    prep = prepare(dataclasses.replace(config, val_fraction=0.0, **({"effective_batch_size": 1} if auto else {})),
                   out=out)
    device, seq_len, data = prep.device, prep.seq_len, prep.data
    model = prep.spec
    budget = int(config.memory_budget_bytes() or 0)
    if config.out is None and out.exists():
        raise UsageError.single("--out", f"default {out} already exists; give --out")
    notes: list[str] = []
    batch_choice: BatchChoice | None = None
    # One deadline from the plan's start: the noise-scale measurement spends part of it, the trials the rest.
    deadline = Deadline(options.time_budget, started=started)
    if auto:
        with deadline.phase("noise scale"):
            batch_choice = choose_effective_batch(
                prep, model, budget=budget, windows=options.noise_scale_windows,
                bounds=(options.min_effective_batch_size, options.max_effective_batch_size),
                lr_reference=options.lr_reference_batch, constrained=constrained, say=say, deadline=deadline,
                training=options.noise_scale_training)
        config = dataclasses.replace(config, effective_batch_size=batch_choice.effective_batch_size)
        prep = prep.variant(effective_batch_size=batch_choice.effective_batch_size)
        notes.append(f"effective batch {batch_choice.effective_batch_size}: {batch_choice.reason}. "
                     f"{batch_choice.lr_advice}")
        if batch_choice.time_note is not None:
            notes.append(batch_choice.time_note)
    effective = int(config.effective_batch_size or 0)

    longest = longest_example(data, seq_len)
    baseline = estimate_for(model, micro_batch_size=effective, seq_len=longest, precision="fp32",
                            checkpointing="none", device_type=device.type, packed=config.packing,
                            lora_base_precision=config.lora_base_precision)
    say(f"plan: {config.model}, effective batch {effective} x {seq_len} tokens, budget {format_bytes(budget)} "
        f"on {device}\ndiagnosis: the whole batch at once in fp32 needs about {format_bytes(baseline.peak_bytes)}: "
        f"{baseline.dominant}")
    if longest < seq_len:
        notes.append(f"the data's longest example has {longest} positions (--seq-len {seq_len}): every candidate is "
                     f"estimated at micro-batches of rows that long, and measured on the longest window the data can "
                     f"produce")
    states = ([config.optimizer_state] if "optimizer_state" in constrained else ["fp32"])
    with deadline.phase("precision probe"):  # and the candidates' estimates
        candidates = build_candidates(config, constrained, device, seq_len, notes, model, states=states,
                                      longest=longest)
    kept = sorted({c.setup.precision for c in candidates}, key=PRECISIONS.index)
    accumulation = accumulation_diagnosis(candidates, model)
    if accumulation["raises_peak"]:
        say(f"diagnosis: {accumulation['explanation']}")
    measured: list[Candidate] = []
    with deadline.phase("trials"):
        _run_trials(candidates, candidates, measured, prep, budget, options, deadline, say, notes,
                    defer_over_estimate="optimizer_state" not in constrained
                    or nf4_problem(config, constrained, model, kept) is None)
    feasible = [c for c in measured if _feasible(c)]
    if not feasible:
        # Only where no exact configuration fits (measured, not estimated: the estimate may be optimistic) does the
        # plan reach for the lossy levers, lower-precision optimizer state and an nf4 base; the loss checks below
        # then gate them.
        more = lossy_candidates(config, constrained, device, seq_len, model, longest=longest, precisions=kept,
                                first_number=len(candidates) + 1, notes=notes, say=say)
        candidates += more
        with deadline.phase("trials"):
            _run_trials(more, candidates, measured, prep, budget, options, deadline, say, notes)
        feasible = [c for c in measured if _feasible(c)]
    if not feasible:
        smallest = min((c for c in measured if c.measured and c.measured.peak_bytes), default=None,
                       key=lambda c: c.measured.peak_bytes)  # type: ignore[union-attr]
        detail = (f"; the smallest measured peak was {format_bytes(smallest.measured.peak_bytes)} "  # type: ignore
                  f"({smallest.setup.describe()})") if smallest else ""
        why_not_nf4 = nf4_problem(config, constrained, model, kept)
        raise PlanFailed(f"no configuration fits in {format_bytes(budget)}{detail}."
                         + untried_levers(candidates, budget, deadline, constrained)
                         + (f" An nf4 base (--lora-base-precision nf4) was not a candidate: it {why_not_nf4}."
                            if why_not_nf4 is not None else ""))
    with deadline.phase("rounds"):
        chosen = _decide(feasible, prep, options, deadline, say, notes)
    if nf4_problem(config, constrained, model, kept) is None and not any(
            c.setup.lora_base_precision == "nf4" for c in candidates):
        # A full-precision base fits: an nf4 base is worth a measurement only where the memory it frees buys the
        # choice a larger micro-batch or less recompute, and it replaces the choice only when clearly faster.
        with deadline.phase("nf4 comparison"):
            chosen, contenders = _compare_nf4_base(prep, chosen, config, constrained, model, budget, options, say,
                                                   notes, deadline, first_number=len(candidates) + 1, longest=longest)
        candidates += contenders
        feasible += [c for c in contenders if _feasible(c)]
    lossy_checks: dict[str, list[dict[str, Any]]] = {"optimizer_state": [], "lora_base_precision": []}
    while (lever := _unchecked_lossy_lever(chosen.setup, lossy_checks)) is not None:
        # A lossy lever is kept only when its losses stay near the exact configuration's. The split, recompute,
        # offload and chunking are exact levers, so the check of one lossy value holds for every candidate with it.
        with deadline.phase("lossy-lever checks"):
            check = (_state_check if lever == "optimizer_state" else _base_check)(prep, chosen, budget, options)
        lossy_checks[lever].append(check)
        label, value, reference, tolerance = _lossy_words(lever, check)
        say(f"{label}: losses within {check['max_relative_difference']:.2%} of {reference} over {check['steps']} "
            f"steps ({'pass' if check['passed'] else 'FAIL'}, tolerance {tolerance:.0%})")
        if check["passed"]:
            continue
        refused = getattr(chosen.setup, lever)
        for candidate in feasible:
            if getattr(candidate.setup, lever) == refused:
                candidate.status = f"refused: {value}'s losses left the tolerance against {reference}"
        feasible = [c for c in feasible if getattr(c.setup, lever) != refused]
        notes.append(f"{value} was refused: over {check['steps']} steps its losses differed up to "
                     f"{check['max_relative_difference']:.2%} from {reference} ({check.get('error') or 'tolerance'} "
                     f"{tolerance:.0%})")
        if not feasible:
            what = ("an optimizer state whose losses stay within {:.0%} of fp32 state's" if lever == "optimizer_state"
                    else "a base whose losses stay within {:.0%} of the full-precision base's").format(tolerance)
            anyway = ("give --optimizer-state to train with one anyway" if lever == "optimizer_state"
                      else "give --lora-base-precision nf4 to train with it anyway")
            raise PlanFailed(f"no configuration fits in {format_bytes(budget)} with {what}. Try a larger "
                             f"--memory-budget, a smaller --seq-len or a smaller model (or {anyway}).")
        with deadline.phase("rounds"):
            chosen = _decide(feasible, prep, options, deadline, say, notes)
    with deadline.phase("cuts"):
        chosen, cuts = (_compare_cuts(prep, chosen, budget, options, say, model, notes, deadline)
                        if not constrained & set(CUT_FLAGS) else (chosen, []))
    say(f"choice: {chosen.id} {chosen.setup.describe()} at {chosen.measured.tokens_per_s:,.0f} tokens/s, "  # type: ignore
        f"peak {format_bytes(chosen.measured.peak_bytes)}")  # type: ignore[union-attr]
    with deadline.phase("quality check"):
        quality = _quality_check(prep, chosen, budget, options, model)
    quality["optimizer_state"] = lossy_checks["optimizer_state"]
    quality["lora_base_precision"] = lossy_checks["lora_base_precision"]
    say(f"quality: gradient relative error {quality['gradient']['relative_error']:.2e} "
        f"({'pass' if quality['gradient']['passed'] else 'FAIL'}), loss within "
        f"{quality['loss']['max_relative_difference']:.2%} of fp32 ({'pass' if quality['loss']['passed'] else 'FAIL'})")
    duration = time.perf_counter() - started
    over = time_over_budget(deadline, duration)
    if over is not None:
        notes.append(over)
        say(f"time: {over}")
    plan = _plan_document(config, data, device, seq_len, budget, baseline, candidates, chosen, quality, notes,
                          epoch_tokens(data), duration, model, options.time_budget)
    plan["time_spent_s"] = {name: round(seconds, 3) for name, seconds in deadline.spent.items() if seconds > 0}
    plan["cuts"] = cuts
    plan["diagnosis"]["accumulation"] = accumulation
    plan["effective_batch"] = (batch_choice.as_dict() if batch_choice is not None
                               else {"given": effective, "chosen": effective})
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / PLAN_FILE, plan)
    _write_report(out, say)
    say(f"plan written to {out / PLAN_FILE}; train with: cadence train --plan {out / PLAN_FILE}")
    return plan


TIME_OVER = 1.1
"""A plan that takes longer than this share of its --time-budget says where the time went."""


def time_over_budget(deadline: Deadline, duration: float) -> str | None:
    """The note of a plan that ran past its --time-budget (by more than :data:`TIME_OVER`): where its time went. A
    plan always measures one candidate and checks the one it chooses, so the start-up, the first trial and the quality
    check are spent whatever the budget, and on a busy machine each takes several times its quiet time."""
    if duration <= deadline.seconds * TIME_OVER:
        return None
    spent = sorted(((name, seconds) for name, seconds in deadline.spent.items() if seconds >= 0.5),
                   key=lambda item: -item[1])
    return (f"the plan took {duration:.0f} s against its --time-budget of {deadline.seconds:g} s: "
            + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in spent)
            + ". The start-up, the first trial and the quality check run whatever the budget (a plan measures at least "
              "one candidate and checks the one it chooses); on a busy machine each takes several times its quiet "
              "time: a larger --time-budget, or planning on a quieter machine, keeps the plan within it")


def _run_trials(pool: list[Candidate], candidates: list[Candidate], measured: list[Candidate], prep: Prepared,
                budget: int, options: PlanOptions, deadline: Deadline, say: Callable[[str], None],
                notes: list[str], *, defer_over_estimate: bool = False) -> None:
    """Measure the candidates of ``pool`` that choose_trials picks (adding each to ``measured``), stepping down to
    the next smaller micro-batch of a group whose measured peak is over the budget, until the trials or the time run
    out. ``defer_over_estimate``: while nothing fits, stop at the first candidate whose estimate is over the budget
    (the lossy levers, whose estimates fit, come before it)."""
    for candidate in pool:
        if candidate.estimate.peak_bytes > budget * ESTIMATE_MARGIN:
            candidate.status = "over budget (estimate)"
    queue = choose_trials(pool, budget, options.max_trials, prep.device,
                          fitting_known=any(_feasible(c) for c in measured))
    trials_left = len(pool) if options.max_trials == 0 else options.max_trials
    while queue and trials_left > 0:
        fits = any(_feasible(c) for c in measured)
        # Nothing fits yet: measure what can fit first; something fits: what can be faster. Either way the
        # --time-budget bounds the search (with nothing that fits, no quality check is left to keep time for), once
        # one trial has run: a plan always measures the candidate most likely to fit, so it has a decision to give.
        queue = speed_first(queue, prep.device) if fits else fit_first(queue, budget, prep.device)
        if measured and deadline.passed(_quality_reserve(measured, options) if fits else 0.0):
            _out_of_time(queue, deadline, notes, "trials")
            break
        if defer_over_estimate and not fits and queue[0].estimate.peak_bytes > budget:
            for candidate in queue:
                candidate.status = "not measured: its estimate is over the budget (lower-precision state first)"
            break
        candidate = queue.pop(0)
        trials_left -= 1
        _measure(candidate, prep, budget, options, say)
        measured.append(candidate)
        if candidate.measured.fits and not fits:  # type: ignore[union-attr]
            # The first fit: from here the search ranks, so each group's largest micro-batch within the estimate's
            # margin (passed over while fitting came first) is worth measuring too.
            queue += [c for c in choose_trials(pool, budget, len(pool), prep.device)
                      if c.measured is None and c not in queue]
        if options.max_trials and not candidate.measured.fits:  # type: ignore[union-attr]
            smaller = _next_smaller(candidates, candidate)  # the estimate was optimistic: step down in this group
            if smaller is not None and smaller.measured is None and smaller not in queue:
                queue.insert(0, smaller)


UNTRIED_SHOWN = 4
"""Untried lever combinations a failed plan lists (the lowest estimated peaks)."""


def untried_levers(candidates: list[Candidate], budget: int, deadline: Deadline, constrained: set[str]) -> str:
    """What a plan that found nothing to fit did not measure: each untried combination of levers at its smallest
    estimated peak (lowest first), and the one most likely to fit with the flags that plan it alone; or, when every
    combination was measured, what else to try."""
    groups: dict[tuple[str, str, str, int, str, str], Candidate] = {}
    for candidate in candidates:
        if candidate.measured is not None:
            continue
        best = groups.get(candidate.group)
        if best is None or candidate.estimate.peak_bytes < best.estimate.peak_bytes:
            groups[candidate.group] = candidate
    tried = {c.group for c in candidates if c.measured is not None}
    untried = sorted((c for group, c in groups.items() if group not in tried), key=lambda c: c.estimate.peak_bytes)
    if not untried:
        return " Every combination of levers was measured: try a larger --memory-budget, a smaller --seq-len or a " \
               "smaller model."
    out_of_time = deadline.passed()
    listed = "; ".join(f"{c.id} {_lever_words(c)}: estimated {format_bytes(c.estimate.peak_bytes)}"
                       for c in untried[:UNTRIED_SHOWN])
    more = f" (and {len(untried) - UNTRIED_SHOWN} more)" if len(untried) > UNTRIED_SHOWN else ""
    head = f"The --time-budget of {deadline.seconds:g} s ran out before these were measured" if out_of_time \
        else "Not measured"
    text = f" {head}: {listed}{more}."
    likely = untried[0]
    verdict = ("within the budget" if likely.estimate.peak_bytes <= budget
               else f"{likely.estimate.peak_bytes / budget:.2f}x the budget")
    flags = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in _lever_flags(likely).items()
                     if name not in constrained)
    return text + (f" Most likely to fit: {likely.id} ({_lever_words(likely)}, estimated "
            f"{format_bytes(likely.estimate.peak_bytes)}, {verdict}); plan it with "
            + (f"{flags}, or " if flags else "") + "a larger --time-budget.")


def _lever_flags(candidate: Candidate) -> dict[str, Any]:
    """The levers of ``candidate`` that are pulled (not at their defaults), as plan flags."""
    setup = candidate.setup
    pulled = {"optimizer_state": setup.optimizer_state, "lora_base_precision": setup.lora_base_precision,
              "loss_chunk_tokens": setup.loss_chunk_tokens, "activation_checkpointing": setup.activation_checkpointing,
              "offload": setup.offload, "precision": setup.precision}
    defaults = {"optimizer_state": "fp32", "lora_base_precision": "fp32", "loss_chunk_tokens": 0,
                "activation_checkpointing": "none", "offload": "none", "precision": "fp32"}
    return {name: value for name, value in pulled.items() if value != defaults[name]}


def _lever_words(candidate: Candidate) -> str:
    setup = candidate.setup
    return (f"micro {setup.micro_batch_size} x accum {setup.grad_accum_steps}, {setup.precision}, recompute "
            f"{setup.activation_checkpointing}" + (f", offload {setup.offload}" if setup.offload != "none" else "")
            + setup.lever_text())


def _feasible(candidate: Candidate) -> bool:
    return bool(candidate.measured and candidate.measured.fits and candidate.measured.tokens_per_s)


REPORT_STEPS = 4
"""The report's plots and pages, in trial steps of time (about 2 s on a 2-core CPU, where a gpt-tiny step with its
share of a trial's building is 0.5 s), kept beside the quality check."""


def _quality_reserve(measured: list[Candidate], options: PlanOptions) -> float:
    """Seconds to keep for the quality check (its two short runs and the gradient comparison) and the report, at the
    slowest feasible candidate's time per trial step, its trial's building included. The step time alone left the
    building out: under a load of 9 on 2 cores the quality check took 2.5x what it predicted (45 s against 18)."""
    step = max((c.seconds_per_step or c.measured.step_time_s or 0.0  # type: ignore[union-attr]
                for c in measured if _feasible(c)), default=0.0)
    # The quality check's runs: the choice and, unless it computes in fp32, its fp32 reference; a lossy lever's
    # loss check runs two more.
    runs = 1 + int(any(_feasible(c) and c.setup.precision != "fp32" for c in measured))
    runs += 2 if any(_feasible(c) and not c.setup.exact for c in measured) else 0
    return (runs * (max(3, options.quality_steps) + 1) + 2 + REPORT_STEPS) * step


def _out_of_time(left: list[Candidate], deadline: Deadline, notes: list[str], what: str) -> None:
    for candidate in left:
        candidate.status = "not measured: --time-budget spent"
    if left:
        notes.append(f"the --time-budget of {deadline.seconds:g} s was spent after {deadline.elapsed:.0f} s: "
                     f"{len(left)} {what if len(left) > 1 else what.rstrip('s')} "
                     f"{'were' if len(left) > 1 else 'was'} not measured ({', '.join(c.id for c in left)}); a larger "
                     f"--time-budget measures them")


def _simplicity(candidate: Candidate) -> tuple[int, ...]:
    """Smaller is simpler: fewer levers pulled (an nf4 base, recompute, offload, loss chunks, reduced precision), then
    less accumulation."""
    setup = candidate.setup
    return (int(setup.lora_base_precision == "nf4"), CHECKPOINTING_MODES.index(setup.activation_checkpointing),
            OFFLOAD_MODES.index(setup.offload),
            int(setup.loss_chunk_tokens > 0), ("fp32", "bf16", "fp16").index(setup.precision),
            int(setup.cut.by_length), setup.grad_accum_steps)


def _decide(feasible: list[Candidate], prep: Prepared, options: PlanOptions, deadline: Deadline,
            say: Callable[[str], None], notes: list[str]) -> Candidate:
    """The feasible candidate to train with. The front-runners (first measurements within FRONT_RUNNER_SHARE of the
    best, at most CONFIRM_TOP) are timed again in alternating rounds; the fastest median wins, and candidates tied
    with it within their noise go to the lowest measured peak, then the simplest configuration."""
    best = max(c.measured.tokens_per_s for c in feasible)  # type: ignore[union-attr]
    front = sorted((c for c in feasible if c.measured.tokens_per_s >= FRONT_RUNNER_SHARE * best),  # type: ignore
                   key=lambda c: -c.measured.tokens_per_s)[:CONFIRM_TOP]  # type: ignore[union-attr]
    for candidate in front:
        candidate.rates = Rates(rounds=[candidate.measured.tokens_per_s])  # type: ignore[union-attr]
    if len(front) > 1 and options.max_trials:
        say(f"front-runners {', '.join(c.id for c in front)}: timing them again in up to {options.rounds} "
            f"alternating rounds")
        _alternate(front, prep, options, deadline, say, notes)
    return _ranked(front, notes, "front-runners")


def _alternate(items: list[Candidate], prep: Prepared, options: PlanOptions, deadline: Deadline,
               say: Callable[[str], None], notes: list[str]) -> None:
    def time_one(candidate: Candidate) -> float | None:
        rate = timed_round(prep, candidate.setup, steps=max(1, options.trial_steps - 2))
        if rate is not None:
            candidate.rates.rounds.append(rate)  # type: ignore[union-attr]
        say(f"  round {len(candidate.rates.rounds) - 1} {candidate.id}: "  # type: ignore[union-attr]
            + (f"{rate:,.0f} tokens/s" if rate else "out of memory"))
        return rate

    done = alternate(items, options.rounds, time_one,
                     should_stop=lambda: deadline.passed(_quality_reserve(items, options)))
    noisy = [c for c in items if c.rates is not None and not agree(c.rates)]
    if noisy and done == options.rounds and options.rounds > 1:
        # The rounds disagree (a loaded machine): time another set, so the medians rest on more rounds.
        say(f"  the rounds of {', '.join(c.id for c in noisy)} disagree by more than {DISAGREE:.0%} of their median: "
            f"timing {options.rounds} more rounds")
        extra = alternate(items, options.rounds, time_one,
                          should_stop=lambda: deadline.passed(_quality_reserve(items, options)))
        done += extra
        notes.append(f"the rounds of {', '.join(c.id for c in noisy)} disagreed by more than {DISAGREE:.0%} of their "
                     f"median (a busy machine): {extra} more alternating rounds were timed")
    if done < options.rounds:
        notes.append(f"the --time-budget of {deadline.seconds:g} s allowed {done} of {options.rounds} alternating "
                     f"rounds of {', '.join(c.id for c in items)}")


def _ranked(items: list[Candidate], notes: list[str], what: str) -> Candidate:
    """The winner of ``items`` by their rounds' medians, ties (within the noise band) said in the notes."""
    winner, tie = ranked_with_ties(items, rates=lambda c: c.rates or Rates(), simplicity=_simplicity,
                                   peak=lambda c: int(c.measured.peak_bytes or 0))  # type: ignore[union-attr]
    for candidate in items:  # the median of the rounds is the candidate's throughput from here on
        rates = candidate.rates
        if rates is not None and rates.median is not None and candidate.measured is not None:
            candidate.measured = dataclasses.replace(candidate.measured, tokens_per_s=rates.median)
    leader = max(items, key=lambda c: (c.rates or Rates()).median or 0.0)
    if leader.rates is not None and not agree(leader.rates):
        notes.append(f"{what}: the rounds of {leader.id} still disagree ({min(leader.rates.rounds):,.0f} to "
                     f"{max(leader.rates.rounds):,.0f} tokens/s): its median does not rank it, every candidate whose "
                     f"rounds overlap its rounds is in the tie, and the predicted throughput is uncertain by that much")
    if len(tie) > 1:
        figures = "; ".join(f"{c.id} {c.rates.median:,.0f} +/- {c.rates.band:,.0f} tokens/s, peak "  # type: ignore
                            f"{format_bytes(c.measured.peak_bytes)}" for c in tie)  # type: ignore[union-attr]
        notes.append(f"{what} {', '.join(c.id for c in tie)} were tied within their measured noise ({figures}, "
                     f"over {len(winner.rates.rounds)} rounds): {winner.id} was chosen for its lower peak memory, "  # type: ignore
                     f"then the simpler configuration")
    return winner


CUT_GAIN = 1.03
"""A cut by length replaces drawn order only when its measured throughput is more than 3% higher: the same
gradient either way, so only a clear measured gain is worth a different configuration."""
VARIABLE_LENGTHS = 0.95
"""Below this share of real tokens among the computed positions (drawn order), the data is variable-length enough
for cuts by length to be measured."""


NF4_GAIN = 1.1
"""An nf4 base replaces a full-precision base that fits only when its median throughput is more than 10% higher and
outside the rounds' noise: it is lossy (4-bit rounding, kept only after its loss check) and dequantises every weight
in each matmul, so it can be faster only by what its freed memory buys, and only a clear measured gain is worth it."""
NF4_CONTENDERS = 2
"""nf4-base configurations a plan measures against a full-precision choice (the ones its freed memory buys most)."""


def nf4_buys_speed(nf4: TrialSetup, chosen: TrialSetup) -> bool:
    """Whether ``nf4`` (an nf4-base setup) pulls no speed lever harder than ``chosen`` and eases at least one: a larger
    micro-batch, less recompute, no offload or no loss chunks where the choice needs them. At the choice's own levers
    an nf4 base is only slower (it dequantises each weight in every matmul), so only these can be faster."""
    levers = [(nf4.micro_batch_size, chosen.micro_batch_size, True),
              (RECOMPUTE_COST[nf4.activation_checkpointing], RECOMPUTE_COST[chosen.activation_checkpointing], False),
              (OFFLOAD_COST[nf4.offload], OFFLOAD_COST[chosen.offload], False),
              (int(nf4.loss_chunk_tokens > 0), int(chosen.loss_chunk_tokens > 0), False)]
    no_worse = all(mine >= theirs if larger_is_faster else mine <= theirs for mine, theirs, larger_is_faster in levers)
    same_cut = dataclasses.replace(nf4.cut, micro_batch_size=chosen.cut.micro_batch_size) == chosen.cut
    return no_worse and any(mine != theirs for mine, theirs, _ in levers) and same_cut


def nf4_clearly_faster(nf4: Rates, chosen: Rates) -> bool:
    """The rule that lets an nf4 base replace a full-precision choice: its median above NF4_GAIN x the choice's and
    the two not tied within their rounds' noise."""
    if nf4.median is None or chosen.median is None:
        return False
    return nf4.median > NF4_GAIN * chosen.median and not tied(nf4, chosen)


def _compare_nf4_base(prep: Prepared, chosen: Candidate, config: TrainConfig, constrained: set[str],
                      model: ModelSpec, budget: int, options: PlanOptions, say: Callable[[str], None],
                      notes: list[str], deadline: Deadline, *, first_number: int,
                      longest: int) -> tuple[Candidate, list[Candidate]]:
    """Under LoRA with a full-precision base that fits: the nf4-base configurations whose estimates fit the budget
    and whose freed memory buys the choice a speed lever (:func:`nf4_buys_speed`), at most NF4_CONTENDERS, measured
    and timed in alternating rounds with the choice. The fastest replaces it only when :func:`nf4_clearly_faster`
    (the loss check of the base follows in make_plan). Returns the choice and the nf4 candidates measured."""
    setup = chosen.setup
    if setup.precision not in NF4_PRECISIONS:
        return chosen, []
    pool = build_candidates(config, constrained, prep.device, prep.seq_len, [], model,
                            states=[setup.optimizer_state], bases=["nf4"], precisions=[setup.precision],
                            longest=longest)
    buying = sorted((c for c in pool if c.estimate.peak_bytes <= budget and nf4_buys_speed(c.setup, setup)),
                    key=lambda c: (measuring_cost(c, prep.device), -c.setup.micro_batch_size))[:NF4_CONTENDERS]
    if not buying:
        notes.append("an nf4 base was not measured: within the budget the memory it frees buys the choice no larger "
                     "micro-batch and no cheaper recompute, offload or loss chunking, and at the choice's own levers "
                     "an nf4 base is only slower (it dequantises every weight in each matmul)")
        return chosen, []
    contenders: list[Candidate] = []
    say(f"nf4 base: the memory it frees buys {', '.join(c.setup.describe() for c in buying)}; measuring against the "
        f"choice (kept only if more than {NF4_GAIN - 1:.0%} faster and its losses stay within {BASE_TOLERANCE:.0%})")
    for number, candidate in enumerate(buying, start=first_number):
        if deadline.passed(_quality_reserve([chosen, *contenders], options) * 2):  # its loss check's runs too
            notes.append(f"the --time-budget of {deadline.seconds:g} s was spent before an nf4 base "
                         f"({candidate.setup.describe()}) was measured")
            break
        candidate.id = f"c{number:02d}"
        _measure(candidate, prep, budget, options, say)
        contenders.append(candidate)
    fitting = [c for c in contenders if _feasible(c)]
    if not fitting:
        if contenders:
            notes.append(f"an nf4 base was measured ({', '.join(c.id for c in contenders)}) and did not fit the "
                         f"budget: the choice keeps its {setup.lora_base_precision} base")
        return chosen, contenders
    _time_against(chosen, fitting, prep, options, deadline, say, notes,
                  f"nf4 base {', '.join(c.id for c in fitting)} against {chosen.id}")
    best = max(fitting, key=lambda c: (c.rates or Rates()).median or 0.0)
    figures = (f"{best.id} {best.setup.describe()} {(best.rates or Rates()).median or 0:,.0f} +/- "
               f"{(best.rates or Rates()).band:,.0f} tokens/s against {chosen.id}'s "
               f"{(chosen.rates or Rates()).median or 0:,.0f} +/- {(chosen.rates or Rates()).band:,.0f}")
    if nf4_clearly_faster(best.rates or Rates(), chosen.rates or Rates()):
        notes.append(f"an nf4 base was clearly faster: {figures} (more than {NF4_GAIN - 1:.0%}, outside the "
                     f"rounds' noise): it replaces the {setup.lora_base_precision} base if its losses pass their check")
        return best, contenders
    notes.append(f"an nf4 base was not clearly faster: {figures} (it must be more than {NF4_GAIN - 1:.0%} faster, "
                 f"outside the rounds' noise): the choice keeps its {setup.lora_base_precision} base")
    return chosen, contenders


def _time_against(chosen: Candidate, fitting: list[Candidate], prep: Prepared, options: PlanOptions,
                  deadline: Deadline, say: Callable[[str], None], notes: list[str], what: str) -> None:
    """Time ``fitting`` (measured once) in alternating rounds with the ``chosen`` configuration, as the front-runners
    were, so that noise cannot crown one; each one's throughput is then the median of its rounds."""
    for candidate in fitting:
        candidate.rates = Rates(rounds=[candidate.measured.tokens_per_s])  # type: ignore[union-attr]
    if chosen.rates is None:
        chosen.rates = Rates(rounds=[chosen.measured.tokens_per_s])  # type: ignore[union-attr]
    say(f"{what}: timing them again in up to {options.rounds} alternating rounds")
    _alternate([chosen, *fitting], prep, options, deadline, say, notes)
    for candidate in [chosen, *fitting]:
        if candidate.rates is not None and candidate.rates.median is not None:
            candidate.measured = dataclasses.replace(candidate.measured,  # type: ignore[arg-type]
                                                     tokens_per_s=candidate.rates.median)


def _compare_cuts(prep: Prepared, chosen: Candidate, budget: int, options: PlanOptions, say: Callable[[str], None],
                  model: ModelSpec, notes: list[str], deadline: Deadline) -> tuple[Candidate, list[dict[str, Any]]]:
    """For data of variable lengths, the chosen configuration measured again with its windows cut by length, by a
    token budget and packed: the same samples per window and the same gradient, less padding. The fastest that fits
    replaces drawn order when it is clearly faster. Returns the (possibly re-cut) choice and one row per cut."""
    data, seq_len = prep.data, prep.seq_len
    if isinstance(data.train, PackedSequences):
        notes.append("the data is text cut into full sequences of --seq-len: there is no padding, so cuts by length "
                     "and packing were not measured")
        return chosen, []
    measured = chosen.measured
    share = measured.real_share if measured else None
    if share is None or share >= VARIABLE_LENGTHS:
        notes.append(f"in drawn order {share or 1:.0%} of the computed positions are real tokens: too little padding "
                     f"for cuts by length or packing to pay, so they were not measured")
        return chosen, []
    micro = chosen.setup.micro_batch_size
    variants: list[tuple[str, dict[str, Any]]] = [
        ("by-length", {"order": "by-length"}),
        # The budget is the chosen micro-batch's worst case (micro x seq-len): the same memory bound as the choice.
        ("token budget", {"order": "by-length", "micro_batch_tokens": micro * seq_len}),
        ("packing", {"pack_length": seq_len, "micro_batch_tokens": micro * seq_len}),
    ]
    if model.supports.packing == "none":
        variants.pop()
        notes.append(f"packing was not measured: {model.supports.packing_problem}")
    elif model.supports.packing == "dense-mask":
        notes.append(f"packing on this model ({model.supports.attention} attention) goes through "
                     f"transformers' dense block mask, attention over whole rows: it can be slower than by-length "
                     f"although it computes less padding (the measurement below decides)")
    if chosen.setup.grad_accum_steps == 1:
        # One micro-batch per window: sorting it, or cutting it by its own worst case, leaves it as it is.
        variants = [variant for variant in variants if "pack_length" in variant[1]]
        notes.append("the choice runs each window as one micro-batch, so only packing can change its padding")
    if not variants:
        return chosen, []
    say(f"cuts: in drawn order {share:.0%} of the computed positions are real tokens; measuring the choice with "
        f"its windows cut {', '.join(name for name, _ in variants)} (a budget is {micro * seq_len} positions; same "
        f"samples, same gradient)")
    names = {chosen.id: "drawn"}
    tried = [chosen]
    for name, fields in variants:
        if deadline.passed(_quality_reserve(tried, options)):
            notes.append(f"the --time-budget of {deadline.seconds:g} s was spent before the {name} cut was measured")
            break
        cut = dataclasses.replace(chosen.setup.cut, **fields)
        variant = Candidate(id=f"{chosen.id}-{name.replace(' ', '-')}", estimate=chosen.estimate,
                            setup=dataclasses.replace(chosen.setup, cut=cut))
        _measure(variant, prep, budget, options, say, label="cut")
        names[variant.id] = name
        tried.append(variant)
    fitting = [c for c in tried[1:] if _feasible(c)]
    if fitting:
        # The cuts are the same math: only a clear, measured gain is worth another configuration. Timed in
        # alternating rounds with the drawn order, as the front-runners were, so noise cannot crown one.
        _time_against(chosen, fitting, prep, options, deadline, say, notes,
                      f"cuts {', '.join(names[c.id] for c in [chosen, *fitting])}")
    rows = [_cut_row(names[c.id], c, chosen) for c in tried]
    best = max(fitting, key=lambda c: c.measured.tokens_per_s, default=None)  # type: ignore[union-attr]
    drawn_rate = chosen.measured.tokens_per_s or 0  # type: ignore[union-attr]
    if (best is not None and best.measured.tokens_per_s > CUT_GAIN * drawn_rate  # type: ignore[union-attr]
            and not tied(best.rates or Rates(), chosen.rates or Rates())):
        for row in rows:
            row["chosen"] = row["id"] == best.id
        return best, rows
    rows[0]["chosen"] = True
    if best is not None and best.measured.tokens_per_s > CUT_GAIN * drawn_rate:  # type: ignore[union-attr]
        notes.append(f"the {names[best.id]} cut measured faster than drawn order, but within the rounds' noise: the "
                     f"choice keeps drawn order")
    elif not fitting:
        # Only what was measured is compared: with no cut measured within the budget, nothing was found slower.
        unmeasured = [name for name, _ in variants if name not in names.values()]
        over = [names[c.id] for c in tried[1:]]
        notes.append("the choice keeps drawn order, the order it was measured in: "
                     + "; ".join(part for part in (
                         f"{', '.join(over)} did not fit the budget on the longest window" if over else "",
                         f"{', '.join(unmeasured)} not measured" if unmeasured else "") if part)
                     + " (so no cut was compared with it on speed)")
    else:
        notes.append(f"no cut by length ({', '.join(names[c.id] for c in fitting)}, measured) was more than 3% faster "
                     f"than drawn order: the choice keeps drawn order")
    return chosen, rows


def _cut_row(name: str, candidate: Candidate, drawn: Candidate) -> dict[str, Any]:
    result, base = candidate.measured, drawn.measured
    rate = result.tokens_per_s if result else None
    return {"cut": name, "id": candidate.id, **candidate.setup.cut.flags(),
            "real_share": result.real_share if result else None, "tokens_per_s": rate,
            "ratio": rate / base.tokens_per_s if rate and base and base.tokens_per_s else None,
            "peak_bytes": result.peak_bytes if result else None, "fits": bool(result and result.fits),
            "error": result.error if result else None, "chosen": False,
            "rounds": candidate.rates.as_dict() if candidate.rates else None}


def _measure(candidate: Candidate, prep: Prepared, budget: int, options: PlanOptions, say: Callable[[str], None],
             label: str = "trial") -> None:
    started = time.perf_counter()
    result = run_trial(prep, candidate.setup, steps=options.trial_steps, budget_bytes=budget)
    candidate.seconds_per_step = (time.perf_counter() - started) / max(options.trial_steps, MIN_TRIAL_STEPS)
    candidate.measured = result
    candidate.status = "measured" if result.error is None else f"measured: {result.error}"
    rate = f"{result.tokens_per_s:,.0f} tokens/s" if result.tokens_per_s else "-"
    say(f"  {label} {candidate.id} {candidate.setup.describe()}: peak {format_bytes(result.peak_bytes)} "
        f"(estimate {format_bytes(candidate.estimate.peak_bytes)}), {rate}, {'fits' if result.fits else 'DOES NOT FIT'}")


def _next_smaller(candidates: list[Candidate], candidate: Candidate) -> Candidate | None:
    smaller = [c for c in candidates if c.group == candidate.group
               and c.setup.micro_batch_size < candidate.setup.micro_batch_size]
    return max(smaller, key=lambda c: c.setup.micro_batch_size, default=None)


def _quality_check(prep: Prepared, chosen: Candidate, budget: int, options: PlanOptions,
                   model: ModelSpec) -> dict[str, Any]:
    setup, device = chosen.setup, prep.device
    window = next(prep.windows(0, whole=True))  # the first window of the trials' samples, re-cut as ``setup`` cuts it

    def model_factory() -> torch.nn.Module:
        # The chosen base: an nf4 one computes in the chosen precision (its layers' dtype is fixed when quantised).
        return model.build(seed=prep.config.seed, precision=setup.precision,
                           base_precision=setup.lora_base_precision).module.to(device)

    gradient = compare_gradients(model_factory, window, setup)
    steps = max(3, options.quality_steps)
    chosen_run = run_trial(prep, setup, steps=steps, budget_bytes=budget)
    reference_setup = dataclasses.replace(setup, precision="fp32")
    # An fp32 choice is its own reference (the same windows, weights and computation): running it again would only
    # repeat its losses, at a third of the quality check's time (the gradient check above is what tests its levers).
    reference_run = chosen_run if reference_setup == setup else run_trial(prep, reference_setup, steps=steps,
                                                                          budget_bytes=budget)
    loss = compare_losses(chosen_run.losses, reference_run.losses, setup.precision)
    return {"gradient": gradient.as_dict(), "loss": {**loss.as_dict(), "reference": reference_run.losses,
                                                     "reference_setup": reference_setup.describe()}}


def _state_check(prep: Prepared, chosen: Candidate, budget: int, options: PlanOptions) -> dict[str, Any]:
    """The chosen setup's losses over the quality check's steps against the same setup with fp32 optimizer state
    (the same windows and weights: only the state's precision differs)."""
    setup = chosen.setup
    reference = dataclasses.replace(setup, optimizer_state="fp32")
    return {"optimizer_state": setup.optimizer_state,
            **_loss_check(prep, setup, reference, budget, options, STATE_TOLERANCE)}


def reference_base(config: TrainConfig, precision: str) -> str:
    """The full-precision base an nf4 base is checked against: the given one, or, where nf4 was given, bf16 under
    --precision bf16 (the same math as fp32 there, in half the memory) and fp32 otherwise."""
    if config.lora_base_precision != "nf4":
        return config.lora_base_precision
    return "bf16" if precision == "bf16" else "fp32"


def _base_check(prep: Prepared, chosen: Candidate, budget: int, options: PlanOptions) -> dict[str, Any]:
    """The chosen setup's losses over the quality check's steps against the same setup with the full-precision base
    (the same windows, the same initial weights before quantisation, the same adapters' initialisation: only the
    base's 4-bit rounding differs)."""
    setup = chosen.setup
    base = reference_base(prep.config, setup.precision)
    reference = dataclasses.replace(setup, lora_base_precision=base)
    return {"lora_base_precision": setup.lora_base_precision, "reference_base": base,
            **_loss_check(prep, setup, reference, budget, options, BASE_TOLERANCE)}


def _loss_check(prep: Prepared, setup: TrialSetup, reference_setup: TrialSetup, budget: int, options: PlanOptions,
                tolerance: float) -> dict[str, Any]:
    """``setup``'s losses over the quality check's steps against ``reference_setup``'s (a lossy lever's exact
    counterpart), on the same windows. When the reference runs out of memory, it runs one sequence per micro-batch
    with full recompute: the same math."""
    steps = max(3, options.quality_steps)
    run = run_trial(prep, setup, steps=steps, budget_bytes=budget)
    reference = run_trial(prep, reference_setup, steps=steps, budget_bytes=budget)
    if reference.error is not None and reference.error.startswith("out of memory"):
        reference_setup = dataclasses.replace(reference_setup, cut=setup.cut.resized(1), activation_checkpointing="full",
                                              grad_accum_steps=setup.grad_accum_steps * setup.micro_batch_size)
        reference = run_trial(prep, reference_setup, steps=steps, budget_bytes=budget)
    pairs = [(a, b) for a, b in zip(run.losses, reference.losses) if a is not None and b is not None]
    worst = max((abs(a - b) / abs(b) for a, b in pairs), default=math.inf)
    error = run.error or reference.error
    return {"steps": steps, "losses": run.losses, "reference": reference.losses,
            "reference_setup": reference_setup.describe(), "max_relative_difference": worst, "tolerance": tolerance,
            "passed": error is None and len(pairs) == steps and worst <= tolerance, "error": error}


def _plan_document(config: TrainConfig, data: DataSplits, device: torch.device, seq_len: int, budget: int,
                   baseline: MemoryEstimate, candidates: list[Candidate], chosen: Candidate, quality: dict[str, Any],
                   notes: list[str], tokens_per_epoch: int, duration: float, model: ModelSpec,
                   time_budget: float) -> dict[str, Any]:
    def row(candidate: Candidate) -> dict[str, Any]:
        result = candidate.measured
        measured = None
        if result is not None:
            rate = result.tokens_per_s
            measured = {
                "peak_bytes": result.peak_bytes, "fits": result.fits, "tokens_per_s": rate,
                "step_time_s": result.step_time_s, "measured_on": result.measured_on,
                "seconds_per_epoch": tokens_per_epoch / rate if rate else None,
                "hours_per_billion_tokens": 1e9 / rate / 3600 if rate else None,
                "error": result.error,
            }
        return {"id": candidate.id, **candidate.setup.as_dict(), "estimated_peak_bytes": candidate.estimate.peak_bytes,
                "estimated_by_category": candidate.estimate.by_category,
                "fits_estimate": candidate.estimate.peak_bytes <= budget, "status": candidate.status,
                "accumulation_bytes": candidate.accumulation_bytes,
                "measured": measured, "rounds": candidate.rates.as_dict() if candidate.rates else None}

    rate = chosen.measured.tokens_per_s if chosen.measured else None
    return {
        "version": 1,
        "created": datetime.now().isoformat(timespec="seconds"),
        "duration_s": duration,
        "model": config.model,
        "model_config": list(config.model_config) if config.model_config else None,
        "parameters": model.shape.num_parameters,
        "seq_len": seq_len,
        # Rows of the data's longest micro-batch: what every candidate's peak was measured on (train --plan's check
        # of a cut the user gives reads it).
        "longest_example": longest_example(data, seq_len),
        "data": data.description,
        # What train --plan reads again unless told otherwise: the plan's decision holds for this data and cut.
        "source": {**Source.from_flags(config).flags(),
                   "data": str(config.data.resolve()) if config.data is not None else None,
                   "data_fingerprint": data.fingerprint},
        "tokens_per_epoch": tokens_per_epoch,
        "device": str(device),
        "effective_batch_size": config.effective_batch_size,
        "world_size": 1,
        "memory_budget_bytes": budget,
        "diagnosis": {
            "baseline": {"micro_batch_size": config.effective_batch_size, "grad_accum_steps": 1, "precision": "fp32",
                         "activation_checkpointing": "none", "offload": "none"},
            "estimate": {"peak_bytes": baseline.peak_bytes, "by_category": baseline.by_category,
                         "peak_phase": baseline.peak_phase},
            "dominant": max(baseline.by_category, key=lambda k: baseline.by_category[k]
                            if k != "offloaded_to_host" else -1),
            "explanation": baseline.dominant,
        },
        "candidates": [row(c) for c in candidates],
        # What train --plan should see: the decision's throughput (the median of its rounds) and the time per epoch it
        # implies; `cadence report` of the run puts the run's own figures beside them.
        "prediction": {"tokens_per_s": rate, "tokens_per_s_band": chosen.rates.band if chosen.rates else None,
                       "rounds": len(chosen.rates.rounds) if chosen.rates else 1,
                       "seconds_per_epoch": tokens_per_epoch / rate if rate else None,
                       "peak_bytes": chosen.measured.peak_bytes if chosen.measured else None},
        "time_budget_s": time_budget,
        "choice": {"id": chosen.id, **chosen.setup.train_flags(),
                   "reason": f"highest measured throughput ({rate:,.0f} tokens/s, the median of "
                             f"{len(chosen.rates.rounds) if chosen.rates else 1} alternating rounds) among the "
                             f"measured candidates whose measured peak is within the budget, or the lowest peak among "
                             f"those tied with it within the measured noise; every candidate has the same effective "
                             f"batch of {config.effective_batch_size}"
                             + (f"; its windows are cut ({chosen.setup.cut.describe()}) to compute less padding "
                                f"for the same gradient" if chosen.setup.cut.by_length else "")},
        "quality": quality,
        "notes": notes + [f"estimates: {n}" for n in baseline.notes],
        # LoRA changes what is trained: train --plan trains the adapters the plan measured, on the base it chose.
        "lora": {**{name: value for name, value in config.to_json_dict().items() if section_of(name) is LORA},
                 "lora_base_precision": chosen.setup.lora_base_precision},
        "training": {key: value for key, value in config.to_json_dict().items()
                     if key in ("lr", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "seed")},
    }


def _write_report(out: Path, say: Callable[[str], None]) -> None:
    for path in write_report(plan_report(out), out):
        if path.suffix == ".html":
            say(f"report: {path}")


# ---------------------------------------------------------------------------------------------------- train --plan


def _accepted_cut(config: TrainConfig, given: set[str], decided: dict[str, Any], plan: Record,
                  hints: dict[str, Any], path: Path) -> tuple[dict[str, Any], list[Problem]]:
    """The cut flags train --plan runs with when the user gives some (``given``) beside the plan: every cut gives the
    same gradient, so what decides is the memory. Accepted: the plan's own cut; a cut the plan measured on its
    longest window and found within the budget (plan.json's cuts); and, where the plan cut rows by a row count
    (no token budget, no packing), either order of those rows, whose longest micro-batch is the same rows (the
    micro-batch size's longest examples, what the plan measured). Anything else might raise the peak the plan
    measured, and is refused saying why."""
    wanted = {name: getattr(config, name) for name in CUT_FLAGS if name in given}
    if all(decided.get(name) == value for name, value in wanted.items()):
        return {}, []
    for row in plan.records("cuts", []):
        flags = {name: row.get(name, CUT_FLAG_DEFAULTS[name]) for name in CUT_FLAGS}
        if row.get("fits") is True and all(flags[name] == value for name, value in wanted.items()):
            return {name: row.take(name, field_kind(hints[name]), CUT_FLAG_DEFAULTS[name]) for name in CUT_FLAGS}, []
    rows_cut = decided.get("micro_batch_tokens") is None and not decided.get("packing")
    if rows_cut and set(wanted) == {"micro_batch_order"}:
        return wanted, []
    micro, seq_len = decided.get("micro_batch_size"), plan.get("seq_len")
    longest = plan.get("longest_example") or seq_len
    measured = f"the plan measured {micro} rows of at most {longest} positions per micro-batch ({path})"
    problems = []
    if "packing" in wanted and wanted["packing"] != decided.get("packing"):
        problems.append(Problem(where="--packing" if wanted["packing"] else "--no-packing", message=(
            f"could raise the peak the plan measured: packed rows of --seq-len {seq_len} fill each row with examples "
            f"(up to {micro} x {seq_len} positions per micro-batch, every one a real token and most of them "
            f"targets), where {measured}, and the plan measured no packed cut that fits; plan again with --packing")
            if wanted["packing"] else (
            f"the plan chose packed rows; unpacked micro-batches of {micro} examples pad to their "
            f"longest and were not measured; plan again without --packing")))
    if "micro_batch_tokens" in wanted and wanted["micro_batch_tokens"] != decided.get("micro_batch_tokens"):
        problems.append(Problem(where="--micro-batch-tokens", message=(
            f"{wanted['micro_batch_tokens']} could raise the peak the plan measured: a token budget cuts micro-batches "
            f"by positions, in as many rows as fit, not by {micro} rows, where {measured} and no cut with this budget; "
            f"plan again with --micro-batch-tokens {wanted['micro_batch_tokens']}")))
    if not problems:  # the order alone, under a cut by a token budget or packing
        problems.append(Problem(where="--micro-batch-order", message=(
            f"{wanted.get('micro_batch_order')!r}: the plan's cut ({decided.get('micro_batch_tokens')} positions per "
            f"micro-batch, packing {decided.get('packing')}) was measured in its own order only; plan again with it")))
    return {}, problems


def apply_plan(config: TrainConfig, given: set[str]) -> TrainConfig:
    """The configuration with the plan's decision; a given flag that contradicts the plan is a usage error."""
    path = config.plan
    assert path is not None
    content = read_regular_file(path, where="--plan", limit=64 << 20)  # a pipe or a device is refused, not read
    # plan.json is read back like user input (cadence.records): every field it gives the run has the type of the
    # flag it sets, or the refusal names the file and the field.
    plan = Record.parse(content, f"--plan {path}")
    hints = get_type_hints(TrainConfig)
    choice = plan.record("choice")
    # A lever a plan.json predates (it has no key for it) was not pulled: its default.
    decided = {name: choice.take(name, field_kind(hints[name])) if choice.has(name)
               else DECISION_DEFAULTS.get(name) for name in DECISION_FIELDS}
    missing = [name for name in DECISION_FIELDS if not choice.has(name) and name not in DECISION_DEFAULTS]
    if missing:
        raise choice.invalid(missing[0], "is missing")
    decided.update({name: choice.take(name, field_kind(hints[name]), default)
                    for name, default in CUT_FLAG_DEFAULTS.items()})
    model = plan.text("model")
    if not model.strip():
        raise plan.invalid("model", "is empty, not a model name")
    decided.update(model=model, seq_len=plan.take("seq_len", field_kind(hints["seq_len"]), None),
                   effective_batch_size=None)
    if plan.get("model_config"):  # a Hugging Face model's --model-config overrides
        decided["model_config"] = plan.take("model_config", field_kind(hints["model_config"]))
    empty = Record({}, plan.source)
    lora = plan.record("lora", empty)  # plans made before LoRA was recorded trained no adapters
    decided.update({name: lora.take(name, field_kind(hints[name])) for name in lora.data
                    if name in FIELD_NAMES and section_of(name) is LORA and lora.has(name)})
    source = plan.record("source", empty)  # plans written before sources were recorded have none
    # An empty path is the current directory: a plan.json edited or damaged to "" would have train read (and store)
    # everything under it. The data is a named file or directory (field_kind refuses ""), or null for the corpus.
    planned_data = source.take("data", field_kind(hints["data"]), None) if source.has("data") else None
    if source.has("data") and isinstance(planned_data, Path) and not str(source.get("data")).strip():
        raise source.invalid("data", "is empty, not the path of the data it measured")
    if "data" not in given and "data" in source.data:
        # The plan measured this data: training on other data would train with a decision made for that one.
        decided["data"] = planned_data
        for name in FIELD_DEFAULTS:  # how its rows became examples (fields, chat template, what is trained)
            if name not in given and source.has(name):
                decided[name] = source.take(name, field_kind(hints[name]))
        if decided.get("train_on", "assistant") not in TRAIN_ON:
            raise source.invalid("train_on", f"is {decided['train_on']!r}, not one of {', '.join(TRAIN_ON)}")
    elif "data" in given and "data" in source.data:
        planned = str(planned_data) if planned_data is not None else "the built-in corpus"
        given_data = str(config.data.resolve()) if config.data is not None else "the built-in corpus"
        if given_data != planned:
            warnings.warn(f"training on --data {config.data or 'the built-in corpus'}, while the plan {path} was made "
                          f"on {planned}: its decision was measured on that data", stacklevel=2)
    problems = []
    if given & set(CUT_FLAGS):
        # A cut is an exact lever (the same samples per window): a cut that keeps the memory the plan measured is
        # accepted, one that might raise it is refused saying why.
        cut_flags, cut_problems = _accepted_cut(config, given, decided, plan, hints, path)
        decided.update(cut_flags)
        problems += cut_problems
    for name, value in decided.items():
        if name in CUT_FLAGS and name in given:
            continue  # decided above
        if name in given and value is not None and getattr(config, name) != value:
            problems.append(Problem(where="--" + name.replace("_", "-"),
                                    message=f"{getattr(config, name)!r} contradicts the plan's {value!r} ({path})"))
    if "effective_batch_size" in given and config.effective_batch_size != plan.get("effective_batch_size"):
        problems.append(Problem(where="--effective-batch-size", message=f"{config.effective_batch_size} contradicts "
                                f"the plan's {plan.get('effective_batch_size')} ({path})"))
    if problems:
        raise UsageError(problems)
    return dataclasses.replace(config, **decided)
