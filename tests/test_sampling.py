"""Issue 30 item 7: `cadence sample RUN_DIR --prompt TEXT` generates from a run's final, best or checkpointed
weights: the built-in GPT (bytes) and a transformers model, whose greedy text is transformers' own generate's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_cli, write_jsonl

from cadence.cli import main
from cadence.sampling import SampleOptions, generate, load_run

LLAMA = ["--model", "hf:llama", *[arg for key, value in {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 256,
    "max_position_embeddings": 128}.items() for arg in ("--model-config", f"{key}={value}")]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sample")
    data = write_jsonl(root / "data.jsonl", 32)
    common = ["--data", str(data), "--seq-len", "64", "--too-long", "truncate", "--micro-batch-size", "4",
              "--max-steps", "4", "--eval-every", "2", "--keep-best", "--checkpoint-every", "2"]
    for name, model in (("gpt", ["--model", "gpt-tiny"]), ("llama", LLAMA)):
        assert main(["train", *model, *common, "--out", str(root / name)]) == 0
    return {"gpt": root / "gpt", "llama": root / "llama"}


def test_greedy_sampling_is_the_same_text_every_time_and_names_its_weights(runs, capsys) -> None:
    argv = ["sample", str(runs["gpt"]), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert main(argv) == 0
    second = capsys.readouterr()
    assert first.out == second.out and first.out.strip("\n") != ""
    assert f"weights: {runs['gpt'] / 'model.safetensors'}" in first.err
    for weights, path in (("best", "best/model.safetensors"), ("step-2", "checkpoints/step-2/model.safetensors")):
        assert main([*argv, "--weights", weights]) == 0
        assert str(runs["gpt"] / path) in capsys.readouterr().err


def test_a_seed_fixes_sampled_text(runs) -> None:
    run = load_run(runs["gpt"])
    texts = [generate(run, SampleOptions(prompt="import", max_new_tokens=16, temperature=1.0, seed=seed))[1]
             for seed in (1, 1, 2)]
    assert texts[0] == texts[1] and len(texts[0]) >= 1


def test_a_transformers_run_greedy_matches_transformers_generate(runs) -> None:
    run = load_run(runs["llama"])
    _, ids, ended = generate(run, SampleOptions(prompt="Q: ", max_new_tokens=10, temperature=0))
    prompt = torch.tensor([list(b"Q: ")])
    expected = run.model.generate(prompt, max_new_tokens=len(ids) + (1 if ended else 0), do_sample=False,
                                  eos_token_id=4, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert expected[:len(ids)] == ids and (not ended or expected[len(ids)] == 4)


@pytest.mark.parametrize(("extra", "flag"), [
    (["--weights", "step-99"], "--weights"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"), (["--top-k", "-1"], "--top-k")])
def test_bad_sample_options_name_their_flag(runs, extra, flag) -> None:
    status, _, err = run_cli(["sample", str(runs["gpt"]), "--prompt", "x", *extra])
    assert status == 2 and flag in err and "Traceback" not in err


def test_a_directory_that_is_not_a_run_is_refused(tmp_path) -> None:
    status, _, err = run_cli(["sample", str(tmp_path), "--prompt", "x"])
    assert status == 2 and "not a cadence run directory" in err
