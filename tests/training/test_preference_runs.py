"""`cadence train --objective dpo|ipo|simpo|orpo|kto` (issue 52): bad preference input is one line per problem, exit
2 and nothing written; a run logs TRL's metrics window-wide; and with --reference-model (weights differing from the
policy's) the first step's DPO loss is an independent computation's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli, write_preference_jsonl

from cadence.training.run_dir import read_metrics

FAST = ["--max-steps", "1", "--seq-len", "64", "--micro-batch-size", "2"]
PROMPT = [{"role": "user", "content": "hi"}]
ANSWER = [{"role": "assistant", "content": "hello"}]

ROWS = {
    "empty chosen": ([{"prompt": "q:", "chosen": "", "rejected": "no"}], ["--objective", "dpo"],
                     'rows.jsonl:1: "chosen" is empty'),
    "empty rejected": ([{"prompt": "q:", "chosen": "yes", "rejected": ""}], ["--objective", "ipo"],
                       'rows.jsonl:1: "rejected" is empty'),
    "chosen equals rejected everywhere": ([{"prompt": "q:", "chosen": "same", "rejected": "same"}] * 3,
                                          ["--objective", "dpo"], "--data: "),
    "a row missing a field": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}, {"prompt": "q:", "chosen": "y"}],
                              ["--objective", "dpo"], 'rows.jsonl:2: has no "rejected"'),
    "a label that is not a boolean": ([{"prompt": "q:", "completion": "yes", "label": "good"}], ["--objective", "kto"],
                                      'rows.jsonl:1: "label" is \'good\''),
    "a prompt ending with an assistant turn": (
        [{"prompt": PROMPT + ANSWER, "chosen": ANSWER, "rejected": [{"role": "assistant", "content": "bye"}]}],
        ["--objective", "dpo"], "rows.jsonl:1: \"prompt\" ends with an assistant turn"),
    "kto on pairs": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}], ["--objective", "kto"],
                     "--objective: kto trains on unpaired rows"),
    "dpo on prompt/completion rows": ([{"prompt": "q:", "completion": "yes"}], ["--objective", "dpo"],
                                      "--objective: dpo trains on preference pairs"),
    "sft on pairs": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}], [], "--objective: sft trains on"),
    "a reference for simpo": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}],
                              ["--objective", "simpo", "--reference-model", "{tmp}"], "--reference-model: "),
    "precomputed log-probabilities for simpo": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}],
                                                ["--objective", "simpo", "--reference-logprobs", "precomputed"],
                                                "--reference-logprobs: precomputed: --objective simpo has no reference"),
    "precomputed log-probabilities for orpo": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}],
                                               ["--objective", "orpo", "--reference-logprobs", "precomputed"],
                                               "--reference-logprobs: precomputed: --objective orpo has no reference"),
    "precomputed log-probabilities under LoRA": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}],
                                                 ["--model", "hf:llama", "--objective", "dpo", "--lora-rank", "4",
                                                  "--reference-logprobs", "precomputed"],
                                                 "--reference-logprobs: precomputed is unnecessary with --lora-rank"),
    "dpo on KTO rows": ([{"prompt": "q:", "completion": "yes", "label": True}], ["--objective", "dpo"],
                        "--objective: dpo trains on preference pairs"),
    "kto on text rows": ([{"text": "hello"}], ["--objective", "kto"], "--objective: kto trains on unpaired rows"),
    "a label that is a number": ([{"prompt": "q:", "completion": "yes", "label": 1}], ["--objective", "kto"],
                                 'rows.jsonl:1: "label" is 1'),
    "an empty conversational rejected": ([{"prompt": PROMPT, "chosen": ANSWER, "rejected": []}],
                                         ["--objective", "dpo"], 'rows.jsonl:1: "rejected" is empty'),
    "a row of the other format": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"},
                                   {"prompt": "q:", "completion": "yes", "label": True}], ["--objective", "dpo"],
                                  "rows.jsonl:2: is not a preference pair"),
    "a margin for dpo": ([{"prompt": "q:", "chosen": "yes", "rejected": "no"}],
                         ["--objective", "dpo", "--simpo-gamma", "1"], "--simpo-gamma: applies to --objective simpo"),
}


@pytest.mark.parametrize("case", list(ROWS))
def test_bad_preference_input_is_one_line_exit_2_nothing_written(tmp_path, case):
    rows, flags, expected = ROWS[case]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    status, out, err = run_cli(["train", "--data", str(data), "--data-cache", str(tmp_path / "cache"),
                                "--out", str(tmp_path / "run"), *FAST,
                                *(flag.replace("{tmp}", str(tmp_path)) for flag in flags)])
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("cadence: error: ") and expected in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_dpo_run_logs_trls_metrics_window_wide_evaluates_held_out_pairs_and_plots_them(tmp_path):
    data = write_preference_jsonl(tmp_path / "pairs.jsonl", 20)
    status, out, err = run_cli(["train", "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--out",
                                str(tmp_path / "run"), "--objective", "dpo", "--beta", "0.2", "--seq-len", "64",
                                "--micro-batch-size", "2", "--grad-accum-steps", "2", "--max-steps", "2",
                                "--eval-every", "1", "--val-fraction", "0.2", "--keep-best"])
    assert status == 0, err
    rows = read_metrics(tmp_path / "run")
    # The 4 held-out pairs' DPO loss and rewards (after each step: the policy has moved from the reference).
    assert rows[0]["val_loss"] != pytest.approx(0.6931471805599453, rel=1e-6) and "val_rewards/margins" in rows[1]
    assert (tmp_path / "run" / "best" / "best.json").is_file()
    assert run_cli(["report", str(tmp_path / "run")])[0] == 0
    assert (tmp_path / "run" / "report-rewards.png").is_file()
    assert rows[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)  # the policy is the reference at step 1
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert name in rows[1]
    assert rows[1]["rewards/margins"] == pytest.approx(rows[1]["rewards/chosen"] - rows[1]["rewards/rejected"])
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["objective"] == "dpo" and config["beta"] == 0.2
    assert "sigmoid DPO (beta 0.2)" in out + err


def _llama_directory(path: Path, seed: int) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _summed_logps(model: torch.nn.Module, ids: list[int], start: int) -> torch.Tensor:
    """By hand: the summed log-probability of tokens ids[start:] given the ones before them."""
    logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    targets = torch.tensor(ids[1:])
    return logits.log_softmax(-1).gather(1, targets[:, None])[start - 1:].sum()


def test_with_a_reference_model_the_first_dpo_loss_is_the_independent_computation(tmp_path):
    """Summed log-probabilities over each completion's tokens (and its end of sequence), the pair mean over the whole
    window (all 6 pairs: micro-batches of 2, accumulation 3), against a reference of other weights."""
    transformers = pytest.importorskip("transformers")
    policy_dir, reference_dir = _llama_directory(tmp_path / "policy", 0), _llama_directory(tmp_path / "reference", 1)
    data = write_preference_jsonl(tmp_path / "pairs.jsonl", 6)
    status, _, err = run_cli(["train", "--model", str(policy_dir), "--reference-model", str(reference_dir),
                              "--objective", "dpo", "--data", str(data), "--data-cache", str(tmp_path / "cache"),
                              "--out", str(tmp_path / "run"), "--seq-len", "64", "--micro-batch-size", "2",
                              "--grad-accum-steps", "3", "--max-steps", "1"])
    assert status == 0, err
    policy = transformers.LlamaForCausalLM.from_pretrained(policy_dir).eval()
    reference = transformers.LlamaForCausalLM.from_pretrained(reference_dir).eval()
    losses = []
    with torch.no_grad():
        for line in data.read_text().splitlines():
            row = json.loads(line)
            prompt = list(row["prompt"].encode())
            chosen, rejected = (prompt + list(row[k].encode()) + [4] for k in ("chosen", "rejected"))
            margin = (_summed_logps(policy, chosen, len(prompt)) - _summed_logps(reference, chosen, len(prompt))) - (
                _summed_logps(policy, rejected, len(prompt)) - _summed_logps(reference, rejected, len(prompt)))
            losses.append(-F.logsigmoid(0.1 * margin))
    [row] = read_metrics(tmp_path / "run")
    assert row["loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-6)


def _train(tmp_path: Path, out: str, *extra: str) -> list[dict]:  # type: ignore[type-arg]
    status, _, err = run_cli(["train", "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / out),
                              "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "2", *extra])
    assert status == 0, err
    return read_metrics(tmp_path / out)


@pytest.mark.parametrize("objective", ["dpo", pytest.param("kto", marks=pytest.mark.slow)])
def test_a_resumed_preference_run_is_bitwise_the_uninterrupted_one(tmp_path, objective):
    """The reference (a frozen copy of the starting weights, made before the checkpoint is loaded) and KTO's
    window-wide reference point are the uninterrupted run's."""
    import shutil

    from safetensors.torch import load_file

    data = write_preference_jsonl(tmp_path / "rows.jsonl", 24, unpaired=objective == "kto")
    common = ["--data", str(data), "--objective", objective, "--max-steps", "4", "--checkpoint-every", "2"]
    whole = _train(tmp_path, "whole", *common)
    _train(tmp_path, "cut", *common)
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "step-4")  # as if killed right after step 2
    resumed = _train(tmp_path, "cut", *common, "--resume")
    assert [row["loss"] for row in resumed] == [row["loss"] for row in whole]
    assert [row.get("rewards/chosen") for row in resumed] == [row.get("rewards/chosen") for row in whole]
    cut, uncut = load_file(str(tmp_path / "cut" / "model.safetensors")), load_file(str(tmp_path / "whole" /
                                                                                       "model.safetensors"))
    assert all(torch.equal(cut[name], uncut[name]) for name in uncut)


