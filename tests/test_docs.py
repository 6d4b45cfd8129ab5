"""The README and docs/ stay true (issue 41): every code block in README.md and docs/*.md runs as written, or is a
declared fragment of a file a test runs.

- Every code block is fenced and says its language (no indented code blocks, so none escapes this test). ``json``,
  ``text`` and ``toml`` blocks are data and trees; ``python`` and ``sh`` blocks are run.
- ``python``: a page's blocks run in the page's order in one namespace of their own (a fresh one per page: a later
  block may continue an earlier one of the same page, never use a name from another page), in a temporary directory
  prepared as the recipes need it (``workspace``). A block whose first line is ``# fragment: see FILE for the whole
  example`` is not run: FILE must exist, hold the fragment's calls, and be run by a test.
- ``sh``: every line starting with ``cadence `` (a trailing backslash continues it; a ``#`` comment ends it) is split
  with shlex and run through ``cadence.cli.main`` in the page's directory, in the page's order, and must exit 0. So
  that the pages stay fast to check, ``CAPS[command]`` is appended to the line: click lets a flag given later win over
  the same flag given earlier, so a cap replaces the page's value (``--max-steps 500`` runs 2 steps, sequences of
  256 tokens are checked at 64) and leaves every other flag as written. A line with a ``# needs: WHAT`` comment (CUDA, several GPUs, several machines) is only parsed
  against the command line: every flag must exist and take its value, nothing runs. ``torchrun ... -m cadence ARGS``
  lines are parsed the same way. Other shell lines (``make``, ``.``, ``tensorboard``) are the quick start's, run by
  ``test_the_quick_start_lines_work_pasted_into_a_fresh_shell``.
- Relative links point at files that exist, and their ``#anchors`` at headings there.

The files a recipe names (``notes.txt``, ``train.jsonl``, ``chat.jsonl``, the preference rows ``pairs.jsonl`` and
``kto.jsonl``, the model directory ``my-model``,
``train.py`` for ``cadence audit``, and ``runs/demo`` as ``make demo`` leaves it, shorter) are in every page's
directory; ``my-model`` is a 2-layer, hidden-64 llama with a ChatML tokenizer built offline by ``tokenizers``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import torch
from helpers import sample_text, write_preference_jsonl

from cadence.cli import app, main
from cadence.config import TrainConfig, flag

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DATA_LANGUAGES = {"json", "text", "toml"}

FRAGMENT = re.compile(r"^# fragment: see (\S+) for the whole example$")
"""The first line of a code block that is only a part of a program (it uses names a whole program defines): the file
it names holds the whole program, and a test runs that file."""

NEEDS = re.compile(r"#\s*needs:\s*(.+)$")
"""A shell line this machine cannot run (``# needs: 4 GPUs``): checked against the command line only."""

CAPS: dict[str, list[str]] = {
    "train": ["--max-steps", "2", "--warmup-steps", "0"],
    # The plan's search, narrowed: one trial, one round, fp32 without recompute (an emulated bf16 probe alone takes
    # minutes on a CPU without bf16 instructions).
    "plan": ["--time-budget", "10", "--max-trials", "1", "--rounds", "1", "--quality-steps", "1", "--trial-steps", "3",
             "--precision", "fp32", "--activation-checkpointing", "none"],
    "profile": ["--steps", "1"],
    "verify": ["--steps", "1"],
    "sample": ["--max-new-tokens", "4"],
}
"""Appended to a page's ``cadence COMMAND`` line before it runs (a later flag wins); the commands not named here run
unchanged (``report``, ``prepare-data``, ``audit``, whose arguments after ``--`` are the script's)."""

SHORT = ["--seq-len", "64"]
"""Also appended to the commands that train or measure steps (train, plan, profile, verify): a recipe's sequences of
256 or 512 tokens checked at 64. Not where the length comes from elsewhere: ``--plan`` (the plan's, itself made at
64) and ``profile --compare`` (two profiles, no flags)."""


def capped(arguments: list[str]) -> list[str]:
    """The page's arguments with the caps after them."""
    command = arguments[0]
    if "--compare" in arguments:
        return arguments
    short = SHORT if command in ("train", "plan", "profile", "verify") and "--plan" not in arguments else []
    return [*arguments, *CAPS.get(command, []), *short]


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
          "+ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)} line {self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced code block of a page, in order (a fence may be indented inside a list item)."""
    lines = page.read_text().split("\n")
    found, number = [], 0
    while number < len(lines):
        stripped = lines[number].strip()
        if stripped.startswith("```"):
            indent = len(lines[number]) - len(lines[number].lstrip())
            end = next(k for k in range(number + 1, len(lines)) if lines[k].strip() == "```")
            body = "\n".join(line[indent:] for line in lines[number + 1:end]) + "\n"
            found.append(Block(page, number + 1, stripped[3:].strip(), body))
            number = end + 1
            continue
        number += 1
    return found


def indented_code(page: Path) -> list[int]:
    """Lines that open an indented (unfenced) code block: indented 4 or more after a blank line, outside fences, and
    not a nested list item."""
    lines, fenced, found = page.read_text().split("\n"), False, []
    for number, line in enumerate(lines):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        indent = len(line) - len(line.lstrip(" "))
        if (not fenced and line.strip() and indent >= 4 and number and not lines[number - 1].strip()
                and not re.match(r"\s*(- |\d+\. )", line)):
            found.append(number + 1)
    return found


def shell_commands(block: Block) -> list[tuple[str, str | None]]:
    """(command, needs) of each ``cadence`` or ``torchrun`` line of a shell block, continuation lines joined and the
    comment cut off; ``needs`` is the ``# needs:`` declaration or None."""
    joined, pending = [], ""
    for line in block.code.split("\n"):
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    commands = []
    for line in joined:
        if not line.startswith(("cadence ", "torchrun ")):
            continue
        needs = NEEDS.search(line)
        words = shlex.split(line, comments=True)
        commands.append((shlex.join(words), needs.group(1).strip() if needs else None))
    return commands


def cadence_arguments(command: str) -> list[str]:
    """The arguments after ``cadence`` (or after ``torchrun ... -m cadence``)."""
    words = shlex.split(command)
    if words[0] == "torchrun":
        return words[words.index("-m") + 2:]
    return words[1:]


def parses(arguments: list[str]) -> None:
    """click parses the line as the command would (unknown flags, bad values and missing arguments raise), without
    running it."""
    command = app.commands[arguments[0]]
    command.make_context(arguments[0], list(arguments[1:]))


# ------------------------------------------------------------------------------------------------ the workspace


def _conversations() -> list[dict]:
    pairs = [("Capital of France?", "Paris."), ("Capital of Italy?", "Rome."), ("2+2?", "4."), ("Say hi.", "hi!"),
             ("Colour of the sky?", "Blue."), ("Opposite of up?", "Down."), ("3+3?", "6."), ("Capital of Spain?",
                                                                                           "Madrid.")]
    rows = []
    for index in range(40):
        question, answer = pairs[index % len(pairs)]
        rows.append({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question},
                                  {"role": "assistant", "content": answer}]})
    return rows


