"""The README stays true: its engine example is the file a test runs, and it lists every train flag."""

from __future__ import annotations

import dataclasses
import re
import runpy
from pathlib import Path

from cadence.config import TrainConfig, flag

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_example_is_the_example_file_and_it_runs_and_so_does_the_profiler_snippet(tmp_path, monkeypatch,
                                                                                      capsys):
    """One run of the example (40 steps) serves both README blocks: the engine example, then the profiler snippet
    that continues it."""
    example = (ROOT / "examples" / "own_loop.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    body = example.split('"""', 2)[2].lstrip("\n")  # the file without its module docstring
    assert body in blocks, "README's engine example differs from examples/own_loop.py"
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(ROOT / "examples" / "own_loop.py"), run_name="__main__")
    assert "40 optimizer steps, 0 skipped" in capsys.readouterr().out
    snippet = next(block for block in blocks if "StepProfiler" in block)
    exec(compile(snippet, "README profiler snippet", "exec"), namespace)  # noqa: S102 - our own README
    assert (tmp_path / "profile" / "profile.json").exists() and (tmp_path / "profile" / "trace.json").exists()
    assert "kind" in capsys.readouterr().out


def test_readme_lists_every_train_flag():
    for field in dataclasses.fields(TrainConfig):
        assert f"`{flag(field.name)}`" in README, flag(field.name)


def test_readme_quick_start_is_the_two_make_commands():
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and re.search(r"^demo:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
