"""Helpers shared by the tests: a tiny GPT, sample text, variable-length prompt/completion data, and the command
line run in this process or in one of its own.

Test modules import them from here (``from helpers import tiny_model``; pytest puts tests/ on the path), never from
conftest.py or from another test module; conftest.py only turns some of them into fixtures.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cadence.data import TokenDataset, collate, epoch_order, make_example
from cadence.data.batching import Example
from cadence.data.preference import PreferenceExample, mismatched
from cadence.data.reference_logps import LogpsIdentity, ReferenceLogps, row_keys
from cadence.engine.schedules import build_lr_scheduler
from cadence.models import GPT, GPTConfig

TINY = GPTConfig(vocab_size=256, context_length=40, n_layer=2, n_head=2, n_embd=32)


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def make_optimizer(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def reference_loop(dataset: TokenDataset, *, steps: int, max_grad_norm: float, effective: int = 8, seed: int = 0,
                   warmup: int = 2) -> tuple[list[float], torch.nn.Module]:
    """The textbook loop every split and cut is held to: one big batch of ``effective`` samples per step (the
    epoch's order), mean loss over its targets, clip, AdamW, cosine schedule."""
    model = tiny_model()
    optimizer = make_optimizer(model)
    scheduler = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=warmup, max_steps=steps)
    order = epoch_order(len(dataset), seed, 0).tolist()
    losses = []
    for step in range(steps):
        batch = collate([dataset[i] for i in order[step * effective:(step + 1) * effective]])
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses, model


