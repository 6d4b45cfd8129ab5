"""Errors that reach the user as one line per problem, never as a traceback."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with the user's input."""

    where: str
    """The flag (``--lr``) or file (``data.jsonl:7``) the problem is about."""
    message: str
    """What is wrong and what is allowed."""

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class UsageError(Exception):
    """Bad input from the user. The CLI prints each problem on its own line and exits with status 2."""

    def __init__(self, problems: list[Problem]) -> None:
        if not problems:
            raise ValueError("UsageError needs at least one problem")
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    @classmethod
    def single(cls, where: str, message: str) -> "UsageError":
        return cls([Problem(where=where, message=message)])
