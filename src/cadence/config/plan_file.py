"""plan.json: the record of a plan, as one typed value with one writer and one reader.

``cadence plan`` builds a :class:`PlanRecord` (``cadence.plan.record``) and writes it here (:func:`write_plan`); every
reader takes it back through :func:`read_plan`: ``train --plan`` (``config.from_plan.apply_plan``: the decision becomes
flags), ``cadence report`` of a plan (``cadence.plan.report``) and of a run trained with one (``cadence.report.runs``:
the prediction beside the run's figures), and ``cadence report``'s directory check (``cadence.rebuild``).

It lives in config/ because ``train --plan`` reads it while it builds a TrainConfig, below every package that runs
anything; the record is plain values (bytes, rates, flags), so it needs nothing above config. A plan.json is read
back like any record (``cadence.records``): it is copied and edited, so a field of the wrong type is one line naming
the file and the field, and a field an older plan.json predates is its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from cadence.config.schema import FIELD_NAMES, LORA, OBJECTIVE, TrainConfig, section_of
from cadence.config.sources import field_kind
from cadence.data.source import FIELD_DEFAULTS, TRAIN_ON
from cadence.engine.cut import CUT_FLAG_DEFAULTS
from cadence.input_files import read_regular_file
from cadence.output_files import atomic_write_json
from cadence.records import COUNT, NUMBER, OBJECT, TEXT, Kind, Record, integer, list_of

PLAN_FILE = "plan.json"
PLAN_VERSION = 1
PLAN_LIMIT_BYTES = 64 << 20
"""A plan.json holds a few dozen candidates; anything past 64 MiB is not one (a link to a device, a wrong file)."""

DECISION_FIELDS: tuple[str, ...] = ("micro_batch_size", "grad_accum_steps", "precision", "activation_checkpointing",
                                    "offload", "loss_chunk_tokens", "optimizer_state", "lora_base_precision",
                                    "reference_logprobs")
"""What a plan decides, in plan.json's order, as train's flags (TrainConfig fields): the split of the effective batch,
then how a window is computed and the optimizer updates (``cadence.plan.trials.TrialSetup``'s fields, a test keeps
them the same). plan.json records the cut next to them, as train's cut flags (:data:`CUT_FLAGS`)."""
DECISION_DEFAULTS: dict[str, Any] = {"precision": "fp32", "activation_checkpointing": "none", "offload": "none",
                                     "loss_chunk_tokens": 0, "optimizer_state": "fp32", "lora_base_precision": "fp32",
                                     "reference_logprobs": "live"}
"""What a decision field is when a plan.json has no key for it (a lever added after the plan was made)."""
CUT_FLAGS = tuple(CUT_FLAG_DEFAULTS)
"""Train's cut flags beyond the micro-batch size."""
MARKS: dict[str, type | tuple[type, ...]] = {"version": int, "created": str, "diagnosis": dict, "candidates": list}
"""Fields every plan.json that cadence plan writes holds, with their JSON types: what tells it from another tool's."""

_HINTS = get_type_hints(TrainConfig)
_NUMBERS = Kind("an object of numbers", lambda value: {str(k): NUMBER.accept(v) for k, v in value.items()}
                if isinstance(value, dict) else _refuse())


def _refuse() -> Any:
    raise ValueError


_KINDS = {"micro_batch_size": integer(1), "grad_accum_steps": integer(1), "loss_chunk_tokens": COUNT}
"""The decision fields whose TrainConfig type admits more than a decision can be (``auto``, None)."""


def _flags(record: Record, names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    """Train's flags ``names`` of ``record``, each of its TrainConfig field's type (an absent one: its default)."""
    missing = [name for name in names if not record.has(name) and name not in defaults]
    if missing:
        raise record.invalid(missing[0], "is missing")
    return {name: record.take(name, _KINDS.get(name) or field_kind(_HINTS[name]), defaults.get(name))
            for name in names}


@dataclass(frozen=True, kw_only=True)
class Rounds:
    """A candidate's alternating rounds: each round's throughput (tokens/s), their median and noise band."""

    rounds: list[float]
    median: float | None
    band: float

    def as_json(self) -> dict[str, Any]:
        return {"rounds": list(self.rounds), "median": self.median, "band": self.band}

    @classmethod
    def read(cls, record: Record) -> Rounds:
        return cls(rounds=record.take("rounds", list_of(NUMBER), []), median=record.number("median", None),
                   band=record.number("band", 0.0))


@dataclass(frozen=True, kw_only=True)
class Measured:
    """What a candidate's trial measured (null fields: it could not run so far)."""

    peak_bytes: int | None
    fits: bool | None
    tokens_per_s: float | None
    step_time_s: float | None
    measured_on: str | None = None
    """What the memory step ran (a plan made before it was recorded: the epoch's second window)."""
    seconds_per_epoch: float | None = None
    hours_per_billion_tokens: float | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, record: Record) -> Measured:
        numbers = {name: record.number(name, None) for name in ("tokens_per_s", "step_time_s", "seconds_per_epoch",
                                                                 "hours_per_billion_tokens")}
        return cls(peak_bytes=record.count("peak_bytes", None), fits=record.flag("fits", None),
                   measured_on=record.text("measured_on", None), error=record.text("error", None), **numbers)


