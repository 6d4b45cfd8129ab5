"""--batch-branch-test on two gloo ranks, DDP and FSDP2: every rank snapshots its own state (its replica, or its
shards), trains both branches on its own part of the read-ahead windows, and the probe loss is all-reduced, so every
rank takes the same verdict; the run equals one process taking one big batch of the same examples at each step and
in each branch (losses and probe losses 1e-5, weights 1e-4, as every two-rank parity test here); the run after a
kept test is the two-rank run without one, after a lost test the two-rank run whose maximum is the minimum, and a
two-rank resume right after or before the test is the uninterrupted run (bitwise).

The FSDP2 runs use --seed 1, under which their noise scale asks to grow at step 20 (with seed 0 only at step 28, too
late for two branch windows before --max-steps), and --sync-every-micro-step, which the noise scale needs there."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import collate, epoch_order, relative_l2, sample_text
from safetensors.torch import load_file

from cadence.config import TrainConfig
from cadence.engine.windows import padding_micro_batch
from cadence.training.branch_test import PROBE_MICRO_BATCHES, probe_share
from cadence.training.run_dir import read_metrics

SLOW = pytest.mark.slow
"""Real gloo processes: each strategy's four two-rank runs of 30 steps, about 50 s (DDP) and 2 minutes (FSDP2) on
this loaded 2-core machine, and the resume test's three more (about 40 s and 100 s)."""

MIN, MAX, BUDGET, TOLERANCE = 4, 16, 30, 0.01
"""The batch's bounds and the run's --max-steps; the default --batch-branch-tolerance (the verdict is a real one)."""

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"micro": 2, "seed": 0, "flags": []},
    "fsdp": {"micro": 1, "seed": 1, "flags": ["--strategy", "fsdp", "--sync-every-micro-step"]},
}
"""Each strategy's micro-batch, seed and flags (DDP: one micro-batch per rank per window of the minimum; FSDP2: two,
as its noise scale needs)."""

LOSE = ("--batch-branch-tolerance", "-1e9")
"""A tolerance no probe loss meets: the branch test rolls the grow back."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """tests/training/test_adaptive_batch_branch.py's training text and separate validation file."""
    folder = tmp_path_factory.mktemp("branch-ranks")
    (folder / "text.txt").write_bytes(sample_text(16000))
    (folder / "eval.txt").write_bytes(sample_text(3000)[::-1])
    return folder / "text.txt", folder / "eval.txt"


def flags(data: tuple[Path, Path], strategy: str, *, maximum: int = MAX) -> list[str]:
    chosen = STRATEGIES[strategy]
    return ["--data", str(data[0]), "--eval-data", str(data[1]), "--eval-every", "100", "--seq-len", "8",
            "--micro-batch-size", str(chosen["micro"]), "--seed", str(chosen["seed"]), "--effective-batch-size",
            "adaptive", "--min-effective-batch-size", str(MIN), "--max-effective-batch-size", str(maximum),
            "--max-steps", str(BUDGET), "--noise-scale-ema", "0.8", "--val-fraction", "0", "--lr", "3e-3",
            "--device", "cpu", *chosen["flags"]]


