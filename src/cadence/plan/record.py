"""The plan's record: its candidates, decision and measurements as the typed plan.json (``config.plan_file``).

``cadence plan`` builds the :class:`~cadence.config.plan_file.PlanRecord` here from what it measured, and writes it
with the record's one writer; ``train --plan``, ``cadence report`` and the plan's own report read it back through the
record's one reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from cadence.config import TrainConfig
from cadence.config.plan_file import (
    DECISION_FIELDS,
    PLAN_FILE,
    CandidateRow,
    Choice,
    CutRow,
    Measured,
    PlanAdaptive,
    PlanRecord,
    PlanSource,
    Prediction,
    Rounds,
    write_plan,
)
from cadence.config.schema import LORA, OBJECTIVE, section_of
from cadence.data import DataSplits
from cadence.data.source import Source
from cadence.memory.estimate import MemoryEstimate
from cadence.models.spec import ModelSpec
from cadence.plan.adaptive import planned_batch
from cadence.plan.candidates import Candidate, epoch_tokens, longest_example
from cadence.plan.optimizer_levers import optimizer_levers
from cadence.plan.trust import Trust


def rounds_of(candidate: Candidate) -> Rounds | None:
    return Rounds(**candidate.rates.as_dict()) if candidate.rates is not None else None


def candidate_row(candidate: Candidate, budget: int, tokens_per_epoch: int, trust: Trust | None = None) -> CandidateRow:
    """One candidate as plan.json records it: its decision, estimate, status, trial and rounds."""
    result = candidate.measured
    measured = None
    if result is not None:
        rate = result.tokens_per_s
        measured = Measured(peak_bytes=result.peak_bytes, fits=result.fits, tokens_per_s=rate,
                            step_time_s=result.step_time_s, measured_on=result.measured_on,
                            seconds_per_epoch=tokens_per_epoch / rate if rate else None,
                            hours_per_billion_tokens=1e9 / rate / 3600 if rate else None, error=result.error)
    return CandidateRow(id=candidate.id, decision=candidate.setup.as_dict(),
                        estimated_peak_bytes=candidate.estimate.peak_bytes,
                        estimated_by_category=dict(candidate.estimate.by_category),
                        fits_estimate=candidate.estimate.peak_bytes <= budget, status=candidate.status,
                        accumulation_bytes=candidate.accumulation_bytes, measured=measured,
                        rounds=rounds_of(candidate), memory=memory_of(candidate, budget, trust))


def memory_of(candidate: Candidate, budget: int, trust: Trust | None) -> dict[str, Any] | None:
    """How ``candidate``'s memory was decided: by its estimate (within the margin of its measured error) or measured,
    with the margin it was judged by."""
    if trust is None:
        return None
    result = candidate.measured
    decided_by = ("estimate" if result is not None and result.estimated else "measured" if result is not None
                  else "estimate" if trust.verdict(candidate, budget) == "over" else None)
    return {"decided_by": decided_by, "margin": trust.margin(candidate), "error": trust.error(candidate)}


@dataclass(kw_only=True)
class PlanOutcome:
    """What a plan found, for its record: the candidates, the choice, and the checks and notes around them."""

    config: TrainConfig
    data: DataSplits
    source: Source
    """What --data is (the run's ``Prepared.source``, built once per command)."""
    device: torch.device
    seq_len: int
    budget: int
    baseline: MemoryEstimate
    model: ModelSpec
    candidates: list[Candidate]
    chosen: Candidate
    quality: dict[str, Any]
    notes: list[str]
    cuts: list[CutRow]
    diagnosis_extra: dict[str, Any]
    effective_batch: dict[str, Any]
    time_budget: float
    time_spent: dict[str, float]
    duration: float
    trust: Trust | None = None
    """The estimate's measured error the plan judged memory by (``cadence.plan.trust``)."""
    adaptive: PlanAdaptive | None = None
    """Under --effective-batch-size adaptive: the policy planned for and the throughput over its range."""


def plan_record(outcome: PlanOutcome) -> PlanRecord:
    """The record of a plan that decided."""
    config, chosen, data, baseline = outcome.config, outcome.chosen, outcome.data, outcome.baseline
    tokens_per_epoch = epoch_tokens(data)
    rate = chosen.measured.tokens_per_s if chosen.measured else None
    rounds = len(chosen.rates.rounds) if chosen.rates else 1
    reason = (f"highest measured throughput ({rate or 0:,.0f} tokens/s, the median of {rounds} alternating rounds) "
              f"among the measured candidates whose measured peak is within the budget, or the lowest peak among "
              f"those tied with it within the measured noise; every candidate has the same effective batch of "
              f"{planned_batch(config)}"
              + (" (the adaptive range's minimum: a larger batch of the range accumulates more of the same "
                 "micro-batches, at the same memory)" if outcome.adaptive is not None else "")
              + (f"; its windows are cut ({chosen.setup.cut.describe()}) to compute less padding for the same "
                 f"gradient" if chosen.setup.cut.by_length else ""))
    source = outcome.source.flags()
    return PlanRecord(
        created=datetime.now().isoformat(timespec="seconds"), duration_s=outcome.duration, model=config.model,
        model_config=list(config.model_config) if config.model_config else None,
        parameters=outcome.model.shape.num_parameters, seq_len=outcome.seq_len,
        # Rows of the data's longest micro-batch: what every candidate's peak was measured on (train --plan's check
        # of a cut the user gives reads it).
        longest_example=longest_example(data, outcome.seq_len), data=data.description,
        # What train --plan reads again unless told otherwise: the plan's decision holds for this data and cut.
        source=PlanSource(data=config.data.resolve() if config.data is not None else None,
                          fields={name: value for name, value in source.items() if name != "data"},
                          data_fingerprint=data.fingerprint),
        tokens_per_epoch=tokens_per_epoch, device=str(outcome.device),
        effective_batch_size=planned_batch(config), world_size=1, memory_budget_bytes=outcome.budget,
        diagnosis={**_diagnosis(config, baseline), **outcome.diagnosis_extra},
        candidates=[candidate_row(c, outcome.budget, tokens_per_epoch, outcome.trust) for c in outcome.candidates],
        # What train --plan should see: the decision's throughput (the median of its rounds) and the time per epoch
        # it implies; `cadence report` of the run puts the run's own figures beside them.
        prediction=Prediction(tokens_per_s=rate, tokens_per_s_band=chosen.rates.band if chosen.rates else None,
                              rounds=rounds, seconds_per_epoch=tokens_per_epoch / rate if rate else None,
                              peak_bytes=chosen.measured.peak_bytes if chosen.measured else None),
        time_budget_s=outcome.time_budget,
        choice=Choice(id=chosen.id, flags=chosen.setup.train_flags(), reason=reason),
        quality=outcome.quality, notes=outcome.notes + [f"estimates: {n}" for n in baseline.notes],
        # LoRA changes what is trained: train --plan trains the adapters the plan measured, on the base it chose.
        lora={**{name: value for name, value in config.to_json_dict().items() if section_of(name) is LORA},
              "lora_base_precision": chosen.setup.lora_base_precision},
        training={key: value for key, value in config.to_json_dict().items()
                  if key in ("lr", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "seed")},
        time_spent_s=outcome.time_spent, cuts=outcome.cuts, effective_batch=outcome.effective_batch,
        # The objective changes what is trained: train --plan trains the one the plan measured.
        objective={name: value for name, value in config.to_json_dict().items()
                   if section_of(name) is OBJECTIVE and name not in DECISION_FIELDS},
        # The user's optimizer, which every candidate ran with; others with less state are listed, never tried.
        optimizer=config.optimizer,
        optimizer_levers=optimizer_levers(config, outcome.model, seq_len=outcome.seq_len,
                                          chosen_state=chosen.setup.optimizer_state),
        estimate_error=outcome.trust.as_dict() if outcome.trust is not None else None,
        adaptive_batch=outcome.adaptive)


def _diagnosis(config: TrainConfig, baseline: MemoryEstimate) -> dict[str, Any]:
    """The naive configuration (the whole batch at once, fp32) and its estimate by category."""
    return {
        "baseline": {"micro_batch_size": planned_batch(config), "grad_accum_steps": 1, "precision": "fp32",
                     "activation_checkpointing": "none", "offload": "none"},
        "estimate": {"peak_bytes": baseline.peak_bytes, "by_category": baseline.by_category,
                     "peak_phase": baseline.peak_phase},
        "dominant": max(baseline.by_category, key=lambda k: baseline.by_category[k]
                        if k != "offloaded_to_host" else -1),
        "explanation": baseline.dominant,
    }


def write(out: Path, plan: PlanRecord) -> Path:
    """OUT/plan.json; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    write_plan(out / PLAN_FILE, plan)
    return out / PLAN_FILE
