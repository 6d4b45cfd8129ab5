"""Short measured trials of a training configuration: peak memory and throughput of real steps.

A trial builds the real model, optimizer and engine for one configuration and runs a few windows of the real data:
the first allocates the optimizer state (warm-up, not timed), the second is measured for memory (on CPU by the
profiler, which slows it, so it is not timed either), and the rest are timed. Throughput is the median over the timed
steps, so one slow step (another process, a page fault) does not decide a plan.

The memory step is the *longest window the data can produce* (:func:`longest_window`), not the epoch's second one:
on data of uneven lengths the first windows may hold only short examples, and a configuration that fits them runs out
of memory on the first long one of the epoch. "Fits" means it fits the data.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from cadence.config.plan_file import DECISION_FIELDS
from cadence.config.schema import LoraBasePrecision
from cadence.data.text import PackedSequences
from cadence.engine.choices import ReferenceLogprobs
from cadence.engine.precision import fp32_matmul
from cadence.engine.prefetch import prefetch
from cadence.engine.windows import (
    Window,
    collate_samples,
    count_targets,
    epoch_windows,
    example_lengths,
    make_window,
)
from cadence.optim.choices import OptimizerStateName
from cadence.training.components import build_components
from cadence.training.prepare import Prepared
from cadence.verify.equivalence import Setup

MIN_TRIAL_STEPS = 3
"""Warm-up, memory and at least one timed step."""


@dataclass(kw_only=True, frozen=True)
class TrialSetup(Setup):
    """The decision variables of a plan: how a window is cut and computed (the verify Setup, so that the quality
    check compares exactly this) plus how many micro-batches make the effective batch and how the optimizer keeps
    its state."""

    grad_accum_steps: int
    optimizer_state: OptimizerStateName = "fp32"
    """``--optimizer-state``: a lossy lever (the window's gradient is the same, the update is not), so a decision
    that pulls it has passed a loss comparison against fp32 state (plan.json's quality)."""
    lora_base_precision: LoraBasePrecision = "fp32"
    """``--lora-base-precision`` under LoRA: the given base (fp32, or bf16: the same math under bf16), or nf4, the
    other lossy lever (4-bit weights: every step's gradient differs), kept only after a loss comparison against the
    full-precision base (plan.json's quality)."""

    reference_logprobs: ReferenceLogprobs = "live"
    """``--reference-logprobs`` of a preference objective's reference in full fine-tuning: live (a frozen copy), or
    precomputed where only that fits (``cadence.plan.objective_cost``; the same losses)."""

    def lever_text(self) -> str:
        state = f", {self.optimizer_state} optimizer state" if self.optimizer_state != "fp32" else ""
        base = f", {self.lora_base_precision} base" if self.lora_base_precision != "fp32" else ""
        reference = ", reference log-probabilities precomputed" if self.reference_logprobs != "live" else ""
        return super().lever_text() + state + base + reference

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DECISION_FIELDS}

    def train_flags(self) -> dict[str, Any]:
        """The setup as train's flags (TrainConfig fields): the decision and the cut."""
        return {**self.as_dict(), **self.cut.flags()}

    @property
    def exact(self) -> bool:
        """Whether the setup gives the update of fp32 accumulation (every lever but the optimizer state's and the nf4
        base's is exact)."""
        return self.optimizer_state == "fp32" and self.lora_base_precision != "nf4"

    def describe(self) -> str:
        cut = self.cut.describe()
        return (f"micro {self.micro_batch_size} x accum {self.grad_accum_steps}, {self.precision}, "
                f"recompute {self.activation_checkpointing}, offload {self.offload}" + self.lever_text()
                + (f", {cut}" if cut else ""))


@dataclass(kw_only=True)
class TrialResult:
    peak_bytes: int | None
    """Measured peak of the memory step (None when the trial could not run)."""
    fits: bool
    """Measured peak within the budget and no out-of-memory error."""
    tokens_per_s: float | None
    """Median over the timed steps."""
    step_time_s: float | None
    """Median optimizer-step wall time."""
    losses: list[float | None]
    error: str | None = None
    real_share: float | None = None
    """Real tokens over computed positions (padding included) over the trial's windows (the longest one left out)."""
    measured_on: str | None = None
    """What the memory step ran: the longest window the data can produce (in words), or the epoch's second window
    where every window is as long as any (text cut into full sequences)."""
    estimated: bool = False
    """The peak is the estimate, trusted within its measured error (``cadence.plan.trust``): no trial ran."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def trial_run(prep: Prepared, setup: TrialSetup, *, steps: int) -> Prepared:
    """The plan's run (``prep``: its data loaded and checked once) with ``setup``'s decision and cut, for ``steps``
    optimizer steps; no budget guard (the trial measures the peak itself) and nothing written."""
    return prep.variant(**setup.train_flags(), effective_batch_size=None, max_steps=steps, memory_budget=None)


LONGEST_CANDIDATES = 4
"""Of the longest examples, this many times a window's worth are read to pick those with the most targets (the
targets-only loss's logits grow with them); the rest are judged by their length alone, read from the index."""


@dataclass(frozen=True, kw_only=True)
class LongestWindow:
    """The longest window the data can produce for a cut (what a trial measures its memory on)."""

    window: Window
    longest_example: int
    """Input positions of the data's longest example."""
    description: str


def longest_window(prep: Prepared) -> LongestWindow | None:
    """The window of ``prep``'s cut whose micro-batches are the longest the training split can produce; None for text
    cut into full sequences (every window is as long as any).

    Rows in drawn order: every micro-batch holds the micro-batch size's longest examples. Drawn order can put them in
    any micro-batch of a window, including one after the first (where accumulation holds the gradients already
    summed), so every micro-batch of this window is that one: the largest peak any window of the epoch can reach.
    Cuts by length (an order by length, a token budget, packing) sort the window's samples themselves, so their
    longest window is the window of the data's longest examples, cut as they cut it. Ties in length go to the
    examples with the most targets."""
    train = prep.data.train
    if isinstance(train, PackedSequences) or len(train) == 0:
        return None
    micro, accum = prep.micro_batch_size, prep.grad_accum_steps
    per_window = micro * accum
    lengths = example_lengths(train, range(len(train)))
    by_length = sorted(range(len(train)), key=lambda i: -lengths[i])
    read = [train[i] for i in by_length[:LONGEST_CANDIDATES * per_window]]
    # A preference sample's input_ids are its two sequences' and num_targets theirs: ranked as whole samples.
    ranked = sorted(read, key=lambda e: (-len(e.input_ids), -e.num_targets))
    cut = prep.cut
    longest = len(ranked[0].input_ids)
    if not cut.by_length:
        rows = ranked[:micro]
        batch = collate_samples(rows)
        window = make_window([batch] * accum)
        words = (f"every micro-batch the data's {len(rows)} longest examples ({len(rows)} x {longest} positions, "
                 f"{count_targets(batch)} targets)")
    else:
        window = next(epoch_windows(ranked[:per_window], cut=cut, grad_accum_steps=accum, seed=prep.config.seed,
                                    epoch=0))
        words = f"the data's {min(per_window, len(ranked))} longest examples (up to {longest} positions), cut as " \
                f"the setup cuts"
    return LongestWindow(window=window, longest_example=longest, description=words)


def run_trial(prep: Prepared, setup: TrialSetup, *, steps: int, budget_bytes: int, timed: bool = True) -> TrialResult:
    """Run ``steps`` windows of ``setup`` and measure them; out-of-memory is a result (fits False), not an error.
    The memory step (the second) runs the longest window the data can produce (:func:`longest_window`). ``timed``
    False: the warm-up and the memory step only (the plan times its candidates in alternating rounds instead), with
    no throughput."""
    steps = max(steps, MIN_TRIAL_STEPS) if timed else 2
    trial = trial_run(prep, setup, steps=steps)
    device = trial.device
    parts = build_components(trial)
    longest = longest_window(trial)
    # The windows train would run (the epoch's permutation, cut as the setup says), prepared ahead in a thread as
    # train prepares them: cut and collated in the measuring thread instead, the same steps ran 10-20x slower on a
    # loaded 2-core CPU (measured: 165 against 3,458 tokens/s for gpt-tiny), and the plan predicted 1/6 of the run.
    windows = prefetch(trial.windows(0), depth=trial.config.prefetch_windows, pin_memory=device.type == "cuda")
    peak: int | None = None
    tokens = positions = 0
    rates: list[float] = []
    times: list[float] = []
    losses: list[float | None] = []
    try:
        # fp32 matmuls as the run will set them (tf32 on CUDA by default): they change the speed being measured.
        with windows, fp32_matmul(trial.config.fp32_matmul):
            drawn = iter(windows)
            for number in range(steps):
                window = longest.window if number == 1 and longest is not None else next(drawn, None)
                if window is None:
                    break
                result = parts.engine.step(window, measure_memory=number == 1)
                losses.append(result.loss)
                if not (number == 1 and longest is not None):
                    tokens, positions = tokens + result.tokens, positions + result.tokens + result.padded_positions
                if number == 1 or device.type == "cuda":
                    peak = max(peak or 0, result.peak_memory_bytes or 0)
                if number >= 2:
                    rates.append(result.tokens_per_s)
                    times.append(result.step_time_s)
    except torch.OutOfMemoryError as err:
        return TrialResult(peak_bytes=peak, fits=False, tokens_per_s=None, step_time_s=None, losses=losses,
                           error=f"out of memory: {str(err).splitlines()[0]}")
    finally:
        del parts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if len(losses) < steps:
        return TrialResult(peak_bytes=peak, fits=False, tokens_per_s=None, step_time_s=None, losses=losses,
                           error=f"the training split has fewer than {steps} windows for a trial")
    return TrialResult(
        peak_bytes=peak, fits=peak is not None and peak <= budget_bytes,
        tokens_per_s=statistics.median(rates) if rates else None,
        step_time_s=statistics.median(times) if times else None, losses=losses, real_share=tokens / positions if positions else None,
        measured_on=longest.description if longest is not None else "a window of full sequences (all as long)",
    )


def timed_round(prep: Prepared, setup: TrialSetup, *, steps: int) -> float | None:
    """One round of timing ``setup``: one warm-up window (untimed: it allocates the optimizer state), then ``steps``
    windows timed as training times them, throughput over the round (tokens / step time, no profiler, no memory
    measurement). The same first windows of the epoch for every candidate, so every round sees the same samples.
    None when it runs out of memory."""
    trial = trial_run(prep, setup, steps=steps + 1)
    parts = build_components(trial)
    tokens, seconds = 0, 0.0
    windows = prefetch(trial.windows(0), depth=trial.config.prefetch_windows,
                       pin_memory=trial.device.type == "cuda")  # as training prepares them (see run_trial)
    try:
        with windows, fp32_matmul(trial.config.fp32_matmul):
            for number, window in zip(range(steps + 1), windows):
                result = parts.engine.step(window)
                if number >= 1:
                    tokens, seconds = tokens + result.tokens, seconds + result.step_time_s
    except torch.OutOfMemoryError:
        return None
    finally:
        del parts
        if trial.device.type == "cuda":
            torch.cuda.empty_cache()
    return tokens / seconds if seconds > 0 else None