@dataclass(frozen=True, kw_only=True)
class CandidateRow:
    """One candidate of the plan: its decision (train's flags), its estimate, and what was measured of it."""

    id: str
    decision: dict[str, Any]
    """:data:`DECISION_FIELDS` as train's flags."""
    estimated_peak_bytes: int
    estimated_by_category: dict[str, float] = field(default_factory=dict)
    fits_estimate: bool | None = None
    status: str = "not measured"
    accumulation_bytes: int | None = None
    """What accumulation adds to the estimated peak (None: no accumulation)."""
    measured: Measured | None = None
    rounds: Rounds | None = None
    memory: dict[str, Any] | None = None
    """How its memory was decided: by the estimate within its measured error, or measured (``cadence.plan``)."""

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, **self.decision, "estimated_peak_bytes": self.estimated_peak_bytes,
                "estimated_by_category": self.estimated_by_category, "fits_estimate": self.fits_estimate,
                "status": self.status, "accumulation_bytes": self.accumulation_bytes,
                "measured": self.measured.as_json() if self.measured is not None else None,
                "rounds": self.rounds.as_json() if self.rounds is not None else None,
                **({"memory": self.memory} if self.memory is not None else {})}

    @classmethod
    def read(cls, record: Record) -> CandidateRow:
        measured, rounds = record.record("measured", None), record.record("rounds", None)
        return cls(id=record.text("id"), decision=_flags(record, DECISION_FIELDS, DECISION_DEFAULTS),
                   estimated_peak_bytes=record.count("estimated_peak_bytes"),
                   estimated_by_category=record.take("estimated_by_category", _NUMBERS, {}),
                   fits_estimate=record.flag("fits_estimate", None), status=record.text("status", "not measured"),
                   accumulation_bytes=record.count("accumulation_bytes", None),
                   measured=Measured.read(measured) if measured is not None else None,
                   rounds=Rounds.read(rounds) if rounds is not None else None,
                   memory=record.take("memory", OBJECT, None))


@dataclass(frozen=True, kw_only=True)
class CutRow:
    """The chosen configuration measured with its windows cut another way (the same samples and gradient)."""

    cut: str
    id: str
    flags: dict[str, Any]
    """:data:`CUT_FLAGS` as train's flags."""
    real_share: float | None
    tokens_per_s: float | None
    ratio: float | None
    peak_bytes: int | None
    fits: bool
    error: str | None
    chosen: bool
    rounds: Rounds | None = None

    def as_json(self) -> dict[str, Any]:
        return {"cut": self.cut, "id": self.id, **self.flags, "real_share": self.real_share,
                "tokens_per_s": self.tokens_per_s, "ratio": self.ratio, "peak_bytes": self.peak_bytes,
                "fits": self.fits, "error": self.error, "chosen": self.chosen,
                "rounds": self.rounds.as_json() if self.rounds is not None else None}

    @classmethod
    def read(cls, record: Record) -> CutRow:
        rounds = record.record("rounds", None)
        return cls(cut=record.text("cut"), id=record.text("id"), flags=_flags(record, CUT_FLAGS, CUT_FLAG_DEFAULTS),
                   real_share=record.number("real_share", None), tokens_per_s=record.number("tokens_per_s", None),
                   ratio=record.number("ratio", None), peak_bytes=record.count("peak_bytes", None),
                   fits=record.flag("fits", False), error=record.text("error", None),
                   chosen=record.flag("chosen", False), rounds=Rounds.read(rounds) if rounds is not None else None)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The plan's decision: the candidate, train's flags (the decision and the cut), and why."""

    id: str
    flags: dict[str, Any]
    """:data:`DECISION_FIELDS` and :data:`CUT_FLAGS` as train's flags."""
    reason: str

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, **self.flags, "reason": self.reason}

    @classmethod
    def read(cls, record: Record) -> Choice:
        flags = _flags(record, DECISION_FIELDS, DECISION_DEFAULTS) | _flags(record, CUT_FLAGS, CUT_FLAG_DEFAULTS)
        return cls(id=record.text("id", "?"), flags=flags, reason=record.text("reason", ""))


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What ``train --plan`` should see: the decision's throughput (the median of its rounds) and peak."""

    tokens_per_s: float | None
    tokens_per_s_band: float | None
    rounds: int
    seconds_per_epoch: float | None
    peak_bytes: int | None
    peak_from: str = "measured"
    """Where the peak comes from: "measured", or "estimate" (within the estimate's measured error of the budget)."""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, record: Record) -> Prediction:
        return cls(tokens_per_s=record.number("tokens_per_s", None),
                   tokens_per_s_band=record.number("tokens_per_s_band", None), rounds=record.count("rounds", 1),
                   seconds_per_epoch=record.number("seconds_per_epoch", None),
                   peak_bytes=record.count("peak_bytes", None), peak_from=record.text("peak_from", "measured"))


