"""A plan's candidates: every combination of the levers the user left open, each with its estimated peak.

A candidate is a :class:`~cadence.plan.trials.TrialSetup` (the split, precision, recompute, offload, loss chunks,
optimizer state, LoRA base and cut) with its estimate and, once measured, its trial and rounds. The lossy levers
(a lower-precision optimizer state, an nf4 base) join only where nothing exact fits; the diagnosis says whether
accumulation raises the peak on this model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from cadence.config import TrainConfig
from cadence.config.plan_file import CUT_FLAGS
from cadence.config.schema import LoraBasePrecision
from cadence.data import DataSplits
from cadence.data.preference import PreferenceExamples
from cadence.data.text import PackedSequences
from cadence.engine.choices import PRECISIONS, PrecisionName
from cadence.engine.cut import Cut
from cadence.engine.precision import precision_problem
from cadence.formatting import format_bytes
from cadence.memory.choices import CHECKPOINTING_MODES, OFFLOAD_MODES, CheckpointingMode, OffloadMode
from cadence.memory.estimate import MemoryEstimate
from cadence.memory.estimate_for import estimate_for
from cadence.models.quantized import bitsandbytes_problem
from cadence.models.spec import ModelSpec
from cadence.optim.choices import OptimizerStateName
from cadence.optim.spec import OptimizerSpec
from cadence.plan.adaptive import planned_batch, serving_micro_batches, snapshot_bytes, with_snapshot
from cadence.plan.measure import Rates, probe_precisions
from cadence.plan.objective_cost import objective_cost, reference_modes
from cadence.plan.tolerances import BASE_TOLERANCE, STATE_TOLERANCE
from cadence.plan.trials import TrialResult, TrialSetup

Group = tuple[str, str, str, int, str, str]
"""The levers but the split: precision, recompute, offload, loss chunks, optimizer state, LoRA base."""


@dataclass(kw_only=True)
class Candidate:
    id: str
    setup: TrialSetup
    estimate: MemoryEstimate
    status: str = "not measured"
    measured: TrialResult | None = None
    """Its trial (None: not measured); :attr:`result` for one known to be measured."""
    rates: Rates | None = None
    """The throughputs of its alternating rounds (front-runners and cuts), the first trial's included."""
    seconds_per_step: float | None = None
    """Its trial's whole time over its steps: the step with its share of the trial's building (the model, the
    optimizer, the data), which is what the quality check's short runs spend per step too."""
    snapshot_bytes: int = 0
    """Under ``--batch-branch-test``: the snapshot of the weights and optimizer state the branch test holds
    (``plan.adaptive.snapshot_bytes``), counted in its estimate and added to its measured peak (a trial runs without
    it); 0 otherwise."""
    accumulation_bytes: int | None = None
    """What accumulation adds to its estimated peak (against the same micro-batch as a whole window): the gradients
    held through the later micro-batches, and each new gradient made beside the accumulated one, except the token
    embedding's and (fp32) the head's, which go straight into ``.grad`` (cadence.memory.grad_in_place). None: no
    accumulation."""

    @property
    def group(self) -> Group:
        return (self.setup.precision, self.setup.activation_checkpointing, self.setup.offload,
                self.setup.loss_chunk_tokens, self.setup.optimizer_state, self.setup.lora_base_precision)

    @property
    def result(self) -> TrialResult:
        """Its trial; only for a candidate that was measured (every :attr:`feasible` one was)."""
        if self.measured is None:
            raise RuntimeError(f"candidate {self.id} was not measured")  # a bug of the plan, not the user's input
        return self.measured

    @property
    def feasible(self) -> bool:
        """Within the budget: measured, or by an estimate trusted within its measured error (``plan.trust``)."""
        return bool(self.measured and self.measured.fits)

    @property
    def rate(self) -> float:
        """Its measured throughput (the median of its rounds once timed again); 0 when it has none."""
        return (self.measured.tokens_per_s if self.measured is not None else None) or 0.0

    @property
    def peak(self) -> int:
        """Its measured peak; 0 when it has none."""
        return (self.measured.peak_bytes if self.measured is not None else None) or 0

    @property
    def timing(self) -> Rates:
        """Its alternating rounds (none yet: empty)."""
        return self.rates or Rates()


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


def given_cut(config: TrainConfig, constrained: set[str], micro_batch_size: int, seq_len: int) -> Cut:
    """The cut the user gave (--micro-batch-order, --micro-batch-tokens, --packing), kept for every candidate; with
    none given, candidates are measured in drawn order and the decision measures the cuts for the choice."""
    if not constrained & set(CUT_FLAGS):
        return Cut(micro_batch_size=micro_batch_size)
    return Cut.from_flags(config, micro_batch_size=micro_batch_size, seq_len=seq_len)


