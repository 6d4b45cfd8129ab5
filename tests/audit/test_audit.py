"""cadence audit: every loop in tests/audit/cases/ reports exactly the rules (and lines) its header expects, the
user's script keeps its output and exit status, and nothing stays patched after the audit."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad

import cadence.audit.checker
from cadence.audit.checker import RULES, Audit, format_report
from cadence.audit.run import run_script
from cadence.errors import UsageError

CASES = Path(__file__).parent / "cases"
CASE_FILES = sorted(CASES.glob("*.py"))


def expected(path: Path) -> tuple[set[tuple[str, int]], int | None]:
    """The ``# expect: CAD00X line N, ...`` (or ``none``) header and the optional ``# exit: N`` line."""
    head = path.read_text().splitlines()[:3]
    match = re.fullmatch(r"# expect: (.*)", head[0])
    assert match, f"{path.name}: first line must be '# expect: ...'"
    rules = set()
    if match.group(1).strip() != "none":
        for item in match.group(1).split(","):
            rule, line = re.fullmatch(r"\s*(CAD\d{3}) line (\d+)\s*", item).groups()
            rules.add((rule, int(line)))
    exit_lines = [int(line.split(":")[1]) for line in head if line.startswith("# exit:")]
    return rules, exit_lines[0] if exit_lines else None


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's own scheduler-order warning in some cases
# The DDP cases start gloo processes of their own: make test-slow.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if "_ddp_" in p.stem else p
                                  for p in CASE_FILES], ids=[p.stem for p in CASE_FILES])