@dataclass(frozen=True, kw_only=True)
class PlanSource:
    """The data a plan measured, as train's flags: what ``train --plan`` reads again unless told otherwise."""

    data: Path | None
    """The data's resolved path; None: the built-in corpus."""
    fields: dict[str, Any]
    """How its rows became examples (``cadence.data.source.FIELD_DEFAULTS``' flags, those recorded)."""
    data_fingerprint: str | None
    given: bool = True
    """Whether plan.json records the data at all (plans written before sources were recorded do not)."""

    def as_json(self) -> dict[str, Any]:
        return {**self.fields, "data": str(self.data) if self.data is not None else None,
                "data_fingerprint": self.data_fingerprint}

    @classmethod
    def read(cls, record: Record) -> PlanSource:
        # An empty path is the current directory: a plan.json edited or damaged to "" would have train read (and
        # store) everything under it. The data is a named file or directory, or null for the corpus.
        if record.has("data") and not str(record.get("data")).strip():
            raise record.invalid("data", "is empty, not the path of the data it measured")
        data = record.take("data", field_kind(_HINTS["data"]), None)
        fields = {name: record.take(name, field_kind(_HINTS[name])) for name in FIELD_DEFAULTS if record.has(name)}
        if fields.get("train_on", "assistant") not in TRAIN_ON:
            raise record.invalid("train_on", f"is {fields['train_on']!r}, not one of {', '.join(TRAIN_ON)}")
        return cls(data=data, fields=fields, data_fingerprint=record.text("data_fingerprint", None),
                   given="data" in record.data)


@dataclass(frozen=True, kw_only=True)
class OptimizerLever:
    """Another optimizer whose state would be smaller than the user's, listed with its estimate and never tried: the
    optimizer changes the math, so it is the user's choice, not the plan's (issue 51)."""

    optimizer: str
    """Its --optimizer name."""
    state_bytes: int
    """Its estimated state on this model (``OptimizerSpec.state_bytes`` through the memory estimate)."""
    chosen_state_bytes: int
    """The state of the user's optimizer as the chosen configuration keeps it (its --optimizer-state included)."""
    tried: bool = False
    """Always False: a plan never trains another optimizer than the user's."""

    def as_json(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "state_bytes": self.state_bytes,
                "chosen_state_bytes": self.chosen_state_bytes, "tried": self.tried}

    @classmethod
    def read(cls, record: Record) -> OptimizerLever:
        return cls(optimizer=record.text("optimizer"), state_bytes=record.count("state_bytes"),
                   chosen_state_bytes=record.count("chosen_state_bytes"), tried=record.flag("tried", False))


ADAPTIVE_FLAGS: tuple[str, ...] = ("effective_batch_size", "min_effective_batch_size", "max_effective_batch_size",
                                   "batch_lr_scaling", "batch_ramp_tokens", "batch_branch_test",
                                   "batch_branch_tolerance")
"""Train's flags of an adaptive batch, as plan.json's ``adaptive_batch`` records them."""


