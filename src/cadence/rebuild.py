"""``cadence report DIR``: (re)build the report of any directory cadence wrote: a run, a plan or a profile.

Each report is built by the package that knows its subject; this module only tells the kinds of directory apart, which
is why it sits above them all.

Only a directory cadence wrote is reported on, since the report is written into it: a run is known by its config.json
(``is_cadence_config``: the resolved batch, the data's fingerprint, cadence's version), a plan and a profile by the
fields their JSON always holds. A folder that merely holds a metrics.jsonl, a plan.json or a profile.json of some other
tool is refused, naming the file, and nothing is written; ``write_report`` then refuses to replace any report file that
cadence did not write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from cadence.config import is_cadence_config
from cadence.config.plan_file import MARKS as PLAN_MARKS
from cadence.config.plan_file import PLAN_FILE
from cadence.errors import UsageError
from cadence.plan.report import plan_report
from cadence.profiling.report import PROFILE_FILE, profile_report
from cadence.records import PROFILE, read_object
from cadence.report.document import WHERE, write_report
from cadence.report.runs import run_report
from cadence.training.run_dir import CONFIG_FILE, METRICS_FILE


def _plan_problem(path: Path) -> str | None:
    """Why cadence plan did not write the plan.json at ``path`` (one line naming it), or None."""
    value = read_object(path, where=WHERE).data  # not JSON at all is its own error, naming the line
    missing = [key for key, kind in PLAN_MARKS.items()
               if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool)]
    return _not_written_by("cadence plan", path, missing)


def _profile_problem(path: Path) -> str | None:
    """Why cadence profile did not write the profile.json at ``path``, or None: its record's marks."""
    return _not_written_by("cadence profile", path, PROFILE.missing(read_object(path, where=WHERE)))


def _not_written_by(command: str, path: Path, missing: list[str]) -> str | None:
    if missing:
        return (f"{path} was not written by {command} (no {', '.join(missing)}); its report is not written "
                f"(nothing was written)")
    return None


def _run_problem(path: Path) -> str | None:
    """A run is cadence's when its config.json is: metrics.jsonl alone may be any tool's."""
    config = path.parent / CONFIG_FILE
    if not is_cadence_config(config):
        said = "is not one written by cadence train" if config.exists() else "is missing"
        return (f"{path.parent} is not a run cadence wrote: {config} {said}; its report is not written "
                f"(nothing was written)")
    return None


DIRECTORY_KINDS: tuple[tuple[str, Callable[[Path], str | None], Callable[[Path], Any], str], ...] = (
    (PLAN_FILE, _plan_problem, plan_report, "a plan ({file}, written by cadence plan)"),
    # Before metrics.jsonl: a profile directory may hold one as well.
    (PROFILE_FILE, _profile_problem, profile_report,
     "a profile ({file}, written by cadence profile)"),
    (METRICS_FILE, _run_problem, run_report, "a run ({file}, written by cadence train)"),
)
"""The directories cadence writes, each told by the file it holds and the check that cadence wrote it (the first
that passes decides), with the report builder of the package that knows it."""


def build_report(path: Path) -> list[Path]:
    """Write report.md, report.html and the report-*.png plots into a run, plan or profile directory; return them.

    Raises UsageError (naming RUN_DIR) when ``path`` is missing, is not a directory, holds no run (metrics.jsonl and
    cadence's config.json), plan (plan.json) or profile (profile.json) that cadence wrote, holds files that are not
    valid JSON, or holds a report file that cadence did not write.
    """
    root = Path(path)
    if not root.exists():
        raise UsageError.single(WHERE, f"{root} does not exist")
    if not root.is_dir():
        raise UsageError.single(WHERE, f"{root} is a file; give the run or plan directory that holds it")
    refused: list[str] = []
    for file, problem_of, build, _ in DIRECTORY_KINDS:
        if (root / file).is_file():
            problem = problem_of(root / file)
            if problem is None:
                return write_report(build(root), root)
            refused.append(problem)  # another kind may still match: a run directory holding someone's plan.json
    if refused:
        raise UsageError.single(WHERE, refused[0])
    # Said run first (what most people look for), whatever the order the kinds are told apart in.
    shown = sorted(DIRECTORY_KINDS, key=lambda kind: kind[0] != METRICS_FILE)
    kinds = [what.format(file=file) for file, _, _, what in shown]
    raise UsageError.single(WHERE, f"{root} holds neither {', '.join(kinds[:-1])} nor {kinds[-1]}")
