"""The rules of ``cadence audit`` (tabled in ``cadence.audit.checker``'s docstring) and the analysis of the event stream that
``cadence.audit.checker.Audit`` records.

The instrumentation (``cadence.audit.checker``) appends small tuples, one per call of interest, in call order; this module
turns that stream into windows (the backward passes between two optimizer steps) and findings. The analysis is a
single pass that can be fed in chunks, so a long run keeps only aggregates, never its whole history.

Event tuples (the first item is the kind; ``loc`` is ``(filename, lineno, via)`` in the user's code, ``via`` the
``(filename, lineno)`` of the library call below it or None; or None):

    (BACKWARD, loc, ddp, stale)        ddp: None | (forward_synced, backward_in_no_sync, no_sync_loc);
                                       stale: the gradients were left untouched since the previous step
    (NORM, loc, weights, counts, unit) just before a STEP: the gradient weight each micro-batch of the window gave
                                       each of its targets, and its target count (None when unknown); lists, or
                                       tensors on an accelerator; loc is the window's first backward; unit: what
                                       the weights are per ("targets", "pairs" of a preference loss, or "orpo": the
                                       NLL term's targets of a preference loss)
    (FOUND, loc, rule, severity, detail)  a finding the checker saw whole (CAD027)
    (STEP, loc, optimizer_id, did_step, via_scaler)
    (ZERO_GRAD, loc)  (CLIP, loc)  (SCALE, loc)  (UNSCALE, loc, optimizer_id)  (UPDATE, loc)
    (SCHEDULER, loc, scheduler_id, is_plateau)  (AUTOCAST, loc, is_fp16)  (EPOCH,)
    (ORTHO, loc, in_backward)          Newton-Schulz called (cadence.audit.optimizers: CAD022-CAD024's events)
    (ORTHO_STEP, loc, optimizer_id)    an orthogonalising optimizer stepped (just before its STEP)
    (CLIP_IN_STEP, loc)  (TRAIN_MODE, loc, what)
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from array import array
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

BACKWARD, STEP, ZERO_GRAD, CLIP, SCALE, UNSCALE, UPDATE, SCHEDULER, AUTOCAST, EPOCH, NORM = range(11)
ORTHO, ORTHO_STEP, CLIP_IN_STEP, TRAIN_MODE = range(11, 15)
FOUND = 15

Loc = tuple[str, int, tuple[str, int] | None] | None

_APART = 1.1  # CAD018/CAD021: weights more than 10% apart

ERROR, WARNING, INFO = "error", "warning", "info"
"""The levels. ERROR: the loop computes a different gradient, update or LR schedule than one big batch would (or
torch raises); ``cadence audit`` exits 1. WARNING: performance only (the math is right, e.g. needless
communication); exit 0 unless ``--strict``. INFO: harmless, worth knowing."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One thing a training loop can get wrong about the step chain (docs/ARCHITECTURE.md, "The step chain")."""

    id: str
    level: str
    what: str
    fix: str


