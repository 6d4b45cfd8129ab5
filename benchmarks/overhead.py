"""Benchmark: cadence's Engine against a hand-written loop, Hugging Face Accelerate and Lightning Fabric (issue 9).

The same model (gpt-small, fresh from the same starting weights each round), the same windows of the built-in corpus,
micro 4 x accum 4, AdamW lr 1e-3, clipping at 1.0, in fp32 and bf16, four ways:

1. ``plain``: a hand-written PyTorch loop (sum loss / window target count, backward per micro-batch, clip once, step,
   zero_grad);
2. ``cadence``: ``Engine.step(window)``;
3. ``accelerate``: ``Accelerator(gradient_accumulation_steps=A, cpu=True)``, ``accumulate(model)``, ``backward``,
   ``clip_grad_norm_`` when ``sync_gradients``. ``accelerator.backward`` divides the loss by A, so, as Accelerate's
   gradient-accumulation guide does for a loss summed over targets, the loss is sum / window targets * A;
4. ``fabric``: ``Fabric(accelerator="cpu", devices=1)``, ``no_backward_sync(model, enabled=not last)``,
   ``backward`` (no division of its own), ``clip_gradients``; the loss is sum / window targets.

They run alternately (plain cadence accelerate fabric, plain cadence ...), each round one warm-up step then a few
timed steps on the same windows. Every round's per-step losses AND gradient norms before clipping (AdamW and clipping
would hide a wrongly scaled gradient from the losses alone) of each implementation are checked against the
hand-written loop's (same math, so they must agree to float rounding). Reports the median tokens/s (over rounds),
the ratio to the hand-written loop and the peak memory of one extra step (cadence.memory.meter.StepMemoryMeter, one
profiler session around the step, on the unwrapped model and optimizer).

Each implementation runs where the model's parameters are: ``benchmarks/gpu.py`` calls ``take_windows`` and
``compare`` with a model on CUDA (autocast, Accelerate and Fabric then use the GPU, and the memory is the
allocator's high-water mark), and its own sizes.

    .venv/bin/python benchmarks/overhead.py [--quick] [--rounds 8] [--steps 4] [--model gpt-small] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_env import environment

from cadence import Engine
from cadence.data import IGNORE_INDEX, iterate_micro_batches, load_data
from cadence.engine.windows import Window, iter_windows
from cadence.memory.meter import StepMemoryMeter
from cadence.models import build_model

IMPLEMENTATIONS = ("plain", "cadence", "accelerate", "fabric")
LR = 1e-3
MAX_GRAD_NORM = 1.0
# The loss of every implementation must agree with the hand-written loop's to this relative difference.
LOSS_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over targets, in fp32 (as cadence's default loss)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def window_targets(window: Window) -> int:
    """Counted by each loop itself, inside the timed step (as a user's loop would)."""
    return sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in window.micro_batches)


class Runner:
    """One implementation, set up on a fresh model; ``step(window)`` returns the window's token-mean loss."""

    model: torch.nn.Module  # unwrapped, for the memory meter
    optimizer: torch.optim.Optimizer  # unwrapped

    def step(self, window: Window) -> tuple[float, float]:
        """Returns the window's token-mean loss and the total gradient norm before clipping."""
        raise NotImplementedError


def device_of(model: torch.nn.Module) -> torch.device:
    """Where an implementation runs: where the model's parameters are."""
    return next(model.parameters()).device


class Plain(Runner):
    def __init__(self, model: torch.nn.Module, precision: str, accum: int) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.device_type = device_of(model).type
        self.bf16 = precision == "bf16"

    def step(self, window: Window) -> float:
        self.model.train()
        targets = window_targets(window)
        total = torch.zeros((), dtype=torch.float64, device=device_of(self.model))
        for batch in window.micro_batches:
            with torch.autocast(self.device_type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext():
                loss = loss_sum(self.model(batch["input_ids"]), batch["labels"])
            (loss / targets).backward()
            total += loss.detach().double()  # on the device: one host sync per step, as cadence does
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total) / targets, float(norm)


class Cadence(Runner):
    def __init__(self, model: torch.nn.Module, precision: str, accum: int) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.engine = Engine(model, self.optimizer, precision=precision, max_grad_norm=MAX_GRAD_NORM)

    def step(self, window: Window) -> float:
        # A fresh Window of the same micro-batches: the engine counts targets and tokens itself, inside the step.
        result = self.engine.step(list(window.micro_batches))
        assert result.loss is not None and result.grad_norm is not None and not result.skipped
        return result.loss, result.grad_norm