@pytest.mark.slow  # four runs of 4 steps (about 25 s for dpo)
@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_precomputed_reference_logprobs_are_the_live_losses_kept_beside_the_store_and_reused(tmp_path, objective):
    """--reference-logprobs precomputed: one pass before step 1 over the train and validation sequences, the file
    beside the token store; the losses, the rewards and the evaluation are the live frozen copy's (1e-6, rewards 1e-5 absolute); a later run
    and a resume find every row (0 batches scored) and give the same losses again."""
    import shutil

    data = write_preference_jsonl(tmp_path / "rows.jsonl", 24, unpaired=objective == "kto")
    common = ["--data", str(data), "--objective", objective, "--max-steps", "4", "--val-fraction", "0.25",
              "--eval-every", "2", "--checkpoint-every", "2"]
    live = _train(tmp_path, "live", *common)
    runs = {}
    for out in ("first", "again"):
        status, said, err = run_cli(["train", "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / out),
                                     "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "2",
                                     *common, "--reference-logprobs", "precomputed"])
        assert status == 0, err
        runs[out] = (read_metrics(tmp_path / out), said + err)
    [record] = list((tmp_path / "cache").rglob("reference-logps/*.safetensors"))
    assert "0 of 3 batches found beside the token store" in runs["first"][1]  # 18 samples, 8 a batch
    assert "3 of 3 batches found beside the token store" in runs["again"][1]
    def values(metrics: list[dict], key: str) -> list[float]:  # type: ignore[type-arg]
        return [row[key] for row in metrics if row.get(key) is not None]

    for key in ("loss", "rewards/chosen", "rewards/rejected", "val_loss"):
        assert len(values(live, key)) >= (2 if key == "val_loss" else 4), key
        for metrics, _ in runs.values():
            # A reward is beta x (policy - reference) log-probabilities summed over a sequence (about -200 here): the
            # precomputed pass scores other batch shapes, so the two sums may differ in fp32 rounding (1e-7 x 200 x
            # beta ~ 1e-6 absolute), which against step 1's reward of exactly 0 no relative tolerance absorbs.
            assert values(metrics, key) == pytest.approx(values(live, key), rel=1e-6, abs=1e-5), key
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step-4")  # as if killed right after step 2
    status, said, err = run_cli(["train", "--data-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "again"),
                                 "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "2", *common,
                                 "--reference-logprobs", "precomputed", "--resume"])
    assert status == 0, err
    assert "3 of 3 batches found" in said + err and record.exists()
    assert [row["loss"] for row in read_metrics(tmp_path / "again")] == [row["loss"] for row in runs["first"][0]]


