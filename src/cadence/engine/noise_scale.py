"""The gradient noise scale, measured from accumulation: how large an effective batch is still worth its tokens.

The simple noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A) is
``B_noise = tr(Sigma) / |G|^2``: the gradient's noise per example over its signal. Near the critical batch ``B ~
B_noise`` a step of ``B`` examples makes about half the progress a step of the true gradient would; far above it,
more examples per step buy almost nothing (tokens spent for the same progress grow like ``1 + B / B_noise``); far
below it, every step is noisy and more steps are needed (``1 + B_noise / B``).

**What is estimated.** cadence's window gradient is the per-target mean loss gradient: every micro-batch's summed
loss is divided by the whole window's target count ``N``, so ``G_N = sum over the window's targets of grad l_i / N``.
The samples (sequences, the unit of ``--effective-batch-size``) are drawn at random and each brings its targets, so
with ``g_s`` a sequence's summed gradient and ``n_s`` its target count, the population gradient is ``G = E[g_s] /
E[n_s]`` and, to first order in ``1 / N``, ``E|G_N|^2 = |G|^2 + tr(Sigma) / N`` with ``tr(Sigma) = E|g_s - n_s
G|^2 / E[n_s]``, whatever the lengths: the noise of a batch goes as one over its *target count*. So the batch sizes
below are target counts (unequal micro-batches, a token budget, packed rows: each micro-batch counts its own
targets), the estimate comes out in targets, and sequences follow by the mean targets per sequence (``B_targets /
(targets / samples)``, over the same windows); tokens are sequences times the mean real tokens per sequence.

**Two sizes per window, nearly free.** Right after the first micro-batch's backward the accumulated gradient is that
micro-batch's alone, times its share of the window (``world / N`` per target): ``G_b = grad x N / (world x b)`` for
its ``b`` targets on this rank (its gradient is local: the sync happens only on the window's last micro-batch). The
window's whole gradient norm ``|G_B|`` (``B = N``) is computed anyway for clipping. With ``E|G_x|^2 = |G|^2 +
tr(Sigma) / x`` at both sizes, unbiased estimates are::

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1 / b - 1 / B)

(``G_b`` is part of ``G_B``; expectations add without needing independence). Per window both are noisy, the second
often negative, so numerator and denominator are averaged separately (an exponential moving average, decay ``ema``,
both started at 0 so that their ratio needs no bias correction) and ``B_noise = EMA(tr Sigma) / EMA(|G|^2)``. With
several ranks each rank's first micro-batch is a small batch of its own: their estimates are averaged before the
moving average (so every rank reports the same value).

Corrections: fp16's accumulated gradient is multiplied by the GradScaler's scale, which is divided out (the clipping
norm is already unscaled); a window whose optimizer step was skipped (overflow, non-finite) is left out. DDP with one
micro-batch per window syncs inside that backward: a communication hook takes this rank's norm before the all-reduce
(``cadence.distributed.ranks.ProcessGroupCollective.watch_local_gradients``), so the local gradient against the
all-reduced one are the two sizes. FSDP2: see ``ProcessGroupCollective.first_gradient_problem``. One micro-batch on
one process holds only one size: no estimate, and the reason is kept in ``unmeasured``.

**Assumptions.** A length-aware cut (``--micro-batch-order by-length``, a token budget, packing; text of one length
keeps its drawn order) puts the window's *longest* samples into its first micro-batch, so on variable-length data the
small batch is not a random draw: the estimate then assumes that a target's gradient statistics do not depend on the
length of its example. ``--micro-batch-order drawn`` needs no such assumption. Windows drawn without replacement from
a finite training set shrink ``|G|^2`` by about ``tr(Sigma) / (dataset targets)``: negligible unless the noise scale
is a sizeable share of the data.

**Cost.** One gradient norm per window (a foreach reduction over the gradients in place, no copy), queued on the
device and read back with the window's loss, in the same read-back and the same all-reduce; on a window with one
micro-batch under DDP, the norm of each gradient bucket inside DDP's hook instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

ONE_SIZE = ("one micro-batch per window on one process holds one batch size only, and the noise scale needs two: "
            "accumulate (--grad-accum-steps 2 or more) or run several processes")
NO_PROBE = "the engine's collective cannot read the first micro-batch's gradient (it has no first_gradient)"
NOISE_UNRESOLVED = ("not resolved: the gradient's noise is too small against its signal to show between these two "
                    "batch sizes (a noise scale well below the first micro-batch, so the effective batch is far above "
                    "it), or too few windows")
SIGNAL_UNRESOLVED = ("not resolved: the gradient's signal is too small against its noise to show between these two "
                     "batch sizes (a noise scale well above the window, so the effective batch is below it), or too "
                     "few windows")
DEFAULT_EMA = 0.99
"""About the last 100 windows: the per-window estimate is noisy (often tens of percent), and the noise scale moves
slowly as training goes on."""


@dataclass(kw_only=True)
class FirstGradient:
    """The window's first micro-batch's gradient as read right after its backward (a Collective's ``first_gradient``
    fills it in when the context exits)."""

    norm: torch.Tensor | None = None
    """Its L2 norm, on the device and not read back (scaled by the fp16 loss scale as the gradients are)."""
    reduced: bool = False
    """Summed over the ranks (their first micro-batches together, FSDP2 with --sync-every-micro-step) rather than
    this rank's own."""
    unavailable: str | None = None
    """Why it could not be read (then ``norm`` is None)."""