@dataclass(frozen=True, kw_only=True)
class PlanAdaptive:
    """The adaptive batch a plan planned for (``cadence plan --effective-batch-size adaptive``): its policy as train's
    flags, which ``train --plan`` trains with, the branch test's snapshot counted in every candidate's memory, and
    the throughput at both ends of the range."""

    flags: dict[str, Any]
    """:data:`ADAPTIVE_FLAGS` as train's flags (``effective_batch_size`` is ``adaptive``, or ``ramp`` with its token
    counts; the branch test's two only when it is on)."""
    snapshot_bytes: int = 0
    """The chosen configuration's branch-test snapshot (weights and optimizer state), counted in its peak; 0 without
    --batch-branch-test."""
    throughput: dict[str, Any] | None = None
    """Tokens/s at the minimum (measured) and the maximum (derived), with how each was obtained
    (``cadence.plan.adaptive.RangeThroughput``)."""

    def as_json(self) -> dict[str, Any]:
        return {**self.flags, "snapshot_bytes": self.snapshot_bytes, "throughput": self.throughput}

    @classmethod
    def read(cls, record: Record) -> PlanAdaptive:
        flags = {name: record.take(name, field_kind(_HINTS[name])) for name in ADAPTIVE_FLAGS if record.has(name)}
        if flags.get("effective_batch_size") not in ("adaptive", "ramp"):
            raise record.invalid("effective_batch_size", "is neither adaptive nor ramp")
        for name in ("min_effective_batch_size", "max_effective_batch_size"):
            if flags.get(name) is None:
                raise record.invalid(name, "is missing")
        return cls(flags=flags, snapshot_bytes=record.count("snapshot_bytes", 0),
                   throughput=record.take("throughput", OBJECT, None))


@dataclass(frozen=True, kw_only=True)
class PlanRecord:
    """Everything plan.json holds. Objects whose inner fields only the plan's report shows (the diagnosis, the quality
    check, the effective batch) are kept as checked JSON objects; what a reader acts on is typed."""

    created: str
    duration_s: float | None
    model: str | None
    """The model's name (None: a plan.json without one, which train --plan refuses)."""
    model_config: list[str] | None
    parameters: int | None
    seq_len: int | None
    longest_example: int | None
    """Rows of the data's longest micro-batch: what every candidate's peak was measured on."""
    data: str | None
    """The data in words."""
    source: PlanSource | None
    tokens_per_epoch: int | None
    device: str
    effective_batch_size: int | None
    world_size: int
    memory_budget_bytes: int | None
    diagnosis: dict[str, Any]
    candidates: list[CandidateRow]
    prediction: Prediction | None
    time_budget_s: float | None
    choice: Choice | None
    quality: dict[str, Any] | None
    notes: list[str]
    lora: dict[str, Any] | None
    """The LoRA flags the plan trained (each of its TrainConfig type), with the base it chose."""
    training: dict[str, Any] | None
    time_spent_s: dict[str, float] = field(default_factory=dict)
    cuts: list[CutRow] = field(default_factory=list)
    effective_batch: dict[str, Any] | None = None
    estimate_error: dict[str, Any] | None = None
    """How far the memory estimate was trusted: its measured error per model family and lever (``cadence.plan``)."""
    objective: dict[str, Any] | None = None
    """The objective's flags the plan measured (--objective, --beta, --reference-model ...; each of its TrainConfig
    type; its reference's mode is the decision's): train --plan trains that objective."""
    optimizer: str | None = None
    """The user's --optimizer: what every candidate was estimated and measured with (None: a plan.json before it)."""
    optimizer_levers: list[OptimizerLever] = field(default_factory=list)
    """Other optimizers with a smaller state, each with its estimate, not tried (``cadence.plan.optimizer_levers``)."""
    adaptive_batch: PlanAdaptive | None = None
    """The adaptive batch the plan planned for (None: a fixed batch, ``effective_batch_size``); its candidates computed
    the minimum (``effective_batch_size`` then holds it)."""
    version: int = PLAN_VERSION

    def as_json(self) -> dict[str, Any]:
        """plan.json's object, in its order."""
        return {
            "version": self.version, "created": self.created, "duration_s": self.duration_s, "model": self.model,
            "model_config": self.model_config, "parameters": self.parameters, "seq_len": self.seq_len,
            "longest_example": self.longest_example, "data": self.data,
            "source": self.source.as_json() if self.source is not None else None,
            "tokens_per_epoch": self.tokens_per_epoch, "device": self.device,
            "effective_batch_size": self.effective_batch_size, "world_size": self.world_size,
            "memory_budget_bytes": self.memory_budget_bytes, "diagnosis": self.diagnosis,
            "candidates": [row.as_json() for row in self.candidates],
            "prediction": self.prediction.as_json() if self.prediction is not None else None,
            "time_budget_s": self.time_budget_s, "choice": self.choice.as_json() if self.choice is not None else None,
            "quality": self.quality, "notes": self.notes, "lora": self.lora, "training": self.training,
            "time_spent_s": self.time_spent_s, "cuts": [row.as_json() for row in self.cuts],
            "effective_batch": self.effective_batch, "estimate_error": self.estimate_error,
            "objective": self.objective,
            "optimizer": self.optimizer, "optimizer_levers": [lever.as_json() for lever in self.optimizer_levers],
            "adaptive_batch": self.adaptive_batch.as_json() if self.adaptive_batch is not None else None,
        }

    @classmethod
    def read(cls, record: Record) -> PlanRecord:
        """The plan of a record (a plan.json's object): every field checked, an absent one its default."""
        source, choice, prediction = (record.record(key, None) for key in ("source", "choice", "prediction"))
        lora, objective = record.record("lora", None), record.record("objective", None)
        adaptive = record.record("adaptive_batch", None)
        return cls(
            version=record.count("version", PLAN_VERSION), created=record.text("created", "?"),
            duration_s=record.number("duration_s", None), model=_model(record),
            model_config=record.take("model_config", field_kind(_HINTS["model_config"]), None),
            parameters=record.count("parameters", None), seq_len=record.count("seq_len", None),
            longest_example=record.count("longest_example", None), data=record.text("data", None),
            source=PlanSource.read(source) if source is not None else None,
            tokens_per_epoch=record.count("tokens_per_epoch", None), device=record.text("device", "?"),
            effective_batch_size=record.count("effective_batch_size", None),
            world_size=record.count("world_size", 1), memory_budget_bytes=record.count("memory_budget_bytes", None),
            diagnosis=record.take("diagnosis", OBJECT, {}),
            candidates=[CandidateRow.read(row) for row in record.records("candidates", [])],
            prediction=Prediction.read(prediction) if prediction is not None else None,
            time_budget_s=record.number("time_budget_s", None),
            choice=Choice.read(choice) if choice is not None else None,
            quality=record.take("quality", OBJECT, None), notes=record.take("notes", list_of(TEXT), []),
            lora=_lora(lora) if lora is not None else None, training=record.take("training", OBJECT, None),
            time_spent_s=record.take("time_spent_s", _NUMBERS, {}),
            cuts=[CutRow.read(row) for row in record.records("cuts", [])],
            effective_batch=record.take("effective_batch", OBJECT, None),
            estimate_error=record.take("estimate_error", OBJECT, None),
            objective=_objective(objective) if objective is not None else None, optimizer=record.text("optimizer", None),
            optimizer_levers=[OptimizerLever.read(row) for row in record.records("optimizer_levers", [])],
            adaptive_batch=PlanAdaptive.read(adaptive) if adaptive is not None else None)

    def candidate(self, candidate_id: str | None) -> CandidateRow | None:
        return next((row for row in self.candidates if row.id == candidate_id), None)