_RULE_LIST = [
    Rule(id="CAD001", level=ERROR, what="gradients clipped while still scaled by the fp16 GradScaler "
         "(no scaler.unscale_ since the last step), so the clip threshold is multiplied by the loss scale",
         fix="call scaler.unscale_(optimizer) right before clip_grad_norm_"),
    Rule(id="CAD002", level=ERROR, what="gradients clipped where the window's gradient is not complete "
         "(another backward follows before the optimizer step, or no backward since the last step)",
         fix="clip once per optimizer step, after the window's last backward"),
    Rule(id="CAD003", level=ERROR, what="scaler.unscale_ called where the window's gradient is not complete "
         "(another backward follows before the step): later micro-batches add scaled to unscaled gradients",
         fix="unscale once per optimizer step, after the window's last backward"),
    Rule(id="CAD004", level=ERROR, what="scaler.unscale_ called twice for one optimizer in one step "
         "(torch raises)", fix="unscale each optimizer once, between the last backward and scaler.step"),
    Rule(id="CAD005", level=ERROR, what="LR scheduler stepped more than once per optimizer step "
         "(per micro-batch): the schedule runs grad_accum_steps times too fast",
         fix="call scheduler.step() once, after the optimizer step of each window"),
    Rule(id="CAD006", level=ERROR, what="LR scheduler stepped before the first optimizer step: the schedule's "
         "first value is skipped (torch's own warning)", fix="call scheduler.step() after optimizer.step()"),
    Rule(id="CAD007", level=ERROR, what="LR scheduler stepped after an fp16 step that the GradScaler skipped "
         "(inf/nan gradients): the schedule advances for a step that did not happen",
         fix="compare scaler.get_scale() before and after scaler.update(); step the scheduler only if it did not drop"),
    Rule(id="CAD008", level=ERROR, what="zero_grad inside the accumulation window: gradients of earlier "
         "micro-batches are discarded before the optimizer used them",
         fix="zero gradients once per window, after the optimizer step (or before the window's first backward)"),
    Rule(id="CAD009", level=ERROR, what="optimizer.step with no backward since this optimizer's previous step: "
         "it applies stale or empty gradients (momentum and weight decay still move the weights)",
         fix="step once per window, after its backwards"),
    Rule(id="CAD010", level=ERROR, what="accumulation windows of different lengths (a short one is only "
         "expected at the end of an epoch or run): those steps weigh their micro-batches differently",
         fix="count micro-steps from the window start, e.g. `if (i + 1) % accum == 0 or last:`"),
    Rule(id="CAD011", level=ERROR, what="fp16 autocast without a GradScaler: small gradients underflow to zero "
         "in fp16", fix="scale the loss with torch.amp.GradScaler, or use bf16 autocast"),
    Rule(id="CAD012", level=INFO, what="GradScaler used with bf16 autocast: harmless but unneeded (bf16 has "
         "fp32's exponent range)", fix="drop the GradScaler for bf16"),
    Rule(id="CAD013", level=ERROR, what="scaler.step called again without scaler.update in between "
         "(update missing): the loss scale never adapts (torch raises on the second step)",
         fix="call scaler.update() once after every scaler.step(optimizer)"),
    Rule(id="CAD014", level=ERROR, what="scaler.update called without a scaler.step since the previous update "
         "(per micro-batch; torch raises)", fix="call scaler.update() once per optimizer step, after scaler.step"),
    Rule(id="CAD015", level=WARNING, what="DDP all-reduces gradients on a non-final micro-step of a window "
         "(forward and backward outside no_sync): wasted communication",
         fix="wrap the forward AND backward of every micro-step but the window's last in model.no_sync()"),
    Rule(id="CAD016", level=WARNING, what="DDP no_sync entered after the forward: DDP decides at forward time, "
         "so this backward still all-reduces (the gradient is still right: wasted communication)", fix="enter model.no_sync() before the forward, not around backward"),
    Rule(id="CAD017", level=ERROR, what="DDP sync suppressed on the window's last micro-step: the optimizer "
         "steps on gradients that were never all-reduced (ranks drift apart)",
         fix="run the window's last forward and backward outside no_sync"),
    Rule(id="CAD018", level=ERROR, what="per-micro-batch mean: the micro-batches of a window give their targets "
         "gradient weights more than 10% apart (each loss divided by its own target count over uneven counts): "
         "targets of short micro-batches weigh more than in one big batch",
         fix="sum the per-target losses and divide by the window's total target count (transformers/TRL: keep "
         "model_accepts_loss_kwargs so the loss is divided by num_items_in_batch)"),
    Rule(id="CAD019", level=ERROR, what="gradients not cleared after an optimizer step: the next window "
         "accumulates onto the gradients already applied", fix="call optimizer.zero_grad() after each step"),
    Rule(id="CAD020", level=INFO, what="backward passes after the last optimizer step were never stepped",
         fix="step the short last window too (or drop it explicitly)"),
    Rule(id="CAD021", level=ERROR, what="a short window (fewer micro-batches than the others: an epoch's last) is "
         "normalised as a full one (a loss divided by the fixed accumulation steps): its gradient is scaled "
         "differently from one big batch of its micro-batches",
         fix="divide by the window's own target count (or its number of micro-batches), not the fixed accumulation "
         "steps"),
    Rule(id="CAD022", level=ERROR, what="Newton-Schulz orthogonalisation (Muon) on an incomplete window: in a "
         "backward pass (a gradient hook), with another backward of the window still to come, or an orthogonalising "
         "optimizer stepped more than once in a window of the loop's other optimizer: the orthogonalisation of a sum "
         "is not the sum of the orthogonalisations (DeepSpeed #8443)",
         fix="orthogonalise once per optimizer step, on the window's whole gradient: step Muon once per window, "
         "after its last backward, with the loop's other optimizers"),
    Rule(id="CAD023", level=ERROR, what="gradients clipped inside an optimizer's step, after the update is made: "
         "clipping an orthogonalised update divides it by its own norm (DeepSpeed #8439: 4.2x to 85.6x smaller "
         "updates)", fix="clip the raw gradient once, after the window's last backward and before optimizer.step"),
    Rule(id="CAD024", level=ERROR, what="a schedule-free optimizer's model evaluated (model.eval()) or saved "
         "(torch.save, safetensors) while the optimizer is in train mode: the weights are the gradient point y, not "
         "the averaged weights x (schedule_free #48, accelerate #4159)",
         fix="call optimizer.eval() before evaluating or saving, and optimizer.train() before the next step"),
    Rule(id="CAD025", level=ERROR, what="per-micro-batch pair mean: a preference loss (DPO, IPO, SimPO...) averaged "
         "over each micro-batch's pairs gives the pairs of a window weights more than 10% apart (unequal pair counts: "
         "a short last micro-batch, dropped pairs, padding-free batching)",
         fix="sum the per-pair losses and divide by the window's pair count, summed over micro-batches and ranks "
         "before the first backward (cadence train --objective dpo)"),
    Rule(id="CAD026", level=ERROR, what="per-micro-batch NLL mean in a preference loss (ORPO, CPO, DPO's sft term): "
         "the chosen completions' tokens of a window weigh more than 10% apart",
         fix="sum the NLL over the chosen tokens and divide by the window's chosen-token count (cadence train "
         "--objective orpo)"),
    Rule(id="CAD027", level=ERROR, what="KTO's reference point (the KL estimate z) is taken per micro-batch: with "
         "several micro-batches per optimizer step the objective itself changes with the split",
         fix="estimate z over the whole window (every micro-batch and rank) before its first backward (cadence "
         "train --objective kto), or train one micro-batch per optimizer step"),
]
RULES: dict[str, Rule] = {rule.id: rule for rule in _RULE_LIST}

