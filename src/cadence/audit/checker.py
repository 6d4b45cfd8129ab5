"""``cadence audit``: check a user's own plain-PyTorch training loop against the step chain (docs/ARCHITECTURE.md, "The step chain").

In Python::

    with Audit() as audit:
        train()                      # your loop, unchanged
    report = audit.report()          # AuditReport: findings (rule, level, file:line, fix) and the observed cadence
    print(format_report(report))

From the shell, ``cadence audit -- python train.py [args]`` calls ``run_script(argv)``: the script runs in this process
(its output and exit status pass through) and the report goes to stderr at the end.

While the audit is active, the calls below are instrumented (and restored on exit, exceptions included): backward
(``Tensor.backward``, ``torch.autograd.backward``), optimizer steps (torch's global step post-hook) and ``zero_grad``
(optimizer and module), gradient clipping, ``GradScaler.scale/unscale_/step/update``, LR scheduler steps, autocast
entry, DDP forward and ``no_sync``, ``DataLoader`` iteration (epoch ends; the ``labels`` of each batch), and what the
optimizer rules need (``cadence.audit.optimizers``: Newton-Schulz, optimizer step starts, ``Module.eval``,
``torch.save`` and safetensors' writers). Each hook
appends a small tuple with the place of the call: the first frame of the user's own code (outside torch, this package,
the standard library and the installed packages: site-packages, cadence itself) with the library frame that made the
call after it (``train.py:51 via accelerate/accelerator.py:2889``); calls that torch makes
itself (``Tensor.backward`` -> ``autograd.backward``, ``scaler.step`` -> ``unscale_``, a scheduler's initial step) are
not user events and are not recorded. A *window* is the backward passes between two optimizer steps.

Normalisation (CAD018, CAD021) is read from what each backward's gradient is, whatever loss function made it: at every
backward the audit walks a few autograd nodes from the loss (through scalar arithmetic: division, multiplication,
addition, the GradScaler's scale) to the node that reduced the per-target losses to a scalar (``nll_loss`` /
``cross_entropy`` with mean or sum, a ``.sum()`` or ``.mean()`` of per-token losses: a fused LM-head loss, a hand-written
``-log_softmax`` sum, ``reduction="none"`` then divided by anything) and hooks the gradient that reaches it. That
gradient over the node's own divisor (its target count for a mean ``nll_loss``, its element count for ``.mean()``)
and over the GradScaler's scale is the weight each target of the micro-batch gets in the window's gradient. One big
batch gives every target of a window the same weight: CAD018 is a window whose micro-batches weigh their targets more
than 10% apart (a per-micro-batch mean over uneven target counts; equal counts make a per-micro-batch mean exact and
are not reported). The window's total weight (weight x targets, summed) is the same for every window of a loop that
averages over the window; CAD021 is a short window (an epoch's last) whose total differs from the full windows' by
more than 10% (a loss divided by the fixed accumulation steps: 2 of 4 micro-batches get 0.50x). Target counts come from
the ``nll_loss`` node, else from the ``labels`` of the DataLoader batches (``labels != -100``, shifted by one as
Hugging Face models shift them), taken in order, one batch per backward.

| rule   | level   | what                                                        | fix                               |
| ------ | ------- | ----------------------------------------------------------- | --------------------------------- |
| CAD001 | error   | clip while the GradScaler's gradients are still scaled      | scaler.unscale_(opt), then clip   |
| CAD002 | error   | clip on a non-final micro-step (or with no backward yet)    | clip once, after last backward    |
| CAD003 | error   | unscale_ on a non-final micro-step                          | unscale once, after last backward |
| CAD004 | error   | unscale_ twice for one optimizer in one step (torch raises) | unscale each optimizer once       |
| CAD005 | error   | scheduler stepped more than once per optimizer step         | scheduler.step() once per step    |
| CAD006 | error   | scheduler stepped before the first optimizer step           | scheduler.step() after the step   |
| CAD007 | error   | scheduler stepped after a step the GradScaler skipped       | only when the scale did not drop  |
| CAD008 | error   | zero_grad between backwards of a window, or before its step | zero_grad once, after the step    |
| CAD009 | error   | optimizer.step with no backward since its previous step     | one step per window               |
| CAD010 | error   | windows of different lengths (a short last one is fine)     | count from the window start       |
| CAD011 | error   | fp16 autocast without a GradScaler                          | GradScaler, or bf16               |
| CAD012 | info    | GradScaler with bf16 autocast (harmless, unneeded)          | drop the scaler for bf16          |
| CAD013 | error   | scaler.step without update before the next one (or end)     | update after each scaler.step     |
| CAD014 | error   | scaler.update without a scaler.step since the last update   | update once per step              |
| CAD015 | warning | DDP all-reduce on a non-final micro-step (outside no_sync)  | no_sync around forward+backward   |
| CAD016 | warning | DDP no_sync entered after the forward (around backward)     | no_sync before the forward        |
| CAD017 | error   | DDP sync suppressed on the window's last micro-step         | last micro-step outside no_sync   |
| CAD018 | error   | per-micro-batch mean: targets of a window weigh >10% apart  | sum / window's target count       |
| CAD019 | error   | gradients not cleared after an optimizer step               | zero_grad after each step         |
| CAD020 | info    | backwards after the last optimizer step were never stepped  | step (or drop) the last window    |
| CAD021 | error   | short window normalised as a full one (e.g. 0.50x gradient) | divide by the window's own count  |
| CAD022 | error   | Newton-Schulz (Muon) on an incomplete window                | orthogonalise once per step       |
| CAD023 | error   | gradients clipped inside an optimizer's step                | clip before optimizer.step        |
| CAD024 | error   | schedule-free model evaluated or saved in train mode        | optimizer.eval() first            |
| CAD025 | error   | per-micro-batch pair mean: pairs of a window weigh >10% apart | sum / window's pair count       |
| CAD026 | error   | per-micro-batch NLL mean in a preference loss (ORPO)        | sum / window's chosen tokens      |
| CAD027 | error   | KTO's reference point taken per micro-batch                 | z over the whole window           |

Levels: **error** when the loop's gradient, update or LR schedule differs from one big batch's (CI gates on it:
exit status 1); **warning** for performance only (the math is right: needless communication; exit 0 unless
``--strict``); **info** for harmless findings.

The line reported is the call that breaks the rule: the clip (CAD001/002), the unscale_ (003/004), the scheduler step
(005-007), the zero_grad (008), the optimizer or scaler step (009, 010: the step closing the odd window, 013), the
autocast entry (011), the scaler.scale (012), the update (014), the backward (015, 017-020; the window's first backward
for 018 and 021) and the no_sync entry (016). ``cadence.audit.rules`` holds the same table (``RULES``) and the analysis.
"""

