"""The step chain: one optimizer step from one window of micro-batches, readable top to bottom in ``Engine.step``.

Use it from your own loop::

    engine = Engine(model, optimizer, scheduler=scheduler, precision="bf16", max_grad_norm=1.0)
    for window in iter_windows(loader, grad_accum_steps=4):
        result = engine.step(window)

Rules it keeps (each has a test that fails when the rule is broken):
- every micro-batch's summed loss is divided by the window's count of the objective's reduction unit (over all
  processes; target tokens for the default objective, cadence.engine.objective), so any split of the window gives
  the gradient of one big batch, whatever the padding and the targets per example;
- gradients synchronise only on the window's last micro-batch (the sync context is entered before its forward);
- fp16 unscales before clipping; clipping happens once per window, on the total norm;
- accumulation makes the largest gradients once: the token embedding's and (fp32) the head's are added straight into
  ``.grad`` (cadence.memory.grad_in_place), so micro-batch 1 x accumulation 8 peaks no higher than 8 x 1;
- the LR scheduler advances only when the optimizer really stepped; skipped steps are counted apart.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from cadence.engine.choices import PrecisionName
from cadence.engine.noise_scale import FirstGradient, GradientNoiseScale, local_first_gradient
from cadence.engine.objective import Objective
from cadence.engine.precision import Precision
from cadence.engine.token_loss import LossFn, token_cross_entropy_sum
from cadence.engine.windows import IGNORE_INDEX, Batch, Window, WindowCounter, make_window
from cadence.errors import CadenceFailure
from cadence.memory.grad_in_place import accumulate_in_place
from cadence.memory.meter import StepMemoryMeter
from cadence.memory.offload import activation_offload


def looks_like_hf_labels(batch: Batch) -> bool:
    """Whether the labels are surely Hugging Face style, which cadence's loss would read as "predict the current
    token": ``labels`` equal ``input_ids`` at every target (at least 8 of them), AND some target's next position in
    the same example holds another token.

    Equality alone is no proof: next-token labels of text of one repeated character ("-----") equal its inputs too.
    Next-token labels have ``labels[t] == input_ids[t + 1]`` within an example, so equal labels are next-token labels
    only where each token is followed by itself; one target followed by another token rules them out. The example
    ends where the attention mask turns to padding or the position ids start again (packed rows)."""
    labels, inputs = batch["labels"], batch["input_ids"]
    if labels.shape != inputs.shape or labels.dim() == 0:
        return False
    targets = labels != IGNORE_INDEX
    count = int(targets.sum())
    if count < 8 or not bool((labels[targets] == inputs[targets]).all()):
        return False
    continues = targets[..., :-1].clone()  # position t is a target and t + 1 continues its example
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if isinstance(mask, torch.Tensor) and mask.shape == inputs.shape:
        continues &= mask[..., 1:] != 0
    if isinstance(positions, torch.Tensor) and positions.shape == inputs.shape:
        continues &= positions[..., 1:] == positions[..., :-1] + 1
    return bool((inputs[..., 1:] != inputs[..., :-1])[continues].any())


class HuggingFaceLabels(CadenceFailure, ValueError):
    """Hugging Face style labels (equal to ``input_ids``) given to cadence's next-token loss. A ``ValueError`` for a
    user's own loop, and one ``training failed`` line (no traceback) when it happens in a cadence command. The rank
    whose micro-batch it is finds it (the others hold other data), so that rank reports it."""

    label = "training failed"


class Collective(Protocol):
    """What the step chain needs from the process group; the single-process default is ``SingleProcess``."""

    world_size: int

    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        """Context for one micro-batch's forward and backward; ``enabled=False`` suppresses gradient all-reduce."""

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a small float64 vector over all processes (every process receives the sum)."""

    def first_gradient(self, model: torch.nn.Module, *,
                       synced: bool) -> contextlib.AbstractContextManager[FirstGradient]:
        """Only for the gradient noise scale (``Engine(noise_scale=...)``; a collective without it gets none): around
        a window's first micro-batch, its norm once its backward is done (``synced``: that backward synchronises)."""


