"""What the step chain minimises, as one frozen value: the loss, its reduction unit, what a micro-batch counts, and
what the reported loss means.

The step chain (``Engine.step``) never computes a mean per micro-batch. Each micro-batch returns the SUM of its
losses for each of the objective's reduction units, and the engine divides each sum by that unit counted over the
whole window and all ranks (one small all-reduce before the first backward), so that any split of the window
(micro-batch x accumulation x processes) gives the gradient of one big batch:

    counts  = objective.window_units(window)                 this rank's units, summed over the ranks by the engine
    factors = world / count for each unit
    loss    = objective.micro_batch_loss(model, micro_batch)  one SUM per unit, with its graph
    backward(objective.scaled(loss, factors))

The first objective is ``sft``, next-token cross-entropy whose unit is the loss-bearing target (labels != -100). Its
micro-batch loss sum is computed one of three ways, chosen for the model as ``cadence train`` always chose them
(:meth:`Objective.for_model`): all logits at once (:func:`cadence.engine.token_loss.token_cross_entropy_sum`), the
head on the target positions only (:class:`cadence.engine.chunked_loss.TargetsOnlyCrossEntropy`), or the head a
chunk of targets at a time (``--loss-chunk-tokens N``, :class:`~cadence.engine.chunked_loss.ChunkedCrossEntropy`).
The three give the same loss and gradient (to rounding); the reported loss is the window's token mean.

As :class:`cadence.engine.cut.Cut` is for the window, this value is made once from the flags
(:meth:`Objective.from_flags`), written back to them (:meth:`Objective.flags`), said in words
(:meth:`Objective.describe`) and checked (:meth:`Objective.problems`, each problem naming its flag). A user's own loop
gives the engine a bare loss function instead: that is the ``sft`` objective computed by that function
(:meth:`Objective.token`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from cadence.engine.choices import OBJECTIVES, ObjectiveName
from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
from cadence.engine.token_loss import LossFn, reads_next_token_labels, token_cross_entropy_sum
from cadence.engine.windows import Batch, Window, WindowCounter
from cadence.errors import Problem
from cadence.models.heads import chunking_problem

OBJECTIVE_FLAG_DEFAULTS: dict[str, Any] = {"loss_chunk_tokens": 0}
"""The objective's flags as a record without them (an older config.json or plan.json) means them."""


class MicroBatchLoss(NamedTuple):
    """One micro-batch's part of the window's loss, before any division."""

    terms: tuple[torch.Tensor, ...]
    """The SUM of the micro-batch's losses per reduction unit of the objective (``sft``: one term, the per-target
    cross-entropy summed over its targets), each a scalar with its graph."""
    statistics: tuple[torch.Tensor, ...] = ()
    """Sums the objective reports per window beside the loss, detached (none for ``sft``)."""