@dataclass(frozen=True, kw_only=True)
class Levers:
    """The values of each lever a plan's candidates take."""

    micro_sizes: list[int]
    precisions: list[PrecisionName]
    recomputes: list[CheckpointingMode]
    offloads: list[OffloadMode]
    chunks: list[int]
    combinations: list[tuple[OptimizerStateName, LoraBasePrecision, PrecisionName]]
    """(optimizer state, LoRA base, precision)."""


def _levers(config: TrainConfig, constrained: set[str], device: torch.device, rows: int, notes: list[str],
            model: ModelSpec, states: list[OptimizerStateName] | None, precisions: list[PrecisionName] | None,
            bases: list[LoraBasePrecision] | None) -> Levers:
    # Under adaptive, only the micro-batches that serve the whole range (dividing the minimum, two or more per window).
    micro_sizes = ([int(config.micro_batch_size)] if "micro_batch_size" in constrained
                   else serving_micro_batches(config, divisors(planned_batch(config))))
    if precisions is None and "precision" in constrained:
        precisions = [config.precision]
    elif precisions is None:
        probe = probe_precisions([name for name in PRECISIONS if precision_problem(name, device) is None], device)
        precisions = probe.kept
        notes += probe.notes
    recomputes = [config.activation_checkpointing] if "activation_checkpointing" in constrained else list(
        CHECKPOINTING_MODES)
    offloads: list[OffloadMode]
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
    return Levers(micro_sizes=micro_sizes, precisions=precisions, recomputes=recomputes, offloads=offloads,
                  chunks=chunks, combinations=combinations)


def build_candidates(config: TrainConfig, constrained: set[str], device: torch.device, seq_len: int,
                     notes: list[str], model: ModelSpec | None = None, *,
                     states: list[OptimizerStateName] | None = None, first_number: int = 1, longest: int | None = None,
                     precisions: list[PrecisionName] | None = None,
                     bases: list[LoraBasePrecision] | None = None) -> list[Candidate]:
    """Every combination of the levers the user left open, each with its estimated peak; ``states``: the optimizer
    states (default: the given one, else fp32), ``bases``: the --lora-base-precision values (default: the given
    one; only bf16 and fp32 compute an nf4 base), numbered from ``first_number``. ``longest``: the data's longest
    example (positions; default ``seq_len``), the row length of its longest micro-batch, where each is estimated
    (packed rows are ``seq_len`` long whatever the examples). ``precisions``: the ones a first call kept (the matmul
    probe that chooses them takes seconds: it runs once per plan)."""
    model = model or ModelSpec.from_flags(config)
    optimizer = OptimizerSpec.from_flags(config)
    rows = seq_len if config.packing and "packing" in constrained else min(seq_len, longest or seq_len)
    levers = _levers(config, constrained, device, rows, notes, model, states, precisions, bases)
    modes = reference_modes(config, constrained)  # the preference reference: a frozen copy, or precomputed
    budget = int(config.memory_budget_bytes() or 0)
    effective = planned_batch(config)
    candidates: list[Candidate] = []
    for state, base, precision in levers.combinations:
        for recompute in levers.recomputes:
            for offload in levers.offloads:
                for chunk in levers.chunks:
                    for micro in levers.micro_sizes:
                        setup = TrialSetup(cut=given_cut(config, constrained, micro, seq_len),
                                           grad_accum_steps=effective // micro, precision=precision,
                                           activation_checkpointing=recompute, offload=offload,
                                           loss_chunk_tokens=chunk, optimizer_state=state,
                                           lora_base_precision=base, reference_logprobs=modes[0])
                        levers_of: dict[str, Any] = {"seq_len": rows, "precision": precision, "checkpointing": recompute,
                                     "offload": offload, "device_type": device.type, "loss_chunk_tokens": chunk,
                                     "optimizer": optimizer.with_state(state), "lora_base_precision": base,
                                     "packed": config.packing, "objective": objective_cost(config, model, modes[0])}
                        estimate = estimate_for(model, micro_batch_size=micro,
                                                grad_accum_steps=setup.grad_accum_steps, **levers_of)
                        if len(modes) > 1 and estimate.peak_bytes > budget:  # the frozen copy does not fit
                            setup = dataclasses.replace(setup, reference_logprobs=modes[1])
                            levers_of["objective"] = objective_cost(config, model, modes[1])
                            estimate = estimate_for(model, micro_batch_size=micro,
                                                    grad_accum_steps=setup.grad_accum_steps, **levers_of)
                        alone = estimate if setup.grad_accum_steps == 1 else estimate_for(
                            model, micro_batch_size=micro, grad_accum_steps=1, **levers_of)
                        snapshot = snapshot_bytes(model, config, optimizer=levers_of["optimizer"], offload=offload,
                                                  lora_base_precision=base, device_type=device.type)
                        candidates.append(Candidate(
                            id=f"c{len(candidates) + first_number:02d}", setup=setup,
                            estimate=with_snapshot(estimate, snapshot), snapshot_bytes=snapshot,
                            accumulation_bytes=(estimate.peak_bytes - alone.peak_bytes
                                                if setup.grad_accum_steps > 1 else None)))
    return candidates


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
                notes: list[str]) -> list[LoraBasePrecision]:
    """["nf4"] where a 4-bit NormalFloat base can be a candidate of this plan (:func:`nf4_problem`), else [] with the
    reason in ``notes`` (the report's notes, and a failed plan's message)."""
    problem = nf4_problem(config, constrained, model, precisions)
    if problem is None:
        return ["nf4"]
    notes.append(f"an nf4 base (--lora-base-precision nf4) was not a candidate: it {problem}")
    return []