from __future__ import annotations

import contextlib
import functools
import os
import site
import sys
import sysconfig
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch

from cadence.audit.optimizers import OptimizerWatch
from cadence.audit.rules import (
    AUTOCAST,
    BACKWARD,
    CLIP,
    EPOCH,
    FOUND,
    NORM,
    RULES,
    SCALE,
    SCHEDULER,
    STEP,
    UNSCALE,
    UPDATE,
    ZERO_GRAD,
    Analyzer,
    AuditReport,
    Loc,
    ObservedCadence,
    RuleViolation,
    format_report,
)

__all__ = ["Audit", "AuditReport", "ObservedCadence", "RULES", "RuleViolation", "format_report"]
# The runner of `cadence audit -- python train.py` is in cadence.audit.run (run_script, audit_script).

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SCALE_KEY = "cadence_audit_loss_scale"  # node metadata key: the GradScaler scale that multiplied this loss
_DRAIN_AT = 4096  # events kept before the analyzer consumes them: a long run keeps aggregates, not its history
_WALK = 16  # autograd nodes looked at from a loss towards its reduction: a few scalar ops, never the model
# Nodes that reduce per-target losses to the scalar loss; the scalar arithmetic walked through on the way to them.
_REDUCTIONS = frozenset({"NllLossBackward0", "NllLoss2DBackward0", "SumBackward0", "MeanBackward0"})
_SCALAR_OPS = frozenset({"DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1", "AddBackward0", "AddBackward1",
                         "SubBackward0", "SubBackward1", "NegBackward0", "ToCopyBackward0", "CloneBackward0",
                         "AliasBackward0", "ViewBackward0", "SqueezeBackward0", "SqueezeBackward1",
                         "UnsqueezeBackward0"})
