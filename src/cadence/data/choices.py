"""The spellings of the data options that numpy-bearing modules use, in a module without numpy or torch.

Why a module of its own: the command line's `--help` lists these choices and must answer without importing the
numerical stack (issue 41); too_long.py, which needs numpy, takes its names from here.
"""

from __future__ import annotations

from typing import Literal

TooLong = Literal["skip", "truncate", "error"]
TOO_LONG_CHOICES: tuple[TooLong, ...] = ("skip", "truncate", "error")
