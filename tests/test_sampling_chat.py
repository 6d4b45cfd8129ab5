"""Issue 37 item 6: `cadence sample --message` on a chat-trained run: the conversation rendered with the run's chat
template and its generation prompt, generation stopped at the end of the assistant's turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from cadence.cli import main
from cadence.sampling import SampleOptions, chat_prompt, conversation_messages, generate, load_run

pytest.importorskip("jinja2")

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat_run")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(16)))
    assert main(["train", "--data", str(data), "--seq-len", "128", "--micro-batch-size", "4", "--grad-accum-steps",
                 "1", "--max-steps", "2", "--val-fraction", "0", "--out", str(root / "run")]) == 0
    return root / "run"


def test_messages_are_rendered_with_the_run_s_template_and_its_generation_prompt(chat_run: Path) -> None:
    run = load_run(chat_run)
    options = SampleOptions(message=["system: be brief", "hi"])
    ids, ends = chat_prompt(run, conversation_messages(options))
    assert bytes(ids).decode() == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    assert "<|im_end|>" in ends


class _Scripted(torch.nn.Module):
    """Emits the bytes of ``script`` one after another (whatever the context): generation's stopping, seen alone."""

    def __init__(self, script: bytes) -> None:
        super().__init__()
        self.script, self.start = script, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.start = ids.shape[1] if self.start is None else self.start
        logits = torch.full((1, ids.shape[1], 256), -1e9)
        logits[0, -1, self.script[ids.shape[1] - self.start]] = 0.0
        return logits


def test_generation_stops_at_the_end_of_the_turn(chat_run: Path) -> None:
    run = load_run(chat_run)
    run.model = _Scripted(b"fine, thanks<|im_end|>\n<|im_start|>user\nmore")
    options = SampleOptions(message=["hi"], temperature=0, max_new_tokens=40)
    ids, ends = chat_prompt(run, conversation_messages(options))
    text, _, ended = generate(run, options, ids, ends)
    assert (text, ended) == ("fine, thanks", True)


def test_sample_message_end_to_end_and_its_bad_input(chat_run: Path, tmp_path: Path) -> None:
    status, out, err = run_cli(["sample", str(chat_run), "--message", "hi", "--temperature", "0",
                                "--max-new-tokens", "8"])
    assert status == 0, err
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps([{"role": "robot", "content": "x"}]))
    for argv, flag in ((["--messages-file", str(bad)], "--messages-file"),
                       (["--message", "hi", "--prompt", "x"], "--prompt"),
                       (["--message", "hi", "--messages-file", str(bad)], "--message")):
        status, _, err = run_cli(["sample", str(chat_run), *argv])
        assert status == 2 and flag in err and "Traceback" not in err, err
