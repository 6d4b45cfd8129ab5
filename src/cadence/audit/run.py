"""``cadence audit -- python train.py [args]``: run a user's script in-process under the Audit.

The user's output, traceback and exit status pass through untouched; the audit report goes to stderr (or JSON).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import runpy
import sys
import traceback
from typing import Any, TextIO

from cadence.audit.checker import Audit, AuditReport, format_report, is_audit_file
from cadence.errors import UsageError

_PYTHON = re.compile(r"python[\d.]*(\.exe)?")
_PYTHON_FLAGS = {"-u", "-B", "-O", "-OO", "-s", "-E", "-I", "-q", "-X", "-W"}


def _parse_argv(argv: list[str]) -> tuple[str, list[str], bool]:
    """(script or module, its arguments, is a module) from ``[python] train.py args`` or ``[python] -m mod args``."""
    args = list(argv)
    if args and args[0] == "--":
        args = args[1:]
    if args and (_PYTHON.fullmatch(os.path.basename(args[0])) or args[0] == sys.executable):
        args = args[1:]
    while args and args[0] in _PYTHON_FLAGS:  # interpreter options do not apply in-process: skip them
        args = args[2:] if args[0] in ("-X", "-W") else args[1:]
    if not args:
        raise UsageError.single("SCRIPT", "give the training script to run: cadence audit -- python train.py [args]")
    if args[0] == "-m":
        if len(args) < 2 or not _module_exists(args[1]):
            name = args[1] if len(args) > 1 else "(none)"
            raise UsageError.single("SCRIPT", f"-m {name}: no such module (looked in the current directory and "
                                              f"the installed packages, as python -m does)")
        return args[1], args[2:], True
    if args[0].startswith("-"):
        raise UsageError.single("SCRIPT", f"{args[0]}: not supported; give a script file or -m module")
    if not os.path.isfile(args[0]):
        raise UsageError.single("SCRIPT", f"{args[0]}: no such file")
    return args[0], args[1:], False


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find ``name``: searched with the current directory first on the path, as
    ``python -m`` searches (the ``cadence`` console script's own path starts at its bin directory instead, so an
    uninstalled package in the current directory would not be found)."""
    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # find_spec imports the parent packages: a missing one raises
        return False
    finally:
        sys.path[:] = saved


def _exit_status(code: Any) -> int:
    """What the interpreter would exit with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_user_traceback(exc: BaseException) -> None:
    """The traceback Python would print for the script: without runpy's frames above it and the audit's wrappers."""
    report = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    ours = (runpy.__file__, "<frozen runpy>")
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename not in ours and not is_audit_file(frame.filename)]
    )
    print("".join(report.format()), end="", file=sys.stderr)


def audit_script(argv: list[str]) -> tuple[int, AuditReport]:
    """Run ``[python] train.py [args]`` (or ``-m module``) in this process under an Audit.

    Returns the script's exit status (0, its ``sys.exit`` code, or 1 for an uncaught exception, whose traceback is
    printed to stderr as Python would) and the report. Raises UsageError when the script or module does not exist.
    """
    target, args, is_module = _parse_argv(argv)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    status = 0
    audit = Audit()
    with audit:
        try:
            if is_module:
                sys.argv = [target, *args]  # runpy replaces argv[0] by the module's file
                sys.path.insert(0, os.getcwd())
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [target, *args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
        except SystemExit as exc:
            status = _exit_status(exc.code)
        except KeyboardInterrupt as exc:
            _print_user_traceback(exc)
            status = 130
        except Exception as exc:
            _print_user_traceback(exc)
            status = 1
        finally:
            sys.argv, sys.path[:] = saved_argv, saved_path
            sys.stdout.flush()
    if status != 0:
        audit.mark_crashed()
    return status, audit.report()


def run_script(argv: list[str], *, as_json: bool = False, out: TextIO | None = None, strict: bool = False) -> int:
    """``cadence audit -- python train.py [args]``: run the script under the audit, print the report, return the
    exit status: the script's own when it failed, else 1 when an error-level rule fired (or, with ``strict``, a
    warning-level one), else 0.

    The report goes to ``out`` (default stderr, so the script's stdout stays its own); ``as_json`` prints
    ``report.as_dict()`` as JSON instead of the human text.
    """
    status, report = audit_script(argv)
    stream = out if out is not None else sys.stderr
    text = json.dumps(report.as_dict(), indent=2) if as_json else format_report(report)
    print(text, file=stream)
    stream.flush()
    if status != 0:
        return status
    return 1 if report.has_errors or (strict and report.has_warnings) else 0
