"""The one estimate entry point (memory/estimate_for.py) finds a model's replay by the estimator its spec names: a
replay cadence ships with, or a module of its own, so that a new replay touches one file in memory/."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import pytest

from cadence.config import TrainConfig
from cadence.memory.estimate import MemoryEstimate
from cadence.memory.estimate_for import ESTIMATORS, REPLAY_MODULE, estimate_for, replay_for
from cadence.models.spec import ModelSpec


def test_a_new_replay_is_one_module_named_by_its_estimator(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: dict[str, Any] = {}
    built_in = ModelSpec.from_flags(TrainConfig(model="gpt-tiny"))
    known = estimate_for(built_in, micro_batch_size=2, seq_len=16, precision="fp32", checkpointing="none")

    def replay(spec: ModelSpec, **options: Any) -> MemoryEstimate:
        asked.update(options, spec=spec)
        return known

    module = types.ModuleType(REPLAY_MODULE.format("toy"))
    module.replay = replay  # type: ignore[attr-defined]  # a module made here
    monkeypatch.setitem(sys.modules, module.__name__, module)
    spec = dataclasses.replace(built_in, estimator="toy")
    assert "toy" not in ESTIMATORS and replay_for("toy") is replay
    assert estimate_for(spec, micro_batch_size=2, seq_len=16, precision="bf16", checkpointing="full") is known
    assert asked["spec"] is spec and asked["micro_batch_size"] == 2 and asked["checkpointing"] == "full"


def test_the_shipped_replays_are_found_by_name() -> None:
    assert all(replay_for(name) is replay for name, replay in ESTIMATORS.items())