def two_ranks(args: list[str], out: Path) -> list[list[dict[str, Any]]]:
    """``cadence train ARGS --out OUT`` on 2 gloo ranks under torchrun (tests/training/branch_ranks.py); each rank's
    branch-test verdicts."""
    records = out.parent / f"{out.name}-ranks"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).resolve().parent / "branch_ranks.py"), str(records), "--", "train", *args, "--out",
         str(out)], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads((records / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [rank["status"] for rank in found] == [0, 0], result.stderr[-3000:]
    return [rank["verdicts"] for rank in found]


@pytest.fixture(scope="module", params=sorted(STRATEGIES))
def runs(request: pytest.FixtureRequest, data: tuple[Path, Path],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One strategy's four two-rank runs: with the branch test (the default tolerance: it keeps this grow), without
    it, with a branch test that loses, and with the maximum at the minimum; and each rank's verdicts."""
    strategy, root = request.param, tmp_path_factory.mktemp(f"branch-{request.param}")
    found: dict[str, Any] = {"strategy": strategy, "data": data}
    found["verdicts"] = two_ranks([*flags(data, strategy), "--batch-branch-test", "2"], root / "branch")
    found["lost_verdicts"] = two_ranks([*flags(data, strategy), "--batch-branch-test", "2", *LOSE], root / "lost")
    assert two_ranks(flags(data, strategy), root / "plain") == [[], []]
    assert two_ranks(flags(data, strategy, maximum=MIN), root / "never") == [[], []]
    found.update({name: root / name for name in ("branch", "lost", "plain", "never")})
    return found


@pytest.mark.parametrize(("world", "validation"), [(1, 9), (2, 9), (3, 9), (2, 3), (4, 1)])
def test_each_rank_scores_its_share_of_the_first_probe_micro_batches(world: int, validation: int) -> None:
    """Across the ranks, the probe is the evaluation's first PROBE_MICRO_BATCHES micro-batches (of ``validation``),
    each once, every rank scoring its own (those its validation share holds) and all as many forwards, padded with
    target-less micro-batches: what one process scores, summed by the evaluation's all-reduce."""
    batches = [{"index": index} for index in range(validation)]
    per_rank = -(-validation // world)
    pad = padding_micro_batch()
    shares = []
    for rank in range(world):
        mine = batches[rank::world]  # training.evaluation.validation_batches: every world-th, padded
        shares.append(probe_share(mine + [pad] * (per_rank - len(mine)), rank=rank, world_size=world))
    assert {len(share) for share in shares} == {-(-PROBE_MICRO_BATCHES // world)}
    scored = sorted(batch["index"] for share in shares for batch in share if "index" in batch)
    assert scored == list(range(min(PROBE_MICRO_BATCHES, validation)))
    padding = [batch for share in shares for batch in share if "index" not in batch]
    assert all(int((batch["labels"] != -100).sum()) == 0 for batch in padding)


def _rows(run: Path) -> list[tuple[int, float, float, int]]:
    return [(row["step"], row["loss"], row["lr"], row["effective_batch"]) for row in read_metrics(run)]


def _same_weights(a: Path, b: Path) -> None:
    weights_a, weights_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


def _tests(run: Path) -> list[dict[str, Any]]:
    return list(json.loads((run / "summary.json").read_text())["adaptive_batch"]["branch_tests"])


@SLOW
def test_every_rank_takes_the_same_verdict(runs: dict[str, Any]) -> None:
    """Both ranks ran the test at the same step and read the same two probe losses (all-reduced), so they took the
    same verdict, with the same reason; it is the one rank 0 wrote to metrics.jsonl and summary.json."""
    for verdicts, run, kept in ((runs["verdicts"], runs["branch"], True), (runs["lost_verdicts"], runs["lost"], False)):
        first, second = verdicts
        assert first == second
        (verdict,) = [taken for taken in first if taken["test"] is not None]  # a later grow may find no room
        assert verdict["test"]["kept"] is kept and verdict["decision"] == ("grow" if kept else "hold")
        (test,) = _tests(run)
        assert {key: value for key, value in test.items() if key != "time_s"} == verdict["test"]
        row = read_metrics(run)[verdict["step"] - 1]
        assert (row["batch_decision"], row["batch_reason"]) == (verdict["decision"], verdict["reason"])


@SLOW
def test_a_kept_test_leaves_the_two_rank_run_that_grew_without_one(runs: dict[str, Any]) -> None:
    """Each rank restored its own snapshot (replica or shards, optimizer state, generators, noise-scale averages,
    counters): every step's loss, LR and batch and the final weights are bitwise those of the run without the test."""
    (test,) = _tests(runs["branch"])
    assert test["kept"] and (test["from"], test["to"], test["windows"]) == (MIN, 2 * MIN, 2)
    assert _rows(runs["branch"]) == _rows(runs["plain"])
    _same_weights(runs["branch"], runs["plain"])


@SLOW
def test_a_lost_test_rolls_back_to_the_two_rank_run_that_never_grew(runs: dict[str, Any]) -> None:
    """Rolled back on both ranks: the run holds at the minimum and is bitwise the run whose maximum is the minimum."""
    assert [test["kept"] for test in _tests(runs["lost"])] == [False]
    assert _rows(runs["lost"]) == _rows(runs["never"])
    _same_weights(runs["lost"], runs["never"])


@SLOW
def test_two_rank_resume_after_and_before_a_branch_test_is_bitwise(runs: dict[str, Any], tmp_path: Path) -> None:
    """Resumed on two ranks from the checkpoint of the step whose decision ran the branch test (every rank's
    controller state is in it; FSDP2's as shards), or from two steps before it (both ranks test again, together): the
    uninterrupted two-rank run, bitwise."""
    from cadence.training.checkpoint import checkpoint_dirs

    (test,) = _tests(runs["branch"])
    args = [*flags(runs["data"], runs["strategy"]), "--batch-branch-test", "2", "--checkpoint-every", "1"]
    out = tmp_path / "cut"
    two_ranks(args, out)
    for at in (test["step"], test["step"] - 2):
        for path in checkpoint_dirs(out):
            if int(path.name.split("-")[1]) > at:
                shutil.rmtree(path)
        verdicts = two_ranks([*args, "--resume"], out)
        assert verdicts[0] == verdicts[1]
        assert _rows(out) == _rows(runs["branch"])
        _same_weights(out, runs["branch"])
        assert [(found["step"], found["kept"]) for found in _tests(out)] == [(test["step"], True)]


@SLOW
def test_two_ranks_with_a_branch_test_equal_one_process(runs: dict[str, Any], tmp_path: Path) -> None:
    """The textbook loop of one process replays the two-rank run: each step one big batch of the next examples,
    and at the branch test both branches from a copy of its model and optimizer, scored on the evaluation's first
    validation micro-batches: the same losses, probe losses and verdict, and the same final weights."""
    chosen = STRATEGIES[runs["strategy"]]
    data = runs["data"]
    config = TrainConfig(data=data[0], eval_data=data[1], eval_every=100, seq_len=8, micro_batch_size=chosen["micro"],
                         seed=chosen["seed"], effective_batch_size="adaptive", min_effective_batch_size=MIN,
                         max_effective_batch_size=MAX, max_steps=BUDGET, noise_scale_ema=0.8, val_fraction=0.0,
                         lr=3e-3, device="cpu", out=tmp_path / "reference")
    rows = read_metrics(runs["branch"])
    (test,) = _tests(runs["branch"])
    weights, (larger, current) = Replay(config).run(rows, test)
    assert larger == pytest.approx(test["larger_probe_loss"], rel=1e-5)
    assert current == pytest.approx(test["current_probe_loss"], rel=1e-5)
    assert test["kept"] == (larger <= current * (1 + TOLERANCE))
    assert relative_l2(load_file(str(runs["branch"] / "model.safetensors")), weights) < 1e-4


class Replay:
    """One process's textbook loop (as tests/helpers.py's one_big_batch_replay) with the branch test's two branches:
    from a copy of the model and optimizer, ``windows`` steps of the larger batch, then from the same copy as many
    examples at the current batch, each scored on the probe (token-mean loss, eval mode), then the copy restored."""

    def __init__(self, config: TrainConfig) -> None:
        from cadence.training.prepare import prepare

        self.config = config
        prep = prepare(config)
        self.model = prep.built.module
        self.optimizer = prep.optimizer.build(self.model)
        self.train = prep.data.train
        self.order = epoch_order(len(self.train), config.seed, 0).tolist()
        micro = int(config.micro_batch_size)
        self.probe = collate([prep.data.val[i] for i in range(PROBE_MICRO_BATCHES * micro)])

    def step(self, position: int, size: int, *, ratio: int, clock: int) -> tuple[float, float]:
        """One optimizer step on the order's ``size`` examples from ``position``, at the batch ``ratio`` (in windows
        of the minimum) decided before it, ``clock`` windows of the minimum into the schedule; its loss and LR."""
        from cadence.engine.schedules import lr_factor

        config = self.config
        lr = config.lr * math.sqrt(ratio) * lr_factor(clock, schedule=config.lr_schedule,
                                                      warmup_steps=config.warmup_steps, max_steps=config.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            group["betas"] = (config.adam_beta1, max(0.9, config.adam_beta2 ** ratio) if ratio > 1 else
                              config.adam_beta2)
        batch = collate([self.train[i] for i in self.order[position:position + size]])
        loss = F.cross_entropy(self.model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                               ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), lr

    def branches(self, position: int, *, clock: int, larger: int, current: int, windows: int) -> tuple[float, float]:
        """The two probe losses of the branch test taken ``clock`` windows into the schedule at ``position``."""
        saved = copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict())
        losses = []
        for multiple in (larger, current):
            for index in range(windows * larger // multiple):
                self.step(position + index * multiple * MIN, multiple * MIN, ratio=multiple,
                          clock=clock + index * multiple)
            self.model.eval()
            with torch.no_grad():
                losses.append(F.cross_entropy(self.model(self.probe["input_ids"]).flatten(0, 1),
                                              self.probe["labels"].flatten(), ignore_index=-100).item())
            self.model.train()
            self.model.load_state_dict(saved[0])
            self.optimizer.load_state_dict(copy.deepcopy(saved[1]))
        return losses[0], losses[1]

    def run(self, rows: list[dict[str, Any]], test: dict[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                                               tuple[float, float]]:
        """Replays ``rows`` (asserting each step's LR 1e-9 and loss 1e-5) and the branch ``test`` after its step;
        the final weights and the branches' probe losses."""
        position = clock = 0
        ratio, probes = 1, (math.nan, math.nan)
        for row in rows:
            loss, lr = self.step(position, row["effective_batch"], ratio=ratio, clock=clock)
            assert row["lr"] == pytest.approx(lr, rel=1e-9), f"step {row['step']}"
            assert abs(row["loss"] - loss) <= 1e-5 * loss, f"step {row['step']}"
            position += row["effective_batch"]
            clock += row["effective_batch"] // MIN
            if row["step"] == test["step"]:  # the decision after this step ran the branch test
                probes = self.branches(position, clock=clock, larger=test["to"] // MIN, current=test["from"] // MIN,
                                       windows=test["windows"])
            ratio = row["next_effective_batch"] // MIN
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}, probes