def lossy_candidates(config: TrainConfig, constrained: set[str], device: torch.device, seq_len: int,
                     model: ModelSpec, *, longest: int, precisions: list[PrecisionName], first_number: int,
                     notes: list[str],
                     say: Callable[[str], None]) -> list[Candidate]:
    """The candidates of the lossy levers, for a plan where nothing exact fits (measured): lower-precision optimizer
    state (unless --optimizer-state was given) and, under LoRA, an nf4 base with the exact optimizer state (unless
    it cannot be here: :func:`lossy_bases`). Each is kept only after its loss check; numbered from
    ``first_number``. Here because nothing else fits; where a full-precision base fits, an nf4 base is measured
    only for what its freed memory buys (``cadence.plan.decision.compare_nf4_base``): it dequantises every weight in
    each matmul, forward, recompute and backward, so at the same levers it is slower (measured on this CPU, a 49.9M
    llama: 229 against 272 tokens/s, 0.84x, BENCHMARKS.md)."""
    more: list[Candidate] = []
    # What the optimizer may vary (AdamW: bf16, and 8bit where bitsandbytes is installed); never the optimizer.
    lossy = [] if "optimizer_state" in constrained else OptimizerSpec.from_flags(config).lossy_states(notes)
    if lossy:
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
                            lora_base_precision=config.lora_base_precision,
                            objective=objective_cost(config, model)).peak_bytes
    whole = peak(0)
    sizes = [size for size in LOSS_CHUNKS if size < seq_len]
    if not sizes or peak(sizes[-1]) > CHUNK_SAVING * whole:
        notes.append(f"loss chunking was not a candidate: with a vocabulary of {model.shape.vocab_size:,} the logits are "
                     f"a small part of the estimated peak, so chunking them would only cost time")
        return [0]
    fitting = [size for size in sizes if peak(size) <= budget]
    return [0, fitting[0] if fitting else sizes[-1]]


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
    if isinstance(train, PreferenceExamples) and train.unpaired:
        # A KTO example's mismatched row joins its prompt to another's completion: longer than either, up to seq_len.
        return seq_len
    return min(seq_len, int(getattr(train, "max_length", seq_len)) or seq_len)


def epoch_tokens(data: DataSplits) -> int:
    train = data.train
    if isinstance(train, PackedSequences):
        return len(train) * train.max_length
    return sum(len(example.input_ids) for example in train)


def lever_flags(candidate: Candidate) -> dict[str, Any]:
    """The levers of ``candidate`` that are pulled (not at their defaults), as plan flags."""
    setup = candidate.setup
    pulled = {"optimizer_state": setup.optimizer_state, "lora_base_precision": setup.lora_base_precision,
              "loss_chunk_tokens": setup.loss_chunk_tokens, "activation_checkpointing": setup.activation_checkpointing,
              "offload": setup.offload, "precision": setup.precision}
    defaults = {"optimizer_state": "fp32", "lora_base_precision": "fp32", "loss_chunk_tokens": 0,
                "activation_checkpointing": "none", "offload": "none", "precision": "fp32"}
    return {name: value for name, value in pulled.items() if value != defaults[name]}


def lever_words(candidate: Candidate) -> str:
    setup = candidate.setup
    return (f"micro {setup.micro_batch_size} x accum {setup.grad_accum_steps}, {setup.precision}, recompute "
            f"{setup.activation_checkpointing}" + (f", offload {setup.offload}" if setup.offload != "none" else "")
            + setup.lever_text())
