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
entry, DDP forward and ``no_sync``, ``F.cross_entropy`` and ``DataLoader`` iteration (epoch ends). Each hook appends a
small tuple with the file:line of the first frame outside torch and outside this module; calls that torch makes
itself (``Tensor.backward`` -> ``autograd.backward``, ``scaler.step`` -> ``unscale_``, a scheduler's initial step) are
not user events and are not recorded. A *window* is the backward passes between two optimizer steps.

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
| CAD018 | error   | mean cross_entropy, micro-batch target counts >10% apart    | sum / window's target count       |
| CAD019 | error   | gradients not cleared after an optimizer step               | zero_grad after each step         |
| CAD020 | info    | backwards after the last optimizer step were never stepped  | step (or drop) the last window    |

Levels: **error** when the loop's gradient, update or LR schedule differs from one big batch's (CI gates on it:
exit status 1); **warning** for performance only (the math is right: needless communication; exit 0 unless
``--strict``); **info** for harmless findings.

The line reported is the call that breaks the rule: the clip (CAD001/002), the unscale_ (003/004), the scheduler step
(005-007), the zero_grad (008), the optimizer or scaler step (009, 010: the step closing the odd window, 013), the
autocast entry (011), the scaler.scale (012), the update (014), the backward (015, 017-020) and the no_sync entry
(016). ``cadence.audit.rules`` holds the same table (``RULES``) and the analysis.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cadence.audit.rules import (
    AUTOCAST,
    BACKWARD,
    CE_COUNTS,
    CLIP,
    EPOCH,
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
_CE_KEY = "cadence_audit_targets"  # node metadata key: (target, ignore_index) of a mean cross_entropy
_DRAIN_AT = 4096  # events kept before the analyzer consumes them: a long run keeps aggregates, not its history


def _is_torch(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR)


def is_audit_file(filename: str) -> bool:
    """A frame of the audit package itself (never the user's loop)."""
    return filename.startswith(_HERE)


def _is_internal(filename: str) -> bool:
    """Frames that are not the user's: torch, the audit itself and contextlib's generator plumbing."""
    return filename.startswith(_TORCH_DIR) or filename == contextlib.__file__ or is_audit_file(filename)


class Audit:
    """Instruments torch while the ``with`` block runs (nothing stays patched after it); ``report()`` afterwards."""

    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._analyzer = Analyzer()
        self._active = False
        self._crashed = False
        self._report: AuditReport | None = None
        self._undo: contextlib.ExitStack | None = None
        self._internal: dict[str, bool] = {}  # filename -> not the user's (cached: the hooks stay cheap)
        self._torch_file: dict[str, bool] = {}
        # state the hooks share between events
        self._in_scaler_step = 0
        self._scaler_stepped = False
        self._probe: tuple[torch.Tensor, weakref.ref[torch.Tensor], int] | None = None
        self._ddp_module: Any = None
        self._ddp_fwd_sync = True
        self._no_sync_locs: list[Loc] = []
        self._ce_pending = 0  # mean cross_entropy calls since the last backward
        self._ce_window: list[list[tuple[torch.Tensor, int]]] | None = []  # per backward; None: one was not mean CE
        self._ce_loc: Loc = None

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
        """(filename, line) of the first frame outside torch and the audit: usually 1-3 frames up."""
        frame = sys._getframe(1)
        internal = self._internal
        while frame is not None:
            name = frame.f_code.co_filename
            flag = internal.get(name)
            if flag is None:
                flag = internal[name] = _is_internal(name)
            if not flag:
                return (name, frame.f_lineno)
            frame = frame.f_back
        return None

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
        patch(scaler, "step", self._scaler_step_wrapper)
        # LRScheduler.step, and every torch scheduler that overrides it (ReduceLROnPlateau, SequentialLR, ...)
        for cls in vars(lr_scheduler).values():
            if isinstance(cls, type) and issubclass(cls, lr_scheduler.LRScheduler) and "step" in vars(cls):
                patch(cls, "step", self._event_wrapper(SCHEDULER))
        # subclasses (torch.cuda.amp.autocast) call this __enter__ through super(): one patch sees them all
        patch(torch.amp.autocast_mode.autocast, "__enter__", self._autocast_wrapper)
        patch(DistributedDataParallel, "forward", self._ddp_forward_wrapper)
        patch(DistributedDataParallel, "no_sync", self._no_sync_wrapper)
        patch(torch.nn.functional, "cross_entropy", self._cross_entropy_wrapper)
        patch(torch.utils.data.DataLoader, "__iter__", self._event_wrapper(EPOCH))

    def _backward_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(*args: Any, **kwargs: Any) -> Any:
            if self._active and not self._from_torch():
                self._on_backward(args[0] if args else kwargs.get("tensors"))
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
                self._window_targets()
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

    def _cross_entropy_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def cross_entropy(input: Any, target: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(input, target, *args, **kwargs)
            if not self._active or out.grad_fn is None:
                return out
            if args or "size_average" in kwargs or "reduce" in kwargs:
                # positional order after target: weight, size_average, ignore_index, reduce, reduction
                given = dict(zip(("weight", "size_average", "ignore_index", "reduce", "reduction"), args)) | kwargs
                reduction = given.get("reduction", "mean")
                if given.get("size_average") is not None or given.get("reduce") is not None:
                    reduction = torch.nn._reduction.legacy_get_string(given.get("size_average"), given.get("reduce"))
            else:  # the common call: keywords only, no legacy arguments
                given, reduction = kwargs, kwargs.get("reduction", "mean")
            if reduction == "mean" and not target.is_floating_point():
                # On the node itself: its metadata outlives the Python wrapper object, and holding the node would keep
                # the graph alive. Counting waits for the window's end (one batched count per optimizer step).
                out.grad_fn.metadata[_CE_KEY] = (target, given.get("ignore_index", -100))
                self._ce_pending += 1
            return out

        return cross_entropy

    # ------------------------------------------------------------------------------------------------ events
    def _on_backward(self, loss: Any) -> None:
        ddp = None
        module = self._ddp_module
        if module is not None:
            self._ddp_module = None
            in_no_sync = not module.require_backward_grad_sync
            ddp = (self._ddp_fwd_sync, in_no_sync, self._no_sync_locs[-1] if self._no_sync_locs else None)
        found = self._match_cross_entropy(loss) if self._ce_pending else None
        loc = self._loc()
        if self._ce_window is not None:
            if found:
                if not self._ce_window:
                    self._ce_loc = loc
                self._ce_window.append(found)
            else:
                self._ce_window = None  # the rule needs every micro-batch's loss to be a mean cross_entropy
        stale = False
        probe = self._probe
        if probe is not None:
            self._probe = None
            param, grad_ref, version = probe
            grad = param.grad
            stale = grad is not None and grad is grad_ref() and grad._version == version  # untouched since the step
        self._events.append((BACKWARD, loc, ddp, stale))

    def _match_cross_entropy(self, loss: Any) -> list[tuple[torch.Tensor, int]]:
        """(target, ignore_index) of the mean cross_entropy(s) this loss comes from (a few autograd nodes up)."""
        wanted, self._ce_pending = self._ce_pending, 0
        if isinstance(loss, (list, tuple)):
            loss = loss[0] if loss else None
        root = getattr(loss, "grad_fn", None)
        todo = [root] if root is not None else []
        found: list[tuple[torch.Tensor, int]] = []
        visited = 0
        while todo and visited < 16 and len(found) < wanted:  # a few nodes from the loss: never walk the model
            node = todo.pop()
            visited += 1
            entry = node.metadata.get(_CE_KEY)
            if entry is not None:
                found.append(entry)
                continue
            todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return found

    def _window_targets(self) -> None:
        """At a step: the target count of each micro-batch of the window, when every loss was a mean cross_entropy
        (CAD018). One batched count per step; an accelerator's counts stay tensors until the analyzer resolves them."""
        window, self._ce_window = self._ce_window, []
        if not window or len(window) < 2:
            return
        targets = [target for found in window for target, _ in found]
        if all(len(found) == 1 for found in window) and len({(t.shape, t.device) for t in targets}) == 1:
            ignore = torch.tensor([found[0][1] for found in window], device=targets[0].device)
            stacked = torch.stack(targets).reshape(len(window), -1)
            counts: Any = (stacked != ignore[:, None]).sum(1)
        else:
            counts = torch.stack([sum((t != i).sum() for t, i in found) for found in window])
        self._events.append((CE_COUNTS, self._ce_loc, counts.tolist() if counts.device.type == "cpu" else counts))

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """torch's global step post-hook: it fires only when the optimizer really stepped."""
        if not self._active:
            return
        if self._in_scaler_step:
            self._scaler_stepped = True  # the scaler.step wrapper records the event, with did_step
            return
        self._window_targets()
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