def test_under_lora_the_reference_is_the_base_with_the_adapters_off(tmp_path):
    """No copy of the base: the same losses as a run scored against a frozen copy of that base (--reference-model
    naming the same directory), step after step."""
    pytest.importorskip("peft")
    base = _llama_directory(tmp_path / "base", 0)
    data = write_preference_jsonl(tmp_path / "pairs.jsonl", 12)
    common = ["--model", str(base), "--data", str(data), "--objective", "dpo", "--lora-rank", "4", "--lr", "1e-2",
              "--max-steps", "3"]
    adapters_off = _train(tmp_path, "adapters-off", *common)
    frozen_copy = _train(tmp_path, "frozen-copy", *common, "--reference-model", str(base))
    assert adapters_off[0]["loss"] == pytest.approx(0.6931471805599453, rel=1e-6)  # adapters start at zero
    assert [row["loss"] for row in adapters_off] == pytest.approx([row["loss"] for row in frozen_copy], rel=1e-6)
    assert adapters_off[-1]["loss"] != pytest.approx(adapters_off[0]["loss"], rel=1e-3)  # the adapters did move


@pytest.mark.parametrize(("objective", "ranks"), [("dpo", []), pytest.param("kto", ["--nproc-per-node", "2"],
                                                                              marks=pytest.mark.slow)])
