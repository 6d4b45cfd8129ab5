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

The preference objectives (``dpo``, ``ipo``, ``simpo``, ``orpo``, ``kto``: :mod:`cadence.engine.preference`) score
each sequence by its summed target log-probability, computed the same way (targets only where the model allows it,
``--loss-chunk-tokens`` chunks), and divide by the window's pairs (KTO: examples; ORPO's NLL term: the window's chosen
targets). DPO, IPO and KTO are scored against a reference model (:mod:`cadence.engine.reference`), attached when the
components are built (:meth:`Objective.with_reference`).

As :class:`cadence.engine.cut.Cut` is for the window, this value is made once from the flags
(:meth:`Objective.from_flags`), written back to them (:meth:`Objective.flags`), said in words
(:meth:`Objective.describe`) and checked (:meth:`Objective.problems`, each problem naming its flag). A user's own loop
gives the engine a bare loss function instead: that is the ``sft`` objective computed by that function
(:meth:`Objective.token`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from cadence.data.preference import PreferenceExamples
from cadence.engine.choices import OBJECTIVES, REFERENCE_LOGPROBS, ObjectiveName
from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
from cadence.engine.preference import PAIR_OBJECTIVES, REFERENCE_OBJECTIVES, PreferenceLoss, preference_counter
from cadence.engine.reference import Reference
from cadence.engine.token_loss import LossFn, reads_next_token_labels, token_cross_entropy_sum
from cadence.engine.windows import Batch, Window, WindowCounter
from cadence.errors import Problem
from cadence.models.heads import chunking_problem

OBJECTIVE_FLAG_DEFAULTS: dict[str, Any] = {"objective": "sft", "loss_chunk_tokens": 0, "beta": 0.1,
                                           "simpo_gamma": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.0}
"""The objective's flags as a record without them (an older config.json or plan.json) means them; TRL's defaults
(DPOConfig, KTOConfig, ORPOConfig and CPOConfig's beta 0.1, CPOConfig's simpo_gamma 0.5, KTOConfig's weights 1)."""
PREFERENCE_FLAGS = ("beta", "simpo_gamma", "desirable_weight", "undesirable_weight")
"""The flags of the preference objectives (each applies to some of them only)."""


class MicroBatchLoss(NamedTuple):
    """One micro-batch's part of the window's loss, before any division."""

    terms: tuple[torch.Tensor, ...]
    """The SUM of the micro-batch's losses per reduction unit of the objective (``sft``: one term, the per-target
    cross-entropy summed over its targets), each a scalar with its graph."""
    statistics: tuple[torch.Tensor, ...] = ()
    """Sums the objective reports per window beside the loss, detached (none for ``sft``)."""


def _reference_logprobs_problems(name: str, mode: str, lora_rank: int) -> list[Problem]:
    """What is wrong with --reference-logprobs for this objective and run."""
    where = "--reference-logprobs"
    if mode not in REFERENCE_LOGPROBS:
        return [Problem(where=where, message=f"{mode!r} is not one of {', '.join(REFERENCE_LOGPROBS)}")]
    if mode != "precomputed":
        return []
    if name not in REFERENCE_OBJECTIVES:
        return [Problem(where=where, message=(
            f"precomputed: --objective {name} has no reference model to precompute (it applies to "
            f"{', '.join(REFERENCE_OBJECTIVES)})"))]
    if lora_rank:
        return [Problem(where=where, message=(
            "precomputed is unnecessary with --lora-rank: the reference is then the base with the adapters turned "
            "off, which holds no second copy of the weights; leave it live"))]
    return []


@dataclass(frozen=True, kw_only=True)
class Objective:
    """What the step chain minimises (see the module docstring)."""

    name: ObjectiveName = "sft"
    """sft: next-token cross-entropy over the loss-bearing targets; dpo, ipo, simpo, orpo, kto: preference
    objectives (cadence.engine.preference)."""
    loss_chunk_tokens: int = 0
    """The LM head and cross-entropy this many target positions at a time (--loss-chunk-tokens); 0: all at once (the
    target positions only where the model can be split at its head)."""
    beta: float = 0.1
    """dpo, ipo, simpo, orpo, kto: the temperature (IPO's tau; ORPO's lambda, the odds-ratio term's weight)."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin."""
    desirable_weight: float = 1.0
    """kto: the weight of a desirable example's loss."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable example's loss."""
    token_loss: LossFn | None = field(default=None, compare=False)
    """The function computing a micro-batch's summed token loss, once chosen for a model (:meth:`for_model`) or given
    by a user's loop (:meth:`token`); None: not yet chosen (all logits, until it is). A preference objective reads
    from it whether the head runs on the target positions only, and its chunk size."""
    reference: Reference | None = field(default=None, compare=False)
    """dpo, ipo, kto: the reference model (:meth:`with_reference`); None until it is attached."""

    def __post_init__(self) -> None:
        # Library misuse, not user input: the flags are validated (naming them) before an Objective is made.
        if self.name not in OBJECTIVES:
            raise ValueError(f"name must be one of {', '.join(OBJECTIVES)}, got {self.name!r}")
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")

    # ------------------------------------------------------------------------------------------------ from and to flags
    @classmethod
    def from_flags(cls, flags: Any) -> Objective:
        """The objective of train's flags (a TrainConfig, or a record's mapping with the same names)."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        values = {name: get(name, default) for name, default in OBJECTIVE_FLAG_DEFAULTS.items()}
        return cls(name=values.pop("objective"), **values)

    @classmethod
    def token(cls, loss_fn: LossFn) -> Objective:
        """The ``sft`` objective computed by ``loss_fn(model, micro_batch)``, which returns the SUM of the micro-batch's
        per-target losses (what ``Engine(loss_fn=...)`` gives a user's own loop)."""
        return cls(token_loss=loss_fn)

    def flags(self) -> dict[str, Any]:
        """The objective as train's flags (the run record's and plan.json's keys)."""
        return {"objective": self.name, "loss_chunk_tokens": self.loss_chunk_tokens,
                **{name: getattr(self, name) for name in PREFERENCE_FLAGS}}

    @property
    def pairs(self) -> bool:
        """Trained on preference pairs (dpo, ipo, simpo, orpo)."""
        return self.name in PAIR_OBJECTIVES

    @property
    def needs_reference(self) -> bool:
        """Scored against a reference model (dpo, ipo, kto)."""
        return self.name in REFERENCE_OBJECTIVES

    def describe(self) -> str:
        """In words, for the console and the reports: the loss and how its sum is computed."""
        if self.name != "sft":
            return self._describe_preference()
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

    def _describe_preference(self) -> str:
        what = {"dpo": f"sigmoid DPO (beta {self.beta:g})", "ipo": f"IPO (tau {self.beta:g})",
                "simpo": f"SimPO (beta {self.beta:g}, gamma {self.simpo_gamma:g}; no reference)",
                "orpo": f"ORPO (lambda {self.beta:g}; the chosen completion's NLL per chosen target, no reference)",
                "kto": f"KTO (beta {self.beta:g}, weights {self.desirable_weight:g}/{self.undesirable_weight:g}; "
                       f"the reference point over the whole window)"}[self.name]
        against = f" against {self.reference.description}" if self.reference is not None else ""
        unit = "example" if self.name == "kto" else "pair"
        return f"{what}{against}; the reported loss is the window's mean per {unit}"

    @staticmethod
    def problems(flags: Any) -> list[Problem]:
        """The objective's flags that are wrong, each naming its flag (``validate`` reports them with the rest; the
        flags' types are checked where they are parsed)."""
        get = flags.get if isinstance(flags, Mapping) else lambda name, default: getattr(flags, name, default)
        problems = []
        if (chunk := get("loss_chunk_tokens", 0)) < 0:
            problems.append(Problem(where="--loss-chunk-tokens", message=f"must be at least 0, got {chunk}"))
        name = get("objective", "sft")
        if name not in OBJECTIVES:
            return [*problems, Problem(where="--objective", message=f"{name!r} is not one of {', '.join(OBJECTIVES)}")]
        applies = {"beta": ("dpo", "ipo", "simpo", "orpo", "kto"), "simpo_gamma": ("simpo",),
                   "desirable_weight": ("kto",), "undesirable_weight": ("kto",)}
        for flag_name, objectives in applies.items():
            value, where = get(flag_name, OBJECTIVE_FLAG_DEFAULTS[flag_name]), "--" + flag_name.replace("_", "-")
            if not math.isfinite(value) or (value <= 0 and flag_name != "simpo_gamma"):
                problems.append(Problem(where=where, message=f"must be a finite number above 0, got {value:g}"
                                        if flag_name != "simpo_gamma" else f"must be finite, got {value:g}"))
            elif name not in objectives and value != OBJECTIVE_FLAG_DEFAULTS[flag_name]:
                problems.append(Problem(where=where, message=f"applies to --objective {' or '.join(objectives)}, "
                                                             f"not {name}"))
        if name != "sft" and get("packing", False):
            problems.append(Problem(where="--packing", message=(
                f"--objective {name} cuts each sample's two sequences as rows of their own; packing them is not "
                f"available (--micro-batch-order by-length pads little)")))
        if name != "sft" and get("checkpoint_mid_window", False):
            problems.append(Problem(where="--checkpoint-mid-window", message=(
                f"is not available with --objective {name} yet (a stop then waits for the window's end, and a "
                f"checkpoint at the step boundary keeps all of it)")))
        if name in REFERENCE_OBJECTIVES and get("strategy", "ddp") == "fsdp" and not get("lora_rank", 0):
            problems.append(Problem(where="--strategy", message=(
                f"fsdp with --objective {name} would hold a whole reference model on every rank; give --lora-rank "
                f"(the reference is then the base, with no copy) or use ddp (with --reference-logprobs precomputed "
                f"for no reference model in memory; not with fsdp yet: its pass scores the unsharded weights)")))
        problems += _reference_logprobs_problems(name, get("reference_logprobs", "live"), get("lora_rank", 0))
        reference = get("reference_model", None)
        if reference is not None and name not in REFERENCE_OBJECTIVES:
            problems.append(Problem(where="--reference-model", message=(
                f"--objective {name} has no reference model (it applies to {', '.join(REFERENCE_OBJECTIVES)})")))
        elif reference is not None and not (Path(reference) / "config.json").is_file():
            problems.append(Problem(where="--reference-model", message=(
                f"{reference} is not a model directory (no config.json; save one with save_pretrained)")))
        return problems

    def data_problem(self, train: Any) -> str | None:
        """Why the training examples do not fit the objective (pairs for dpo, ipo, simpo and orpo; unpaired labelled
        rows for kto; anything but preference rows for sft), or None."""
        unpaired = getattr(train, "unpaired", None) if isinstance(train, PreferenceExamples) else None
        wanted = {"sft": None, "kto": True}.get(self.name, False)
        if unpaired == wanted:
            return None
        held = {None: "text, prompt/completion or chat examples", False: "preference pairs (prompt, chosen, rejected)",
                True: "unpaired preference rows (prompt, completion, label)"}
        needs = {None: "text, prompt/completion or chat rows", False: 'preference pairs: {"prompt", "chosen", '
                 '"rejected"} rows', True: 'unpaired rows: {"prompt", "completion", "label"}'}
        return f"{self.name} trains on {needs[wanted]}; --data holds {held[unpaired]}"

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

    def with_reference(self, reference: Reference | None) -> Objective:
        """The objective scored against ``reference`` (dpo, ipo, kto; cadence.engine.reference)."""
        return replace(self, reference=reference)

    @property
    def resident_bytes(self) -> int:
        """The memory the objective holds besides the model: its reference's own weights (0 without one)."""
        return self.reference.held_bytes if self.reference is not None else 0

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
    def preference(self) -> PreferenceLoss | None:
        """A preference objective's computations (None for ``sft``)."""
        if self.name == "sft":
            return None
        loss = self.loss_fn
        return PreferenceLoss(name=self.name, beta=self.beta, simpo_gamma=self.simpo_gamma,
                              desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
                              targets_only=isinstance(loss, ChunkedCrossEntropy),
                              chunk_tokens=getattr(loss, "chunk_tokens", None), reference=self.reference)

    def counter(self) -> WindowCounter:
        """What a window's micro-batches count (a preference micro-batch's samples are its pairs)."""
        return preference_counter() if self.name != "sft" else WindowCounter()

    @property
    def units(self) -> tuple[str, ...]:
        """The reduction units, one per term of :class:`MicroBatchLoss` (the first is the one the gradient noise scale
        and an empty window's skip count): targets for sft, pairs, examples for KTO, ORPO's chosen targets."""
        preference = self.preference
        return preference.units if preference is not None else ("targets",)

    def window_units(self, window: Window) -> tuple[int, ...]:
        """This rank's count of each unit in ``window`` (the engine sums them over the ranks): for sft the loss-bearing
        targets its counter counted."""
        preference = self.preference
        return preference.window_units(window) if preference is not None else (window.targets,)

    def batch_units(self, batch: Batch, counter: WindowCounter) -> tuple[int, ...]:
        """One micro-batch's count of each unit (the noise scale's small batch, an evaluation's denominators)."""
        preference = self.preference
        return preference.batch_units(batch) if preference is not None else (counter.targets(batch),)

    @property
    def statistic_names(self) -> tuple[str, ...]:
        """The names of :attr:`MicroBatchLoss.statistics` as the metrics report them (none for ``sft``)."""
        preference = self.preference
        return preference.statistic_names if preference is not None else ()

    # ------------------------------------------------------------------------------------------------ the loss
    @property
    def has_window_statistic(self) -> bool:
        """Whether the loss needs a statistic of the whole window (KTO's reference point)."""
        return self.name == "kto"

    def window_statistic(self, model: torch.nn.Module, window: Window, *,
                         reduce: Callable[[torch.Tensor], torch.Tensor],
                         autocast: Callable[[], AbstractContextManager[Any]],
                         to_device: Callable[[Batch], Batch]) -> torch.Tensor | None:
        """A statistic of the whole window (all ranks: ``reduce`` sums a float64 vector over them) that every
        micro-batch's loss needs, computed before the first backward (``autocast``: the training precision;
        ``to_device``: a micro-batch onto the model's device); KTO's reference point, None for the others."""
        preference = self.preference
        if preference is None:
            return None
        return preference.window_statistic(model, window, reduce=reduce, autocast=autocast, to_device=to_device)

    def micro_batch_loss(self, model: torch.nn.Module, batch: Batch,
                         statistic: torch.Tensor | None = None) -> MicroBatchLoss:
        """The micro-batch's loss sums (one per unit) and reported statistics; ``statistic`` is
        :meth:`window_statistic`'s."""
        preference = self.preference
        if preference is None:
            return MicroBatchLoss(terms=(self.loss_fn(model, batch),))
        terms, statistics = preference.micro_batch_loss(model, batch, statistic)
        return MicroBatchLoss(terms=terms, statistics=statistics)

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
        preference = self.preference
        if preference is not None:
            return preference.window_loss(sums, units)
        return sum(sums[k] / units[k] for k in range(len(units))) if len(units) > 1 else sums[0] / units[0]

    def window_metrics(self, sums: Sequence[float], units: Sequence[int]) -> dict[str, float]:
        """The statistics the objective reports for a window, under TRL's names (none for ``sft``)."""
        preference = self.preference
        return preference.window_metrics(sums, units) if preference is not None else {}


__all__ = ["MicroBatchLoss", "OBJECTIVE_FLAG_DEFAULTS", "Objective"]
