"""`cadence audit -- python train.py`: the CLI passes the script's status through, or 1 on an error-level rule (every
rule that changes the math or the schedule), and with --strict on a warning too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cadence.audit.rules import RULES
from cadence.cli import main

CASES = Path(__file__).parent / "cases"


def audit_in_own_process(*argv: str) -> tuple[int, str]:
    """`cadence audit ARGV` in a fresh process: (exit status, stderr). The DDP cases set up and tear down a gloo
    process group; done again and again inside the pytest process this once hung for good (a futex wait, after
    several set-ups), so each runs in a process of its own, as a user's `cadence audit` does."""
    result = subprocess.run([sys.executable, "-m", "cadence", "audit", *argv], capture_output=True, text=True,
                            timeout=180)
    return result.returncode, result.stderr


def test_bad_loop_exits_1_with_rule_and_line(capsys):
    assert main(["audit", "--", "python", str(CASES / "bad_clip_before_unscale.py")]) == 1
    err = capsys.readouterr().err
    assert "CAD001" in err and "bad_clip_before_unscale.py:17" in err


def test_good_loop_exits_0_and_json(capsys):
    assert main(["audit", "--json", "--", "python", str(CASES / "good_fp16_scaler.py")]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.err[captured.err.index("{"):])
    assert report["findings"] == []


@pytest.mark.slow
def test_a_module_of_an_uninstalled_package_in_the_current_directory_is_audited(tmp_path: Path) -> None:
    """docs/commands.md's form, `cadence audit --json -- python -m mypackage.train`, through the installed console script
    (whose sys.path starts at its bin directory, not the current directory) from the directory holding the package:
    found and run as `python -m` would, as is an unknown module refused as a usage error."""
    package = tmp_path / "mypackage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text((CASES / "good_bf16_no_scaler.py").read_text())
    console = Path(sys.executable).with_name("cadence")

    def audit(module: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(console), "audit", "--json", "--", "python", "-m", module], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)

    found = audit("mypackage.train")
    assert found.returncode == 0, found.stderr[-2000:]
    report = json.loads(found.stderr[found.stderr.index("{"):])
    assert report["findings"] == [] and report["cadence"]["optimizer_steps"] == 3
    missing = audit("nopackage.train")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "-m nopackage.train: no such module" in missing.stderr


def test_missing_script_is_a_usage_error(capsys):
    assert main(["audit", "--", "python", "no_such_script.py"]) == 2
    assert "SCRIPT" in capsys.readouterr().err


# Each rule whose finding means the loop trains differently from one big batch (gradient, update or LR schedule),
# or that torch itself rejects: a CI gate on `cadence audit` must fail on every one of them.
MATH_OR_SCHEDULE = {"CAD001", "CAD002", "CAD003", "CAD004", "CAD005", "CAD006", "CAD007", "CAD008", "CAD009", "CAD010",
                    "CAD011", "CAD013", "CAD014", "CAD017", "CAD018", "CAD019", "CAD021", "CAD022", "CAD023", "CAD024",
                    "CAD025", "CAD026", "CAD027"}
PERFORMANCE_ONLY = {"CAD015", "CAD016"}  # the gradient is right; communication is wasted


def test_every_math_or_schedule_rule_is_an_error_and_only_performance_is_a_warning():
    assert {rule.id for rule in RULES.values() if rule.level == "error"} == MATH_OR_SCHEDULE
    assert {rule.id for rule in RULES.values() if rule.level == "warning"} == PERFORMANCE_ONLY


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.slow) if "_ddp_" in name else name
                                  for name in sorted(p.name for p in CASES.glob("bad_*.py"))])  # DDP: gloo processes
def test_every_bad_case_that_changes_the_math_exits_1(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    expected = {word for word in (CASES / case).read_text().splitlines()[0].split() if word.startswith("CAD")}
    if "ddp" in case:
        status, _ = audit_in_own_process("--", "python", str(CASES / case))
    else:
        status = main(["audit", "--", "python", str(CASES / case)])
    capsys.readouterr()
    if expected & MATH_OR_SCHEDULE:
        assert status == 1, case
    elif expected <= PERFORMANCE_ONLY | {"CAD012", "CAD020"}:
        assert status == 0, case


@pytest.mark.slow
def test_strict_fails_on_warnings_too() -> None:
    """The two performance-only cases exit 0 without --strict (test_every_bad_case_that_changes_the_math_exits_1)
    and 1 with it; a good loop passes --strict."""
    for case in ("bad_ddp_sync_every_micro_step.py", "bad_ddp_no_sync_after_forward.py"):
        status, err = audit_in_own_process("--strict", "--", "python", str(CASES / case))
        assert status == 1 and "warning" in err, case
    assert audit_in_own_process("--strict", "--", "python", str(CASES / "good_ddp_no_sync.py"))[0] == 0


def test_torchs_own_warnings_name_the_users_line_not_the_checker(tmp_path) -> None:
    """Issue 30: torch warns with stacklevel=2, which named the audit's wrapper (cadence/audit/checker.py) as the
    place of the user's call. A scheduler stepped before its optimizer warns from the script's own line."""
    script = tmp_path / "early_scheduler.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(2, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)\n"
        "model(torch.ones(1, 2)).sum().backward()\n"
        "scheduler.step()  # line 6: before optimizer.step()\n"
        "optimizer.step()\n", encoding="utf-8")
    result = subprocess.run([sys.executable, "-m", "cadence", "audit", "--", sys.executable, str(script)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "lr_scheduler.step()" in result.stderr, result.stderr
    assert "checker.py" not in result.stderr and f"{script}:6" in result.stderr, result.stderr
