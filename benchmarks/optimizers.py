"""Benchmark (issue 51 item 7): every --optimizer on gpt-small and a transformers llama (CPU): the median step time
and the state bytes against AdamW, and the validation loss after the same tokens, 3 seeds; and Muon's clipping
policy (item 2) measured on gpt-small: the clip over all groups (cadence's) against the clip of the AdamW groups only
(xtuner's default) and no clip.

Each run: the same byte-level text (Python's standard library source, the built-in corpus's kind), the same
windows in the same order for every optimizer of a seed (the seed sets the initial weights and the order), fp32,
`Engine` with the clip at 1.0, a warm-up of 2 steps then cosine (Schedule-Free: constant), ``--steps`` steps of
``--micro`` sequences of ``--seq`` tokens, then the mean loss over ``VAL_BATCHES`` held-out batches (Schedule-Free
in its eval-mode weights, as cadence evaluates it). Runs alternate optimizer by optimizer within a seed, in an order
rotated by the seed, so a load change on the shared machine or a position in the process reaches all of them alike;
the step time is each run's median over its steps after the first (which allocates the state), its ratio against
AdamW's of the same seed, then the median over seeds.

The LRs are each optimizer's documented one (docs/optimizers.md): AdamW and Muon the same --lr (Muon's update is
RMS-matched to AdamW's, so the claim is that one LR serves both), Schedule-Free the same, Adafactor torch's default
relative step, SGD 0.1. Short runs: the comparison is of the first ``--steps`` steps' progress, not of a converged run.

    .venv/bin/python benchmarks/optimizers.py [--steps 20] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_env import environment, write_results

from cadence import Engine, iter_windows
from cadence.engine.schedules import build_lr_scheduler
from cadence.models import GPT, MODEL_CONFIGS
from cadence.models.hf import build_hf_model
from cadence.optim.choices import OPTIMIZERS
from cadence.optim.spec import OptimizerSpec
from cadence.optim.state import optimizer_state_bytes

LLAMA = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 688,
         "vocab_size": 256, "max_position_embeddings": 512}
LR = {"adamw": 3e-3, "muon": 3e-3, "schedule-free": 3e-3, "adafactor": 1e-2, "sgd": 0.1}
SEEDS = (0, 1, 2)
VAL_BATCHES = 8
CLIP = 1.0


def corpus(size: int) -> torch.Tensor:
    """``size`` bytes of Python's standard library source (sorted file order: the same bytes on every run)."""
    root = Path(os.__file__).parent
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= size:
            break
    return torch.tensor(list(b"".join(chunks)[:size]), dtype=torch.long)


