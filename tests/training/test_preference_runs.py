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


def test_a_dpo_run_logs_trls_metrics_window_wide_and_records_its_objective(tmp_path):
    data = write_preference_jsonl(tmp_path / "pairs.jsonl", 16)
    status, out, err = run_cli(["train", "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--out",
                                str(tmp_path / "run"), "--objective", "dpo", "--beta", "0.2", "--seq-len", "64",
                                "--micro-batch-size", "2", "--grad-accum-steps", "2", "--max-steps", "2"])
    assert status == 0, err
    rows = read_metrics(tmp_path / "run")
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