def sample_text(num_bytes: int = 4000) -> bytes:
    rng = random.Random(1)
    words = ["window", "micro", "batch", "scale", "clip", "step", "token", "loss", "grad", "norm", "def", "return"]
    text = " ".join(rng.choice(words) for _ in range(num_bytes // 4))
    return text.encode()[:num_bytes]


def prompt_completion_dataset(count: int = 40, seed: int = 3) -> TokenDataset:
    """Variable-length examples whose target counts differ by 10x or more (2 .. 28 targets)."""
    rng = random.Random(seed)
    examples = []
    for index in range(count):
        prompt_len = rng.randint(1, 8)
        completion_len = 2 if index % 3 == 0 else rng.randint(20, 28)  # short and long completions mixed
        tokens = [rng.randrange(256) for _ in range(prompt_len + completion_len)]
        labels = [tokens[i + 1] if i + 1 >= prompt_len else -100 for i in range(len(tokens) - 1)]
        examples.append(make_example(tokens[:-1], labels))
    return TokenDataset(examples)


def variable_text_dataset(count: int = 64, seed: int = 5) -> TokenDataset:
    """Variable-length examples cut from ``sample_text`` (words: a signal even an untrained model's gradient shows),
    the first 1-3 positions without a target like a prompt: 3 to 27 targets each."""
    rng = random.Random(seed)
    text = sample_text(count * 30)
    examples, at = [], 0
    for _ in range(count):
        length = rng.randint(6, 28)
        tokens = list(text[at:at + length + 1])
        at += length + 1
        prompt_len = rng.randint(1, 3)
        labels = [tokens[i + 1] if i + 1 >= prompt_len else -100 for i in range(length)]
        examples.append(make_example(tokens[:-1], labels))
    return TokenDataset(examples)


def write_jsonl(path: Path, count: int = 48) -> Path:
    """``count`` prompt/completion lines whose completions differ in target count by more than 10x."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "step", "scale"]
    lines = []
    for index in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) + ":"
        # completions of 2 bytes and of 25-30 bytes: target counts differ by more than 10x
        completion = "ok" if index % 3 == 0 else "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(25, 30)))
        lines.append(json.dumps({"prompt": prompt, "completion": completion}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _sequence(rng: random.Random, prompt_len: int, completion_len: int) -> Example:
    tokens = [rng.randrange(1, 256) for _ in range(prompt_len + completion_len)]
    labels = [tokens[i + 1] if i + 1 >= prompt_len else -100 for i in range(len(tokens) - 1)]
    return make_example(tokens[:-1], labels)


def preference_samples(kind: str, count: int = 20, seed: int = 4) -> list[PreferenceExample]:
    """Preference samples in memory (``kind`` "kto": KTO examples with their mismatched sequences and labels; else
    pairs) whose completions differ in length by 10x (2 or 20-28 tokens): random tokens, every sequence within the
    tiny GPT's 40 positions."""
    rng = random.Random(seed)

    def completion_len(index: int) -> int:
        return 2 if index % 3 == 0 else rng.randint(20, 28)

    firsts = [_sequence(rng, rng.randint(1, 6), completion_len(i)) for i in range(count)]
    if kind == "kto":
        return [PreferenceExample(first=firsts[i], second=mismatched(firsts[i], firsts[(i + 1) % count], 39),
                                  desirable=i % 3 != 1) for i in range(count)]
    return [PreferenceExample(first=first, second=_sequence(rng, 3, completion_len(i + 1)))
            for i, first in enumerate(firsts)]


def write_preference_jsonl(path: Path, count: int = 24, *, unpaired: bool = False, seed: int = 11) -> Path:
    """``count`` preference rows of strings: pairs ``{"prompt", "chosen", "rejected"}`` whose completions differ in
    length by 10x or more (2 to 30 bytes), or, ``unpaired``, KTO rows ``{"prompt", "completion", "label"}`` with
    about two desirable rows to one undesirable."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "step", "scale"]

    def completion(index: int) -> str:
        return "ok" if index % 3 == 0 else "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(20, 30)))

    lines = []
    for index in range(count):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) + ":"
        if unpaired:
            row = {"prompt": prompt, "completion": completion(index), "label": index % 3 != 2}
        else:
            row = {"prompt": prompt, "chosen": completion(index), "rejected": completion(index + 1) + "!"}
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def precomputed_record(reference: Any, samples: list[PreferenceExample]) -> ReferenceLogps:
    """``reference``'s log-probabilities of every row of ``samples``, scored one sample at a time, as the record
    ``--reference-logprobs precomputed`` keeps (``reference``: a FrozenReference)."""
    from cadence.engine.windows import collate_samples

    identity = LogpsIdentity(store_digest="test", reference="test", precision="fp32", head="targets")
    logps: dict[bytes, float] = {}
    for sample in samples:
        batch = collate_samples([sample])
        for key, value in zip(row_keys(batch["input_ids"], batch["labels"]), reference.row_logps(batch).tolist()):
            if key is not None:
                logps[key] = value
    return ReferenceLogps(identity=identity, logps=logps)


def relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    diff = torch.cat([(a[k] - b[k]).flatten() for k in sorted(a)])
    base = torch.cat([b[k].flatten() for k in sorted(b)])
    return float(diff.norm() / base.norm())


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (avx512_bf16 or amx_bf16). Without it torch emulates bf16 at
    about a tenth of fp32's speed, so tests that only need bf16's memory, not its speed, keep it to small models.
    True when /proc/cpuinfo cannot be read (assume the fast path rather than skip coverage)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & set(flags))


# ------------------------------------------------------------------------------------------------ the command line
CADENCE = str(Path(sys.executable).with_name("cadence"))
"""The installed console script, for tests that need a process of its own (signals, locks, two runs at once)."""


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``cadence ARGV`` in this process: (exit status, stdout, stderr)."""
    from cadence.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    """``cadence ARGV`` as a process of its own (stdout discarded, stderr kept)."""
    return subprocess.Popen([CADENCE, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def train_args(data: Path | str, out: Path, *extra: str, steps: int, seq_len: int = 32, micro: int = 4,
               accum: int = 2, cache: Path | None = None) -> list[str]:
    """A small ``cadence train`` on ``data`` into ``out``: no validation split, a checkpoint every 2 steps."""
    return ["train", "--data", str(data), *(["--data-cache", str(cache)] if cache is not None else []),
            "--seq-len", str(seq_len), "--micro-batch-size", str(micro), "--grad-accum-steps", str(accum),
            "--max-steps", str(steps), "--val-fraction", "0", "--checkpoint-every", "2", "--out", str(out), *extra]


@contextlib.contextmanager
def sigterm_at(step: int, micro: int):  # type: ignore[no-untyped-def]
    """Within the block, an in-process ``cadence train`` gets SIGTERM once micro-batch ``micro`` of step ``step + 1``
    has run (as ``TrainProgress.micro_step`` reports it): a stop at a known point without a second process."""
    import os
    import signal

    from cadence.training.progress import TrainProgress

    original = TrainProgress.micro_step

    def signal_once(progress: TrainProgress, at_step: int, at_micro: int, total: int | None = None) -> None:
        original(progress, at_step, at_micro, total)
        if (at_step, at_micro) == (step, micro):
            os.kill(os.getpid(), signal.SIGTERM)

    TrainProgress.micro_step = signal_once  # type: ignore[method-assign]
    try:
        yield
    finally:
        TrainProgress.micro_step = original  # type: ignore[method-assign]


def rank_pids(launcher: int, variable: str = "RANK") -> dict[int, int]:
    """``variable`` (RANK, or LOCAL_RANK) -> pid of the worker processes the torchrun launcher ``launcher`` started,
    found through /proc by their parent and their torchrun variables."""
    found = {}
    key = variable.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        variables = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if parent == launcher and key in variables:
            found[int(variables[key])] = int(entry.name)
    return found


def ranks_counting(flags: list[str], out: Path, data: Path, run: Path, *, stop: tuple[int, int],
                   resume: bool = False) -> list[dict]:
    """``cadence train --data DATA FLAGS --out RUN`` on 2 ranks under torchrun, each counting the micro-batches it
    computes (tests/distributed/mid_window_ranks.py, its record in OUT/rank-N.json); rank 0 gets SIGTERM at ``stop``
    = (steps done, micro-batch of the next)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(Path(__file__).resolve().parent / "distributed" / "mid_window_ranks.py"), str(out), *map(str, stop),
         "--", "train", "--data", str(data), *flags, "--out", str(run), *(["--resume"] if resume else [])],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    found = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]
    assert [rank["status"] for rank in found] == [0, 0], result.stderr[-3000:]
    return found


def one_big_batch_replay(rows: list[dict], config: Any) -> dict[str, torch.Tensor]:
    """The textbook loop an --effective-batch-size adaptive run is held to, replaying its metrics ``rows``: each step
    one big batch of the next ``effective_batch`` examples of the epoch's order (mean loss over its targets, clip,
    the run's AdamW groups), at the LR of the schedule counted in windows of the minimum times sqrt(batch ratio) and
    beta2 = max(0.9, beta2 ** ratio), the ratio being the batch decided before the step. Asserts each row's LR
    (1e-9) and loss (1e-5); returns the final weights."""
    import math

    from cadence.engine.schedules import lr_factor
    from cadence.training.prepare import prepare

    prep = prepare(config)
    model = prep.built.module
    optimizer = prep.optimizer.build(model)
    order = epoch_order(len(prep.data.train), config.seed, 0).tolist()
    minimum, beta2 = config.min_effective_batch_size, config.adam_beta2
    position = clock = 0
    ratio = 1  # the batch decided before this step, in windows of the minimum (the last window may hold fewer)
    for row in rows:
        lr = config.lr * math.sqrt(ratio) * lr_factor(clock, schedule=config.lr_schedule,
                                                      warmup_steps=config.warmup_steps, max_steps=config.max_steps)
        assert row["lr"] == pytest.approx(lr, rel=1e-9), f"step {row['step']}"
        assert row["lr_batch_scale"] == pytest.approx(math.sqrt(ratio))
        for group in optimizer.param_groups:
            group["lr"] = lr
            group["betas"] = (config.adam_beta1, max(0.9, beta2 ** ratio) if ratio > 1 else beta2)
        batch = collate([prep.data.train[i] for i in order[position:position + row["effective_batch"]]])
        loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert abs(row["loss"] - loss.item()) <= 1e-5 * loss.item(), f"step {row['step']}"
        position += row["effective_batch"]
        clock += row["effective_batch"] // minimum
        ratio = row["next_effective_batch"] // minimum
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}