_INTERNAL, _LIBRARY, _USER = range(3)


def _is_torch(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR)


def is_audit_file(filename: str) -> bool:
    """A frame of the audit package itself (never the user's loop)."""
    return filename.startswith(_HERE)


def _is_internal(filename: str) -> bool:
    """Frames that are not the user's: torch, the audit itself and contextlib's generator plumbing."""
    return filename.startswith(_TORCH_DIR) or filename == contextlib.__file__ or is_audit_file(filename)


def _library_dirs() -> tuple[str, ...]:
    """Where installed code lives: the standard library, site-packages (also a virtual environment's) and cadence
    itself (a library to its users, installed or not)."""
    paths = sysconfig.get_paths()
    dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(key)}
    dirs.update(getattr(site, "getsitepackages", list)())
    user_site = getattr(site, "getusersitepackages", lambda: None)()
    if user_site:
        dirs.add(user_site)
    dirs.add(os.path.dirname(_HERE.rstrip(os.sep)))  # cadence/
    return tuple(sorted(os.path.join(os.path.realpath(d), "") for d in dirs))


_LIBRARY_DIRS = _library_dirs()


def _frame_kind(filename: str) -> int:
    """_INTERNAL (torch, the audit, contextlib's plumbing: never named), _LIBRARY (installed code: named after the
    user's frame) or _USER."""
    if _is_internal(filename):
        return _INTERNAL
    if filename.startswith("<frozen") or os.path.realpath(filename).startswith(_LIBRARY_DIRS):
        return _LIBRARY
    return _USER