class Accelerate(Runner):
    accelerator = None  # one per precision, accumulation and device (Accelerate's state is a process-wide singleton)
    accelerator_key: tuple[str, int, str] | None = None

    def __init__(self, model: torch.nn.Module, precision: str, accum: int) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState

        device_type = device_of(model).type
        if Accelerate.accelerator_key != (precision, accum, device_type):
            if Accelerate.accelerator is not None:
                AcceleratorState._reset_state(True)  # a new mixed_precision needs a fresh process-wide state
                GradientState._reset_state()
            threads = torch.get_num_threads()
            Accelerate.accelerator = Accelerator(
                gradient_accumulation_steps=accum, mixed_precision="bf16" if precision == "bf16" else "no",
                cpu=device_type == "cpu",
            )
            torch.set_num_threads(threads)
            Accelerate.accelerator_key = (precision, accum, device_type)
        self.accelerator = Accelerate.accelerator
        self.accelerator.free_memory()  # forgets the previous round's objects and resets its micro-step counter
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.optimizer = model, optimizer
        self.wrapped_model, self.wrapped_optimizer = self.accelerator.prepare(model, optimizer)
        self.accum = accum

    def step(self, window: Window) -> float:
        accelerator, model, optimizer = self.accelerator, self.wrapped_model, self.wrapped_optimizer
        model.train()
        targets = window_targets(window)
        total, norm = torch.zeros((), dtype=torch.float64, device=device_of(self.model)), None
        for batch in window.micro_batches:
            with accelerator.accumulate(model):
                loss = loss_sum(model(batch["input_ids"]), batch["labels"])
                # accelerator.backward divides by gradient_accumulation_steps: undo it, as Accelerate's guide does
                # for a loss normalised by the number of targets in the whole accumulated batch.
                accelerator.backward(loss / targets * self.accum * accelerator.num_processes)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.detach().double()  # on the device: one host sync per step, as cadence does
        assert norm is not None, "the window's last micro-batch must have synchronised, clipped and stepped"
        return float(total) / targets, float(norm)