class FirstGradientSource(Protocol):
    """What a Collective offers the noise scale (``SingleProcess`` and cadence's ``ProcessGroupCollective`` do)."""

    world_size: int

    def first_gradient(self, model: torch.nn.Module, *,
                       synced: bool) -> contextlib.AbstractContextManager[FirstGradient]:
        """Around the window's first micro-batch (forward and backward; ``synced``: its backward synchronises, it
        being also the window's last): on exit the FirstGradient holds the norm of the gradient it left."""


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor | None:
    """The total L2 norm of the parameters' gradients, on the device: one foreach reduction, no copy of them. Under
    FSDP2 the gradients are sharded DTensors and the total needs their shards' sum: ``full_tensor`` all-reduces it
    (one scalar). None when no parameter has a gradient."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(grads, error_if_nonfinite=False)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total


@contextlib.contextmanager
def local_first_gradient(model: torch.nn.Module) -> Iterator[FirstGradient]:
    """``first_gradient`` for gradients that stay in the parameters after the backward (one process; a DDP rank
    whose backward did not sync)."""
    found = FirstGradient()
    yield found
    found.norm = gradient_norm(model.parameters())
    if found.norm is None:
        found.unavailable = "no parameter had a gradient after the first micro-batch"


@dataclass(frozen=True, kw_only=True)
class NoiseScale:
    """The gradient noise scale over the windows measured so far."""

    sequences: float
    """In sequences (samples: the unit of --effective-batch-size; examples when packed)."""
    tokens: float
    """In real input tokens (sequences x mean tokens per sequence)."""
    targets: float
    """In loss-bearing targets: what the estimator measures (see the module docstring)."""
    windows: int
    """Windows the averages are over."""


@dataclass(frozen=True, kw_only=True)
class WindowTerms:
    """One window's two estimates, averaged over ranks, with its counts over all ranks."""

    trace: float
    """tr(Sigma) per target."""
    grad_sq: float
    """|G|^2."""
    samples: int
    targets: int
    tokens: int