# A finding that is a mere consequence of another at the same line is dropped (say one thing once).
_IMPLIED_BY = {"CAD006": "CAD005", "CAD004": "CAD003"}


@dataclass(frozen=True, kw_only=True)
class RuleViolation:
    """One rule broken at one place of the user's code (``count`` times).

    Not ``cadence.verify.check.Finding`` (a property of a model, its data or its loss that makes a configuration's
    math differ from the big batch): this one is a call the audited loop made, at a file and line."""

    rule: str
    level: str
    what: str
    fix: str
    file: str | None
    """The first frame of the user's own code (outside torch and the installed libraries)."""
    line: int | None
    via_file: str | None = None
    """The library frame that made the call below the user's frame (accelerate, transformers, ...), or None."""
    via_line: int | None = None
    count: int = 1
    detail: str = ""
    """What was measured, when the rule measures (CAD018: how far apart the weights were; CAD021: the scaling)."""

    @property
    def where(self) -> str:
        if self.file is None:
            return "<unknown>"
        place = f"{_short_path(self.file)}:{self.line}"
        if self.via_file is not None:
            place += f" via {_library_path(self.via_file)}:{self.via_line}"
        return place


@dataclass(kw_only=True)
class ObservedCadence:
    """What the loop did, as the audit saw it."""

    backwards: int = 0
    optimizer_steps: int = 0
    """Optimizer steps that really happened (scaler.step calls that skipped are not counted)."""
    skipped_steps: int = 0
    windows: int = 0
    window_lengths: dict[int, int] = field(default_factory=dict)
    """Backward passes per window -> how many windows had that many."""
    precision: str = "fp32"
    grad_scaler: bool = False
    clip_calls: int = 0
    unscale_calls: int = 0
    zero_grad_calls: int = 0
    scheduler_steps: int = 0
    ddp: bool = False
    ddp_suppressed_micro_steps: int = 0


