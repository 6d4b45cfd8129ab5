"""The optimizer bugs ``cadence audit`` looks for (issue 51 item 6), instrumented beside the step chain's
(``cadence.audit.checker``):

- Newton-Schulz (torch.optim.Muon's, cadence's) running on an incomplete window: inside a backward pass (a gradient
  hook orthogonalising each micro-batch's gradient, DeepSpeed #8443), or with another backward of the window still
  to come; and an orthogonalising optimizer stepped more than once in a window of the loop's other optimizer
  (Muon stepped per micro-batch beside an AdamW stepped per window): CAD022.
- Gradients clipped inside an optimizer's ``step`` (after the update is made: clipping an orthogonalised update
  divides it by its own norm, DeepSpeed #8439): CAD023.
- A schedule-free optimizer's model evaluated (``model.eval()``) or saved (``torch.save``, safetensors) while the
  optimizer is in train mode, so the weights are the gradient point y, not the averaged x (schedule_free #48,
  accelerate #4159): CAD024.

Each hook appends an event tuple for ``cadence.audit.rules.Analyzer``:

    (ORTHO, loc, in_backward)          Newton-Schulz called
    (ORTHO_STEP, loc, optimizer_id)    an orthogonalising optimizer about to be recorded as stepped
    (CLIP_IN_STEP, loc)                a clip inside an optimizer's step
    (TRAIN_MODE, loc, what)            a schedule-free optimizer in train mode while the model is evaluated / saved
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cadence.audit.rules import CLIP_IN_STEP, ORTHO, ORTHO_STEP, TRAIN_MODE, Loc


def orthogonalising(optimizer: Any) -> bool:
    """Muon and its kin (torch.optim.Muon, cadence's Muon, a class named so): their step orthogonalises."""
    return any("Muon" in cls.__name__ for cls in type(optimizer).__mro__)


def schedule_free(optimizer: Any) -> bool:
    """A schedule-free optimizer: train/eval methods and a train_mode flag in its groups (the schedulefree
    package's, cadence's ScheduleFreeAdamW)."""
    groups = getattr(optimizer, "param_groups", None)
    return isinstance(groups, list) and bool(groups) and "train_mode" in groups[0] \
        and callable(getattr(optimizer, "eval", None))


class OptimizerWatch:
    """The hooks of this module's rules; ``emit`` appends an event, ``loc`` names the user's line, ``active`` says
    whether the audit is still running (a wrapper kept by the user passes straight through after it)."""

    def __init__(self, *, emit: Callable[[tuple], None], loc: Callable[[], Loc], active: Callable[[], bool]) -> None:
        self.emit, self.loc, self.active = emit, loc, active
        self.backwards = 0  # backward passes running now (hooks run inside them)
        self.steps = 0  # optimizer steps running now
        self.schedule_free: weakref.WeakSet[Any] = weakref.WeakSet()

    def install(self, stack: contextlib.ExitStack, patch: Callable[[Any, str, Callable[[Any], Any]], None]) -> None:
        from torch.optim import _muon
        from torch.optim import optimizer as optimizer_module

        from cadence.optim import muon

        patch(_muon, "_zeropower_via_newtonschulz", self._newton_schulz)
        patch(muon, "newton_schulz", self._newton_schulz)
        handle = optimizer_module.register_optimizer_step_pre_hook(self._step_started)
        stack.callback(handle.remove)
        patch(torch.nn.Module, "eval", functools.partial(self._in_train_mode, "evaluated"))
        patch(torch, "save", functools.partial(self._in_train_mode, "saved"))
        import safetensors.torch

        for name in ("save_file", "save_model"):
            patch(safetensors.torch, name, functools.partial(self._in_train_mode, "saved"))

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Around a backward pass: what runs in it (gradient hooks) runs per micro-batch."""
        self.backwards += 1
        try:
            yield
        finally:
            self.backwards -= 1

    def clipping(self) -> bool:
        """A clip now is inside an optimizer's step (CAD023, instead of the step chain's clip rules)."""
        if self.steps and self.active():
            self.emit((CLIP_IN_STEP, self.loc()))
            return True
        return False

    def stepped(self, optimizer: Any) -> None:
        """After an optimizer's step (torch's post-hook: it stepped): the step is over; an orthogonalising optimizer
        is named before the step chain's STEP event; a schedule-free one is watched from now on."""
        self.steps = max(0, self.steps - 1)
        if orthogonalising(optimizer):
            self.emit((ORTHO_STEP, self.loc(), id(optimizer)))
        if schedule_free(optimizer):
            self.schedule_free.add(optimizer)

    def _step_started(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active():
            self.steps += 1

    def _newton_schulz(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def newton_schulz(*args: Any, **kwargs: Any) -> Any:
            if self.active():
                self.emit((ORTHO, self.loc(), self.backwards > 0))
            return original(*args, **kwargs)

        return newton_schulz

    def _in_train_mode(self, what: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.active() and any(group.get("train_mode") for optimizer in list(self.schedule_free)
                                     for group in optimizer.param_groups[:1]):
                self.emit((TRAIN_MODE, self.loc(), what))
            return original(*args, **kwargs)

        return call