class GradientNoiseScale:
    """The two-size estimator of the module docstring, fed by ``Engine`` (``Engine(..., noise_scale=
    GradientNoiseScale())``): the first micro-batch's gradient norm (``first_micro_batch``), then with the window's
    clipping norm its two estimates (``window_terms``, on the device, read back and all-reduced with the window's
    loss), then the moving averages (``add_window``). ``estimate()`` is the value after the last window."""

    def __init__(self, *, ema: float = DEFAULT_EMA) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        self.ema = ema
        self.windows = 0
        """Windows the averages are over."""
        self.unmeasured: str | None = None
        """Why the last window gave no estimate (None when it did)."""
        self.last: WindowTerms | None = None
        """The last window's own estimates (None when it gave none): for averages of one's own, with an
        uncertainty (``cadence.training.noise_scale.measure_noise_scale``)."""
        self._first: FirstGradient | None = None
        self._averages = [0.0] * 5  # tr(Sigma), |G|^2, samples, targets, tokens

    # ------------------------------------------------------------------------------------------------ per window
    @contextlib.contextmanager
    def first_micro_batch(self, model: torch.nn.Module, collective: Any, *, only: bool) -> Iterator[None]:
        """Around the window's first micro-batch (``only``: it is also the last): after its backward, the norm of the
        accumulated gradient, which is still that micro-batch's alone. Nothing is read back here."""
        self._first = None
        if only and collective.world_size == 1:
            self._first = FirstGradient(unavailable=ONE_SIZE)  # no norm is taken: it would be the window's
            yield
            return
        probe = getattr(collective, "first_gradient", None)
        if probe is None:
            self._first = FirstGradient(unavailable=NO_PROBE)
            yield
            return
        with probe(model, synced=only) as found:
            yield
        self._first = found

    def window_terms(self, *, grad_norm: float, stepped: bool, window_targets: int, first_targets_here: int,
                     first_targets_all: int, world_size: int, loss_scale: float | None,
                     device: torch.device) -> torch.Tensor:
        """This rank's ``[counted, tr(Sigma), |G|^2]`` for the window (float64, on ``device``; zeros when it gives
        none), to be summed over ranks with the loss: ``add_window`` divides by the ranks that counted.

        ``grad_norm``: the clipping norm (unscaled); ``stepped``: the optimizer stepped (a skipped window's
        gradients are not the run's); ``first_targets_here`` / ``_all``: the first micro-batch's targets on this
        rank / over all ranks; ``loss_scale``: the fp16 scale the window's backward used (None: no scaler)."""
        first, self._first = self._first, None
        zeros = torch.zeros(3, dtype=torch.float64, device=device)
        if first is None or first.norm is None:
            self.unmeasured = first.unavailable if first is not None else "the window's first micro-batch was not " \
                                                                           "run here (a resumed window)"
            return zeros
        small = first_targets_all if first.reduced else first_targets_here
        big = window_targets
        if not stepped or not math.isfinite(grad_norm) or not 0 < small < big:
            self.unmeasured = ("the optimizer step was skipped" if not stepped or not math.isfinite(grad_norm)
                               else "the first micro-batch held no targets, or all of them")
            return zeros
        # Each micro-batch's loss was scaled by world / N before its backward, so this rank's gradient of b targets
        # is (sum of their gradients) x world / N: x N / (world x b) makes it their mean. A gradient summed over the
        # ranks (DDP / FSDP2 average it) is that of all ranks' first micro-batches: x N / b. fp16: / the loss scale.
        factor = big / ((1 if first.reduced else world_size) * small) / (loss_scale or 1.0)
        small_sq = (first.norm.detach().to(torch.float64) * factor).square()
        big_sq = grad_norm * grad_norm
        trace = (small_sq - big_sq) / (1.0 / small - 1.0 / big)
        grad_sq = (big * big_sq - small * small_sq) / (big - small)
        # fp16's first micro-batch may overflow where the window's step did not: left out on the device, unread.
        counted = torch.isfinite(small_sq)
        return torch.stack([counted.to(torch.float64), torch.where(counted, trace, zeros[0]),
                            torch.where(counted, grad_sq, zeros[0])])

    def add_window(self, terms: Sequence[float], *, samples: int, targets: int, tokens: int) -> None:
        """The window's ``window_terms`` summed over ranks: average them over the ranks that counted, then into the
        moving averages (a window no rank counted changes nothing)."""
        counted, trace, grad_sq = terms
        if counted <= 0:
            self.last = None
            return
        self.last = WindowTerms(trace=trace / counted, grad_sq=grad_sq / counted, samples=samples, targets=targets,
                                tokens=tokens)
        keep = self.ema
        for index, value in enumerate((self.last.trace, self.last.grad_sq, samples, targets, tokens)):
            self._averages[index] = keep * self._averages[index] + (1.0 - keep) * value
        self.windows += 1
        self.unmeasured = None

    # ------------------------------------------------------------------------------------------------ the value
    def estimate(self) -> NoiseScale | None:
        """The noise scale over the windows so far; None before the first measured window, or while the averages
        are not positive (then ``why_none()`` says so)."""
        return ratio_estimate(*self._averages, windows=self.windows)

    def why_none(self) -> str | None:
        """Why ``estimate()`` is None (None when it is not)."""
        if self.estimate() is not None:
            return None
        if self.windows == 0:
            return self.unmeasured or "no window measured yet"
        return NOISE_UNRESOLVED if self._averages[0] <= 0 else SIGNAL_UNRESOLVED

    def state_dict(self) -> dict[str, Any]:
        """The averages (a resumed run continues them exactly)."""
        return {"ema": self.ema, "windows": self.windows, "averages": list(self._averages)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        averages = [float(value) for value in state["averages"]]
        if len(averages) != len(self._averages):
            raise ValueError(f"noise scale state holds {len(averages)} averages, expected {len(self._averages)}")
        self._averages = averages
        self.windows = int(state["windows"])


def ratio_estimate(trace: float, grad_sq: float, samples: float, targets: float, tokens: float, *,
                   windows: int) -> NoiseScale | None:
    """``trace / grad_sq`` in targets, then in sequences (/ targets per sample) and tokens (x tokens per sample), from
    sums or averages of the windows' terms and counts; None unless all are positive."""
    if windows <= 0 or not (trace > 0 and grad_sq > 0 and samples > 0 and targets > 0):
        return None
    in_targets = trace / grad_sq
    sequences = in_targets * samples / targets
    return NoiseScale(sequences=sequences, tokens=sequences * tokens / samples, targets=in_targets, windows=windows)
