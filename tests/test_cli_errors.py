"""`cadence train` with bad input: one `cadence: error: <where>: <message>` line per problem, exit 2, nothing written.

Each row of the table is one bad input; the row's files are made in ``tmp_path`` by a small builder so the argv can
name them. ``<tmp_path>/run`` is the ``--out`` of every row and must not exist afterwards (except for the rows where
``--out`` itself is the problem: there the existing file/directory must be left exactly as it was).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.cli import main

ERROR_PREFIX = "cadence: error:"
FAST = ["--max-steps", "1", "--seq-len", "16"]
TEXT = ("The quick brown fox jumps over the lazy dog. " * 40).encode()  # 1,800 bytes: plenty of 16-byte sequences


def _write(tmp: Path, name: str, content: bytes | str) -> Path:
    path = tmp / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


# Each builder makes the row's files in tmp_path and returns the arguments after `train --out <tmp>/run`.
Builder = Callable[[Path], list[str]]


def flags(*args: str, fast: bool = True) -> Builder:
    return lambda tmp: [*args, *(FAST if fast else [])]


def data_file(name: str, content: bytes | str) -> Builder:
    return lambda tmp: ["--data", str(_write(tmp, name, content)), *FAST]


def config_file(content: str) -> Builder:
    return lambda tmp: ["--config", str(_write(tmp, "cfg.toml", content)), *FAST]


def empty_dir(tmp: Path) -> list[str]:
    (tmp / "emptydir" / ".git").mkdir(parents=True)
    _write(tmp / "emptydir" / ".git", "HEAD", "ref: refs/heads/main\n")  # hidden files are not text to train on
    return ["--data", str(tmp / "emptydir"), *FAST]


def fifo(flag: str, name: str) -> Builder:
    """A named pipe with no writer: reading it would block forever."""
    def build(tmp: Path) -> list[str]:
        os.mkfifo(tmp / name)
        return [flag, str(tmp / name), *FAST]
    return build


def link_to_dev_zero(flag: str, name: str) -> Builder:
    """A link to /dev/zero: reading it would never end."""
    def build(tmp: Path) -> list[str]:
        (tmp / name).symlink_to("/dev/zero")
        return [flag, str(tmp / name), *FAST]
    return build


def adaptive_plan(*args: str, branch_test: bool = True, fast: list[str] = FAST) -> Builder:
    """A plan.json of an adaptive plan (gpt-tiny at --seq-len 16, micro 4 over [8, 32]), as cadence plan writes it,
    given to --plan with ``args``."""
    def build(tmp: Path) -> list[str]:
        policy = {"effective_batch_size": "adaptive", "min_effective_batch_size": 8, "max_effective_batch_size": 32,
                  "batch_lr_scaling": "sqrt", **({"batch_branch_test": 2, "batch_branch_tolerance": 0.01}
                                                 if branch_test else {}), "snapshot_bytes": 0, "throughput": None}
        plan = {"version": 1, "created": "2026-12-06T20:00:00", "model": "gpt-tiny", "seq_len": 16, "diagnosis": {},
                "candidates": [], "effective_batch_size": 8,
                "choice": {"id": "c03", "micro_batch_size": 4, "grad_accum_steps": 2, "reason": "test"},
                "adaptive_batch": policy}
        return ["--plan", str(_write(tmp, "plan.json", json.dumps(plan))), *args, *fast]
    return build


# (id, builder, substring that names the flag or file in stderr; "{tmp}" is replaced by tmp_path)
CASES: list[tuple[str, Builder, str]] = [
    # ---------------------------------------------------------------- train --plan of an adaptive plan
    ("plan-adaptive-contradicted-maximum", adaptive_plan("--max-effective-batch-size", "64"),
     "--max-effective-batch-size: 64 contradicts the plan's 32"),
    ("plan-adaptive-contradicted-batch", adaptive_plan("--effective-batch-size", "16"),
     "--effective-batch-size: 16 contradicts the plan's 'adaptive'"),
    ("plan-adaptive-branch-test-not-counted",
     adaptive_plan("--batch-branch-test", "2", "--eval-every", "1", branch_test=False),
     "--batch-branch-test: the plan"),
    # ---------------------------------------------------------------- batch geometry
    ("grad-accum-0", flags("--grad-accum-steps", "0"), "--grad-accum-steps"),
    ("micro-batch-0", flags("--micro-batch-size", "0"), "--micro-batch-size"),
    ("micro-batch-negative", flags("--micro-batch-size", "-3"), "--micro-batch-size"),
    ("effective-not-divisible", flags("--effective-batch-size", "30", "--micro-batch-size", "8"),
     "--effective-batch-size"),
    ("effective-contradicts-accum",
     flags("--effective-batch-size", "32", "--micro-batch-size", "8", "--grad-accum-steps", "2"),
     "--effective-batch-size"),
    ("effective-0", flags("--effective-batch-size", "0"), "--effective-batch-size"),
    # ---------------------------------------------------------------- model and sequence length
    ("seq-len-above-context", flags("--seq-len", "257", "--max-steps", "1", fast=False), "--seq-len"),
    ("seq-len-1", flags("--seq-len", "1", "--max-steps", "1", fast=False), "--seq-len"),
    ("seq-len-0", flags("--seq-len", "0", "--max-steps", "1", fast=False), "--seq-len"),
    ("unknown-model", flags("--model", "gpt-huge"), "--model"),
    # ---------------------------------------------------------------- choices
    ("precision-fp8", flags("--precision", "fp8"), "--precision"),
    ("precision-16-spelling", flags("--precision", "16"), "--precision"),
    ("lr-schedule-step", flags("--lr-schedule", "step"), "--lr-schedule"),
    ("last-window-keep", flags("--last-window", "keep"), "--last-window"),
    ("fp32-matmul-highest", flags("--fp32-matmul", "highest"), "--fp32-matmul"),
    ("device-cuda-without-cuda", flags("--device", "cuda"), "--device"),
    ("device-unknown", flags("--device", "tpu"), "--device"),
    # ---------------------------------------------------------------- numbers
    ("lr-0", flags("--lr", "0"), "--lr"),
    ("lr-negative", flags("--lr", "-1"), "--lr"),
    ("lr-nan", flags("--lr", "nan"), "--lr"),
    ("lr-not-a-number", flags("--lr", "abc"), "--lr"),
    ("max-steps-not-an-int", flags("--seq-len", "16", "--max-steps", "1.5", fast=False), "--max-steps"),
    ("max-grad-norm-negative", flags("--max-grad-norm", "-1"), "--max-grad-norm"),
    ("prefetch-windows-negative", flags("--prefetch-windows", "-1"), "--prefetch-windows"),
    # Issue 29: each window ahead waits in memory; a million had no cap.
    ("prefetch-windows-1000000", flags("--prefetch-windows", "1000000"), "--prefetch-windows: must be at most 64"),
    ("loss-chunk-tokens-negative", flags("--loss-chunk-tokens", "-1"), "--loss-chunk-tokens"),
    ("loss-chunk-tokens-not-an-int", flags("--loss-chunk-tokens", "1k"), "--loss-chunk-tokens"),
    # ---------------------------------------------------------------- optimizer state and LoRA (issue 26)
    ("optimizer-state-unknown", flags("--optimizer-state", "4bit"), "--optimizer-state: '4bit' is not one of fp32"),
    # ---------------------------------------------------------------- optimizers (issue 51)
    ("optimizer-unknown", flags("--optimizer", "lion"), "--optimizer: 'lion' is not one of adamw"),
    ("adam-beta-with-sgd", flags("--optimizer", "sgd", "--adam-beta2", "0.99"),
     "--adam-beta2: does not apply to --optimizer sgd"),
    ("adam-beta1-with-adafactor", flags("--optimizer", "adafactor", "--adam-beta1", "0.8"),
     "--adam-beta1: does not apply to --optimizer adafactor"),
    ("nesterov-with-muon", flags("--optimizer", "muon", "--nesterov"), "--nesterov: does not apply to --optimizer muon"),
    ("offload-optimizer-with-muon", flags("--optimizer", "muon", "--offload", "optimizer"),
     "--offload: optimizer does not apply to --optimizer muon"),
    ("bf16-state-with-sgd", flags("--optimizer", "sgd", "--optimizer-state", "bf16"),
     "--optimizer-state: bf16 does not apply to --optimizer sgd"),
    ("8bit-state-with-adafactor", flags("--optimizer", "adafactor", "--optimizer-state", "8bit"),
     "--optimizer-state: 8bit does not apply to --optimizer adafactor"),
    ("momentum-with-adamw", flags("--momentum", "0.9"), "--momentum: does not apply to --optimizer adamw"),
    ("momentum-one", flags("--optimizer", "sgd", "--momentum", "1"), "--momentum: must be in [0, 1)"),
    ("nesterov-without-momentum", flags("--optimizer", "sgd", "--momentum", "0", "--nesterov"),
     "--nesterov: needs momentum"),
    ("muon-without-block-matrices", flags("--model", "hf:llama", "--model-config", "num_hidden_layers=1",
                                          "--model-config", "hidden_size=32", "--model-config", "num_attention_heads=2",
                                          "--model-config", "intermediate_size=64", "--lora-rank", "4",
                                          "--lora-targets", "lm_head", "--optimizer", "muon"),
     "--optimizer: muon orthogonalises the trained 2-D weight matrices of the model's repeated blocks"),
    ("muon-with-8bit-state", flags("--optimizer", "muon", "--optimizer-state", "8bit"),
     "--optimizer-state: 8bit does not apply to --optimizer muon"),
    ("schedule-free-under-a-decaying-schedule", flags("--optimizer", "schedule-free"),
     "--lr-schedule: cosine does not apply to --optimizer schedule-free"),
    ("lora-on-the-built-in-gpt", flags("--lora-rank", "8"), "--lora-rank: LoRA adapts Hugging Face models"),
    ("lora-rank-negative", flags("--model", "hf:llama", "--lora-rank", "-1"), "--lora-rank: must be at least 0"),
    ("lora-alpha-without-rank", flags("--lora-alpha", "16"), "--lora-alpha: needs --lora-rank above 0"),
    ("lora-targets-without-rank", flags("--lora-target-modules", "q_proj"), "--lora-targets: needs --lora-rank"),
    ("lora-dropout-one", flags("--model", "hf:llama", "--lora-rank", "8", "--lora-dropout", "1"),
     "--lora-dropout: must be in [0, 1)"),
    ("lora-alpha-zero", flags("--model", "hf:llama", "--lora-rank", "8", "--lora-alpha", "0"),
     "--lora-alpha: must be a positive number"),
    ("lora-bf16-base-under-fp32", flags("--model", "hf:llama", "--lora-rank", "8", "--lora-base-precision", "bf16"),
     "--lora-base-precision: bf16 needs --precision bf16"),
    ("max-grad-norm-inf", flags("--max-grad-norm", "inf"), "--max-grad-norm"),
    ("warmup-equals-max-steps", flags("--seq-len", "16", "--max-steps", "5", "--warmup-steps", "5", fast=False),
     "--warmup-steps"),
    ("warmup-above-max-steps", flags("--seq-len", "16", "--max-steps", "5", "--warmup-steps", "9", fast=False),
     "--warmup-steps"),
    ("max-steps-0", flags("--seq-len", "16", "--max-steps", "0", fast=False), "--max-steps"),
    ("seed-negative", flags("--seed", "-1"), "--seed"),
    ("weight-decay-above-1", flags("--weight-decay", "2"), "--weight-decay"),
    ("adam-beta2-1", flags("--adam-beta2", "1"), "--adam-beta2"),
    ("eval-every-without-val", flags("--eval-every", "5", "--val-fraction", "0"), "--eval-every"),
    ("val-fraction-0.9", flags("--val-fraction", "0.9"), "--val-fraction"),
    ("eval-batches-negative", flags("--eval-batches", "-1"), "--eval-batches"),
    ("log-every-0", flags("--log-every", "0"), "--log-every"),
    ("checkpoint-every-negative", flags("--checkpoint-every", "-2"), "--checkpoint-every"),
    # The built-in GPT's packed attention splits rows in Python: each new packing would compile again.
    ("compile-with-packing-on-a-built-in-model", flags("--compile", "--packing"), "--compile"),
    # ---------------------------------------------------------------- several processes (checked before launching)
    ("strategy-unknown", flags("--strategy", "zero3"), "--strategy"),
    ("strategy-fsdp-one-process", flags("--strategy", "fsdp"), "--strategy"),
    ("sync-every-micro-step-with-ddp", flags("--sync-every-micro-step"), "--sync-every-micro-step"),
    ("collective-timeout-0", flags("--collective-timeout", "0"), "--collective-timeout"),
    # Issue 29 item 9: 1e30 overflowed torch's timedelta with two processes (and was accepted with one).
    ("collective-timeout-1e30", flags("--collective-timeout", "1e30"), "--collective-timeout"),
    ("collective-timeout-1e30-two-processes", flags("--collective-timeout", "1e30", "--nproc-per-node", "2"),
     "--collective-timeout"),
    ("nproc-per-node-0", flags("--nproc-per-node", "0"), "--nproc-per-node"),
    # Issue 29 item 4: torch's launcher grew by gigabytes on this number; a CPU run takes at most one rank per core.
    ("nproc-per-node-above-the-cores", flags("--nproc-per-node", "99999999999999999999", "--device", "cpu"),
     "--nproc-per-node: 99999999999999999999 is more than the"),
    ("nproc-effective-not-divisible", flags("--nproc-per-node", "2", "--micro-batch-size", "4",
                                            "--effective-batch-size", "12"), "--effective-batch-size"),
    ("nproc-fsdp-fp16", flags("--nproc-per-node", "2", "--strategy", "fsdp", "--precision", "fp16"), "--precision"),
    ("nproc-fsdp-offload-optimizer", flags("--nproc-per-node", "2", "--strategy", "fsdp", "--offload", "optimizer"),
     "--offload"),
    # Issue 51: an optimizer that cannot step a sharded matrix is refused before the ranks start, saying why.
    ("nproc-fsdp-muon", flags("--nproc-per-node", "2", "--strategy", "fsdp", "--optimizer", "muon"),
     "--optimizer: muon with --strategy fsdp is not supported: Newton-Schulz orthogonalises a whole matrix"),
    ("nproc-fsdp-schedule-free", flags("--nproc-per-node", "2", "--strategy", "fsdp", "--optimizer", "schedule-free",
                                       "--lr-schedule", "constant"),
     "--optimizer: schedule-free with --strategy fsdp is not supported"),
    ("nproc-fsdp-adafactor", flags("--nproc-per-node", "2", "--strategy", "fsdp", "--optimizer", "adafactor"),
     "--optimizer: adafactor with --strategy fsdp is not supported"),
    ("nproc-fsdp-mid-window-checkpoint", flags("--nproc-per-node", "2", "--strategy", "fsdp",
                                               "--checkpoint-mid-window"), "--checkpoint-mid-window"),
    # ---------------------------------------------------------------- click-level errors
    ("unknown-flag", flags("--foo"), "--foo"),
    ("missing-flag-value", lambda tmp: [*FAST, "--lr"], "--lr"),
    # ---------------------------------------------------------------- --data
    ("data-missing", lambda tmp: ["--data", str(tmp / "nope.txt"), *FAST], "--data"),
    # Issue 29: Path("") is ".", so --data "" trained on the current directory (and --data-cache "" filled it).
    ("data-empty-path", flags("--data", ""), "--data: the path is empty"),
    ("data-cache-empty-path", flags("--data-cache", ""), "--data-cache: the path is empty"),
    ("out-empty-path", flags("--out", ""), "--out: the path is empty"),
    ("config-data-empty-path", config_file('data = ""\n'), "data: '' is not a valid path string"),
    ("data-empty-txt", data_file("empty.txt", b""), "--data"),
    ("data-csv-without-text-field", data_file("table.csv", "a,b\n1,2\n"), "--text-field"),
    ("data-unknown-suffix", data_file("table.xlsx", "a,b\n1,2\n"), "--data"),
    # Every form --data takes is named (the message once listed three of them).
    ("data-without-a-suffix", data_file("train", "some text"), "a .parquet, .csv or .json file, hf:DIR (a datasets "
                                                                 "save_to_disk directory), or a token store"),
    ("data-txt-too-short", data_file("short.txt", "only ten b"), "--data"),
    ("data-txt-not-utf8", data_file("binary.txt", b"\xff\xfe" * 200), "--data"),
    ("data-dir-without-text", empty_dir, "--data"),
    ("data-txt-one-sequence-no-val-room", lambda tmp: [*data_file("one.txt", TEXT[:17])(tmp), "--val-fraction", "0.05"],
     "--val-fraction"),
    ("data-empty-jsonl", data_file("empty.jsonl", b""), "--data"),
    ("data-blank-jsonl", data_file("blank.jsonl", "\n  \n\n"), "--data"),
    ("data-jsonl-not-json", data_file("bad.jsonl", '{"text": "hello there"}\n{"text": "fine too"}\n{oops\n'),
     "bad.jsonl:3"),
    ("data-jsonl-no-text", data_file("notext.jsonl", '{"text": "hello there"}\n{"label": 1}\n'), "notext.jsonl:2"),
    ("data-jsonl-completion-not-string",
     data_file("comp.jsonl", '{"prompt": "2+2=", "completion": "4!"}\n{"prompt": "1+1=", "completion": 2}\n'),
     "comp.jsonl:2"),
    ("data-jsonl-not-object", data_file("list.jsonl", '["text", "hello"]\n'), "list.jsonl:1"),
    ("data-jsonl-prompt-without-completion",
     data_file("half.jsonl", '{"text": "abc", "prompt": "a"}\n'), "half.jsonl:1"),
    ("data-jsonl-nested-too-deeply",
     data_file("deep.jsonl", '{"text": "fine text"}\n' + "[" * 100_000 + "]" * 100_000 + "\n"), "deep.jsonl:2"),
    ("data-jsonl-lone-surrogate",
     data_file("surrogate.jsonl", '{"text": "fine text"}\n{"prompt": "a", "completion": "b \\ud800 c"}\n'),
     "surrogate.jsonl:2"),
    ("data-named-pipe", fifo("--data", "pipe.txt"), "named pipe"),
    ("data-jsonl-named-pipe", fifo("--data", "pipe.jsonl"), "named pipe"),
    # Issue 30: examples longer than --seq-len (16 here) follow --too-long.
    ("too-long-unknown", flags("--too-long", "cut"), "--too-long: 'cut' is not one of skip, truncate, error"),
    ("data-jsonl-too-long-error",
     lambda tmp: ["--data", str(_write(tmp, "long.jsonl", '{"text": "fits"}\n{"prompt": "a prompt longer than sixteen '
                                                          'bytes", "completion": "x"}\n')), "--too-long", "error",
                  *FAST], "long.jsonl:2: the example has 36 bytes, more than the 17"),
    ("data-jsonl-every-example-too-long",
     data_file("all-long.jsonl", '{"text": "a text longer than sixteen bytes"}\n'), "or --too-long truncate"),
    ("data-link-to-dev-zero", link_to_dev_zero("--data", "zero.txt"), "character device"),
    ("out-name-not-utf8", lambda tmp: ["--out", str(tmp / "run-\udcff"), *FAST], "--out"),
    ("model-config-negative-size",
     flags("--model", "hf:llama", "--model-config", "max_position_embeddings=-5", "--model-config", "hidden_size=32"),
     "--model-config"),
    # A family whose forward trims its logits after the head: the chunked loss cannot reproduce it (issue 26).
    ("loss-chunk-tokens-model-post-processes-logits",
     flags("--model", "hf:inkling2_text", "--loss-chunk-tokens", "64", *(f"--model-config={key}={value}" for key, value in (
         ("hidden_size", 32), ("num_hidden_layers", 1), ("num_attention_heads", 2), ("num_key_value_heads", 1),
         ("head_dim", 16), ("intermediate_size", 64), ("vocab_size", 512)))),
     "--loss-chunk-tokens: hf:inkling2_text: inkling2_text trims its padded vocabulary after the head"),
    # ---------------------------------------------------------------- --config
    ("config-missing", lambda tmp: ["--config", str(tmp / "nope.toml"), *FAST], "--config"),
    ("config-invalid-toml", config_file("lr = \n[[[\n"), "--config"),
    ("config-unknown-key", config_file("learning_rate = 0.1\n"), "--config"),
    ("config-wrong-type", config_file('lr = "fast"\n'), "lr"),
    ("config-float-for-int", config_file("micro_batch_size = 2.5\n"), "micro_batch_size"),
    ("config-bool-for-int", config_file("max_steps = true\n"), "max_steps"),
    ("config-is-directory", lambda tmp: ["--config", str(tmp), *FAST], "--config"),
    ("config-valid-but-bad-value", config_file("lr = -0.5\n"), "--lr"),
    ("config-named-pipe", fifo("--config", "pipe.toml"), "--config"),
    ("config-link-to-dev-zero", link_to_dev_zero("--config", "zero.toml"), "--config"),
]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _check_error_output(stderr: str, stdout: str, expected: str) -> list[str]:
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    lines = _error_lines(stderr)
    assert lines, "no error was printed"
    for line in lines:
        assert line.startswith(ERROR_PREFIX), f"not an error line: {line!r}"
    assert expected in stderr, f"{expected!r} not named in:\n{stderr}"
    return lines


@pytest.mark.parametrize(("builder", "expected"), [pytest.param(b, e, id=i) for i, b, e in CASES])
def test_bad_input_is_one_line_per_problem_exit_2_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], builder: Builder, expected: str
) -> None:
    out = tmp_path / "run"
    args = builder(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    status = main(["train", "--out", str(out), *args])
    captured = capsys.readouterr()
    assert status == 2, captured.err
    _check_error_output(captured.err, captured.out, expected.replace("{tmp}", str(tmp_path)))
    assert not out.exists(), "the run directory was created for bad input"
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "bad input wrote something next to the inputs"


PLAN = ["--model", "gpt-tiny", "--seq-len", "16", "--memory-budget", "1GiB"]
# (id, command, builder, substring naming the flag): other commands' bad input, run as `COMMAND --out <tmp>/run ...`.
COMMAND_CASES: list[tuple[str, str, Builder, str]] = [
    ("plan-adaptive-without-range", "plan", flags(*PLAN, "--effective-batch-size", "adaptive", fast=False),
     "--effective-batch-size: adaptive runs between --min-effective-batch-size and --max-effective-batch-size"),
    ("plan-adaptive-without-maximum", "plan",
     flags(*PLAN, "--effective-batch-size", "adaptive", "--min-effective-batch-size", "8", fast=False),
     "--max-effective-batch-size: is required"),
    # No micro-batch serves a minimum of 1: a window of one micro-batch has no noise scale on one process.
    ("plan-adaptive-minimum-no-micro-batch-serves", "plan",
     flags(*PLAN, "--effective-batch-size", "adaptive", "--min-effective-batch-size", "1",
           "--max-effective-batch-size", "8", fast=False), "--min-effective-batch-size: 1 is one micro-batch"),
    ("plan-adaptive-minimum-not-a-multiple-of-the-micro-batch", "plan",
     flags(*PLAN, "--effective-batch-size", "adaptive", "--min-effective-batch-size", "8",
           "--max-effective-batch-size", "32", "--micro-batch-size", "3", fast=False),
     "--min-effective-batch-size: 8 is not a multiple of --micro-batch-size"),
    ("plan-branch-test-with-a-fixed-batch", "plan",
     flags(*PLAN, "--effective-batch-size", "8", "--batch-branch-test", "2", fast=False),
     "--batch-branch-test: applies only with --effective-batch-size adaptive"),
    ("plan-noise-scale-windows-with-adaptive", "plan",
     flags(*PLAN, "--effective-batch-size", "adaptive", "--min-effective-batch-size", "8",
           "--max-effective-batch-size", "32", "--noise-scale-windows", "4", fast=False),
     "--noise-scale-windows: is for --effective-batch-size auto"),
    ("profile-adaptive-plan", "profile", adaptive_plan("--steps", "3", fast=[]),
     "plans an adaptive effective batch, which only cadence train runs"),
]


@pytest.mark.parametrize(("command", "builder", "expected"), [pytest.param(c, b, e, id=i)
                                                              for i, c, b, e in COMMAND_CASES])
def test_other_commands_bad_input_is_one_line_exit_2_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, builder: Builder, expected: str
) -> None:
    out = tmp_path / "run"
    args = builder(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    status = main([command, "--out", str(out), *args])
    captured = capsys.readouterr()
    assert status == 2, captured.err
    lines = _check_error_output(captured.err, captured.out, expected)
    assert len(lines) == 1, lines
    assert not out.exists(), "the output directory was created for bad input"
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "bad input wrote something next to the inputs"


def test_at_least_twenty_rows() -> None:
    assert len(CASES) >= 20


def test_out_is_an_existing_file_is_left_untouched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.write_text("precious\n")
    status = main(["train", "--out", str(out), *FAST])
    captured = capsys.readouterr()
    assert status == 2
    _check_error_output(captured.err, captured.out, "--out")
    assert out.is_file() and out.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_out_is_a_non_empty_directory_is_left_untouched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("precious\n")
    status = main(["train", "--out", str(out), *FAST])
    captured = capsys.readouterr()
    assert status == 2
    _check_error_output(captured.err, captured.out, "--out")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious\n"


def test_every_problem_is_reported_in_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    status = main(["train", "--out", str(out), *FAST, "--micro-batch-size", "0", "--precision", "fp8", "--lr", "-1",
                   "--lr-schedule", "step", "--val-fraction", "0.9"])
    captured = capsys.readouterr()
    assert status == 2
    lines = _check_error_output(captured.err, captured.out, "--micro-batch-size")
    for name in ("--micro-batch-size", "--precision", "--lr", "--lr-schedule", "--val-fraction"):
        assert sum(line.startswith(f"{ERROR_PREFIX} {name}:") for line in lines) == 1, (name, lines)
    assert len(lines) == 5, lines
    assert not out.exists()


def test_every_bad_jsonl_line_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path, "mixed.jsonl", '{"text": "good line"}\nnope\n{"text": 3}\n\n{"prompt": "p"}\n')
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data", str(data), *FAST]) == 2
    captured = capsys.readouterr()
    lines = _check_error_output(captured.err, captured.out, "mixed.jsonl:2")
    prefix = f"{ERROR_PREFIX} {data}:"
    assert all(line.startswith(prefix) for line in lines), lines
    assert [line[len(prefix):].split(":", 1)[0] for line in lines] == ["2", "3", "5"], lines
    assert not out.exists()


def test_config_problems_are_all_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path, "cfg.toml", 'lr = "fast"\nfoo = 1\nmax_steps = 2.0\n')
    assert main(["train", "--out", str(tmp_path / "run"), "--config", str(config)]) == 2
    captured = capsys.readouterr()
    lines = _check_error_output(captured.err, captured.out, "--config")
    assert len(lines) == 3, lines
    assert any("'foo'" in line for line in lines)
    assert any(": lr:" in line for line in lines)
    assert any(": max_steps:" in line for line in lines)
    assert not (tmp_path / "run").exists()


def test_installed_console_script_maps_usage_error_to_exit_2(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "cadence"
    assert script.exists(), f"console script not installed next to {sys.executable}"
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [str(script), "train", "--out", str(out), *FAST, "--lr", "abc", ], capture_output=True, text=True,
        timeout=120, env=env, cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = _error_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX) and "--lr" in lines[0], result.stderr
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ edge cases
def test_out_below_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = _write(tmp_path, "blocker", "x")
    data = _write(tmp_path, "text.txt", TEXT)
    status = main(["train", "--out", str(blocker / "run"), "--data", str(data), *FAST])
    captured = capsys.readouterr()
    assert status == 2
    _check_error_output(captured.err, captured.out, "--out")


def test_seed_too_large_for_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path, "text.txt", TEXT)
    status = main(["train", "--out", str(tmp_path / "run"), "--data", str(data), *FAST, "--seed", str(2**64)])
    captured = capsys.readouterr()
    assert status == 2
    _check_error_output(captured.err, captured.out, "--seed")
    assert not (tmp_path / "run").exists()


def test_click_type_error_has_the_where_message_form(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--out", str(tmp_path / "run"), *FAST, "--lr", "abc"]) == 2
    assert capsys.readouterr().err.startswith(f"{ERROR_PREFIX} --lr: ")


@pytest.mark.parametrize("content", ["a,b\n1,2\n", "text\n" + "\n" * 3])
def test_a_failed_datasets_load_leaves_no_temporary_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    """A failed build leaves no store (not even a half one) in --data-cache and no temporary Arrow copies."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where tempfile.mkdtemp puts folders
    data = _write(tmp_path, "table.csv", content)
    cache = tmp_path / "cache"
    assert main(["train", "--out", str(tmp_path / "run"), "--data", str(data), "--data-cache", str(cache), *FAST]) == 2
    assert capsys.readouterr().err.startswith("cadence: error:")
    assert list(scratch.iterdir()) == []
    assert list((cache / "stores").iterdir()) == [] and list((cache / "sources").iterdir()) == []
    assert not (tmp_path / "run").exists()


