"""Issue 25: every command runs on every model train runs, with the same model, data and cut flags.

Once, profile and verify assembled the run their own way: `cadence profile --model DIR` ended in a KeyError,
`cadence verify --model DIR` called the directory an unknown model, and neither took --model-config, so hf:llama
could only be checked at its 6.7B default. Here each model kind (built-in, hf:llama and hf:gpt2 from --model-config,
a local save_pretrained directory) is profiled and verified, and each cut (drawn rows, by length, a token budget,
packing) is verified on a transformers model; a run report's suggested commands then run as printed."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from helpers import write_jsonl

from cadence.cli import main

LLAMA = ["--model", "hf:llama", *[item for pair in (("--model-config", f"{k}={v}") for k, v in {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
    "vocab_size": 256, "max_position_embeddings": 128}.items()) for item in pair]]
GPT2 = ["--model", "hf:gpt2", *[item for pair in (("--model-config", f"{k}={v}") for k, v in {
    "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 256, "n_positions": 128}.items()) for item in pair]]
BATCH = ["--seq-len", "64", "--micro-batch-size", "2", "--grad-accum-steps", "4"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> dict[str, object]:
    """The data and a local model directory written by `cadence train --save-hf`, made once for the module."""
    root = tmp_path_factory.mktemp("every-model")
    data = write_jsonl(root / "data.jsonl", 64)
    saved = root / "saved"
    assert main(["train", *LLAMA, "--data", str(data), *BATCH, "--max-steps", "1", "--val-fraction", "0",
                 "--data-cache", str(root / "cache"), "--out", str(root / "run"), "--save-hf", str(saved)]) == 0
    return {"root": root, "data": data, "cache": root / "cache", "models": {
        "built-in": ["--model", "gpt-tiny"], "hf-llama": LLAMA, "hf-gpt2": GPT2, "local-directory": ["--model", str(saved)]}}


@pytest.mark.parametrize("kind", ["built-in", "hf-llama", "hf-gpt2", "local-directory"])
def test_profile_and_verify_run_on_every_model_kind(workspace, kind, capsys):
    model = workspace["models"][kind]
    data = ["--data", str(workspace["data"]), "--data-cache", str(workspace["cache"])]
    out = workspace["root"] / f"profile-{kind}"
    assert main(["profile", *model, *data, *BATCH, "--steps", "1", "--out", str(out)]) == 0
    profile = json.loads((out / "profile.json").read_text())
    assert profile["model_flops_per_token"] > 0 and profile["tokens_per_s"] > 0
    assert main(["verify", *model, *data, *BATCH]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err


@pytest.mark.parametrize("cut", [["--micro-batch-order", "drawn"], ["--micro-batch-order", "by-length"],
                                 ["--micro-batch-tokens", "128"], ["--packing"]],
                         ids=["drawn", "by-length", "token-budget", "packing"])
@pytest.mark.parametrize("kind", ["hf-llama", "local-directory"])
def test_verify_passes_every_cut_on_transformers_models(workspace, kind, cut, capsys):
    model = workspace["models"][kind]
    assert main(["verify", *model, "--data", str(workspace["data"]), "--data-cache", str(workspace["cache"]),
                 *BATCH, *cut, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["relative_error"] < 1e-5


def test_a_run_report_s_suggested_commands_run_as_printed(workspace):
    root = workspace["root"]
    run = root / "run"
    assert main(["report", str(run)]) == 0
    report = (run / "report.md").read_text()
    commands = re.findall(r"`(cadence (?:profile|plan) [^`]*)`", report)
    assert len(commands) == 2 and all("--model-config hidden_size=64" in command for command in commands)
    profile = next(command for command in commands if command.startswith("cadence profile"))
    argv = shlex.split(profile)[1:]
    argv[argv.index("--out") + 1] = str(root / "suggested-profile")
    assert main([*argv, "--steps", "1", "--data-cache", str(workspace["cache"])]) == 0
    assert (root / "suggested-profile" / "profile.json").is_file()
