"""Issue 52: two ranks on uneven preference samples give one process's losses and weights for every objective
(1e-6): each rank's share of a window holds other pairs, other lengths and, in the short last window, 2 samples of
the 4; the pairs (KTO: examples, ORPO's chosen targets too) are counted over both ranks before the first backward,
and KTO's reference point over the whole window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import preference_samples, relative_l2, tiny_model
from safetensors.torch import load_file

from cadence.engine.cut import Cut
from cadence.engine.objective import Objective
from cadence.engine.reference import FrozenReference
from cadence.engine.step import Engine
from cadence.engine.windows import epoch_windows

pytestmark = pytest.mark.slow  # real gloo processes
OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")


def one_process(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    policy = tiny_model()
    reference = FrozenReference(model=tiny_model(seed=1).eval(), targets_only=True)
    objective = Objective(name=name).for_model(policy, vocab_size=256).with_reference(reference)
    engine = Engine(policy, torch.optim.SGD(policy.parameters(), lr=0.5), objective=objective)
    losses = [engine.step(window).loss
              for window in epoch_windows(preference_samples(name), cut=Cut(micro_batch_size=8), grad_accum_steps=1,
                                          seed=0, epoch=0)]
    return losses, policy.state_dict()


def test_two_ranks_give_one_process_losses_and_weights_for_every_objective(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).resolve().parent / "preference_ranks.py"), str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads(out.read_text())
    for name in OBJECTIVES:
        losses, weights = one_process(name)
        assert len(losses) == 3  # two whole windows and the short last one
        assert ranks[name] == pytest.approx(losses, rel=1e-6), name
        assert relative_l2(load_file(str(out) + f".{name}.safetensors"), weights) < 1e-6, name
