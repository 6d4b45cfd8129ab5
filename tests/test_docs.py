"""The README stays true: its engine example is the file a test runs, and it lists every train flag."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from cadence.cli import main
from cadence.config import TrainConfig, flag

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_python_block_of_the_readme_runs_as_it_stands_in_order(tmp_path, monkeypatch, capsys):
    """Each ```python block of the README, in the README's order, in one namespace (a later block may continue an
    earlier one, never use a name before a block defines it), in a directory holding a run at runs/demo as `make demo`
    leaves it. The engine example must also be examples/own_loop.py exactly."""
    example = (ROOT / "examples" / "own_loop.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    body = example.split('"""', 2)[2].lstrip("\n")  # the file without its module docstring
    assert body in blocks, "README's engine example differs from examples/own_loop.py"
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--seq-len", "32", "--max-steps", "3", "--val-fraction", "0", "--out", "runs/demo"]) == 0
    capsys.readouterr()
    namespace: dict = {"__name__": "__main__"}
    for number, block in enumerate(blocks, start=1):
        exec(compile(block, f"README python block {number}", "exec"), namespace)  # noqa: S102 - our own README
    out = capsys.readouterr().out
    assert "40 optimizer steps, 0 skipped" in out and "kind" in out  # the example, then its profiler block
    assert (tmp_path / "profile" / "profile.json").exists() and (tmp_path / "profile" / "trace.json").exists()
    assert "[(1, " in out  # the metrics-reading block read runs/demo


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
