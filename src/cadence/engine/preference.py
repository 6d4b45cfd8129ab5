"""Preference objectives on the objective seam: sigmoid DPO, IPO, SimPO, ORPO and KTO, exact under accumulation.

A preference micro-batch (:func:`cadence.data.preference.collate_preference`) holds ``2P`` rows: rows ``[0, P)`` are
the first sequences (a pair's chosen, a KTO example's completion) and rows ``[P, 2P)`` the second ones (the pair's
rejected; for KTO the example's prompt followed by another example's completion, the mismatched sequence its
reference point is estimated from), with ``desirable`` ([P]) for KTO. A padding micro-batch (one row, no target)
holds no pair and adds exactly zero. Each sequence is scored by its summed log-probability over its targets (the
completion's tokens and end, the same mask as supervised fine-tuning), the policy with gradients and the reference
without (:mod:`cadence.engine.reference`).

What the window divides by (summed over micro-batches and ranks before the first backward, never a micro-batch's
own count; TRL divides each micro-batch's mean by the accumulation steps, which is the one-big-batch gradient only
when every micro-batch holds as many pairs):

========  =====================================================================  ==================================
objective per pair (per example for KTO), with ``c``/``r`` the summed log-probs  divided by the window's
========  =====================================================================  ==================================
dpo       ``-logsigmoid(beta ((c - c_ref) - (r - r_ref)))``                     pairs
ipo       ``((c - c_ref) / |c| - (r - r_ref) / |r| - 1 / (2 beta))^2``          pairs
simpo     ``-logsigmoid(beta (c / |c| - r / |r|) - gamma)`` (no reference)     pairs
orpo      ``-beta logsigmoid(log_odds)``, log odds of the per-token means       pairs
          plus the chosen completion's NLL ``-c``                               chosen targets (a second term)
kto       ``w_d (1 - sigmoid(beta (x - z)))`` desirable, ``w_u (1 -             examples
          sigmoid(beta (z - x)))`` undesirable, ``x = y - y_ref``
========  =====================================================================  ==================================

KTO's reference point ``z`` is cadence's definition: the mean over the WHOLE window (every micro-batch, every rank)
of ``log pi(y'|x) - log pi_ref(y'|x)`` for each example's mismatched sequence, clamped at 0, taken by a no-gradient
pass over the window before its first backward (:meth:`PreferenceLoss.window_statistic`). TRL estimates it per
micro-batch (averaged over ranks), so its objective changes with the split; here any split gives one big batch's.

The reported loss is the window's mean per pair (per example for KTO; ORPO adds its NLL term's token mean), and the
metrics use TRL's names, window-wide: ``rewards/chosen``, ``rewards/rejected`` (``beta`` times the log-ratio to the
reference; for SimPO and ORPO ``beta`` times the per-token mean log-probability, as TRL's CPO and ORPO trainers),
``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``; KTO's ``kl`` is ``z``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cadence.data.preference import DESIRABLE_KEY
from cadence.engine.choices import ObjectiveName
from cadence.engine.reference import Reference, inference_module, row_logps
from cadence.engine.windows import IGNORE_INDEX, Batch, Window, WindowCounter, count_tokens

PAIR_OBJECTIVES: tuple[ObjectiveName, ...] = ("dpo", "ipo", "simpo", "orpo")
"""The objectives trained on pairs (a prompt with a chosen and a rejected completion)."""
REFERENCE_OBJECTIVES: tuple[ObjectiveName, ...] = ("dpo", "ipo", "kto")
"""The objectives scored against a reference model."""


def pairs_in(batch: Batch) -> int:
    """The pairs (KTO: examples) of a preference micro-batch: half its rows (a padding micro-batch has one row, and
    none)."""
    return int(batch["input_ids"].shape[0]) // 2


def rows_of(batch: Batch, start: int, end: int) -> dict[str, torch.Tensor]:
    """Rows ``[start, end)`` of a micro-batch's per-row tensors (the per-example ``desirable`` left out)."""
    return {key: value[start:end] for key, value in batch.items() if key != DESIRABLE_KEY}