def build_model(name: str) -> torch.nn.Module:
    if name == "llama":
        return build_hf_model("hf:llama", dict(LLAMA)).model
    return GPT(MODEL_CONFIGS[name])


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def clip_adamw_groups_only(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """xtuner's ``clip_grad_mode: adamw_only``: before each step, clip the gradient of the groups Muon does not
    orthogonalise over their own norm; the orthogonalised matrices keep their raw gradient."""
    inner = optimizer.step

    def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        params = [p for group in self.param_groups if not group.get("orthogonalise") for p in group["params"]
                  if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return inner(closure)

    # Bound, as torch's LR scheduler wraps the step method through its __func__.
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]


def run(model_name: str, name: str, seed: int, data: dict[str, torch.Tensor], *, steps: int, micro: int,
        clip: str = "all") -> dict[str, Any]:
    torch.manual_seed(seed)
    model = build_model(model_name)
    spec = OptimizerSpec(name=name, lr=LR[name])  # type: ignore[arg-type]
    optimizer = spec.build(model)
    if clip == "adamw-only":
        clip_adamw_groups_only(optimizer, CLIP)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine" if "cosine" in spec.rule.schedules else "constant",
                                   warmup_steps=2, max_steps=steps)
    engine = Engine(model, optimizer, scheduler=scheduler, precision="fp32",
                    max_grad_norm=CLIP if clip == "all" else 0.0)
    train = data["train"]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    batches = [{"input_ids": train[i, :-1], "labels": train[i, 1:]}
               for i in order[:steps * micro].view(steps, micro)]
    times, losses, norms = [], [], []
    for window, _ in zip(iter_windows(batches, 1), range(steps), strict=False):
        started = time.perf_counter()
        result = engine.step(window)
        times.append(time.perf_counter() - started)
        losses.append(float(result.loss))
        norms.append(None if result.grad_norm is None else float(result.grad_norm))
    state = optimizer_state_bytes(optimizer)
    with spec.evaluation_weights(optimizer), torch.no_grad():
        model.eval()
        val = data["val"]
        val_loss = statistics.mean(
            float(F.cross_entropy(logits_of(model, rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten()))
            for rows in val.split(micro))
    return {"model": model_name, "optimizer": name, "seed": seed, "clip": clip, "lr": LR[name],
            "step_time_s": statistics.median(times[1:]), "state_bytes": state, "val_loss": val_loss,
            "train_losses": losses, "grad_norms": norms,
            "clipped_steps": sum(1 for n in norms if n is not None and n > CLIP)}


def summarise(runs: list[dict], model_name: str) -> dict[str, dict]:
    """Per optimizer: medians over seeds of its step time against AdamW's (same seed), state against AdamW's, val."""
    mine = [r for r in runs if r["model"] == model_name and r["clip"] == "all"]
    adamw = {r["seed"]: r for r in mine if r["optimizer"] == "adamw"}
    table = {}
    for name in OPTIMIZERS:
        rows = [r for r in mine if r["optimizer"] == name]
        if not rows:
            continue
        vals = [r["val_loss"] for r in rows]
        table[name] = {
            "step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "step_time_vs_adamw": statistics.median(r["step_time_s"] / adamw[r["seed"]]["step_time_s"] for r in rows),
            "state_bytes": rows[0]["state_bytes"],
            "state_vs_adamw": rows[0]["state_bytes"] / adamw[rows[0]["seed"]]["state_bytes"],
            "val_loss_median": statistics.median(vals), "val_loss_min": min(vals), "val_loss_max": max(vals),
            "val_losses": vals,
        }
    return table


def clipping(runs: list[dict]) -> dict[str, dict]:
    table = {}
    for clip in ("all", "adamw-only", "none"):
        rows = [r for r in runs if r["model"] == "gpt-small" and r["optimizer"] == "muon" and r["clip"] == clip]
        if rows:
            table[clip] = {"val_losses": [r["val_loss"] for r in rows],
                           "val_loss_median": statistics.median(r["val_loss"] for r in rows),
                           "clipped_steps": [r["clipped_steps"] for r in rows],
                           "max_grad_norm_seen": max(n for r in rows for n in r["grad_norms"] if n is not None)}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 steps, one seed: a smoke run (optimizers_quick.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, seeds = (2, SEEDS[:1]) if args.quick else (args.steps, SEEDS)
    load_before = os.getloadavg()
    started = time.perf_counter()
    tokens = corpus(2_000_000)
    rows = tokens[: len(tokens) // (args.seq + 1) * (args.seq + 1)].view(-1, args.seq + 1)
    data = {"train": rows[: -VAL_BATCHES * args.micro], "val": rows[-VAL_BATCHES * args.micro:]}
    runs = []
    plan = [(model, name, "all") for model in ("gpt-small", "llama") for name in OPTIMIZERS]
    plan += [("gpt-small", "muon", clip) for clip in ("adamw-only", "none")]
    for seed in seeds:
        # Rotated by the seed, so that no optimizer always runs first after another model's (or at the process's
        # start: a first position measured AdamW up to 2x slower than the same steps later in the process).
        for model_name, name, clip in plan[seed:] + plan[:seed]:
            gc.collect()  # the previous run's model and optimizer, freed before this one is timed
            result = run(model_name, name, seed, data, steps=steps, micro=args.micro, clip=clip)
            runs.append(result)
            print(f"seed {seed} {model_name} {name} (clip {clip}): step {result['step_time_s'] * 1e3:.0f} ms, state "
                  f"{result['state_bytes'] / 2**20:.2f} MiB, val {result['val_loss']:.4f}, clipped "
                  f"{result['clipped_steps']}/{steps}", file=sys.stderr, flush=True)
    out = {
        "environment": environment(), "steps": steps, "micro_batch_size": args.micro, "seq_len": args.seq,
        "seeds": list(seeds), "val_batches": VAL_BATCHES, "max_grad_norm": CLIP, "lr": LR, "llama": LLAMA,
        "torch_threads": args.threads, "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()), "wall_s": time.perf_counter() - started,
        "models": {model: summarise(runs, model) for model in ("gpt-small", "llama")},
        "muon_clipping": clipping(runs), "runs": runs,
    }
    write_results("optimizers", out, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