@dataclass(frozen=True, kw_only=True)
class Objective:
    """What the step chain minimises (see the module docstring)."""

    name: ObjectiveName = "sft"
    """sft: next-token cross-entropy over the loss-bearing targets."""
    loss_chunk_tokens: int = 0
    """sft: the LM head and cross-entropy this many target positions at a time (--loss-chunk-tokens); 0: all at once
    (the target positions only where the model can be split at its head)."""
    token_loss: LossFn | None = field(default=None, compare=False)
    """sft: the function computing a micro-batch's summed token loss, once chosen for a model (:meth:`for_model`) or
    given by a user's loop (:meth:`token`); None: not yet chosen (all logits, until it is)."""

    def __post_init__(self) -> None:
        # Library misuse, not user input: the flags are validated (naming them) before an Objective is made.
        if self.name not in OBJECTIVES:
            raise ValueError(f"name must be one of {', '.join(OBJECTIVES)}, got {self.name!r}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")

    # ------------------------------------------------------------------------------------------------ from and to flags
    @classmethod
    def from_flags(cls, flags: Any) -> Objective:
        """The objective of train's flags (a TrainConfig, or a record's mapping with the same names)."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        return cls(loss_chunk_tokens=int(get("loss_chunk_tokens", OBJECTIVE_FLAG_DEFAULTS["loss_chunk_tokens"])))

    @classmethod
    def token(cls, loss_fn: LossFn) -> Objective:
        """The ``sft`` objective computed by ``loss_fn(model, micro_batch)``, which returns the SUM of the micro-batch's
        per-target losses (what ``Engine(loss_fn=...)`` gives a user's own loop)."""
        return cls(token_loss=loss_fn)

    def flags(self) -> dict[str, Any]:
        """The objective as train's flags (the run record's and plan.json's keys)."""
        return {"loss_chunk_tokens": self.loss_chunk_tokens}

    def describe(self) -> str:
        """In words, for the console and the reports: the loss and how its sum is computed."""
        loss = self.loss_fn
        if isinstance(loss, TargetsOnlyCrossEntropy):
            how = "the head on the target positions only"
        elif isinstance(loss, ChunkedCrossEntropy):
            how = f"the head {loss.chunk_tokens} targets at a time"
        elif loss is token_cross_entropy_sum:
            how = "all logits at once"
        else:
            how = f"computed by {getattr(loss, '__name__', type(loss).__name__)}"
        return f"next-token cross-entropy over the targets ({how}); the reported loss is the window's token mean"

    @staticmethod
    def problems(flags: Any) -> list[Problem]:
        """The objective's flags that are wrong, each naming its flag (``validate`` reports them with the rest; the
        flags' types are checked where they are parsed)."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        problems = []
        if (chunk := get("loss_chunk_tokens", 0)) < 0:
            problems.append(Problem(where="--loss-chunk-tokens", message=f"must be at least 0, got {chunk}"))
        return problems

    # ------------------------------------------------------------------------------------------------ the loss function
    def for_model(self, model: torch.nn.Module | None, *, vocab_size: int | None) -> Objective:
        """The objective with its loss sum's way of computing chosen for ``model`` (as built, before any wrapping),
        whose vocabulary has ``vocab_size`` tokens:

        - ``loss_chunk_tokens`` > 0: the head and cross-entropy N targets at a time (prepare() has checked that the
          model's logits can be made chunk by chunk);
        - 0, a model that can be split at its head (:func:`cadence.models.heads.chunking_problem` finds nothing,
          checked here by its probe of 6 tokens): the head on the target positions only
          (:class:`~cadence.engine.chunked_loss.TargetsOnlyCrossEntropy`), so the logits of positions without a
          target (prompts, user and system turns, padding) are never made; the same loss and gradient as all logits;
        - otherwise all logits at once (:func:`~cadence.engine.token_loss.token_cross_entropy_sum`): families whose
          logits cadence cannot reproduce from the head's input keep their own forward. That is recurrent Gemma (its
          own ``logits_soft_cap``), a padded vocabulary trimmed after the head (``unpadded_vocab_size``), a config
          with more than one post-processing of the logits, a model without an output-embedding module, a forward
          that calls its head more than once or not on every position, or changes the logits in any way the probe
          does not recognise; and a model not given here.
        """
        if self.loss_chunk_tokens > 0:
            chosen: LossFn = ChunkedCrossEntropy(self.loss_chunk_tokens)
        elif model is not None and vocab_size is not None and chunking_problem(model, vocab_size) is None:
            chosen = TargetsOnlyCrossEntropy()
        else:
            chosen = token_cross_entropy_sum
        return replace(self, token_loss=chosen)

    @property
    def loss_fn(self) -> LossFn:
        """The function computing a micro-batch's summed token loss (all logits until one is chosen)."""
        return self.token_loss if self.token_loss is not None else token_cross_entropy_sum

    @property
    def reads_next_token_labels(self) -> bool:
        """Whether the loss reads cadence's next-token labels (``labels[t]`` is the target of position t), so that the
        engine checks the first window's labels for the Hugging Face convention."""
        return reads_next_token_labels(self.loss_fn)

    # ------------------------------------------------------------------------------------------------ what is counted
    @property
    def units(self) -> tuple[str, ...]:
        """The reduction units, one per term of :class:`MicroBatchLoss` (the first is the one the gradient noise scale
        and an empty window's skip count)."""
        return ("targets",)

    def window_units(self, window: Window) -> tuple[int, ...]:
        """This rank's count of each unit in ``window`` (the engine sums them over the ranks): the loss-bearing targets
        its counter counted."""
        return (window.targets,)

    def batch_units(self, batch: Batch, counter: WindowCounter) -> tuple[int, ...]:
        """One micro-batch's count of each unit (the noise scale's small batch, an evaluation's denominators)."""
        return (counter.targets(batch),)

    @property
    def statistic_names(self) -> tuple[str, ...]:
        """The names of :attr:`MicroBatchLoss.statistics` as the metrics report them (none for ``sft``)."""
        return ()

    # ------------------------------------------------------------------------------------------------ the loss
    def window_statistic(self, model: torch.nn.Module, window: Window, *,
                         reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
        """A statistic of the whole window (all ranks: ``reduce`` sums a float64 vector over them) that every
        micro-batch's loss needs, computed before the first backward; None for an objective without one (``sft``)."""
        return None

    def micro_batch_loss(self, model: torch.nn.Module, batch: Batch,
                         statistic: torch.Tensor | None = None) -> MicroBatchLoss:
        """The micro-batch's loss sums (one per unit) and reported statistics; ``statistic`` is
        :meth:`window_statistic`'s."""
        return MicroBatchLoss(terms=(self.loss_fn(model, batch),))

    @staticmethod
    def scaled(loss: MicroBatchLoss, factors: Sequence[float]) -> torch.Tensor:
        """What the backward runs on: each term times its factor (world size / the window's count of its unit)."""
        total = loss.terms[0] * factors[0]
        for term, factor in zip(loss.terms[1:], factors[1:]):
            total = total + term * factor
        return total

    @staticmethod
    def detached(loss: MicroBatchLoss) -> torch.Tensor:
        """The terms and statistics as one float64 vector without a graph, which the window sums on the device."""
        return torch.stack([value.detach().to(torch.float64) for value in (*loss.terms, *loss.statistics)])

    def window_loss(self, sums: Sequence[float], units: Sequence[int]) -> float:
        """The reported loss from the window's sums over all ranks (:meth:`detached`'s entries): each term over its
        unit's count, added (``sft``: the token mean)."""
        return sum(sums[k] / units[k] for k in range(len(units))) if len(units) > 1 else sums[0] / units[0]

    def window_metrics(self, sums: Sequence[float], units: Sequence[int]) -> dict[str, float]:
        """The statistics the objective reports for a window (none for ``sft``)."""
        return {}


__all__ = ["MicroBatchLoss", "OBJECTIVE_FLAG_DEFAULTS", "Objective"]