class Audit:
    """Instruments torch while the ``with`` block runs (nothing stays patched after it); ``report()`` afterwards."""

    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._analyzer = Analyzer()
        self._active = False
        self._crashed = False
        self._report: AuditReport | None = None
        self._undo: contextlib.ExitStack | None = None
        self._kinds: dict[str, int] = {}  # filename -> _INTERNAL / _LIBRARY / _USER (cached: the hooks stay cheap)
        self._torch_file: dict[str, bool] = {}
        # state the hooks share between events
        self._in_scaler_step = 0
        self._scaler_stepped = False
        self._probe: tuple[torch.Tensor, weakref.ref[torch.Tensor], int] | None = None
        self._ddp_module: Any = None
        self._ddp_fwd_sync = True
        self._no_sync_locs: list[Loc] = []
        self._norm: list[_Probe | None] = []  # the open window's backwards: where their loss was reduced
        self._norm_loc: Loc = None  # the window's first backward
        self._labels: deque[Any] = deque(maxlen=256)  # target counts of the DataLoader batches not yet backpropagated
        # Muon's Newton-Schulz, a clip inside a step, a schedule-free optimizer's mode (CAD022-CAD024)
        self._watch = OptimizerWatch(emit=self._events.append, loc=self._loc, active=lambda: self._active)
        self._layouts: deque[str | None] = deque(maxlen=256)  # their preference layouts (pairs, kto; None: neither)
        self._kto_backwards: list[Loc] = []  # the open window's backwards of KTO batches (CAD027)

    def __enter__(self) -> Audit:
        if self._undo is not None:
            raise RuntimeError("an Audit is used for one run only; create a new one")
        stack = contextlib.ExitStack()
        try:
            self._install(stack)
        except BaseException:
            stack.close()  # a half-installed audit must not leave anything patched
            raise
        self._undo = stack
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._active = False  # a wrapper a user kept a reference to now passes straight through
        if exc_type is not None and not (exc_type is SystemExit and exc.code in (None, 0)):
            self._crashed = True
        assert self._undo is not None
        self._undo.close()
        self._probe = self._ddp_module = None  # drop references to the user's objects

    def mark_crashed(self) -> None:
        """The audited code failed (``run_script`` catches its exception inside the block): trailing backwards are
        then expected, not a finding."""
        self._crashed = True

    def report(self) -> AuditReport:
        """Findings and the observed cadence; available once the ``with`` block has exited."""
        if self._active or self._undo is None:
            raise RuntimeError("Audit.report() is available after the `with Audit()` block")
        if self._report is None:
            self._analyzer.feed(self._events)
            self._events.clear()
            self._report = self._analyzer.finish(crashed=self._crashed)
        return self._report

    # ------------------------------------------------------------------------------------------------ stack
    def _loc(self) -> Loc:
        """(filename, line, via) of the first frame of the user's code, ``via`` the (filename, line) of the first
        library frame below it (the call into torch) or None; when no frame is the user's (a loop run from an
        installed package), the library frame itself."""
        frame: FrameType | None = sys._getframe(1)
        kinds = self._kinds
        via = None
        while frame is not None:
            name = frame.f_code.co_filename
            kind = kinds.get(name)
            if kind is None:
                kind = kinds[name] = _frame_kind(name)
            if kind == _USER:
                return (name, frame.f_lineno, via)
            if kind == _LIBRARY and via is None:
                via = (name, frame.f_lineno)
            frame = frame.f_back
        return (via[0], via[1], None) if via is not None else None

    def _from_torch(self) -> bool:
        """True when the wrapper calling this was called by torch itself (``Tensor.backward`` calling
        ``autograd.backward``, ``scaler.step`` calling ``unscale_``, a scheduler's initial step): not a user event."""
        frame = sys._getframe(2)
        while frame.f_back is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back  # past the warning-attributing layer around every patch (_warnings_from_caller)
        name = frame.f_code.co_filename
        flag = self._torch_file.get(name)
        if flag is None:
            flag = self._torch_file[name] = _is_torch(name)
        return flag

    # ------------------------------------------------------------------------------------------------ patches
    def _install(self, stack: contextlib.ExitStack) -> None:
        from torch.nn.parallel import DistributedDataParallel
        from torch.nn.utils import clip_grad
        from torch.optim import lr_scheduler
        from torch.optim import optimizer as optimizer_module

        def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
            original = vars(owner)[name]  # the object as stored, restored exactly
            stack.callback(setattr, owner, name, original)
            setattr(owner, name, functools.wraps(original)(_warnings_from_caller(make(original))))

        handle = optimizer_module.register_optimizer_step_post_hook(self._on_optimizer_step)
        stack.callback(handle.remove)
        owner: Any  # a class or a module, whose attribute is patched
        for owner in (torch.Tensor, torch.autograd):
            patch(owner, "backward", self._backward_wrapper)
        for owner in (torch.optim.Optimizer, torch.nn.Module):
            patch(owner, "zero_grad", self._event_wrapper(ZERO_GRAD))
        for owner in (torch.nn.utils, clip_grad):
            for name in ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_"):
                if name in vars(owner):
                    patch(owner, name, self._event_wrapper(CLIP))
        scaler = torch.amp.GradScaler  # torch.cuda.amp / torch.cpu.amp.GradScaler subclass it, not overriding these
        for name, kind in (("scale", SCALE), ("unscale_", UNSCALE), ("update", UPDATE)):
            patch(scaler, name, self._event_wrapper(kind))
        patch(scaler, "scale", self._scale_wrapper)  # around the event wrapper: tags the scaled loss with its scale
        patch(scaler, "step", self._scaler_step_wrapper)
        # LRScheduler.step, and every torch scheduler that overrides it (ReduceLROnPlateau, SequentialLR, ...)
        for cls in vars(lr_scheduler).values():
            if isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler) and "step" in vars(cls):
                patch(cls, "step", self._event_wrapper(SCHEDULER))
        # subclasses (torch.cuda.amp.autocast) call this __enter__ through super(): one patch sees them all
        patch(torch.amp.autocast_mode.autocast, "__enter__", self._autocast_wrapper)
        patch(DistributedDataParallel, "forward", self._ddp_forward_wrapper)
        patch(DistributedDataParallel, "no_sync", self._no_sync_wrapper)
        patch(torch.utils.data.DataLoader, "__iter__", self._event_wrapper(EPOCH))
        patch(torch.utils.data.dataloader._BaseDataLoaderIter, "__next__", self._next_batch_wrapper)
        self._watch.install(stack, patch)

    def _backward_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self._active and not self._from_torch():
                self._on_backward(args[0] if args else kwargs.get("tensors"))
            with self._watch.backward():  # gradient hooks run inside it
                return original(*args, **kwargs)

        return backward

    def _event_wrapper(self, kind: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Records ``kind`` BEFORE the call: torch raises on some misuses (unscale_ twice) and the event must exist."""
        scaler = kind in (SCALE, UNSCALE, UPDATE)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if self._active and not self._from_torch() and not (scaler and not args[0].is_enabled()):
                    if kind == UNSCALE:
                        optimizer = args[1] if len(args) > 1 else kwargs.get("optimizer")
                        self._events.append((UNSCALE, self._loc(), id(optimizer)))
                    elif kind == SCHEDULER:
                        self._events.append((SCHEDULER, self._loc(), id(args[0]), isinstance(args[0], plateau)))
                    elif kind == EPOCH:
                        self._events.append((EPOCH,))
                    elif kind == CLIP and self._watch.clipping():
                        pass  # inside an optimizer's step: CAD023's, not the step chain's clip rules
                    else:
                        self._events.append((kind, self._loc()))
                        if kind == ZERO_GRAD:
                            self._probe = None
                return original(*args, **kwargs)

            return wrapper

        return make

    def _scaler_step_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not (self._active and scaler.is_enabled()) or self._from_torch():
                return original(scaler, optimizer, *args, **kwargs)
            loc = self._loc()
            self._in_scaler_step += 1
            self._scaler_stepped = False  # set by the optimizer's post-hook: it does not fire on a skipped step
            try:
                return original(scaler, optimizer, *args, **kwargs)
            finally:
                self._in_scaler_step -= 1
                self._window_norm()
                self._events.append((STEP, loc, id(optimizer), self._scaler_stepped, True))
                self._after_step(optimizer)

        return step

    def _autocast_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        half, bf16 = torch.float16, torch.bfloat16

        def enter(autocast: Any) -> Any:
            # Only training forwards matter: an evaluation under no_grad has no backward to scale.
            if self._active and autocast._enabled and torch.is_grad_enabled():
                dtype = autocast.fast_dtype
                if dtype == half or dtype == bf16:
                    self._events.append((AUTOCAST, self._loc(), dtype == half))
            return original(autocast)

        return enter

    def _ddp_forward_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            # DDP decides at forward time whether the coming backward all-reduces: remember that decision.
            if self._active and torch.is_grad_enabled():
                self._ddp_module = module
                self._ddp_fwd_sync = bool(module.require_backward_grad_sync)
            return original(module, *args, **kwargs)

        return forward

    def _no_sync_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def no_sync(module: Any) -> Iterator[None]:
            active = self._active
            if active:
                self._no_sync_locs.append(self._loc())
            try:
                with original(module):
                    yield
            finally:
                if active and self._no_sync_locs:
                    self._no_sync_locs.pop()

        return no_sync

    def _scale_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scale(scaler: Any, outputs: Any) -> Any:
            scaled = original(scaler, outputs)
            node = getattr(scaled, "grad_fn", None)
            if self._active and node is not None and scaler.is_enabled() and scaler._scale is not None:
                # a copy: update() changes the scale in place, and the window's weights are read at its step
                node.metadata[_SCALE_KEY] = scaler._scale.detach().clone()
            return scaled

        return scale

    def _next_batch_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def next_batch(iterator: Any) -> Any:
            batch = original(iterator)
            if self._active and torch.is_grad_enabled():  # an evaluation under no_grad backpropagates nothing
                count = _target_count(batch)
                if count is not None:
                    self._labels.append(count)
                self._layouts.append(preference_kind(batch))
            return batch

        return next_batch

    # ------------------------------------------------------------------------------------------------ events
    def _on_backward(self, loss: Any) -> None:
        ddp = None
        module = self._ddp_module
        if module is not None:
            self._ddp_module = None
            in_no_sync = not module.require_backward_grad_sync
            ddp = (self._ddp_fwd_sync, in_no_sync, self._no_sync_locs[-1] if self._no_sync_locs else None)
        loc = self._loc()
        if not self._norm:
            self._norm_loc = loc
        kind = self._layouts.popleft() if self._layouts else None
        if kind == "kto":
            self._kto_backwards.append(loc)
        self._norm.append(_probe_reduction(loss, self._labels.popleft() if self._labels else None, kind))
        stale = False
        probe = self._probe
        if probe is not None:
            self._probe = None
            param, grad_ref, version = probe
            grad = param.grad
            stale = grad is not None and grad is grad_ref() and grad._version == version  # untouched since the step
        self._events.append((BACKWARD, loc, ddp, stale))

    def _window_norm(self) -> None:
        """At a step: the weight each micro-batch of the window gave its targets, and their counts (CAD018, CAD021),
        when every backward's reduction was found. Tensors on an accelerator stay tensors until the analyzer resolves
        them in batches (no synchronisation per step)."""
        found, self._norm = self._norm, []
        kto, self._kto_backwards = self._kto_backwards, []
        if len(kto) > 1:  # each micro-batch's KL rows estimate its own z (TRL's KTOTrainer), not the window's
            self._events.append((FOUND, kto[0], "CAD027", float(len(kto)),
                                 f"{len(kto)} micro-batches in one window, each with its own reference point"))
        window = [probe for probe in found if probe is not None and probe.grad]
        if not window or len(window) < len(found):
            return
        weights: Any = torch.stack([probe.weight() for probe in window])
        counts: Any = None
        if all(probe.count is not None for probe in window):
            raw = [probe.count for probe in window]
            if all(isinstance(count, int) for count in raw):
                counts = raw
            else:
                counts = torch.stack([torch.as_tensor(c, dtype=torch.float32, device=weights.device).reshape(())
                                      for c in raw])
        if weights.device.type == "cpu":
            weights = weights.tolist()
            if counts is not None and not isinstance(counts, list):
                counts = counts.tolist()
        self._events.append((NORM, self._norm_loc, weights, counts, window[0].unit))

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's global step post-hook: it fires only when the optimizer really stepped."""
        if not self._active:
            return
        self._watch.stepped(optimizer)
        if self._in_scaler_step:
            self._scaler_stepped = True  # the scaler.step wrapper records the event, with did_step
            return
        self._window_norm()
        self._events.append((STEP, self._loc(), id(optimizer), True, False))
        self._after_step(optimizer)

    def _after_step(self, optimizer: Any) -> None:
        """Remember one gradient and its version: unchanged at the next backward means it was never cleared."""
        self._probe = None
        for group in getattr(optimizer, "param_groups", ()):
            for param in group["params"]:
                grad = param.grad
                if grad is not None:  # a weak reference: a gradient set to None must be free to go
                    self._probe = (param, weakref.ref(grad), grad._version)
                    break
            if self._probe is not None:
                break
        if len(self._events) >= _DRAIN_AT:
            self._analyzer.feed(self._events)
            self._events.clear()


class _Probe:
    """Where one backward's loss reduced its per-target losses: the gradient reaching that node (filled in by a hook
    during the backward), what the node divides by, the GradScaler scale above it and the micro-batch's target
    count (from the node, else from the DataLoader's labels; None when unknown)."""

    __slots__ = ("grad", "divisor", "scale", "count", "unit")

    def __init__(self, divisor: Any, scale: Any, count: Any, unit: str = "targets") -> None:
        self.grad: list[torch.Tensor] = []
        self.divisor = divisor
        self.scale = scale
        self.count = count
        self.unit = unit
        """What the weights are per: targets, a preference loss's pairs, or (orpo) its NLL term's chosen tokens."""

    def weight(self) -> torch.Tensor:
        """The gradient weight of each of this micro-batch's targets in the window's gradient."""
        weight = self.grad[0].detach().float().reshape(())
        if self.divisor is not None:
            weight = weight / self.divisor
        if self.scale is not None:
            weight = weight / self.scale.to(weight.device)
        return weight


def _probe_reduction(loss: Any, loader_count: Any, kind: str | None = None) -> _Probe | None:
    """Find the node that reduced ``loss``'s per-target losses (a few scalar ops below it) and hook its gradient;
    None when there is no single such node (a custom autograd function, two losses of the same kind added).
    ``kind``: the micro-batch's preference layout (pairs: the mean is over its pairs, or an NLL term's tokens)."""
    if isinstance(loss, (list, tuple)):
        loss = loss[0] if len(loss) == 1 else None
    root = getattr(loss, "grad_fn", None)
    if root is None or loss.numel() != 1:
        return None
    todo, found, scale, seen = [root], [], None, 0
    while todo and seen < _WALK:
        node = todo.pop()
        seen += 1
        name = node.name()
        if name in _REDUCTIONS:
            found.append(node)
            continue
        if name not in _SCALAR_OPS:
            continue
        if name == "MulBackward0" and scale is None:
            scale = node.metadata.get(_SCALE_KEY)
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    nll = [node for node in found if node.name().startswith("NllLoss")]
    if len(nll) == 1:  # e.g. cross_entropy plus an auxiliary .mean(): the targets' loss is the nll_loss
        node = nll[0]
    elif len(found) == 1:
        node = found[0]
    else:
        return None
    name = node.name()
    if name.startswith("NllLoss"):
        reduction = node._saved_reduction  # 1: mean (divides by the targets' total weight), 2: sum
        total = node._saved_total_weight
        probe = _Probe(total if reduction == 1 else None, scale, total, "orpo" if kind == "pairs" else "targets")
    elif name == "MeanBackward0":
        probe = _Probe(node._saved_self_sym_numel, scale, loader_count, "pairs" if kind == "pairs" else "targets")
    else:
        probe = _Probe(None, scale, loader_count)
    node.register_prehook(lambda grads: probe.grad.append(grads[0]) if not probe.grad else None)
    return probe


def preference_kind(batch: Any) -> str | None:
    """A DataLoader batch's preference layout, by TRL's keys: "kto" (its mismatched ``KL_`` rows), "pairs" (chosen
    and rejected: ``chosen_input_ids``, or a ``completion_mask`` without labels, DPOTrainer's concatenated rows), or
    None."""
    if not isinstance(batch, Mapping):
        return None
    if any(isinstance(key, str) and key.startswith("KL_") for key in batch):
        return "kto"
    if "chosen_input_ids" in batch or ("completion_mask" in batch and "labels" not in batch and "label" not in batch):
        return "pairs"
    return None


def _target_count(batch: Any) -> Any:
    """Targets in a DataLoader batch: ``labels != -100`` of a mapping's ``labels`` (shifted by one position when 2-D,
    as Hugging Face causal LMs shift them; ``shift_labels`` as given), else of the last item of a tuple or list
    when it holds integers; an int on the CPU, a 0-d tensor elsewhere, None when the batch has no labels."""
    if isinstance(batch, Mapping):
        labels = batch.get("shift_labels")
        if labels is None:
            labels = batch.get("labels")
            if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
                labels = labels[..., 1:]
    elif isinstance(batch, (tuple, list)) and batch:
        labels = batch[-1]
    else:
        return None
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        return None
    count = (labels != -100).sum()
    return int(count) if count.device.type == "cpu" else count


def _warnings_from_caller(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a patched torch function) with the warnings torch raises inside it attributed to its caller:
    torch warns with ``stacklevel=2``, which named the patch's wrapper in this file (cadence/audit/checker.py) as
    the place of the user's own call. Warnings are recorded while it runs and issued again at the caller's line;
    the warning filters apply as always ("error" still raises, inside the call)."""
    def attributed(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        recorded: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                try:
                    return function(*args, **kwargs)
                finally:
                    recorded = list(caught)
        finally:
            for warning in recorded:
                if warning.filename == __file__:
                    warnings.warn_explicit(warning.message, warning.category, caller.f_code.co_filename,
                                           caller.f_lineno, module=caller.f_globals.get("__name__"),
                                           registry=caller.f_globals.setdefault("__warningregistry__", {}))
                else:
                    warnings.warn_explicit(warning.message, warning.category, warning.filename,
                                           warning.lineno or 0, source=warning.source)

    return attributed