def test_case_reports_exactly_what_it_expects(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want, want_exit = expected(path)
    if "ddp" in path.name:
        # A gloo process group set up and torn down again and again inside the pytest process once hung for good
        # (a futex wait): each DDP case runs in a process of its own, as a user's `cadence audit` does.
        result = subprocess.run([sys.executable, "-m", "cadence", "audit", "--json", "--", "python", str(path)],
                                capture_output=True, text=True, timeout=180)
        status, text = result.returncode, result.stderr[result.stderr.index("{"):]
    else:
        out = io.StringIO()
        status = run_script([sys.executable, str(path)], as_json=True, out=out)
        text = out.getvalue()
    report = json.loads(text)
    got = {(f["rule"], f["line"]) for f in report["findings"]}
    assert got == want, format_report_from(report)
    assert all(Path(f["file"]).resolve() == path.resolve() for f in report["findings"])
    if path.name.startswith("good_"):
        assert not want and status == 0
    else:
        error_expected = any(RULES[rule].level == "error" for rule, _ in want)
        assert status == (want_exit if want_exit is not None else int(error_expected))


def format_report_from(report: dict) -> str:
    return "\n".join(f"{f['level']} {f['rule']} {f['where']}" for f in report["findings"]) or "no findings"


def test_cases_cover_every_rule() -> None:
    bad = [p for p in CASE_FILES if p.name.startswith("bad_")]
    good = [p for p in CASE_FILES if p.name.startswith("good_")]
    assert len(bad) >= 20 and len(good) >= 6
    covered = {rule for p in bad for rule, _ in expected(p)[0]}
    assert covered == set(RULES)


def test_docstring_table_matches_rules() -> None:
    doc = cadence.audit.checker.__doc__
    for rule in RULES.values():
        assert re.search(rf"\| {rule.id} \| {rule.level}\s+\|", doc), rule.id


# ---------------------------------------------------------------------------------------------- the script runner
def test_exit_status_and_output_pass_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('hello from the user', sys.argv[1:])\nsys.exit(3)\n")
    saved_argv = sys.argv[:]
    assert run_script(["python", str(script), "--lr", "0.1"]) == 3
    captured = capsys.readouterr()
    assert "hello from the user ['--lr', '0.1']" in captured.out
    assert "cadence audit:" in captured.err and "cadence audit:" not in captured.out
    assert sys.argv == saved_argv


def test_python_prefix_is_optional_and_exceptions_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "boom.py"
    script.write_text("import torch\nprint('before')\ntorch.zeros(1).sum().backward()  # no grad: torch raises\n")
    assert run_script([str(script)]) == 1
    captured = capsys.readouterr()
    assert "before" in captured.out
    assert "RuntimeError: element 0 of tensors does not require grad" in captured.err and "boom.py" in captured.err
    assert "runpy" not in captured.err and "audit.py" not in captured.err  # only the user's and torch's frames


def test_module_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "audited_mod.py").write_text("import sys\nprint('module args', sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run_script(["python", "-m", "audited_mod", "x"]) == 0
    assert "module args ['x']" in capsys.readouterr().out


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        run_script(["python", str(tmp_path / "nope.py")])
    assert info.value.problems[0].where == "SCRIPT"
    with pytest.raises(UsageError):
        run_script([])
    with pytest.raises(UsageError):
        run_script(["-m", "no_such_module_for_cadence_audit"])


# ---------------------------------------------------------------------------------------------- the Python API
def patched_objects() -> dict[str, object]:
    """Every attribute the audit replaces, as stored (so bound-method differences do not hide a leftover)."""
    from torch.optim import lr_scheduler
    from torch.optim import optimizer as optimizer_module

    owners = {
        "Tensor.backward": (torch.Tensor, "backward"),
        "autograd.backward": (torch.autograd, "backward"),
        "Optimizer.zero_grad": (torch.optim.Optimizer, "zero_grad"),
        "Module.zero_grad": (torch.nn.Module, "zero_grad"),
        "utils.clip_grad_norm_": (torch.nn.utils, "clip_grad_norm_"),
        "utils.clip_grad_value_": (torch.nn.utils, "clip_grad_value_"),
        "clip_grad.clip_grad_norm_": (clip_grad, "clip_grad_norm_"),
        "clip_grad.clip_grad_value_": (clip_grad, "clip_grad_value_"),
        "GradScaler.scale": (torch.amp.GradScaler, "scale"),
        "GradScaler.unscale_": (torch.amp.GradScaler, "unscale_"),
        "GradScaler.step": (torch.amp.GradScaler, "step"),
        "GradScaler.update": (torch.amp.GradScaler, "update"),
        "LRScheduler.step": (lr_scheduler.LRScheduler, "step"),
        "ReduceLROnPlateau.step": (lr_scheduler.ReduceLROnPlateau, "step"),
        "autocast.__enter__": (torch.amp.autocast_mode.autocast, "__enter__"),
        "DDP.forward": (DistributedDataParallel, "forward"),
        "DDP.no_sync": (DistributedDataParallel, "no_sync"),
        "DataLoader.__iter__": (torch.utils.data.DataLoader, "__iter__"),
        "DataLoader iterator __next__": (torch.utils.data.dataloader._BaseDataLoaderIter, "__next__"),
    }
    objects = {name: vars(owner)[attr] for name, (owner, attr) in owners.items()}
    objects["post hooks"] = tuple(optimizer_module._global_optimizer_post_hooks.values())
    return objects


def test_nothing_stays_patched_even_on_exceptions() -> None:
    before = patched_objects()
    with pytest.raises(KeyError):
        with Audit():
            during = patched_objects()
            raise KeyError("user code failed")
    assert all(during[name] is not before[name] for name in before if name != "post hooks")
    assert len(during["post hooks"]) == len(before["post hooks"]) + 1
    after = patched_objects()
    assert all(after[name] is before[name] for name in before if name != "post hooks")
    assert after["post hooks"] == before["post hooks"]


def test_context_manager_on_an_inline_loop() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Audit() as audit:
        with pytest.raises(RuntimeError):
            audit.report()  # only after the block
        for i in range(6):
            loss = F.cross_entropy(model(torch.randn(3, 4)), torch.randint(0, 2, (3,)), reduction="sum") / 6
            loss.backward()
            clip_line = sys._getframe().f_lineno + 1
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # per micro-step: CAD002
            if (i + 1) % 2 == 0:
                optimizer.step()
                optimizer.zero_grad()
    report = audit.report()
    assert [(f.rule, f.line, f.count) for f in report.findings] == [("CAD002", clip_line, 3)]
    assert report.findings[0].file == __file__ and report.has_errors
    assert report.cadence.optimizer_steps == 3 and report.cadence.window_lengths == {2: 3}
    assert "CAD002" in format_report(report)
    json.dumps(report.as_dict())
    with pytest.raises(RuntimeError):
        with audit:  # one run per Audit
            pass


# ---------------------------------------------------------------------------------------------- normalisation
def window_gradient(lengths: list[int], per_micro_mean: bool) -> torch.Tensor:
    """The gradient of one window of micro-batches holding ``lengths`` targets: each loss a per-micro-batch mean
    (divided by its own count, then by the micro-batch count) or the window's token mean (summed / window count)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    total = sum(lengths)
    for n in lengths:
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        y[n:] = -100
        if per_micro_mean:
            loss = F.cross_entropy(model(x), y) / len(lengths)
        else:
            loss = F.cross_entropy(model(x), y, reduction="sum") / total
        loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_per_micro_batch_mean_is_measured_from_the_gradient(capsys: pytest.CaptureFixture[str]) -> None:
    """CAD018 reads the weights from the gradients that reach the loss's reduction: for micro-batches of 16 and 3
    targets a per-micro-batch mean weighs the short one's targets 16/3 = 5.33x; the gradient it gives differs from one
    big batch's by the relative error printed; equal counts (16, 16) weigh alike and give the same gradient."""
    with Audit() as audit:
        broken = window_gradient([16, 3], per_micro_mean=True)
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).step()  # closes the window
    right = window_gradient([16, 3], per_micro_mean=False)
    error = float((broken - right).norm() / right.norm())
    (finding,) = audit.report().findings
    assert finding.rule == "CAD018" and "5.33x" in finding.detail
    assert error > 0.1
    with Audit() as audit:
        equal = window_gradient([16, 16], per_micro_mean=True)
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).step()
    assert not audit.report().findings
    assert torch.allclose(equal, window_gradient([16, 16], per_micro_mean=False), atol=1e-6)
    # At the threshold: counts 6.7% apart are not reported, 14% apart are; the gradient error each gives.
    near = {}
    for lengths in ([16, 15], [16, 14]):
        with Audit() as audit:
            near[lengths[1]] = window_gradient(lengths, per_micro_mean=True)
            torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]).step()
        right_near = window_gradient(lengths, per_micro_mean=False)
        near[lengths[1]] = (float((near[lengths[1]] - right_near).norm() / right_near.norm()),
                            [f.rule for f in audit.report().findings])
    assert near[15][1] == [] and near[14][1] == ["CAD018"]
    with capsys.disabled():
        print(f"\nper-micro-batch mean over 16 and 3 targets: weights {finding.detail.split('weigh ')[1][:5]} apart, "
              f"gradient relative error {error:.3f} vs one big batch; 16 and 15 (not reported): {near[15][0]:.3f}; "
              f"16 and 14 (CAD018): {near[14][0]:.3f}; equal counts: exact")
