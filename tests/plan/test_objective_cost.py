"""A plan's estimates count what a preference objective adds (two sequences per sample, the reference), and the
plan keeps the frozen reference copy where it fits and takes the precomputed log-probabilities where only they do."""

from __future__ import annotations

import torch

from cadence.config import TrainConfig
from cadence.memory.estimate_for import estimate_for
from cadence.models.spec import ModelSpec
from cadence.plan.candidates import build_candidates
from cadence.plan.objective_cost import objective_cost, reference_modes

SPEC = ModelSpec.from_flags({"model": "gpt-tiny"})
WEIGHTS = SPEC.shape.num_parameters * 4


def config(**flags: object) -> TrainConfig:
    return TrainConfig(**{"model": "gpt-tiny", "seq_len": 64, "effective_batch_size": 8, **flags})  # type: ignore[arg-type]


def test_each_objective_and_reference_mode_costs_what_it_holds():
    sft = estimate_for(SPEC, micro_batch_size=4, seq_len=64, precision="fp32", checkpointing="none")
    twice = estimate_for(SPEC, micro_batch_size=8, seq_len=64, precision="fp32", checkpointing="none")

    def peak(**flags: object) -> int:
        return estimate_for(SPEC, micro_batch_size=4, seq_len=64, precision="fp32", checkpointing="none",
                            objective=objective_cost(config(**flags), SPEC)).peak_bytes

    assert peak() == sft.peak_bytes
    assert peak(objective="simpo") == peak(objective="orpo") == twice.peak_bytes  # two rows per pair
    assert peak(objective="dpo") == twice.peak_bytes + WEIGHTS  # and a frozen copy of the weights
    assert peak(objective="dpo", reference_logprobs="precomputed") == twice.peak_bytes  # nothing on the device
    # KTO: the completion with gradients, its mismatched row's ids and labels only (the window's no-gradient pass)
    assert peak(objective="kto") == sft.peak_bytes + 4 * 64 * 2 * 8 + WEIGHTS
    assert peak(objective="kto", reference_logprobs="precomputed") == sft.peak_bytes + 4 * 64 * 2 * 8


def test_the_plan_keeps_the_frozen_copy_where_it_fits_and_precomputes_where_only_that_fits():
    assert reference_modes(config(objective="dpo"), set()) == ["live", "precomputed"]
    assert reference_modes(config(objective="dpo"), {"reference_logprobs"}) == ["live"]
    assert reference_modes(config(objective="simpo"), set()) == ["live"]
    live = objective_cost(config(objective="dpo"), SPEC)
    precomputed = objective_cost(config(objective="dpo"), SPEC, "precomputed")
    micro = 8
    at = {cost: estimate_for(SPEC, micro_batch_size=micro, seq_len=64, precision="fp32", checkpointing="none",
                             objective=cost).peak_bytes for cost in (live, precomputed)}
    budget = (at[live] + at[precomputed]) // 2  # the whole batch fits only without the frozen copy
    candidates = build_candidates(config(objective="dpo", memory_budget=str(budget), precision="fp32",
                                         activation_checkpointing="none", micro_batch_size=micro),
                                  {"precision", "activation_checkpointing", "micro_batch_size"}, torch.device("cpu"),
                                  64, [], SPEC)
    modes = {c.setup.micro_batch_size: c.setup.reference_logprobs for c in candidates}
    assert modes[8] == "precomputed" and c_peak(candidates, 8) == at[precomputed]
    assert all(mode == "live" for size, mode in modes.items() if size < 8)
    assert "reference log-probabilities precomputed" in next(c for c in candidates
                                                              if c.setup.micro_batch_size == 8).setup.describe()


def c_peak(candidates, micro):  # type: ignore[no-untyped-def]
    return next(c for c in candidates if c.setup.micro_batch_size == micro).estimate.peak_bytes