def _model(record: Record) -> str | None:
    model = record.text("model", None)
    if model is not None and not model.strip():
        raise record.invalid("model", "is empty, not a model name")
    return model


def _lora(record: Record) -> dict[str, Any]:
    """The LoRA flags a plan recorded, each of its TrainConfig type (other keys are not train's: left out)."""
    return {name: record.take(name, field_kind(_HINTS[name])) for name in record.data
            if name in FIELD_NAMES and section_of(name) is LORA and record.has(name)}


def _objective(record: Record) -> dict[str, Any]:
    """The objective's flags a plan recorded, each of its TrainConfig type (a decision field is the choice's)."""
    return {name: record.take(name, field_kind(_HINTS[name])) for name in record.data
            if name in FIELD_NAMES and section_of(name) is OBJECTIVE and name not in DECISION_FIELDS
            and record.has(name)}


def read_plan(path: Path, *, where: str) -> PlanRecord:
    """The plan in ``path``, read as untrusted input: a regular file only (a pipe or a device is refused, not read),
    parsed and checked field by field; any problem is one line naming ``where`` and the file (and the field)."""
    content = read_regular_file(path, where=where, limit=PLAN_LIMIT_BYTES)
    return PlanRecord.read(Record.parse(content, f"{where} {path}" if where.startswith("--") else str(path)))


def write_plan(path: Path, plan: PlanRecord) -> None:
    """plan.json, atomically (its one writer)."""
    atomic_write_json(path, plan.as_json())


__all__ = ["ADAPTIVE_FLAGS", "CUT_FLAGS", "DECISION_DEFAULTS", "DECISION_FIELDS", "MARKS", "PLAN_FILE", "Choice", "CandidateRow",
           "CutRow", "Measured", "OptimizerLever", "PlanAdaptive", "PlanRecord", "PlanSource", "Prediction", "Rounds", "read_plan", "write_plan"]
