"""``cadence report DIR``: (re)build the report of any directory cadence wrote: a run, a plan or a profile.

Each report is built by the package that knows its subject; this module only tells the kinds of directory apart, which
is why it sits above them all.
"""

from __future__ import annotations

from pathlib import Path

from cadence.errors import UsageError
from cadence.plan.report import PLAN_FILE, plan_report
from cadence.profiling.report import PROFILE_FILE, profile_report
from cadence.report.document import WHERE, write_report
from cadence.report.runs import run_report
from cadence.training.run_dir import METRICS_FILE


def build_report(path: Path) -> list[Path]:
    """Write report.md, report.html and the report-*.png plots into a run, plan or profile directory; return them.

    Raises UsageError (naming RUN_DIR) when ``path`` is missing, is not a directory, holds no run (metrics.jsonl),
    plan (plan.json) or profile (profile.json), or holds files that are not valid JSON.
    """
    root = Path(path)
    if not root.exists():
        raise UsageError.single(WHERE, f"{root} does not exist")
    if not root.is_dir():
        raise UsageError.single(WHERE, f"{root} is a file; give the run or plan directory that holds it")
    if (root / PLAN_FILE).is_file():
        report = plan_report(root)
    elif (root / PROFILE_FILE).is_file():  # before metrics.jsonl: a profile directory may hold one as well
        report = profile_report(root)
    elif (root / METRICS_FILE).is_file():
        report = run_report(root)
    else:
        raise UsageError.single(
            WHERE, f"{root} holds neither a run ({METRICS_FILE}, written by cadence train), a plan ({PLAN_FILE}, "
                   f"written by cadence plan) nor a profile ({PROFILE_FILE}, written by cadence profile)")
    return write_report(report, root)