def test_verify_checks_the_objective_on_its_splits_and_ranks(tmp_path, objective, ranks):
    """The window's gradient under micro-batches of one pair (and two ranks) against the whole window in one pass,
    the objective's own: its reference attached, its units and KTO's reference point over the window."""
    import subprocess
    import sys

    data = write_preference_jsonl(tmp_path / "rows.jsonl", 16, unpaired=objective == "kto")
    args = ["verify", "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--objective", objective,
            "--seq-len", "64", "--micro-batch-size", "1", "--grad-accum-steps", "2" if ranks else "4", "--steps", "1",
            *ranks]
    if ranks:  # the launcher starts the ranks as processes of their own
        result = subprocess.run([sys.executable, "-m", "cadence", *args], capture_output=True, text=True,
                                timeout=600)
        status, out, err = result.returncode, result.stdout, result.stderr
    else:
        status, out, err = run_cli(args)
    assert status == 0, err[-2000:]
    assert "PASS" in out and "gradient relative error" in out


def test_verify_checks_precomputed_reference_logprobs_on_its_splits(tmp_path):
    """verify with --reference-logprobs precomputed: the looked-up log-probabilities under micro-batches of one pair
    give the whole window's gradient."""
    data = write_preference_jsonl(tmp_path / "rows.jsonl", 8)
    status, out, err = run_cli(["verify", "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--objective",
                                "dpo", "--reference-logprobs", "precomputed", "--seq-len", "64", "--micro-batch-size",
                                "1", "--grad-accum-steps", "4", "--steps", "1"])
    assert status == 0, err[-2000:]
    assert "PASS" in out and list((tmp_path / "cache").rglob("reference-logps/*.safetensors"))


@pytest.mark.slow  # two gloo processes, twice
def test_two_ranks_with_precomputed_reference_logprobs_give_the_live_losses(tmp_path):
    """Each rank scores the splits before step 1 (rank 0 writes the file); KTO's window-wide reference point over both
    ranks reads the looked-up values: the losses of the live frozen copy on two ranks (1e-6)."""
    import os
    import subprocess
    import sys

    data = write_preference_jsonl(tmp_path / "rows.jsonl", 24, unpaired=True)
    losses = {}
    for mode in ("live", "precomputed"):
        result = subprocess.run([sys.executable, "-m", "cadence", "train", "--nproc-per-node", "2", "--data", str(data),
                                 "--data-cache", str(tmp_path / "cache"), "--objective", "kto", "--reference-logprobs",
                                 mode, "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "2",
                                 "--max-steps", "3", "--out", str(tmp_path / mode)], capture_output=True, text=True,
                                timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        losses[mode] = [row["loss"] for row in read_metrics(tmp_path / mode)]
    assert len(losses["live"]) == 3 and losses["precomputed"] == pytest.approx(losses["live"], rel=1e-6)
    assert list((tmp_path / "cache").rglob("reference-logps/*.safetensors"))
