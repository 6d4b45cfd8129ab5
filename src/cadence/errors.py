"""Failures that reach the user as lines on stderr and an exit status, never as a traceback.

One hierarchy: every failure cadence reports is a :class:`CadenceFailure`, and the CLI has one place that prints it.
Bad input is a :class:`UsageError` (exit status 2, one line per problem naming the flag or file); a run that could
not finish (training diverged, no plan fits, a configuration that does not train like the big batch) is a subclass
of :class:`CadenceFailure` with exit status 1, defined where it happens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with the user's input."""

    where: str
    """The flag (``--lr``) or file (``data.jsonl:7``) the problem is about."""
    message: str
    """What is wrong and what is allowed."""

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class CadenceFailure(Exception):
    """Something cadence reports and exits on.

    Under several processes, ``every_rank_agrees`` says whether all ranks reached this same failure (the same input,
    an agreed divergence stop, the same gradient comparison): then rank 0 alone reports it, for all of them. A failure
    of one rank's own is reported by that rank, naming it."""

    exit_status: ClassVar[int] = 1
    label: ClassVar[str] = "failed"
    """How the line starts after ``cadence:``, e.g. ``training failed``."""

    def __init__(self, message: str, *, every_rank_agrees: bool = False) -> None:
        super().__init__(message)
        self.every_rank_agrees = every_rank_agrees

    def lines(self) -> list[str]:
        """What the user reads, one line each (without the ``cadence:`` prefix)."""
        return [f"{self.label}: {self}"]


class UsageError(CadenceFailure):
    """Bad input from the user. The CLI prints each problem on its own line and exits with status 2.

    Every rank checks the same input, so by default rank 0 speaks for all; ``every_rank_agrees=False`` marks a
    problem that only this rank found (a file it alone could not read)."""

    exit_status = 2
    label = "error"

    def __init__(self, problems: list[Problem], *, every_rank_agrees: bool = True) -> None:
        if not problems:
            raise ValueError("UsageError needs at least one problem")
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems), every_rank_agrees=every_rank_agrees)

    @classmethod
    def single(cls, where: str, message: str) -> "UsageError":
        return cls([Problem(where=where, message=message)])

    def lines(self) -> list[str]:
        return [f"{self.label}: {problem}" for problem in self.problems]