def test_resume_into_a_directory_that_is_not_a_run_is_refused_and_left_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("config.json", "notes.txt"):  # a config.json that is not cadence's
        (out / name).write_text('{"lr": "mine"}')
    (out / "model.safetensors").write_bytes(b"precious")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    status = main(["train", "--out", str(out), "--resume", *FAST])
    assert status == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert "--out" in capsys.readouterr().err


SETPRIV = shutil.which("setpriv")


@pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0, reason="needs util-linux setpriv, as root")
@pytest.mark.parametrize("unreadable", ["file", "directory"])
def test_unreadable_parts_of_a_data_directory_are_named_not_skipped(tmp_path: Path, unreadable: str) -> None:
    """Root reads every file, so the run drops the capabilities that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
    then a mode-000 file or directory is as unreadable to it as to any user."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "ok.txt").write_bytes(TEXT)
    (data / "sub" / "more.txt").write_bytes(TEXT)
    secret = data / "secret.txt" if unreadable == "file" else data / "sub"
    if unreadable == "file":
        secret.write_bytes(TEXT)
    secret.chmod(0o000)
    try:
        result = subprocess.run(
            [SETPRIV, "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search",
             sys.executable, "-c", "import sys; from cadence.cli import main; sys.exit(main(sys.argv[1:]))",
             "train", "--data", str(data), "--out", str(tmp_path / "run"), *FAST],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        secret.chmod(0o755)
    assert result.returncode == 2, result.stderr
    lines = _check_error_output(result.stderr, result.stdout, "--data")
    assert any(str(secret) in line and "permission denied" in line for line in lines), result.stderr
    assert not (tmp_path / "run").exists()