def _prompt_completions() -> list[dict]:
    return [{"prompt": f"Q: what is {a}+{b}?\nA:", "completion": f" {a + b}"} for a in range(8) for b in range(8)]


def _model_directory(directory: Path) -> Path:
    """A 2-layer, hidden-64 llama saved with a BPE tokenizer trained here (ChatML template, eos <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps(row) for row in _conversations() + _prompt_completions()]
    backend.train_from_iterator(corpus * 2, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The files every page's directory starts with, made once."""
    base = tmp_path_factory.mktemp("docs_workspace")
    (base / "notes.txt").write_bytes(sample_text(60_000))
    (base / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _prompt_completions()))
    (base / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _conversations()))
    write_preference_jsonl(base / "pairs.jsonl", 32)
    write_preference_jsonl(base / "kto.jsonl", 32, unpaired=True)
    shutil.copy(ROOT / "tests" / "audit" / "cases" / "good_nanogpt_accumulation.py", base / "train.py")
    _model_directory(base / "my-model")
    status = main(["train", "--seq-len", "32", "--max-steps", "3", "--val-fraction", "0",
                   "--out", str(base / "runs" / "demo")])
    assert status == 0
    yield base


@pytest.fixture()
def workspace(template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh copy of the template for one page, as the working directory."""
    shutil.copytree(template, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------------------------------------------------- tests


def test_the_readme_is_under_250_lines() -> None:
    assert len(README.split("\n")) < 250, len(README.split("\n"))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_code_block_is_fenced_and_names_its_language(page: Path) -> None:
    assert not indented_code(page), f"{page.name}: indented code at lines {indented_code(page)}; fence it"
    for block in blocks(page):
        assert block.language in DATA_LANGUAGES | {"python", "sh"}, f"{block.where}: ```{block.language}"
        if block.language == "python" and not FRAGMENT.match(block.code.split("\n")[0]):
            ast.parse(block.code, filename=block.where)


def test_the_blocks_are_found() -> None:
    """The parser finds what the pages hold: the engine example and the fragment, the README's recipes, and the
    declared lines."""
    found = [block for page in PAGES for block in blocks(page)]
    python = [block.code for block in found if block.language == "python"]
    assert any(code.startswith("import torch\nfrom torch import nn\n\nfrom cadence import Cut, Engine, Example")
               for code in python)  # the prefetch example
    assert any(FRAGMENT.match(code.split("\n")[0]) for code in python)  # the distributed one
    readme = [command for block in blocks(ROOT / "README.md") if block.language == "sh"
              for command in shell_commands(block)]
    runs = {cadence_arguments(command)[0] for command, needs in readme if needs is None}
    assert {"train", "plan", "sample", "audit", "report"} <= runs, runs
    assert any(needs for _, needs in readme)
    continued = [command for block in blocks(ROOT / "docs" / "distributed.md") if block.language == "sh"
                 for command in shell_commands(block) if "--rdzv-endpoint" in command[0]]
    assert continued and "--out /shared/runs/big" in continued[0][0] and continued[0][1] == "several machines"


def test_a_cap_wins_and_a_declared_line_is_still_checked() -> None:
    """The two rules the page runs rely on: click keeps the last value of a flag given twice (so a cap replaces the
    page's value), and the parse-only check of a ``# needs:`` line refuses a flag that does not exist or a bad value."""
    assert capped(["train", "--max-steps", "500", "--seq-len", "256"])[-6:] == [
        "--max-steps", "2", "--warmup-steps", "0", "--seq-len", "64"]
    context = app.commands["train"].make_context("train", capped(["train", "--max-steps", "500", "--seq-len", "256"])[1:])
    assert context.params["max_steps"] == 2 and context.params["seq_len"] == 64
    assert capped(["train", "--plan", "p.json"])[-2:] == ["--warmup-steps", "0"]  # the plan's length stays
    assert capped(["profile", "--compare", "a", "b"]) == ["profile", "--compare", "a", "b"]
    with pytest.raises(click.NoSuchOption):
        parses(["train", "--nproc-per-node", "4", "--strategie", "fsdp"])
    with pytest.raises(click.BadParameter):
        parses(["train", "--nproc-per-node", "four"])


def test_the_engine_example_is_examples_own_loop() -> None:
    example = (ROOT / "examples" / "own_loop.py").read_text()
    body = example.split('"""', 2)[2].lstrip("\n")  # the file without its module docstring
    assert body in [block.code for block in blocks(ROOT / "docs" / "library.md")], \
        "docs/library.md's engine example differs from examples/own_loop.py"


RUNNABLE = [page for page in PAGES
            if any(block.language in ("python", "sh") for block in blocks(page))]
SLOW_PAGES = {"library.md"}
"""Pages whose blocks take more than a few seconds together (library.md trains its example and profiles it): make
test-slow runs them. make test still checks that library.md's example is examples/own_loop.py, word for word
(test_the_engine_example_is_examples_own_loop), and tests/profiling profiles a loop of the same kind."""


@pytest.mark.parametrize("page", [pytest.param(page, marks=pytest.mark.slow) if page.name in SLOW_PAGES else page
                                  for page in RUNNABLE], ids=lambda page: str(page.relative_to(ROOT)))
def test_every_block_of_the_page_runs_as_written(page: Path, workspace: Path, capsys: pytest.CaptureFixture) -> None:
    """Every block of the page in order (see the module docstring). The time each command took is printed (seen with
    -s, or in a failure's captured output): which recipe is slow."""
    namespace: dict = {"__name__": "__main__"}
    printed: list[str] = []
    timings: list[str] = []
    for block in blocks(page):
        if block.language == "python" and not FRAGMENT.match(block.code.split("\n")[0]):
            exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102 - our own documentation
            printed.append(capsys.readouterr().out)
        if block.language != "sh":
            continue
        for command, needs in shell_commands(block):
            arguments = cadence_arguments(command)
            if needs is not None or command.startswith("torchrun "):
                parses(arguments)
                continue
            started = time.perf_counter()
            status = main(capped(arguments))
            timings.append(f"{time.perf_counter() - started:6.1f} s  {command}")
            captured = capsys.readouterr()
            printed.append(captured.out)
            assert status == 0, f"{block.where}: `{command}` exited {status}\n{captured.err[-3000:]}"
    with capsys.disabled():
        print("\n" + "\n".join(timings))
    out = "".join(printed)
    if page.name == "library.md":
        assert "40 optimizer steps, 0 skipped" in out and "kind" in out  # the example, then its profiler block
        assert (workspace / "profile" / "profile.json").exists() and (workspace / "profile" / "trace.json").exists()
    if page.name == "run-directory.md":
        assert "[(1, " in out  # the metrics-reading block read runs/demo


def test_every_fragment_names_a_whole_example_that_a_test_runs() -> None:
    """A fragment cannot run alone: the file it names must exist, hold the fragment's calls, and be run by a test
    (tests/distributed/count_allreduce.py runs under torchrun in tests/distributed/test_distributed.py)."""
    fragments = [block for page in PAGES for block in blocks(page)
                 if block.language == "python" and FRAGMENT.match(block.code.split("\n")[0])]
    assert fragments
    tests = {path: path.read_text() for path in (ROOT / "tests").rglob("test_*.py")}
    for block in fragments:
        named = ROOT / FRAGMENT.match(block.code.split("\n")[0]).group(1)
        assert named.is_file(), f"{block.where}: {named} does not exist"
        whole = named.read_text()
        called = {node.func.id for node in ast.walk(ast.parse(block.code))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert called and all(f"{name}(" in whole for name in called), (block.where, called)
        assert [path for path, text in tests.items() if path != named and named.name in text], \
            f"{block.where}: no test runs {named}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target}"
        if anchor and linked.suffix == ".md":
            headings = {_slug(line.lstrip("#")) for line in linked.read_text().split("\n") if line.startswith("#")}
            assert anchor in headings, f"{page.name}: {target}"


def test_the_quick_start_lines_work_pasted_into_a_fresh_shell(tmp_path: Path) -> None:
    """The Quick start's shell lines after `make demo`, in a clean bash (no cadence on its PATH until the README's
    activation line): each must work. The TensorBoard line starts a server, so for it the command must be on PATH and
    its --logdir must hold event files."""
    start = README.index("## Quick start")
    section = README[start:README.index("\n## ", start + 1)]
    lines = [line.strip() for line in re.findall(r"```sh\n(.*?)```", section, flags=re.S)[-1].split("\n")
             if line.strip() and not line.startswith("make ")]
    assert lines[0] == ". .venv/bin/activate" and any(line.startswith("cadence ") for line in lines)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the virtual environment running these tests
    assert main(["train", "--seq-len", "32", "--max-steps", "2", "--val-fraction", "0",
                 "--out", str(tmp_path / "runs" / "demo")]) == 0
    script = []
    for line in lines:
        command = line.split("#")[0].strip()
        if command.startswith("tensorboard "):
            logdir = command.split("--logdir", 1)[1].split()[0]
            assert any((tmp_path / logdir).glob("events.out.tfevents.*")), logdir
            command = "command -v tensorboard"
        script.append(command)
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", "-ec", "\n".join(script)], cwd=tmp_path, env=clean, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "runs" / "demo" / "report.html").is_file()


def test_make_demo_keeps_an_earlier_demo_and_its_report(tmp_path: Path) -> None:
    """A second `make demo` once deleted runs/demo, with the report the user had built in it. The demo recipe runs
    here as written, with a stand-in for the 300-step training (a cadence that just writes its --out)."""
    (tmp_path / "Makefile").write_text((ROOT / "Makefile").read_text())
    (tmp_path / "pyproject.toml").write_text("")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "cadence"
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "--out" ]; do shift; done\nmkdir -p "$2" && echo run > "$2/metrics.jsonl"\n')
    fake.chmod(0o755)
    (tmp_path / ".venv" / ".installed").touch()  # newer than the Makefile and pyproject.toml: nothing to install
    for _ in range(2):
        result = subprocess.run(["make", "-s", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        (tmp_path / "runs" / "demo" / "report.html").write_text("the user's report")
    kept = [path for path in (tmp_path / "runs").iterdir() if path.name.startswith("demo-")]
    assert len(kept) == 1 and (kept[0] / "report.html").read_text() == "the user's report"
    assert "kept as runs/demo-" in result.stdout and ". .venv/bin/activate" in result.stdout


def test_the_flag_reference_lists_every_flag_and_the_readme_links_it() -> None:
    """docs/FLAGS.md is generated from the schema (tests/config/test_reference.py keeps it current); the README
    points at it instead of a table of its own."""
    reference = (ROOT / "docs" / "FLAGS.md").read_text()
    for field in dataclasses.fields(TrainConfig):
        assert f"| `{flag(field.name)}` |" in reference, flag(field.name)
    assert "(docs/FLAGS.md)" in README and "| `--micro-batch-size` |" not in README


def test_readme_quick_start_is_the_two_make_commands() -> None:
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and re.search(r"^demo:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