@dataclass(kw_only=True)
class AuditReport:
    """The rules broken (``findings``, sorted by place) and the observed cadence of one audited run."""

    findings: list[RuleViolation]
    cadence: ObservedCadence
    crashed: bool = False
    """The audited code raised; trailing unstepped backwards are then expected and not reported."""

    @property
    def has_errors(self) -> bool:
        return any(f.level == ERROR for f in self.findings)

    @property
    def has_warnings(self) -> bool:
        return any(f.level == WARNING for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``cadence audit --json``)."""
        cadence = asdict(self.cadence)
        cadence["window_lengths"] = {str(k): v for k, v in sorted(self.cadence.window_lengths.items())}
        return {
            "findings": [asdict(f) | {"where": f.where} for f in self.findings],
            "cadence": cadence,
            "crashed": self.crashed,
            "errors": sum(f.level == ERROR for f in self.findings),
            "warnings": sum(f.level == WARNING for f in self.findings),
        }


def _library_path(path: str) -> str:
    """A library file as its import path shows it (``accelerate/accelerator.py``): below the sys.path entry that holds
    it, else as ``_short_path``."""
    best = ""
    for entry in sys.path:
        entry = os.path.join(os.path.abspath(entry or "."), "")
        if path.startswith(entry) and len(entry) > len(best):
            best = entry
    return path[len(best):] if best else _short_path(path)


def _short_path(path: str) -> str:
    """Relative to the working directory when the file is below it (what a user types), else as recorded."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


