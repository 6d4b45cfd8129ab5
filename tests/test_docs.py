"""The README stays true: every Python block in it runs as written (or is a declared fragment of a file a test runs),
its engine example is the file a test runs, and it lists every train flag."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from cadence.cli import main
from cadence.config import TrainConfig, flag

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


FRAGMENT = re.compile(r"^# fragment: see (\S+) for the whole example$")
"""The first line of a README code block that is only a part of a program (it uses names a whole program defines):
the file it names holds the whole program, and a test runs that file."""


def _is_python(code: str) -> bool:
    """Whether an indented block is Python rather than shell lines, a tree of files or pseudo-code: it parses, and
    does something (an import, an assignment, a call, a with or a for), as no shell line that happens to parse does."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.Call, ast.With, ast.For))
               for node in ast.walk(tree))


def readme_python_blocks() -> list[tuple[int, str]]:
    """(line, code) of every Python code block of the README, in order: each ```python block, and each indented
    block (4 spaces, or more inside a list item) that is Python."""
    lines = README.split("\n")
    blocks: list[tuple[int, str]] = []
    number = 0
    while number < len(lines):
        line = lines[number]
        if line.startswith("```"):
            end = lines.index("```", number + 1)
            if line == "```python":
                blocks.append((number + 1, "\n".join(lines[number + 1:end]) + "\n"))
            number = end + 1
            continue
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and indent >= 4 and (number == 0 or not lines[number - 1].strip()):
            start, body = number, []
            while number < len(lines) and (lines[number][:indent].strip() == "" or not lines[number].strip()):
                body.append(lines[number][indent:])
                number += 1
            code = "\n".join(body).rstrip() + "\n"
            if _is_python(code):
                blocks.append((start + 1, code))
            continue
        number += 1
    return blocks


def test_the_readme_s_python_blocks_are_found() -> None:
    """The two kinds: the fenced engine example, and indented ones (the prefetch loop, the distributed fragment);
    the shell lines, file trees and the step chain's pseudo-code are not Python."""
    blocks = readme_python_blocks()
    assert any(code.startswith("import torch\nfrom torch import nn\n\nfrom cadence import Cut, Engine, Example")
               for _, code in blocks)  # the indented prefetch example
    assert any(FRAGMENT.match(code.split("\n")[0]) for _, code in blocks)  # the distributed one
    assert not any(code.startswith(("cadence ", "make ", "runs/", "src/")) for _, code in blocks)


def test_every_python_block_of_the_readme_runs_as_it_stands_in_order(tmp_path, monkeypatch, capsys):
    """Each Python block of the README (```python, and indented Python) that is not a declared fragment, in the
    README's order, in one namespace (a later block may continue an earlier one, never use a name before a block
    defines it), in a directory holding a run at runs/demo as `make demo` leaves it. The engine example must also be
    examples/own_loop.py exactly."""
    example = (ROOT / "examples" / "own_loop.py").read_text()
    blocks = [(line, code) for line, code in readme_python_blocks() if not FRAGMENT.match(code.split("\n")[0])]
    body = example.split('"""', 2)[2].lstrip("\n")  # the file without its module docstring
    assert body in [code for _, code in blocks], "README's engine example differs from examples/own_loop.py"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--seq-len", "32", "--max-steps", "3", "--val-fraction", "0", "--out", "runs/demo"]) == 0
    capsys.readouterr()
    namespace: dict = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile(code, f"README.md line {line}", "exec"), namespace)  # noqa: S102 - our own README
    out = capsys.readouterr().out
    assert "40 optimizer steps, 0 skipped" in out and "kind" in out  # the example, then its profiler block
    assert (tmp_path / "profile" / "profile.json").exists() and (tmp_path / "profile" / "trace.json").exists()
    assert "[(1, " in out  # the metrics-reading block read runs/demo


def test_every_fragment_of_the_readme_names_a_whole_example_that_a_test_runs():
    """A fragment (`# fragment: see FILE for the whole example`) cannot run alone: the file it names must exist,
    hold the fragment's calls, and be run by a test (tests/distributed/count_allreduce.py runs under torchrun in
    tests/distributed/test_distributed.py)."""
    fragments = [(line, code) for line, code in readme_python_blocks() if FRAGMENT.match(code.split("\n")[0])]
    assert fragments
    tests = {path: path.read_text() for path in (ROOT / "tests").rglob("test_*.py")}
    for line, code in fragments:
        named = ROOT / FRAGMENT.match(code.split("\n")[0]).group(1)
        assert named.is_file(), f"README.md line {line}: {named} does not exist"
        whole = named.read_text()
        called = {node.func.id for node in ast.walk(ast.parse(code))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert called and all(f"{name}(" in whole for name in called), (line, called)
        runners = [path for path, text in tests.items() if path != named and named.name in text]
        assert runners, f"README.md line {line}: no test runs {named}"


def test_the_quick_start_lines_work_pasted_into_a_fresh_shell(tmp_path):
    """The Quick start's shell lines after `make demo`, in a clean bash (no cadence on its PATH until the README's
    activation line): each must work. The TensorBoard line starts a server, so for it the command must be on PATH and
    its --logdir must hold event files."""
    section = README[README.index("## Quick start"):README.index("## Command line")]
    lines = [line.strip() for line in re.findall(r"^    (\S.*)$", section, flags=re.M)
             if not line.strip().startswith("make ")]
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


def test_make_demo_keeps_an_earlier_demo_and_its_report(tmp_path):
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


def test_readme_lists_every_train_flag():
    for field in dataclasses.fields(TrainConfig):
        assert f"`{flag(field.name)}`" in README, flag(field.name)


def test_readme_quick_start_is_the_two_make_commands():
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and re.search(r"^demo:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
