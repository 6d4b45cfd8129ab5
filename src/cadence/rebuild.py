"""``cadence report DIR``: (re)build the report of any directory cadence wrote: a run, a plan or a profile.

Each report is built by the package that knows its subject; this module only tells the kinds of directory apart, which
is why it sits above them all.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cadence.errors import UsageError
from cadence.plan.report import PLAN_FILE, plan_report
from cadence.profiling.report import PROFILE_FILE, profile_report
from cadence.report.document import WHERE, write_report
from cadence.report.runs import run_report
from cadence.training.run_dir import METRICS_FILE

DIRECTORY_KINDS: tuple[tuple[str, Callable[[Path], Any], str], ...] = (
    (PLAN_FILE, plan_report, "a plan ({file}, written by cadence plan)"),
    # Before metrics.jsonl: a profile directory may hold one as well.
    (PROFILE_FILE, profile_report, "a profile ({file}, written by cadence profile)"),
    (METRICS_FILE, run_report, "a run ({file}, written by cadence train)"),
)
"""The directories cadence writes, each told by the file it holds (the first that matches decides), with the
report builder of the package that knows it."""


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
    for file, build, _ in DIRECTORY_KINDS:
        if (root / file).is_file():
            return write_report(build(root), root)
    # Said run first (what most people look for), whatever the order the kinds are told apart in.
    shown = sorted(DIRECTORY_KINDS, key=lambda kind: kind[0] != METRICS_FILE)
    kinds = [what.format(file=file) for file, _, what in shown]
    raise UsageError.single(WHERE, f"{root} holds neither {', '.join(kinds[:-1])} nor {kinds[-1]}")