class Analyzer:
    """Consumes events in order (``feed``, any number of times) and produces the report (``finish``)."""

    def __init__(self) -> None:
        self.cadence = ObservedCadence()
        self._hits: dict[tuple[str, Loc], int] = {}
        # closed windows, compact (a long run has one per optimizer step): length, where the closing step was
        # called (an index into _locs), and the windows followed by a new DataLoader epoch
        self._lengths = array("l")
        self._step_locs = array("l")
        self._locs: dict[Loc, int] = {}
        self._epoch_ends: set[int] = set()
        self._bws: list[tuple] = []  # backward events of the open window
        self._boundaries = 0  # optimizer steps attempted (a consecutive step of another optimizer included)
        self._bw_at_step: dict[int, int] = {}  # optimizer -> backwards seen at its last step
        # the open window, since the last boundary
        self._zero_after_bw: Loc = None
        self._clip: Loc = None
        self._unscale: Loc = None
        self._scaled = False
        self._unscaled: set[int] = set()
        # since the last backward
        self._autocast: tuple[Loc, bool] | None = None
        self._scaled_since_bw = False
        # GradScaler state (reset by update)
        self._scaler_stepped: dict[int, Loc] = {}
        self._skipped_pending = False
        # schedulers: id -> boundaries at its last step; steps; candidates of CAD007
        self._sched_last: dict[int, int] = {}
        self._sched_steps: Counter[int] = Counter()
        self._after_skip: list[tuple[int, Loc]] = []
        # normalisation: the pending NORM of the open window; the closed windows' (index, loc, weights, counts) not
        # yet resolved; each window's total weight (NaN: unknown) and its first backward's place (an index in _locs)
        self._norm_pending: tuple[Loc, Any, Any, str] | None = None
        self._norm_windows: list[tuple[int, Loc, Any, Any, str]] = []
        self._totals = array("d")
        self._norm_locs = array("l")
        self._all_unit = True  # every weight so far exactly 1: a plain summed loss (no normalisation to check)
        self._details: dict[tuple[str, Loc], tuple[float, str]] = {}  # the worst measurement per finding
        self._precisions: set[str] = set()
        # optimizers (CAD022): where an orthogonalisation waits for its window to close, each optimizer's last step
        # in the order of all steps, and which optimizers orthogonalise
        self._ortho: Loc = None
        self._step_seq = 0
        self._seq_of: dict[int, int] = {}
        self._orthogonal: set[int] = set()

    # ------------------------------------------------------------------------------------------------ helpers
    def _hit(self, rule: str, loc: Loc) -> None:
        key = (rule, loc)
        self._hits[key] = self._hits.get(key, 0) + 1

    # ------------------------------------------------------------------------------------------------ feeding
    def feed(self, events: Iterable[tuple]) -> None:
        for event in events:
            kind = event[0]
            if kind == BACKWARD:
                self._backward(event)
            elif kind == STEP:
                self._step(event)
            elif kind == ZERO_GRAD:
                self.cadence.zero_grad_calls += 1
                if self._bws and self._zero_after_bw is None:
                    self._zero_after_bw = event[1]
            elif kind == CLIP:
                self._clip_event(event[1])
            elif kind == SCALE:
                self.cadence.grad_scaler = True
                self._scaled = self._scaled_since_bw = True
                if self._autocast is not None and not self._autocast[1]:
                    self._hit("CAD012", event[1])
            elif kind == UNSCALE:
                self._unscale_event(event[1], event[2])
            elif kind == UPDATE:
                if not self._scaler_stepped:
                    self._hit("CAD014", event[1])
                self._scaler_stepped.clear()
                self._unscaled.clear()
            elif kind == SCHEDULER:
                self._scheduler(event[1], event[2], event[3])
            elif kind == AUTOCAST:
                self._autocast = (event[1], event[2])
                self._precisions.add("fp16" if event[2] else "bf16")
            elif kind == NORM:
                self._norm_pending = (event[1], event[2], event[3], event[4])
            elif kind == FOUND:
                self._hit_measured(event[2], event[1], event[3], event[4])
            elif kind == EPOCH:
                if self._lengths and not self._bws:
                    self._epoch_ends.add(len(self._lengths) - 1)
            elif kind == ORTHO:
                if event[2]:
                    self._hit("CAD022", event[1])  # in a backward: a micro-batch's gradient
                elif self._bws:
                    self._ortho = event[1]  # judged at the next backward or step, as a clip is
            elif kind == ORTHO_STEP:
                self._orthogonal_step(event[1], event[2])
            elif kind in (CLIP_IN_STEP, TRAIN_MODE):
                self._hit("CAD023" if kind == CLIP_IN_STEP else "CAD024", event[1])
        if len(self._norm_windows) >= 64:
            self._resolve_norm()

    def _backward(self, event: tuple) -> None:
        _, loc, ddp, stale = event
        self.cadence.backwards += 1
        if self._clip is not None and self._bws:
            self._hit("CAD002", self._clip)
        if self._ortho is not None and self._bws:
            self._hit("CAD022", self._ortho)
        self._ortho = None
        if self._unscale is not None and self._bws:
            self._hit("CAD003", self._unscale)
        self._clip = self._unscale = None
        if self._zero_after_bw is not None:
            self._hit("CAD008", self._zero_after_bw)
            self._zero_after_bw = None
        if self._autocast is not None and self._autocast[1] and not self._scaled_since_bw:
            self._hit("CAD011", self._autocast[0])
        if stale:
            self._hit("CAD019", loc)
        if ddp is not None:
            self.cadence.ddp = True
        self._autocast = None
        self._scaled_since_bw = False
        self._bws.append(event)

    def _clip_event(self, loc: Loc) -> None:
        self.cadence.clip_calls += 1
        if self._scaled and not self._unscaled:
            self._hit("CAD001", loc)
        if not self._bws:
            self._hit("CAD002", loc)  # nothing accumulated since the last step: clips old or empty gradients
        else:
            self._clip = loc  # judged at the next backward or step

    def _unscale_event(self, loc: Loc, optimizer: int) -> None:
        self.cadence.unscale_calls += 1
        if optimizer in self._unscaled:
            self._hit("CAD004", loc)
        self._unscaled.add(optimizer)
        if not self._bws:
            self._hit("CAD003", loc)
        else:
            self._unscale = loc

    def _step(self, event: tuple) -> None:
        _, loc, optimizer, did_step, via_scaler = event
        backwards = self.cadence.backwards
        if self._bw_at_step.get(optimizer, 0) == backwards:
            self._hit("CAD009", loc)
        self._bw_at_step[optimizer] = backwards
        self._step_seq += 1
        self._seq_of[optimizer] = self._step_seq
        self._ortho = None
        if via_scaler:
            if optimizer in self._scaler_stepped:
                self._hit("CAD013", loc)
            self._scaler_stepped[optimizer] = loc
        if did_step:
            self.cadence.optimizer_steps += 1
        else:
            self.cadence.skipped_steps += 1
        if self._zero_after_bw is not None:
            self._hit("CAD008", self._zero_after_bw)
        if self._bws:  # a step right after another optimizer's step belongs to the same boundary
            self._close_window(loc)
            self._boundaries += 1
        elif self._boundaries == 0:
            self._boundaries += 1
        self._skipped_pending = not did_step
        self._zero_after_bw = self._clip = self._unscale = None
        self._scaled = False

    def _orthogonal_step(self, loc: Loc, optimizer: int) -> None:
        """CAD022: an orthogonalising optimizer stepping again before another optimizer of the loop (one that does
        not orthogonalise) has stepped since its previous step: it steps per micro-batch of that one's window."""
        self._orthogonal.add(optimizer)
        previous = self._seq_of.get(optimizer)
        if previous is not None and any(other not in self._orthogonal and seq < previous
                                        for other, seq in self._seq_of.items()):
            self._hit("CAD022", loc)

    def _close_window(self, loc: Loc) -> None:
        bws = self._bws
        self._bws = []
        self._lengths.append(len(bws))
        self._step_locs.append(self._locs.setdefault(loc, len(self._locs)))
        self._totals.append(math.nan)
        self._norm_locs.append(-1)
        pending, self._norm_pending = self._norm_pending, None
        if pending is not None and len(pending[1]) == len(bws):
            self._norm_windows.append((len(self._lengths) - 1, *pending))
        last = len(bws) - 1
        for index, (_, bw_loc, ddp, _) in enumerate(bws):
            if ddp is None:
                continue
            synced, in_no_sync, no_sync_loc = ddp
            if not synced:
                self.cadence.ddp_suppressed_micro_steps += 1
            if index == last:
                if not synced:
                    self._hit("CAD017", bw_loc)
            elif synced:
                if in_no_sync:
                    self._hit("CAD016", no_sync_loc or bw_loc)
                else:
                    self._hit("CAD015", bw_loc)

    def _scheduler(self, loc: Loc, scheduler: int, plateau: bool) -> None:
        self.cadence.scheduler_steps += 1
        self._sched_steps[scheduler] += 1
        last = self._sched_last.get(scheduler)
        if last is not None and last == self._boundaries:
            self._hit("CAD005", loc)
        elif not plateau:
            if self._boundaries == 0:
                self._hit("CAD006", loc)
            elif self._skipped_pending:
                self._after_skip.append((scheduler, loc))
        self._sched_last[scheduler] = self._boundaries

    def _hit_measured(self, rule: str, loc: Loc, severity: float, detail: str) -> None:
        """A finding with a measurement: the worst (largest ``severity``) is the one reported."""
        self._hit(rule, loc)
        key = (rule, loc)
        if key not in self._details or severity > self._details[key][0]:
            self._details[key] = (severity, detail)

    def _resolve_norm(self) -> None:
        """CAD018 per window, and each window's total weight for CAD021 (read at the end); the weights are resolved
        in batches so an accelerator is not synchronised every step."""
        for index, loc, weights, counts, unit in self._norm_windows:
            weights = weights if isinstance(weights, list) else weights.tolist()
            if counts is not None and not isinstance(counts, list):
                counts = counts.tolist()
            # a micro-batch without targets weighs nothing, whatever its loss was divided by
            held = [w for i, w in enumerate(weights) if counts is None or counts[i] > 0]
            if not held or not all(math.isfinite(w) and w > 0 for w in held):
                continue
            self._all_unit = self._all_unit and all(w == 1.0 for w in held)
            apart = max(held) / min(held)
            if apart > _APART:
                rule, what = {"pairs": ("CAD025", "pairs"), "orpo": ("CAD026", "chosen tokens")}.get(
                    unit, ("CAD018", "targets"))
                self._hit_measured(rule, loc, apart, f"in one window the {what} of one micro-batch weigh {apart:.2f}x "
                                                     "those of another (one big batch: 1.00x)")
            if counts is not None:
                self._totals[index] = sum(w * n for w, n in zip(weights, counts))
                self._norm_locs[index] = self._locs.setdefault(loc, len(self._locs))
        self._norm_windows.clear()

    # ------------------------------------------------------------------------------------------------ the end
    def finish(self, *, crashed: bool) -> AuditReport:
        """Rules that need the whole run (window lengths, trailing backwards), then the sorted findings."""
        self._resolve_norm()
        self._check_window_lengths()
        boundaries = max(self._boundaries, 1)
        for scheduler, loc in self._after_skip:
            # Only a scheduler stepped about once per optimizer step follows the steps; a per-epoch one does not.
            if self._sched_steps[scheduler] * 2 >= boundaries:
                self._hit("CAD007", loc)
        if not crashed:
            for loc in self._scaler_stepped.values():
                self._hit("CAD013", loc)  # the run's last scaler.step was never followed by update
        if self._bws and not crashed:
            self._hit("CAD020", self._bws[0][1])
        cadence = self.cadence
        cadence.windows = len(self._lengths)
        cadence.window_lengths = dict(sorted(Counter(self._lengths).items()))
        if self._precisions:
            cadence.precision = "+".join(sorted(self._precisions))
        findings = []
        for (rule_id, loc), count in self._hits.items():
            implied_by = _IMPLIED_BY.get(rule_id)
            if implied_by is not None and (implied_by, loc) in self._hits:
                continue
            rule = RULES[rule_id]
            via = loc[2] if loc else None
            findings.append(RuleViolation(rule=rule_id, level=rule.level, what=rule.what, fix=rule.fix,
                                          file=loc[0] if loc else None, line=loc[1] if loc else None,
                                          via_file=via[0] if via else None, via_line=via[1] if via else None,
                                          count=count, detail=self._details.get((rule_id, loc), (0.0, ""))[1]))
        findings.sort(key=lambda f: (f.file or "", f.line or 0, f.rule))
        return AuditReport(findings=findings, cadence=cadence, crashed=crashed)

    def _check_window_lengths(self) -> None:
        """CAD010: a window whose length differs from the usual one, unless it is a short last one (run/epoch)."""
        lengths = self._lengths
        if len(lengths) < 2:
            return
        counts = Counter(lengths)
        usual = max(counts, key=lambda length: (counts[length], length))
        last = len(lengths) - 1
        odd = [i for i, length in enumerate(lengths) if length != usual]
        # Loops over lists or generators show no DataLoader epochs; a short window recurring every p windows
        # (p >= 2) at the same length looks like the end of each epoch: accept it.
        periodic = False
        short = [i for i in odd if i != last]
        if not self._epoch_ends and short and all(lengths[i] < usual for i in short):
            period = short[0] + 1
            periodic = (period >= 2 and short == list(range(period - 1, last, period))
                        and len({lengths[i] for i in short}) == 1)
        locs = list(self._locs)
        short_ok = []
        for i in odd:
            if lengths[i] < usual and (i == last or i in self._epoch_ends or periodic):
                short_ok.append(i)
                continue
            self._hit("CAD010", locs[self._step_locs[i]])
        self._check_short_windows(short_ok, usual, locs)

    def _check_short_windows(self, short: list[int], usual: int, locs: list[Loc]) -> None:
        """CAD021: a short window (one CAD010 accepts) whose total weight differs from the full windows'. Only for a
        loop that averages over its windows: the full windows' totals agree (within 10%) and are not a plain summed
        loss (every weight 1: one big batch sums too, and its short window is right)."""
        if not short or self._all_unit:
            return
        full = [self._totals[i] for i, length in enumerate(self._lengths) if length == usual]
        full = [total for total in full if not math.isnan(total)]
        if not full:
            return
        typical = statistics.median(full)
        if typical <= 0 or any(not (1 / _APART <= total / typical <= _APART) for total in full):
            return
        for i in short:
            total = self._totals[i]
            if math.isnan(total) or self._norm_locs[i] < 0:
                continue
            ratio = total / typical
            if not (1 / _APART <= ratio <= _APART):
                self._hit_measured("CAD021", locs[self._norm_locs[i]], abs(math.log(ratio)),
                                   f"a window of {self._lengths[i]} micro-batch{'es' if self._lengths[i] != 1 else ''} (the "
                                   f"others {usual}) gets "
                                   f"{ratio:.2f}x the gradient of one big batch of its micro-batches")