class SingleProcess:
    """One process: nothing to synchronise."""

    world_size = 1

    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def first_gradient(self, model: torch.nn.Module, *,
                       synced: bool) -> contextlib.AbstractContextManager[FirstGradient]:
        return local_first_gradient(model)


@dataclass(kw_only=True)
class StepResult:
    """What one window did. Counts are summed over all processes."""

    step: int
    """Optimizer steps that really happened so far, this one included."""
    window: int
    """Windows attempted so far, skipped ones included."""
    skipped: bool
    """True when the optimizer did not step (fp16 overflow, non-finite gradients, or no targets)."""
    skip_reason: str | None
    loss: float | None
    """Token-mean loss over the whole window (None when the window had no targets)."""
    grad_norm: float | None
    """Total gradient norm before clipping, unscaled; None when not finite or not computed."""
    lr: float
    """The learning rate this step used (read before the scheduler advanced)."""
    loss_scale: float | None
    """The fp16 loss scale the window's backward used; None for fp32 and bf16."""
    micro_steps: int
    micro_batch_size: int
    """Sequences in the window's largest micro-batch (changes under --micro-batch-size auto)."""
    samples: int
    tokens: int
    targets: int
    step_time_s: float
    peak_memory_bytes: int | None
    padded_positions: int = 0
    """Positions computed beyond the real tokens (right padding), summed over processes: the compute a length-aware
    cut (--micro-batch-order by-length, --micro-batch-tokens) saves."""
    grad_noise_scale: float | None = None
    """The gradient noise scale in sequences, its moving average after this window (cadence.engine.noise_scale);
    None when not measured (no ``noise_scale``, one batch size only) or not yet positive."""
    grad_noise_scale_tokens: float | None = None
    """The same in tokens (sequences x mean real tokens per sequence)."""
    objective_metrics: dict[str, float] = field(default_factory=dict)
    """The objective's statistics of the window under TRL's names (a preference objective's ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ...); empty for sft."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time_s if self.step_time_s > 0 else 0.0

    def as_metrics(self) -> dict[str, Any]:
        """The metrics.jsonl row of docs/ARCHITECTURE.md, "The run directory" (plus ``window``, ``targets`` and ``skip_reason``)."""
        row = asdict(self)
        row.update(row.pop("objective_metrics"))
        row["tokens_per_s"] = self.tokens_per_s
        return row


class Engine:
    """Runs the step chain for a model and optimizer the user built; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        precision: PrecisionName | Precision = "fp32",
        max_grad_norm: float = 0.0,
        loss_fn: LossFn = token_cross_entropy_sum,
        objective: Objective | None = None,
        collective: Collective | None = None,
        counter: WindowCounter | None = None,
        skip_nonfinite: bool = True,
        offload_activations: bool = False,
        memory_budget_bytes: int | None = None,
        agree_on_out_of_memory: bool = False,
        hf_labels: bool = False,
        noise_scale: GradientNoiseScale | None = None,
        gradients_in_place: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.device = next(model.parameters()).device
        self.precision = precision if isinstance(precision, Precision) else Precision(precision, self.device)
        self.max_grad_norm = float(max_grad_norm)
        if objective is not None and loss_fn is not token_cross_entropy_sum:
            raise ValueError("give the engine an objective or a loss_fn, not both (a loss_fn is the sft objective "
                             "computed by it: Objective.token(loss_fn))")
        self.objective = objective if objective is not None else Objective.token(loss_fn)
        """What the step chain minimises: the loss, its reduction unit and the reported loss
        (cadence.engine.objective); a bare ``loss_fn`` is the sft objective computed by that function."""
        self.collective: Collective = collective or SingleProcess()
        self.counter = counter or self.objective.counter()
        self.skip_nonfinite = skip_nonfinite
        self.offload_activations = offload_activations
        """Keep the tensors saved for backward in host memory (``cadence.memory.offload.activation_offload``)."""
        self.memory = StepMemoryMeter(self.device, budget_bytes=memory_budget_bytes,
                                      resident_bytes=self.objective.resident_bytes)
        self.agree_on_out_of_memory = agree_on_out_of_memory and self.collective.world_size > 1
        """Several processes retrying out-of-memory windows (--micro-batch-size auto): after each micro-batch's
        forward and after its backward, all ranks learn whether any ran out of memory, and all raise together."""
        self.hf_labels = hf_labels
        """Windows given as plain lists hold Hugging Face style labels (equal to ``input_ids``): shift them."""
        self._labels_checked = hf_labels or not self.objective.reads_next_token_labels
        """The first window's labels are checked once for the Hugging Face convention (see ``step``)."""
        self.noise_scale = noise_scale
        """Measures the gradient noise scale from the window's two batch sizes (cadence.engine.noise_scale: one
        gradient norm per window); None: not measured."""
        self.gradients_in_place = gradients_in_place
        """Add the token embedding's and the LM head's weight gradients straight into ``.grad``
        (cadence.memory.grad_in_place), so that accumulation never holds those largest gradients twice; False: autograd's
        usual path for every parameter (the same sums, to rounding)."""
        self.last_metrics: dict[str, float] = {}
        """The objective's statistics of the last window that stepped (none for the default objective)."""
        self.last_eval_metrics: dict[str, float] = {}
        """The same of the last evaluation (``evaluate``)."""
        self.phases: PhaseRecorder | None = None
        """Set by cadence.profiling.profiler while a profile runs; None (no annotations, no cost) otherwise."""
        self.steps = 0
        """Optimizer steps that really happened."""
        self.skipped_steps = 0
        """Windows whose optimizer step was skipped."""
        self.windows = 0
        """Windows attempted."""

    # ------------------------------------------------------------------------------------------------ the chain
    def step(
        self,
        window: Window | Sequence[Batch],
        *,
        measure_memory: bool = False,
        on_micro_batch: Callable[[int], None] | None = None,
        stop_requested: Callable[[], bool] | None = None,
        resume: PartialWindow | None = None,
    ) -> StepResult:
        """Run one window through the step chain and return what happened.

        ``measure_memory`` profiles this step's peak on CPU (CUDA is always measured, at no cost);
        ``on_micro_batch(index)`` is called before each micro-batch (a progress display uses it).
        ``stop_requested()`` is asked after each micro-batch but the last: when it says yes, WindowInterrupted is
        raised with the gradients accumulated so far left in place (a checkpoint saves them); ``resume`` continues
        such a window from where it stopped.
        """
        if self.phases is not None:
            self.phases.step_started()  # the time since the previous step ended was spent waiting for this window
        if not isinstance(window, Window):
            window = make_window(window, counter=self.counter, hf_labels=self.hf_labels)
        if not self._labels_checked:
            self._check_label_convention(window)
        started = time.perf_counter()
        lr = float(self.optimizer.param_groups[0]["lr"])
        loss_scale = self.precision.loss_scale
        self.model.train()

        with self.memory.measure(
            model=self.model, optimizer=self.optimizer, enabled=measure_memory, segmented=True
        ):
            counts = self._window_counts(window)
            if counts.units[0] == 0:
                return self._skip_empty_window(window, started, lr, loss_scale, counts)
            loss_sum = self.accumulate(
                window, counts.units, on_micro_batch=on_micro_batch, stop_requested=stop_requested, resume=resume
            )
            self.windows += 1  # only now: a window that failed or was interrupted part-way is not counted
            grad_norm, skip_reason = self.apply_gradients()
            window_loss = self._window_loss(loss_sum, counts, grad_norm=grad_norm, stepped=skip_reason is None,
                                            loss_scale=loss_scale)
            # The step's host syncs, per window and none per micro-batch: the window's unit counts over ranks
            # (several processes only: it must be known before the first backward), the fp16 loss scale and found-inf
            # check, the grad norm and the loss (with the noise scale's terms) read back for the metrics, and this
            # one, so that step_time_s is the time the device took, not the time it took to queue the work.
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # honest step time: wait for the optimizer's kernels
        return self._result(
            window, started, lr, loss_scale, counts,
            skip_reason=skip_reason, loss=window_loss, grad_norm=grad_norm, peak_memory_bytes=self.memory.peak_bytes,
        )

    def _check_label_convention(self, window: Window) -> None:
        """Once, on the first window: refuse Hugging Face style labels given to cadence's next-token loss. Trained
        as they are, they would teach the model to copy its input, silently (one host sync, on the first step only)."""
        self._labels_checked = True
        batch = window.micro_batches[0]
        if isinstance(batch, Mapping) and "labels" in batch and "input_ids" in batch and looks_like_hf_labels(batch):
            raise HuggingFaceLabels(
                "the labels equal input_ids at every target: a Hugging Face style batch (the model shifts labels "
                "itself). cadence's loss reads labels[t] as the token after input_ids[t]; build the windows with "
                "iter_windows(..., hf_labels=True) or make_window(..., hf_labels=True), or give "
                "Engine(..., hf_labels=True) plain lists of micro-batches (if the model really is meant to predict "
                "its current token, pass your own loss_fn)")

    def _window_counts(self, window: Window) -> _WindowCounts:
        """The window's targets, tokens, samples and the objective's reduction units, summed over all processes (one
        small all-reduce), and the first micro-batch's count of the first unit when the noise scale is measured (its
        small batch)."""
        first = self.objective.batch_units(window.micro_batches[0], self.counter)[0] \
            if self.noise_scale is not None else 0
        units = self.objective.window_units(window)
        # Sync point: every process must know the WHOLE window's unit counts before its first backward.
        with self._region("gradient_sync"):
            totals = self.collective.all_reduce_sum(torch.tensor(
                [window.targets, window.tokens, window.samples, window.positions, first, *units], dtype=torch.float64))
        targets, tokens, samples, positions, first_targets, *units_summed = (int(v) for v in totals.tolist())
        return _WindowCounts(targets, tokens, samples, positions, first_targets, first_targets_here=first,
                             units=tuple(units_summed))

    def accumulate(
        self,
        window: Window,
        window_units: int | Sequence[int],
        *,
        on_micro_batch: Callable[[int], None] | None = None,
        stop_requested: Callable[[], bool] | None = None,
        resume: PartialWindow | None = None,
    ) -> torch.Tensor:
        """Forward and backward every micro-batch of ``window``, the gradients adding up in the parameters and
        synchronising only on the last micro-batch; return the window's loss sum (a float64 scalar on the device).

        No host synchronisation per micro-batch: the copy in is ``non_blocking`` (asynchronous from the pinned memory
        ``prefetch`` gives on CUDA), the loss is summed on the device, the memory meter does nothing per segment on
        CUDA, and nothing is read back, so the host queues micro-batch after micro-batch while the device runs
        (tests/engine/test_prefetch.py checks it under ``torch.cuda.set_sync_debug_mode("error")``). The exceptions
        are asked for: a stop request reads the loss sum back once, with several ranks under --micro-batch-size auto
        the out-of-memory agreement is a tiny all-reduce read after each forward and backward, and the chunked loss
        (--loss-chunk-tokens) reads the micro-batch's target count, which sets the shapes of its chunks.

        ``window_units`` is the whole window's count of each of the objective's reduction units over all processes
        (for the default objective, its target count). The objective's window statistic, if it has one, is computed
        first (before any backward). ``on_micro_batch``, ``stop_requested`` and ``resume`` are ``step``'s. On any
        failure but WindowInterrupted the partial gradients are dropped, so that a retry of the window starts from
        the state before it. Returns the float64 vector of the window's loss sums and statistics on this process.
        """
        units = (window_units,) if isinstance(window_units, int) else tuple(window_units)
        # Dividing by the window's units (not the micro-batch's) makes the accumulated gradient the one-big-batch
        # gradient; x world undoes DDP's average over processes.
        factors = [self.collective.world_size / count for count in units]
        loss_sum = self._resumed_sums(resume)
        last = len(window.micro_batches) - 1
        try:
            statistic = self._window_statistic(window)
            for index, micro_batch in enumerate(window.micro_batches):
                if resume is not None and index < resume.micro_batches_done:
                    continue  # their gradients were restored from the checkpoint
                self._report_progress(on_micro_batch, index)
                batch = _to_device(micro_batch, self.device)  # queued, not waited for (see the docstring)
                # guarded: a micro-batch above --memory-budget raises out-of-memory, like a real CUDA OOM.
                with self._out_of_memory_agreement() as agreement, self._region(segment=True, guarded=True):
                    # Entered BEFORE the forward: DDP decides at forward time whether this backward all-reduces.
                    with self.collective.gradient_sync(self.model, enabled=index == last), \
                            self._first_gradient(index, last), self._gradients_into_grad():
                        with self._region("forward"), self.precision.autocast(), self._saved_tensors_context():
                            micro_loss = self.objective.micro_batch_loss(self.model, batch, statistic)
                        agreement.passed("forward")  # before any backward hook can start an all-reduce
                        with self._region("backward"):
                            self.precision.backward(self.objective.scaled(micro_loss, factors))
                agreement.passed("backward")
                loss_sum += self.objective.detached(micro_loss)
                del micro_loss, batch  # free the graph's last references before the next micro-batch
                self._stop_if_requested(stop_requested, index=index, last=last, loss_sum=loss_sum)
        except WindowInterrupted:
            raise  # the accumulated gradients are the point: keep them for the checkpoint
        except BaseException:
            # Out of memory (or interrupted) mid-window: drop the partial gradients so that a retry of the same
            # window, at any micro-batch size, starts from exactly the state before it. Nothing was counted.
            self.optimizer.zero_grad(set_to_none=True)
            raise
        return loss_sum

    def apply_gradients(self) -> tuple[float, str | None]:
        """Unscale (fp16 only), clip the total gradient norm (once), step the optimizer (skipped on fp16 inf/nan or,
        with ``skip_nonfinite``, a non-finite norm), update the scaler, zero the gradients and advance the schedule
        only after a real step; count the step as taken or skipped.

        Returns the total gradient norm before clipping, and why the optimizer did not step (None: it stepped).
        """
        with self._region(segment=True):
            with self._region("unscale_clip"):
                grad_norm = self.precision.unscale_and_clip(
                    self.optimizer, self.model.parameters(), self.max_grad_norm
                )
            reason: str | None  # why the optimizer did not step
            with self._region("optimizer_step"):
                if self.skip_nonfinite and not self.precision.has_scaler and not math.isfinite(grad_norm):
                    did_step, reason = False, "non-finite gradients"
                else:
                    did_step = self.precision.step(self.optimizer)  # fp16: skipped when the scaler found inf
                    reason = None if did_step else "fp16 overflow"
            with self._region("zero_grad_scheduler"):
                self.optimizer.zero_grad(set_to_none=True)
                if did_step and self.scheduler is not None:
                    self.scheduler.step()  # only after a real step: a skipped step must not move the schedule
        if did_step:
            self.steps += 1
        else:
            self.skipped_steps += 1
        return grad_norm, reason

    def _first_gradient(self, index: int, last: int) -> contextlib.AbstractContextManager[Any]:
        """Around the window's first micro-batch while the noise scale is measured: right after its backward the
        accumulated gradient is that micro-batch's alone, the noise scale's small batch; its norm is queued on the
        device (no host sync) and read back with the window's loss. Any other micro-batch: the shared no-op."""
        if self.noise_scale is None or index != 0:  # a resumed window skips index 0: its gradient is not alone
            return NO_PHASE
        return self.noise_scale.first_micro_batch(self.model, self.collective, only=last == 0)

    def _gradients_into_grad(self) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward, inside the gradient-sync context (which decides whether the
        backward synchronises, and so whether the path applies): the largest weight gradients added straight into
        ``.grad`` (cadence.memory.grad_in_place), or the shared no-op."""
        return accumulate_in_place(self.model) if self.gradients_in_place else NO_PHASE

    def _window_statistic(self, window: Window) -> torch.Tensor | None:
        """The objective's statistic of the whole window (KTO's reference point), before the first backward; None for
        an objective without one. Its all-reduce (when there is one) is a host sync per window."""
        return self.objective.window_statistic(
            self.model, window, reduce=self.collective.all_reduce_sum, autocast=self.precision.autocast,
            to_device=lambda batch: _to_device(batch, self.device))

    def _resumed_sums(self, resume: PartialWindow | None) -> torch.Tensor:
        """The window's loss sums and statistics so far (float64, on the device): zeros, or what the interrupted
        window had summed before it stopped."""
        width = len(self.objective.units) + len(self.objective.statistic_names)
        sums = torch.zeros(width, dtype=torch.float64, device=self.device)
        if resume is not None:
            sums[:] = torch.tensor([resume.loss_sum, *resume.more_sums], dtype=torch.float64)
        return sums

    def _window_loss(self, loss_sum: torch.Tensor, counts: _WindowCounts, *, grad_norm: float, stepped: bool,
                     loss_scale: float | None) -> float:
        """The window's loss over all processes as the objective reports it (the default objective's: the token
        mean): the step's one host sync of the loss. The noise scale's terms for the window (the first micro-batch's
        norm against the clipping norm, computed on the device) travel in the same read-back and the same all-reduce,
        and so do the objective's statistics (kept in ``last_metrics``)."""
        values = loss_sum.reshape(-1)
        width = len(values)
        if self.noise_scale is not None:
            values = torch.cat([values, self.noise_scale.window_terms(
                grad_norm=grad_norm, stepped=stepped, window_targets=counts.units[0],
                first_targets_here=counts.first_targets_here, first_targets_all=counts.first_targets,
                world_size=self.collective.world_size, loss_scale=loss_scale, device=self.device)])
        with self._region("gradient_sync"):
            totals = self.collective.all_reduce_sum(values.cpu()).tolist()
        if self.noise_scale is not None:
            self.noise_scale.add_window(totals[width:], samples=counts.samples, targets=counts.units[0],
                                        tokens=counts.tokens)
        self.last_metrics = self.objective.window_metrics(totals[:width], counts.units)
        return self.objective.window_loss(totals[:width], counts.units)

    def _result(
        self,
        window: Window,
        started: float,
        lr: float,
        loss_scale: float | None,
        counts: _WindowCounts,
        *,
        skip_reason: str | None,
        loss: float | None = None,
        grad_norm: float | None = None,
        peak_memory_bytes: int | None = None,
    ) -> StepResult:
        """The one place a StepResult is made. ``skip_reason`` is None exactly when the optimizer stepped; a grad norm
        that is not finite is reported as None."""
        noise = self.noise_scale.estimate() if self.noise_scale is not None else None
        return StepResult(
            step=self.steps,
            window=self.windows,
            skipped=skip_reason is not None,
            skip_reason=skip_reason,
            loss=loss,
            grad_norm=grad_norm if grad_norm is not None and math.isfinite(grad_norm) else None,
            lr=lr,
            loss_scale=loss_scale,
            micro_steps=len(window.micro_batches),
            micro_batch_size=max(self.counter.samples(b) for b in window.micro_batches),
            samples=counts.samples,
            tokens=counts.tokens,
            targets=counts.targets,
            padded_positions=max(0, counts.positions - counts.tokens),
            step_time_s=time.perf_counter() - started,
            peak_memory_bytes=peak_memory_bytes,
            grad_noise_scale=noise.sequences if noise else None,
            grad_noise_scale_tokens=noise.tokens if noise else None,
            objective_metrics=dict(self.last_metrics) if loss is not None else {},
        )

    def _skip_empty_window(
        self, window: Window, started: float, lr: float, loss_scale: float | None, counts: _WindowCounts
    ) -> StepResult:
        """A window without a single target has no loss to average: skip it, never divide by zero."""
        self.windows += 1
        warnings.warn(
            f"window {self.windows} has no loss-bearing targets (every label is -100); skipped", stacklevel=3
        )
        self.skipped_steps += 1
        return self._result(window, started, lr, loss_scale, counts, skip_reason="no targets")

    # ------------------------------------------------------------------------------------------------ step parts
    def _region(
        self, phase: str | None = None, *, segment: bool = False, guarded: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """One part of the step as the profiler and the memory meter see it: the profiling phase ``phase`` (timed
        only while a profile runs) inside a memory segment when ``segment`` (``guarded``: a peak above the memory
        budget raises out-of-memory). Neither wanted: the shared no-op NO_PHASE (no cost)."""
        timed = NO_PHASE if phase is None else self._phase(phase)
        if not segment:
            return timed
        if timed is NO_PHASE:
            return self.memory.segment(guarded=guarded)
        return _nested(self.memory.segment(guarded=guarded), timed)

    def _phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A profiling range around one phase of the step; a shared no-op when profiling is off (no cost)."""
        return NO_PHASE if self.phases is None else self.phases.phase(name)

    def _out_of_memory_agreement(self) -> _OutOfMemoryAgreement:
        """Around one micro-batch, and at each of its ``passed`` points, all ranks learn whether any ran out of memory
        (see _OutOfMemoryAgreement; a no-op unless ``agree_on_out_of_memory``)."""
        return _OutOfMemoryAgreement(self.collective, enabled=self.agree_on_out_of_memory)

    @staticmethod
    def _report_progress(on_micro_batch: Callable[[int], None] | None, index: int) -> None:
        """Tell the caller's progress display that micro-batch ``index`` starts, when it asked to be told."""
        if on_micro_batch is not None:
            on_micro_batch(index)

    @staticmethod
    def _stop_if_requested(
        stop_requested: Callable[[], bool] | None, *, index: int, last: int, loss_sum: torch.Tensor
    ) -> None:
        """Between two micro-batches (never after the last), raise WindowInterrupted when the caller asks to stop,
        leaving the gradients accumulated so far in place. Only a stop reads ``loss_sum`` back to the host."""
        if stop_requested is not None and index < last and stop_requested():
            sums = loss_sum.tolist()
            raise WindowInterrupted(micro_batches_done=index + 1, loss_sum=sums[0], more_sums=tuple(sums[1:]))

    def _saved_tensors_context(self) -> contextlib.AbstractContextManager[Any]:
        """Where autograd keeps what the forward saves for backward: device memory, or host memory when offloaded."""
        if not self.offload_activations:
            return contextlib.nullcontext()
        return activation_offload(self.device)

    # ------------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, micro_batches: Sequence[Batch] | Any) -> float | None:
        """The objective's loss over ``micro_batches`` (all processes) as one window, in eval mode and the training
        precision (the default objective's: the token mean)."""
        was_training = self.model.training
        self.model.eval()
        width = len(self.objective.units) + len(self.objective.statistic_names)
        totals = torch.zeros(width + len(self.objective.units), dtype=torch.float64)
        try:
            statistic = None
            if self.objective.has_window_statistic:
                # KTO's reference point over everything evaluated, as one window (the batches held for a second pass).
                micro_batches = list(micro_batches)
                if micro_batches:
                    statistic = self._window_statistic(make_window(micro_batches, counter=self.counter))
            for micro_batch in micro_batches:
                batch = _to_device(micro_batch, self.device)
                with self.precision.autocast():
                    loss = self.objective.micro_batch_loss(self.model, batch, statistic)
                totals[:width] += self.objective.detached(loss).cpu()
                totals[width:] += torch.tensor(self.objective.batch_units(micro_batch, self.counter),
                                               dtype=torch.float64)
        finally:
            self.model.train(was_training)
        summed = self.collective.all_reduce_sum(totals).tolist()
        units = [int(count) for count in summed[width:]]
        if min(units) <= 0:
            self.last_eval_metrics = {}
            return None
        self.last_eval_metrics = self.objective.window_metrics(summed[:width], units)
        return self.objective.window_loss(summed[:width], units)

    @property
    def loss_fn(self) -> LossFn:
        """The default objective's way of computing a micro-batch's summed token loss."""
        return self.objective.loss_fn

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters and precision state; the optimizer and scheduler state belong to their own objects."""
        state = {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "windows": self.windows,
            "precision": self.precision.state_dict(),
        }
        if self.noise_scale is not None:
            state["noise_scale"] = self.noise_scale.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.windows = int(state["windows"])
        self.precision.load_state_dict(dict(state["precision"]))
        # A checkpoint from before the noise scale (or from a run without it) starts its averages afresh.
        if self.noise_scale is not None and state.get("noise_scale") is not None:
            self.noise_scale.load_state_dict(dict(state["noise_scale"]))


NO_PHASE = contextlib.nullcontext()


@dataclass(kw_only=True)
class PartialWindow:
    """How far an interrupted window got: its first ``micro_batches_done`` micro-batches are in the gradients."""

    micro_batches_done: int
    loss_sum: float
    """Their summed loss (float64; the objective's first term), so the window's reported loss is exact after a
    resume."""
    more_sums: tuple[float, ...] = ()
    """The objective's further terms and statistics summed so far (none for the default objective)."""


class _WindowCounts(NamedTuple):
    """A window's loss-bearing targets, tokens and samples, summed over all processes."""

    targets: int
    tokens: int
    samples: int
    positions: int
    first_targets: int = 0
    """The first micro-batch's targets over all processes (counted only while the noise scale is measured)."""
    first_targets_here: int = 0
    """The same on this process alone."""
    units: tuple[int, ...] = ()
    """The objective's reduction units in the window, over all processes (the default objective: its targets)."""


class WindowInterrupted(Exception):
    """A stop was asked for between two micro-batches of a window; the gradients so far are still in place."""

    def __init__(self, *, micro_batches_done: int, loss_sum: float, more_sums: tuple[float, ...] = ()) -> None:
        super().__init__(f"window interrupted after {micro_batches_done} micro-batches")
        self.partial = PartialWindow(micro_batches_done=micro_batches_done, loss_sum=loss_sum, more_sums=more_sums)


class _OutOfMemoryAgreement:
    """All ranks learn together whether any ran out of memory in a micro-batch, so that all retry it (or give up)
    together instead of one waiting in a collective the others never enter.

    Each rank takes part in the same sequence of tiny all-reduces: one after the forward, one after the backward,
    ending at the first that reports a failure. A rank that ran out of memory reports it at the point it reached; the
    others raise there too. (The CPU budget is checked after the backward. On CUDA, an out-of-memory inside the
    backward of a window's LAST micro-batch, while DDP all-reduces, cannot be agreed on: that run fails.)
    """

    def __init__(self, collective: Collective, *, enabled: bool) -> None:
        self.collective = collective
        self.enabled = enabled
        self.settled = False

    def passed(self, point: str) -> None:
        if self.enabled and not self.settled and self._failures(0) > 0:
            self.settled = True
            raise torch.OutOfMemoryError(f"another rank ran out of memory in this micro-batch's {point}")

    def __enter__(self) -> _OutOfMemoryAgreement:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if self.enabled and not self.settled and isinstance(error, torch.OutOfMemoryError):
            self.settled = True
            self._failures(1)  # tell the others at the point they will reach next; the error goes on

    def _failures(self, mine: int) -> int:
        return int(self.collective.all_reduce_sum(torch.tensor([float(mine)], dtype=torch.float64))[0])


class PhaseRecorder(Protocol):
    """What the engine tells a profiler: where each step starts, and the phases inside it."""

    def step_started(self) -> None: ...

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]: ...


def _to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


@contextlib.contextmanager
def _nested(
    outer: contextlib.AbstractContextManager[Any], inner: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    """``inner`` entered inside ``outer``, as one context manager."""
    with outer, inner:
        yield
