"""How far a plan trusts the memory estimate: its measured error, per model family and lever group.

Measuring a candidate's peak costs a trial (the model, the optimizer and a profiled step on the data's longest
window); on gpt-small that is 10-40 s of a 2-core CPU. The estimate has a measured record: the figures shipped with
cadence (BENCHMARKS.md's estimate tables) and this plan's own trials. Where it has one, a candidate is measured for
memory only when its estimate is within the margin of the budget (the margin = max(1%, 1.5 x the worst error seen
for its family and levers)); clearly over is not run, clearly under fits by the estimate. Where it has none (a lever
group never measured: LoRA, offload, loss chunks, a lower-precision optimizer state, an nf4 base), every candidate
within :data:`UNTRUSTED_REACH` of the budget is measured, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from cadence.models.spec import ModelSpec
from cadence.plan.candidates import Candidate

Verdict = Literal["over", "under", "measure"]
TrustKey = tuple[str, str, str]
"""(the model's architecture, precision, recompute): what an estimate's error is known by."""

MIN_MARGIN = 0.01
"""The narrowest margin: even an estimate that has been exact is not trusted to decide a candidate within 1% of
the budget (the allocator's rounding, a different build of torch)."""
ERROR_FACTOR = 1.5
"""The margin is this many times the worst error seen: one more configuration may be a little worse than any yet."""
UNTRUSTED_REACH = 0.15
"""Without a measured error, candidates up to 15% over the budget are measured (the estimate's asserted tolerance,
tests/memory/test_memory_estimate.py), and nothing fits by estimate alone."""


@dataclass(frozen=True, kw_only=True)
class Shipped:
    """A verified error of the estimate shipped with cadence."""

    error: float
    """The largest relative error |estimate - measured| / measured over the configurations measured."""
    source: str


SHIPPED: dict[TrustKey, Shipped] = {
    # BENCHMARKS.md "Memory estimate against measurement": gpt-tiny, gpt-small and gpt-base, seq 256, AdamW.
    ("GPT", "fp32", "none"): Shipped(error=0.001, source="BENCHMARKS.md memory_estimate (gpt-tiny/small/base)"),
    ("GPT", "bf16", "none"): Shipped(error=0.006, source="BENCHMARKS.md memory_estimate (gpt-tiny/small/base)"),
    ("GPT", "fp32", "full"): Shipped(error=0.001, source="BENCHMARKS.md memory_estimate (gpt-tiny/small/base)"),
    ("GPT", "bf16", "full"): Shipped(error=0.008, source="BENCHMARKS.md memory_estimate (gpt-tiny/small/base)"),
    # Issue 54: a gpt-small plan's trials at seq 256 (c15 284.9 / 283.5 MiB, c34 308.0 / 307.6).
    ("GPT", "fp32", "selective"): Shipped(error=0.005, source="issue 54 (gpt-small trials)"),
    ("GPT", "bf16", "selective"): Shipped(error=0.005, source="issue 54 (gpt-small trials)"),
    # BENCHMARKS.md "Memory estimate of transformers models": the worst over rows, packed and token-budget cuts.
    ("LlamaForCausalLM", "fp32", "none"): Shipped(error=0.049, source="BENCHMARKS.md memory_estimate_hf"),
    ("LlamaForCausalLM", "fp32", "full"): Shipped(error=0.024, source="BENCHMARKS.md memory_estimate_hf"),
    ("LlamaForCausalLM", "fp32", "selective"): Shipped(error=0.047, source="BENCHMARKS.md memory_estimate_hf"),
    ("LlamaForCausalLM", "bf16", "none"): Shipped(error=0.034, source="BENCHMARKS.md memory_estimate_hf"),
    ("LlamaForCausalLM", "bf16", "full"): Shipped(error=0.030, source="BENCHMARKS.md memory_estimate_hf"),
    ("LlamaForCausalLM", "bf16", "selective"): Shipped(error=0.037, source="BENCHMARKS.md memory_estimate_hf"),
    ("GPT2LMHeadModel", "fp32", "none"): Shipped(error=0.036, source="BENCHMARKS.md memory_estimate_hf"),
    ("GPT2LMHeadModel", "fp32", "full"): Shipped(error=0.057, source="BENCHMARKS.md memory_estimate_hf"),
    ("GPT2LMHeadModel", "fp32", "selective"): Shipped(error=0.047, source="BENCHMARKS.md memory_estimate_hf"),
    ("GPT2LMHeadModel", "bf16", "none"): Shipped(error=0.026, source="BENCHMARKS.md memory_estimate_hf"),
    ("GPT2LMHeadModel", "bf16", "full"): Shipped(error=0.021, source="BENCHMARKS.md memory_estimate_hf"),
    ("GPT2LMHeadModel", "bf16", "selective"): Shipped(error=0.018, source="BENCHMARKS.md memory_estimate_hf"),
}
"""The verified figures: the model's architecture (``ModelSpec.architecture``), precision, recompute. They hold for
the full model with fp32 optimizer state, no offload and no loss chunks, the levers they were measured with."""


def margin_for(error: float) -> float:
    """The margin around the budget within which an estimate with this measured error decides nothing."""
    return max(MIN_MARGIN, ERROR_FACTOR * error)


def verdict(estimate: int, budget: int, margin: float | None) -> Verdict:
    """What the estimate decides about a candidate: ``over`` (not run), ``under`` (fits by the estimate) or
    ``measure``. ``margin`` None: no measured error, so nothing fits by the estimate and only more than
    :data:`UNTRUSTED_REACH` over is not run."""
    distance = estimate / budget - 1
    if margin is None:
        return "over" if distance > UNTRUSTED_REACH else "measure"
    if distance >= margin:
        return "over"
    return "under" if distance <= -margin else "measure"


def distance_words(estimate: int, budget: int) -> str:
    """``estimated 12% over`` / ``estimated 8% under``: the estimate against the budget."""
    distance = estimate / budget - 1
    return f"estimated {abs(distance):.0%} {'over' if distance > 0 else 'under'}"


@dataclass(kw_only=True)
class Trust:
    """The estimate's measured error per (architecture, precision, recompute): the shipped figures, updated by this
    plan's trials. ``enabled`` False (an exhaustive sweep, ``--max-trials 0``): nothing is decided by estimate."""

    architecture: str
    plain: bool
    """The model and levers the shipped figures were measured with (no LoRA); the rest earn trust in this plan."""
    enabled: bool = True
    measured: dict[tuple[object, ...], float] = field(default_factory=dict)
    """This plan's own worst error per lever group (every lever but the split)."""

    @classmethod
    def of(cls, model: ModelSpec, *, enabled: bool = True) -> Trust:
        return cls(architecture=model.architecture, plain=model.lora is None, enabled=enabled)

    def _shipped(self, candidate: Candidate) -> Shipped | None:
        setup = candidate.setup
        levers_plain = (setup.offload == "none" and setup.loss_chunk_tokens == 0 and setup.optimizer_state == "fp32"
                        and setup.lora_base_precision != "nf4")
        if not (self.plain and levers_plain):
            return None
        return SHIPPED.get((self.architecture, setup.precision, setup.activation_checkpointing))

    def error(self, candidate: Candidate) -> float | None:
        """The worst measured error for ``candidate``'s levers (shipped or this plan's), or None."""
        known = [e for e in (self.measured.get(candidate.group),) if e is not None]
        shipped = self._shipped(candidate)
        if shipped is not None:
            known.append(shipped.error)
        return max(known) if known else None

    def margin(self, candidate: Candidate) -> float | None:
        error = self.error(candidate) if self.enabled else None
        return margin_for(error) if error is not None else None

    def verdict(self, candidate: Candidate, budget: int) -> Verdict:
        if not self.enabled:
            return "measure" if candidate.estimate.peak_bytes <= budget * (1 + UNTRUSTED_REACH) else "over"
        return verdict(candidate.estimate.peak_bytes, budget, self.margin(candidate))

    def learn(self, candidate: Candidate) -> None:
        """Take a measured candidate's error into its lever group's."""
        result = candidate.measured
        if result is None or not result.peak_bytes or result.estimated:
            return
        error = abs(candidate.estimate.peak_bytes - result.peak_bytes) / result.peak_bytes
        self.measured[candidate.group] = max(error, self.measured.get(candidate.group, 0.0))

    def as_dict(self) -> dict[str, Any]:
        """plan.json's ``estimate_error``: the shipped figures for this model and this plan's own, per lever group."""
        shipped = {f"{precision} recompute {recompute}": {"error": figure.error, "source": figure.source}
                   for (architecture, precision, recompute), figure in SHIPPED.items()
                   if architecture == self.architecture and self.plain}
        return {"architecture": self.architecture, "enabled": self.enabled, "min_margin": MIN_MARGIN,
                "error_factor": ERROR_FACTOR, "shipped": shipped,
                "measured": {" ".join(str(lever) for lever in group): error for group, error in self.measured.items()}}

    def words(self, candidate: Candidate) -> str:
        """Where the candidate's trust comes from, for its status and the report."""
        margin = self.margin(candidate)
        if margin is None:
            return "no measured error for these levers"
        own = self.measured.get(candidate.group)
        shipped = self._shipped(candidate)
        sources = ([f"{shipped.error:.1%} ({shipped.source})"] if shipped else []) + (
            [f"{own:.1%} (this plan's trials)"] if own is not None else [])
        return f"margin {margin:.1%} from the estimate's measured error " + ", ".join(sources)


__all__ = ["ERROR_FACTOR", "MIN_MARGIN", "SHIPPED", "UNTRUSTED_REACH", "Shipped", "Trust", "Verdict",
           "distance_words", "margin_for", "verdict"]