class Fabric(Runner):
    fabrics: dict[tuple[str, str], object] = {}  # by precision and device

    def __init__(self, model: torch.nn.Module, precision: str, accum: int) -> None:
        from lightning.fabric import Fabric as LightningFabric

        key = (precision, device_of(model).type)
        if key not in Fabric.fabrics:
            threads = torch.get_num_threads()
            Fabric.fabrics[key] = LightningFabric(
                accelerator=key[1], devices=1, precision="bf16-mixed" if precision == "bf16" else "32-true"
            )
            torch.set_num_threads(threads)
        self.fabric = Fabric.fabrics[key]
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model, self.optimizer = model, optimizer
        self.wrapped_model, self.wrapped_optimizer = self.fabric.setup(model, optimizer)

    def step(self, window: Window) -> float:
        fabric, model, optimizer = self.fabric, self.wrapped_model, self.wrapped_optimizer
        model.train()
        targets = window_targets(window)
        total = torch.zeros((), dtype=torch.float64, device=device_of(self.model))
        last = len(window.micro_batches) - 1
        for index, batch in enumerate(window.micro_batches):
            with fabric.no_backward_sync(model, enabled=index != last):
                loss = loss_sum(model(batch["input_ids"]), batch["labels"])
                fabric.backward(loss / targets)
            total += loss.detach().double()  # on the device: one host sync per step, as cadence does
        norm = fabric.clip_gradients(model, optimizer, max_norm=MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        return float(total) / targets, float(norm)


RUNNERS: dict[str, Callable[[torch.nn.Module, str, int], Runner]] = {
    "plain": Plain, "cadence": Cadence, "accelerate": Accelerate, "fabric": Fabric,
}


def run_round(name: str, initial: torch.nn.Module, precision: str, accum: int, windows: list[Window], steps: int,
              measure: bool) -> dict:
    """One warm-up step then ``steps`` timed steps (plus one profiled step when ``measure``)."""
    model = copy.deepcopy(initial)
    device = device_of(model)
    runner = RUNNERS[name](model, precision, accum)
    losses, norms, times, tokens = [], [], [], 0
    for index in range(steps + 1):
        window = windows[index]
        started = time.perf_counter()
        loss, norm = runner.step(window)
        if device.type == "cuda":
            # Each step returns once its loss and norm are on the host, but its optimizer update may still be
            # queued: wait for it, so that a step's time is its own and not partly the next one's.
            torch.cuda.synchronize(device)
        losses.append(loss)
        norms.append(norm)
        elapsed = time.perf_counter() - started
        if index:  # the first step is a warm-up (AdamW allocates its state)
            times.append(elapsed)
            tokens += window.tokens
    out = {"losses": losses, "grad_norms": norms, "tokens_per_s": tokens / sum(times), "step_s": times}
    if measure:
        meter = StepMemoryMeter(device)
        with meter.measure(model=runner.model, optimizer=runner.optimizer, enabled=True):
            runner.step(windows[steps + 1])
        out["peak_bytes"] = meter.peak_bytes
    del runner, model
    return out


def take_windows(seq_len: int, micro_batch_size: int, grad_accum_steps: int, count: int,
                 device: torch.device | None = None) -> list[Window]:
    """The first ``count`` full windows of the built-in corpus (4 MB of it), on ``device`` when given: every
    implementation then starts each micro-batch with its inputs already there, so none is timed copying them."""
    data = load_data(None, seq_len, 0.0, max_corpus_bytes=4_000_000)
    windows: list[Window] = []
    for window in iter_windows(iterate_micro_batches(data.train, micro_batch_size, seed=0, epoch=0),
                               grad_accum_steps, micro_batch_size=micro_batch_size, last_window="drop"):
        if device is not None:
            window = dataclasses.replace(window, micro_batches=[
                {key: value.to(device) for key, value in batch.items()} for batch in window.micro_batches])
        windows.append(window)
        if len(windows) == count:
            break
    return windows


def compare(initial: torch.nn.Module, windows: list[Window], precision: str, accum: int, rounds: int, steps: int,
            implementations: tuple[str, ...] = IMPLEMENTATIONS) -> tuple[dict[str, dict], list[str]]:
    """``rounds`` alternating rounds of ``implementations`` (the first must be ``plain``, the reference) from the
    weights of ``initial``, on ``windows`` (at least ``steps + 2``); the last round also measures peak memory.

    Returns the per-implementation figures and the loss/gradient-norm mismatches beyond ``LOSS_TOLERANCE``."""
    threads = torch.get_num_threads()
    runs: dict[str, list[dict]] = {name: [] for name in implementations}
    for round_index in range(rounds):
        for name in implementations:
            runs[name].append(run_round(name, initial, precision, accum, windows, steps,
                                        measure=round_index == rounds - 1))
            assert torch.get_num_threads() == threads, f"{name} changed the thread count"
        print(f"{precision} round {round_index + 1}/{rounds}: " + ", ".join(
            f"{n} {runs[n][-1]['tokens_per_s']:,.0f}" for n in implementations) + " tokens/s", flush=True)
    reference = runs["plain"][0]["losses"] + runs["plain"][0]["grad_norms"]
    per: dict[str, dict] = {}
    failures = []
    plain_median = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    for name in implementations:
        diff = max(abs(a - b) / abs(b) for r in runs[name] for a, b in zip(r["losses"] + r["grad_norms"], reference))
        median = statistics.median(r["tokens_per_s"] for r in runs[name])
        per[name] = {
            "median_tokens_per_s": median, "ratio_to_plain": median / plain_median,
            "tokens_per_s_by_round": [r["tokens_per_s"] for r in runs[name]],
            "median_step_s": statistics.median(t for r in runs[name] for t in r["step_s"]),
            "peak_bytes": runs[name][-1].get("peak_bytes"), "losses": runs[name][0]["losses"],
            "grad_norms": runs[name][0]["grad_norms"],
            "max_loss_rel_diff": diff,
        }
        if diff > LOSS_TOLERANCE[precision]:
            failures.append(f"{precision} {name}: losses or gradient norms differ from the hand-written loop by "
                            f"{diff:.2e}")
    return per, failures


def markdown(result: dict) -> str:
    lines = ["| precision | implementation | median tokens/s | ratio to hand-written | peak memory MiB | "
             "max loss / grad-norm rel. diff |", "|---|---|---|---|---|---|"]
    for precision, per in result["precisions"].items():
        for name in IMPLEMENTATIONS:
            row = per[name]
            peak = f"{row['peak_bytes'] / 2**20:.1f}" if row.get("peak_bytes") is not None else "n/a"
            lines.append(f"| {precision} | {name} | {row['median_tokens_per_s']:,.0f} | {row['ratio_to_plain']:.3f} | "
                         f"{peak} | {row['max_loss_rel_diff']:.1e} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--grad-accum-steps", type=int, default=4)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2 timed steps (under 3 minutes, 2 cores)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 2
        if args.out == parser.get_default("out"):
            args.out = args.out.with_name("overhead_quick.json")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import accelerate
    import lightning

    started = time.perf_counter()
    windows = take_windows(args.seq_len, args.micro_batch_size, args.grad_accum_steps, args.steps + 2)
    torch.manual_seed(0)
    initial = build_model(args.model)
    threads = torch.get_num_threads()

    result: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {threads} threads",
        "python": platform.python_version(), "torch": torch.__version__, "accelerate": accelerate.__version__,
        "lightning": lightning.__version__, "model": args.model, "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size, "grad_accum_steps": args.grad_accum_steps,
        "tokens_per_step": windows[1].tokens, "rounds": args.rounds, "steps_per_round": args.steps,
        "order": "alternating, " + " ".join(IMPLEMENTATIONS) + " per round", "precisions": {},
        "environment": environment(("accelerate", "lightning")),
    }
    failures = []
    for precision in args.precisions.split(","):
        per, mismatches = compare(initial, windows, precision, args.grad_accum_steps, args.rounds, args.steps)
        failures += mismatches
        result["precisions"][precision] = per
    result["loss_check"] = failures or ("every implementation's per-step losses and gradient norms (before clipping) "
                                        "match the hand-written loop's")
    result["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    print(f"\n{result['machine']}; torch {result['torch']}, accelerate {result['accelerate']}, "
          f"lightning {result['lightning']}; {args.model} seq {args.seq_len}, micro {args.micro_batch_size} x accum "
          f"{args.grad_accum_steps}; {args.rounds} rounds x {args.steps} timed steps; {result['wall_s']:.0f} s")
    print(f"raw: {args.out}")
    for failure in failures:
        print("LOSS MISMATCH:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
