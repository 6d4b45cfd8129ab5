"""Benchmark (issue 53 item 1): which geometry of the gradient noise scale predicts the measured critical batch for
AdamW: the plain one (the gradient's Euclidean norm, what cadence measures) or Adam's preconditioned one (each
gradient divided elementwise by ``sqrt(v_hat) + eps``, the optimizer's own metric).

gpt-tiny on the built-in corpus (sequences of 32 bytes), AdamW at --lr 2e-3 and a batch of 4, trained to a few
points. At each point, from the same weights and optimizer state:

- both noise scales, ``B_simple = tr(S) / |G|^2``, from 16 micro-batches of 2 sequences against their mean (batch 32),
  with McCandlish et al.'s unbiased estimators (the same two-batch-size estimator cadence uses per window);
- the measured critical batch (Merrill et al.'s direct measurement, by branching): the same next 256 sequences
  trained at batches 4, 8, 16, 32 and 64 (the LR x sqrt(batch / 4), as adaptive scales it), each scored on the same 8
  validation micro-batches; the critical batch is the largest whose validation loss is within 1% of the batch 4's
  (the tolerance of --batch-branch-test).

The error of a predictor is ``|log2(predicted / measured)|`` (1 = a factor of 2 off).

    .venv/bin/python benchmarks/noise_geometry.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_env import environment, write_results

SEQ, MICRO, BATCH, LR = 32, 2, 4, 2e-3
POINTS = (16, 64, 160)
"""Optimizer steps at batch 4 after which both estimates and the critical batch are measured."""
BATCHES = (4, 8, 16, 32, 64)
BRANCH_SEQUENCES = 256
ESTIMATE_MICRO_BATCHES = 16
TOLERANCE = 0.01


def _micro_batches(prep: Any) -> list[dict[str, torch.Tensor]]:
    """The epoch's micro-batches of 2 sequences, in order (each window of 4 is two of them)."""
    return [batch for window in prep.windows(0) for batch in window.micro_batches]


def _mean_loss(model: torch.nn.Module, loss_fn: Any, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    total = torch.stack([loss_fn(model, batch) for batch in batches]).sum()
    targets = sum(int((batch["labels"] != -100).sum()) for batch in batches)
    return total / targets


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).double()


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
           batches: list[dict[str, torch.Tensor]], per_step: int) -> None:
    for start in range(0, len(batches), per_step):
        optimizer.zero_grad(set_to_none=True)
        _mean_loss(model, loss_fn, batches[start:start + per_step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def _noise_scales(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                  batches: list[dict[str, torch.Tensor]]) -> dict[str, float | None]:
    """B_simple in both geometries from per-micro-batch gradients (batch MICRO) against their mean."""
    grads = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        _mean_loss(model, loss_fn, [batch]).backward()
        grads.append(_flat_grad(model))
    model.zero_grad(set_to_none=True)
    step = max(int(state["step"]) for state in optimizer.state.values())
    beta2, eps = optimizer.param_groups[0]["betas"][1], optimizer.param_groups[0]["eps"]
    v_hat = torch.cat([(optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** step)).reshape(-1)
                       for p in model.parameters() if p in optimizer.state]).double()
    preconditioner = 1.0 / (v_hat.sqrt() + eps)
    small, big = MICRO, MICRO * len(grads)
    out: dict[str, float | None] = {}
    for name, scale in (("plain", None), ("adam", preconditioner)):
        scaled = [g if scale is None else g * scale for g in grads]
        small_sq = statistics.fmean(float(g.square().sum()) for g in scaled)
        big_sq = float(torch.stack(scaled).mean(0).square().sum())
        g_sq = (big * big_sq - small * small_sq) / (big - small)
        trace = (small_sq - big_sq) / (1 / small - 1 / big)
        out[name] = trace / g_sq if g_sq > 0 and trace > 0 else None
    return out


def _measured_critical(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any,
                       ahead: list[dict[str, torch.Tensor]], val: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    losses = {}
    for batch in BATCHES:
        branch_model = copy.deepcopy(model)
        branch_opt = torch.optim.AdamW(branch_model.parameters(), lr=LR * math.sqrt(batch / BATCH),
                                       betas=(0.9, 0.95), weight_decay=0.1)
        state = copy.deepcopy(optimizer.state_dict())
        state["param_groups"][0]["lr"] = LR * math.sqrt(batch / BATCH)
        branch_opt.load_state_dict(state)
        _train(branch_model, branch_opt, loss_fn, ahead, batch // MICRO)
        with torch.no_grad():
            branch_model.eval()
            losses[batch] = float(_mean_loss(branch_model, loss_fn, val))
    critical = max(batch for batch in BATCHES if losses[batch] <= losses[BATCH] * (1 + TOLERANCE))
    return {"losses": losses, "critical": critical}


def run_seed(seed: int, points: tuple[int, ...]) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from cadence.config import TrainConfig
    from cadence.training.components import build_loss
    from cadence.training.evaluation import validation_batches
    from cadence.training.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        config = TrainConfig(seq_len=SEQ, micro_batch_size=MICRO, effective_batch_size=BATCH, max_steps=max(points),
                             seed=seed, device="cpu", eval_every=1, eval_batches=8, lr=LR, out=Path(tmp) / "run")
        prep = prepare(config, out=Path(tmp) / "run")
    torch.manual_seed(seed)
    model = prep.built.module
    loss_fn = build_loss(config, model)
    val = validation_batches(prep)[0]
    data = _micro_batches(prep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    results, done = [], 0
    for point in points:
        _train(model, optimizer, loss_fn, data[done * 2:point * 2], BATCH // MICRO)
        done = point
        start = done * 2
        ahead = data[start:start + BRANCH_SEQUENCES // MICRO]
        estimate = data[start:start + ESTIMATE_MICRO_BATCHES]
        scales = _noise_scales(model, optimizer, loss_fn, estimate)
        measured = _measured_critical(model, optimizer, loss_fn, ahead, val)
        results.append({"seed": seed, "step": point, **{f"{name}_noise_scale": value for name, value in scales.items()},
                        "measured_critical": measured["critical"], "branch_val_losses": measured["losses"]})
        print(results[-1], flush=True)
    return results


def error(predicted: float | None, measured: int) -> float | None:
    return None if predicted is None else abs(math.log2(max(predicted, 1e-9) / measured))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, one point (never reported)")
    args = parser.parse_args()
    seeds, points = ([0], POINTS[:1]) if args.quick else ([0, 1, 2], POINTS)
    load = os.getloadavg()
    rows = [row for seed in seeds for row in run_seed(seed, points)]
    summary = {}
    for name in ("plain", "adam"):
        errors = [error(row[f"{name}_noise_scale"], row["measured_critical"]) for row in rows]
        resolved = [value for value in errors if value is not None]
        summary[name] = {"median_log2_error": statistics.median(resolved) if resolved else None,
                         "unresolved": len(errors) - len(resolved)}
    output = {"environment": environment(), "load_average": [load, os.getloadavg()],
              "settings": {"model": "gpt-tiny", "seq_len": SEQ, "micro": MICRO, "batch": BATCH, "lr": LR,
                           "points": list(points), "batches": list(BATCHES), "branch_sequences": BRANCH_SEQUENCES,
                           "estimate_micro_batches": ESTIMATE_MICRO_BATCHES, "tolerance": TOLERANCE},
              "rows": rows, "summary": summary}
    print(summary)
    write_results("noise_geometry", output, quick=args.quick)


if __name__ == "__main__":
    main()