def format_report(report: AuditReport) -> str:
    """The human report: the observed cadence, then one block per finding (level, rule, file:line, what, fix)."""
    c = report.cadence
    lengths = ", ".join(f"{length} x{count}" for length, count in c.window_lengths.items()) or "none"
    scaler = " with GradScaler" if c.grad_scaler else ""
    lines = [
        f"cadence audit: {c.optimizer_steps} optimizer steps ({c.skipped_steps} skipped) from {c.backwards} backward "
        f"passes in {c.windows} windows (backwards per window: {lengths})",
        f"  precision {c.precision}{scaler}; clip {c.clip_calls}, unscale {c.unscale_calls}, zero_grad "
        f"{c.zero_grad_calls}, scheduler steps {c.scheduler_steps}; DDP "
        + (f"yes ({c.ddp_suppressed_micro_steps} micro-steps under no_sync)" if c.ddp else "no"),
    ]
    for f in report.findings:
        times = f" (x{f.count})" if f.count > 1 else ""
        lines.append(f"{f.level:<7} {f.rule} {f.where}{times}: {f.what}")
        if f.detail:
            lines.append(f"{'':<15}measured: {f.detail}")
        lines.append(f"{'':<15}fix: {f.fix}")
    levels = Counter(f.level for f in report.findings)
    if report.findings:
        lines.append(f"{levels[ERROR]} errors, {levels[WARNING]} warnings, {levels[INFO]} info")
    else:
        lines.append("no findings: the step chain looks right")
    return "\n".join(lines)