def preference_counter() -> WindowCounter:
    """A preference window's counter: its samples are pairs (two rows each), its targets and tokens every row's."""
    return WindowCounter(samples=pairs_in, tokens=count_tokens)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, without cancellation (the branch at -ln 2, as TRL's ORPO computes it)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass(frozen=True, kw_only=True)
class PreferenceLoss:
    """One preference objective's computations (see the module docstring); made by
    :class:`cadence.engine.objective.Objective` from its flags."""

    name: ObjectiveName
    beta: float
    simpo_gamma: float
    desirable_weight: float
    undesirable_weight: float
    targets_only: bool
    """The head on the target positions only (the model can be split at its head), else all logits."""
    chunk_tokens: int | None
    """With ``targets_only``: target positions per chunk of the head (None: one chunk)."""
    reference: Reference | None

    # ------------------------------------------------------------------------------------------------ what is counted
    @property
    def units(self) -> tuple[str, ...]:
        if self.name == "kto":
            return ("examples",)
        return ("pairs", "chosen targets") if self.name == "orpo" else ("pairs",)

    def batch_units(self, batch: Batch) -> tuple[int, ...]:
        pairs = pairs_in(batch)
        if self.name != "orpo":
            return (pairs,)
        return (pairs, int((batch["labels"][:pairs] != IGNORE_INDEX).sum()))

    def window_units(self, window: Window) -> tuple[int, ...]:
        counts = [self.batch_units(batch) for batch in window.micro_batches]
        return tuple(sum(column) for column in zip(*counts))

    @property
    def statistic_names(self) -> tuple[str, ...]:
        if self.name == "kto":
            return ("rewards/chosen", "desirable", "rewards/rejected", "undesirable", "kl")
        return ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")

    @property
    def reference_scored(self) -> bool:
        """Whether the loss reads a reference's log-probabilities (dpo, ipo, kto)."""
        return self.name in REFERENCE_OBJECTIVES

    # ------------------------------------------------------------------------------------------------ the loss
    def window_statistic(self, model: torch.nn.Module, window: Window, *,
                         reduce: Callable[[torch.Tensor], torch.Tensor],
                         autocast: Callable[[], AbstractContextManager[Any]],
                         to_device: Callable[[Batch], Batch]) -> torch.Tensor | None:
        """KTO's reference point over the whole window (see the module docstring): every micro-batch's mismatched
        sequences scored by the policy and the reference without gradients, summed with their count over the
        ranks (one small all-reduce), the mean clamped at 0. Every rank scores every micro-batch it holds, padding
        ones included, so that FSDP2's gathers pair up. None for the other objectives."""
        if self.name != "kto":
            return None
        device = next(model.parameters()).device
        gaps = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        with torch.no_grad():
            for micro_batch in window.micro_batches:
                batch = to_device(micro_batch)
                pairs = pairs_in(batch)
                mismatched = rows_of(batch, pairs, 2 * pairs) if pairs else rows_of(batch, 0, 1)
                with autocast():
                    reference = self._reference_logps(mismatched)
                    gap = self._policy_logps(inference_module(model), mismatched) - reference
                gaps += gap[:pairs].sum().to(torch.float64)  # summed on the device: one read-back for the window
                count += pairs
        summed, count = reduce(torch.stack([gaps.cpu(), torch.tensor(float(count), dtype=torch.float64)])).tolist()
        return torch.tensor(max(summed / count, 0.0) if count else 0.0, dtype=torch.float32, device=device)

    def micro_batch_loss(self, model: torch.nn.Module, batch: Batch, statistic: torch.Tensor | None
                         ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The micro-batch's loss sums (one per unit) and statistics' sums."""
        pairs = pairs_in(batch)
        if self.name == "kto":
            return self._kto_loss(model, batch, pairs, statistic)
        # The reference scores the rows BEFORE the policy's forward: its activations are freed before the policy's
        # graph exists, so the step's peak is the policy's alone (scored after, they would sit on top of it).
        reference = self._reference_logps(batch) if self.reference_scored else None
        logps = self._policy_logps(model, batch)
        lengths = (batch["labels"] != IGNORE_INDEX).sum(1).to(logps.dtype)
        chosen, rejected = logps[:pairs], logps[pairs:2 * pairs]
        chosen_length, rejected_length = lengths[:pairs], lengths[pairs:2 * pairs]
        terms: tuple[torch.Tensor, ...]
        if self.name in ("simpo", "orpo"):
            chosen_mean, rejected_mean = chosen / chosen_length, rejected / rejected_length
            chosen_reward, rejected_reward = self.beta * chosen_mean.detach(), self.beta * rejected_mean.detach()
            if self.name == "simpo":
                losses = -F.logsigmoid(self.beta * (chosen_mean - rejected_mean) - self.simpo_gamma)
                terms = (losses.sum(),)
            else:
                log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
                terms = ((-self.beta * F.logsigmoid(log_odds)).sum(), -chosen.sum())
        else:
            scored = reference if reference is not None else self._reference_logps(batch)  # dpo, ipo: scored above
            chosen_ratio, rejected_ratio = chosen - scored[:pairs], rejected - scored[pairs:2 * pairs]
            chosen_reward, rejected_reward = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
            if self.name == "dpo":
                losses = -F.logsigmoid(self.beta * (chosen_ratio - rejected_ratio))
            else:  # ipo: TRL's form, each log-ratio a mean per completion token
                gap = chosen_ratio / chosen_length - rejected_ratio / rejected_length
                losses = (gap - 1 / (2 * self.beta)) ** 2
            terms = (losses.sum(),)
        statistics = (chosen_reward.sum(), rejected_reward.sum(), (chosen_reward > rejected_reward).sum(),
                      chosen.detach().sum(), rejected.detach().sum())
        return terms, statistics

    def _kto_loss(self, model: torch.nn.Module, batch: Batch, examples: int, reference_point: torch.Tensor | None
                  ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        # The completions only: the mismatched rows were scored by the window statistic. A padding micro-batch runs its
        # one row (the collectives of DDP and FSDP2 need every rank's forward and backward), and counts none.
        completions = rows_of(batch, 0, examples) if examples else rows_of(batch, 0, 1)
        reference = self._reference_logps(completions)  # before the policy's forward (see micro_batch_loss)
        gap = (self._policy_logps(model, completions) - reference)[:examples]
        point = reference_point if reference_point is not None else gap.new_zeros(())
        desirable = batch[DESIRABLE_KEY][:examples].to(torch.bool) if examples else gap.new_zeros(0, dtype=torch.bool)
        losses = torch.where(desirable, self.desirable_weight * (1 - torch.sigmoid(self.beta * (gap - point))),
                             self.undesirable_weight * (1 - torch.sigmoid(self.beta * (point - gap))))
        rewards = self.beta * gap.detach()
        statistics = (rewards[desirable].sum(), desirable.sum(), rewards[~desirable].sum(), (~desirable).sum(),
                      point.detach() * examples)
        return (losses.sum(),), statistics

    def _policy_logps(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return row_logps(model, batch, targets_only=self.targets_only, chunk_tokens=self.chunk_tokens)

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        if self.reference is None:
            raise RuntimeError(f"the {self.name} objective is scored against a reference model, and has none "
                               f"(Objective.with_reference)")
        return self.reference.row_logps(batch)

    # ------------------------------------------------------------------------------------------------ what is reported
    def window_loss(self, sums: Sequence[float], units: Sequence[int]) -> float:
        """The window's mean loss per pair (per example for KTO), plus ORPO's NLL term per chosen target."""
        return sum(sums[k] / units[k] for k in range(len(units)) if units[k])

    def window_metrics(self, sums: Sequence[float], units: Sequence[int]) -> dict[str, float]:
        """TRL's metrics over the whole window (see the module docstring)."""
        stats = dict(zip(self.statistic_names, sums[len(units):]))
        if self.name == "kto":
            metrics = {"kl": stats["kl"] / units[0]} if units[0] else {}
            for side, count in (("chosen", "desirable"), ("rejected", "undesirable")):
                if stats[count]:
                    metrics[f"rewards/{side}"] = stats[f"rewards/{side}"] / stats[count]
            if stats["desirable"] and stats["undesirable"]:
                metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
            return metrics
        metrics = {name: value / units[0] for name, value in stats.items()}
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        if self.name == "orpo":
            metrics["nll_loss"] = sums[1] / units[1] if units[1] else 0.0
        return metrics


__all__ = ["PAIR_OBJECTIVES", "PreferenceLoss", "REFERENCE_OBJECTIVES", "log1mexp", "pairs_in",
           "preference_counter", "rows_of"]
