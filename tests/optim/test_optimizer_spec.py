"""The optimizer seam (issue 50 item 2): one frozen OptimizerSpec made from the flags and written back to them, the
registry of one module per optimizer, and AdamW built through it exactly as before."""

from __future__ import annotations

import dataclasses
import importlib
from typing import get_args

import pytest
import torch

from cadence.config import TrainConfig
from cadence.optim.choices import OPTIMIZER_MODULES, OPTIMIZERS, OptimizerName
from cadence.optim.offload import OffloadedOptimizer
from cadence.optim.spec import OPTIMIZER_FLAG_DEFAULTS, OptimizerRule, OptimizerSpec, TrainedTensor
from cadence.records import Record, RecordInvalid


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 10))
    model[2].weight = model[0].weight  # tied: one tensor, one state
    return model


def test_the_spec_of_the_default_flags_is_the_default_spec_and_its_flags_are_trains() -> None:
    config = TrainConfig()
    spec = OptimizerSpec.from_flags(config)
    assert spec == OptimizerSpec()
    assert spec.flags() == {name: getattr(config, name) for name in OPTIMIZER_FLAG_DEFAULTS}
    assert OPTIMIZER_FLAG_DEFAULTS == {name: getattr(config, name) for name in OPTIMIZER_FLAG_DEFAULTS}
    given = TrainConfig(weight_decay=0.2, adam_beta1=0.8, optimizer_state="bf16", offload="optimizer", lr=3e-4)
    spec = OptimizerSpec.from_flags(given)
    assert (spec.weight_decay, spec.betas, spec.state, spec.offload, spec.lr) == (0.2, (0.8, 0.95), "bf16", True, 3e-4)
    # A record's mapping (config.json) gives the same spec; a record from before --optimizer means AdamW.
    assert OptimizerSpec.from_flags({**dataclasses.asdict(given), "optimizer": None} | spec.flags()) == spec
    assert OptimizerSpec.from_flags({"optimizer_state": "bf16"}).name == "adamw"
    with pytest.raises(ValueError, match="optimizer must be one of"):
        OptimizerSpec(name="lion")  # type: ignore[arg-type]


def test_every_registered_optimizer_is_one_module_with_a_rule() -> None:
    """Adding an optimizer is its module and its entry here (the Literal and the registry, one file)."""
    assert set(OPTIMIZERS) == set(get_args(OptimizerName)) == set(OPTIMIZER_MODULES)
    for name, module in OPTIMIZER_MODULES.items():
        rule = importlib.import_module(module).RULE
        assert isinstance(rule, OptimizerRule) and OptimizerSpec(name=name).rule is rule


def test_adamw_through_the_spec_is_torchs_adamw_over_two_groups() -> None:
    model = small_model()
    spec = OptimizerSpec(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    groups = spec.param_groups(model)
    assert [g.name for g in groups] == ["decay", "no decay"]
    assert [len(g.params) for g in groups] == [1, 3]  # the tied matrix once; the norm's gain and bias, the bias
    assert groups[0].describe() == "decay: 1 tensor, 60 parameters"
    optimizer = spec.build(model)
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["lr"] == 1e-2
    assert isinstance(dataclasses.replace(spec, offload=True).build(model), OffloadedOptimizer)
    assert "AdamW (fp32 moments; betas 0.9, 0.95; weight decay 0.1" in spec.describe()


def test_the_spec_checks_a_saved_state_before_and_after_loading() -> None:
    model = small_model()
    spec = OptimizerSpec()
    optimizer = spec.build(model)
    model(torch.tensor([[1, 2]])).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    spec.check_saved(Record(saved, "state.json", "optimizer"))
    spec.check_loaded(optimizer)
    broken = {**saved, "state": {0: {**saved["state"][0], "step": "x"}}}
    with pytest.raises(RecordInvalid, match="step"):
        spec.check_saved(Record(broken, "state.json", "optimizer"))
    optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg of shape"):
        spec.check_loaded(optimizer)


def test_the_state_bytes_for_the_estimate() -> None:
    tensors = [TrainedTensor((10, 10)), TrainedTensor((10,))]
    assert OptimizerSpec().state_bytes(tensors, on_device=False) == (880, None)  # the replay models fp32's scratch
    state, scratch = OptimizerSpec(state="bf16").state_bytes(tensors, on_device=False)
    assert (state, scratch) == (440, 12 * 100)
