"""The pickle-free training state: exact round trips, and malformed or hostile files refused without running code."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cadence.training.checkpoint import rng_state
from cadence.training.state_file import StateFileError, read_state, write_state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_optimizer_scheduler_scaler_and_rng_state_round_trip_exactly(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": scaler.state_dict(), "rng": rng_state(), "floats": [math.inf, -math.inf, math.nan, 0.1 + 0.2],
             "__odd key": 1, "partial_window": None, "big": 2**62, "bf16": torch.ones(3, dtype=torch.bfloat16)}
    write_state(tmp_path, "state", state)
    back = read_state(tmp_path, "state")
    assert _same(state, back)
    assert 0 in back["optimizer"]["state"] and isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    random.setstate(back["rng"]["python"])  # the restored states are accepted by the generators themselves
    np.random.set_state(back["rng"]["numpy"])
    torch.set_rng_state(back["rng"]["torch"])
    optimizer.load_state_dict(back["optimizer"])


def test_values_that_would_need_pickle_are_refused_when_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\.hook"):
        write_state(tmp_path, "state", {"hook": print})


def _write_structure(folder: Path, structure: object) -> None:
    (folder / "state.json").write_text(json.dumps(structure))
    save_file({"t0": torch.zeros(1)}, str(folder / "state.safetensors"))


@pytest.mark.parametrize("structure, match", [
    ({"format": "cadence-state/1", "state": {"__tensor__": "t9"}}, "lacks"),
    ({"format": "cadence-state/1", "state": {"__reduce__": ["os.system", ["true"]]}}, "unknown marker"),
    ({"format": "cadence-state/1", "state": {"__ndarray__": {"dtype": "|O", "shape": [1], "data": [1]}}}, "object"),
    ({"format": "cadence-state/1", "state": {"__items__": [[1]]}}, "pairs"),
    ({"format": "pickle", "state": {}}, "not a cadence training state"),
    ([1, 2], "not a cadence training state"),
])
def test_malformed_structures_are_refused(tmp_path: Path, structure: object, match: str) -> None:
    _write_structure(tmp_path, structure)
    with pytest.raises(StateFileError, match=match):
        read_state(tmp_path, "state")


def test_deep_nesting_and_garbage_are_refused_not_crashed_on(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text('{"format": "cadence-state/1", "state": ' + "[" * 100_000 + "]" * 100_000
                                         + "}")
    save_file({}, str(tmp_path / "state.safetensors"))
    with pytest.raises(StateFileError):
        read_state(tmp_path, "state")
    (tmp_path / "state.json").write_text('{"format": "cadence-state/1", "state": {}}')
    (tmp_path / "state.safetensors").write_bytes(b"\x80\x04garbage")
    with pytest.raises(StateFileError):
        read_state(tmp_path, "state")
