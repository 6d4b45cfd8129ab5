"""Issue 51 item 3: Schedule-Free AdamW. Its averaged weights are an independent recomputation's; cadence evaluates,
checkpoints, keeps best/ and ends on them, and a resume continues the training weights bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import prompt_completion_dataset, tiny_model, write_jsonl
from safetensors.torch import load_file

from cadence import Engine, iter_windows
from cadence.cli import main
from cadence.data import iterate_micro_batches
from cadence.models import build_model
from cadence.optim.schedule_free import TRAIN_WEIGHTS, ScheduleFreeAdamW, averaged_weights
from cadence.optim.spec import OptimizerSpec
from cadence.training.checkpoint.layout import STATE_STEM
from cadence.training.run_dir import read_metrics
from cadence.training.state_file import read_state

BETA1 = 0.9


def test_the_averaged_weights_are_the_weighted_mean_of_the_z_sequence() -> None:
    """An independent recomputation: x after T steps is sum_t w_t z_{t+1} / sum_t w_t, with w_t the square of the
    largest bias-corrected LR so far (here under a warm-up, so the weights differ)."""
    model = tiny_model()
    optimizer = ScheduleFreeAdamW(model.parameters(), lr=1e-2, betas=(BETA1, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    engine = Engine(model, optimizer, scheduler=scheduler, precision="fp32", max_grad_norm=0.0)
    windows = iter_windows(iterate_micro_batches(prompt_completion_dataset(), 2, 0, 0), 4, micro_batch_size=2)
    first = next(iter(model.parameters()))
    weighted, total, lr_max = torch.zeros_like(first), 0.0, 0.0
    for step, (window, _) in enumerate(zip(windows, range(5), strict=False)):
        lr = optimizer.param_groups[0]["lr"] * (1 - 0.95 ** (step + 1)) ** 0.5
        engine.step(window)
        lr_max = max(lr_max, lr)
        weighted += lr_max**2 * optimizer.state[first]["z"]
        total += lr_max**2
    with averaged_weights(optimizer):
        assert torch.allclose(first, weighted / total, rtol=0, atol=1e-6)
        assert not optimizer.training
        with pytest.raises(RuntimeError, match="eval mode"):
            optimizer.step()
    assert optimizer.training


def test_eval_and_train_give_the_training_weights_back_bitwise() -> None:
    model = tiny_model()
    optimizer = ScheduleFreeAdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # after one step y = z = x: the averages differ from the second on
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    with averaged_weights(optimizer):
        saved = optimizer.state_dict()
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert all(TRAIN_WEIGHTS in state for state in saved["state"].values())  # the checkpoint keeps y


def test_schedule_free_refuses_a_decaying_schedule_and_fsdp() -> None:
    spec = OptimizerSpec(name="schedule-free")
    assert [p.where for p in spec.problems(lr_schedule="cosine")] == ["--lr-schedule"]
    assert spec.problems(lr_schedule="constant") == []
    assert [p.where for p in spec.problems(sharded=True)] == ["--optimizer"]
    assert [p.where for p in OptimizerSpec(name="schedule-free", offload=True).problems()] == ["--offload"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("schedule-free")
    out = root / "run"
    assert main(["train", "--data", str(write_jsonl(root / "examples.jsonl")), "--seq-len", "32",
                 "--micro-batch-size", "2", "--grad-accum-steps", "2", "--max-steps", "4", "--optimizer",
                 "schedule-free", "--lr-schedule", "constant", "--warmup-steps", "1", "--lr", "1e-2",
                 "--val-fraction", "0.25", "--eval-every", "2", "--keep-best", "--checkpoint-every", "2",
                 "--too-long", "truncate", "--out", str(out)]) == 0
    return out


def averaged(weights: dict[str, torch.Tensor], state: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """x = y + (1 - 1/beta1)(z - y) from a checkpoint's optimizer state (y: train_weights), by parameter name."""
    found = {}
    for index, name in enumerate(names):
        entry = state["optimizer"]["state"][index]
        y, z = entry[TRAIN_WEIGHTS], entry["z"]
        found[name] = y + (1 - 1 / BETA1) * (z - y)
    return found


def test_checkpoints_best_and_the_final_model_hold_the_averaged_weights(run: Path) -> None:
    model = build_model("gpt-tiny")  # the run's (train's default model)
    name_of = {id(p): n for n, p in model.named_parameters()}
    # The optimizer's state is keyed by its order: the decay group's parameters, then the others'.
    names = [name_of[id(p)] for group in OptimizerSpec(name="schedule-free").param_groups(model) for p in group.params]
    final = load_file(str(run / "model.safetensors"))
    checkpoint = run / "checkpoints" / "step-4"
    saved = load_file(str(checkpoint / "model.safetensors"))
    state = read_state(checkpoint, STATE_STEM)
    assert all(torch.equal(final[name], saved[name]) for name in final)  # the run ends on its last checkpoint's x
    for name, x in averaged(saved, state, names).items():
        assert torch.allclose(saved[name], x, rtol=0, atol=1e-6), name
        assert not torch.equal(saved[name], state["optimizer"]["state"][names.index(name)][TRAIN_WEIGHTS])
    best = json.loads((run / "best" / "best.json").read_text())
    step = best["step"]
    best_weights = load_file(str(run / "best" / "model.safetensors"))
    at_step = load_file(str(run / "checkpoints" / f"step-{step}" / "model.safetensors"))  # every evaluation's step
    assert all(torch.equal(best_weights[n], at_step[n]) for n in best_weights)  # x, as the checkpoint holds it
    assert len([row["val_loss"] for row in read_metrics(run) if "val_loss" in row]) == 2
