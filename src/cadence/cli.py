"""The command line: flags -> TrainConfig -> library call. Thin on purpose.

Built on click directly (not typer): the options are generated from TrainConfig's fields, so the dataclass is the one
source of every name, type and help text, and click has been a stable API for a decade.

Bad input never shows a traceback: every problem is one line on stderr naming the flag or file, and the exit status
is 2. A run that fails after starting (divergence) exits with 1.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, get_type_hints

import click

from cadence import __version__
from cadence.config import TrainConfig, build_config, field_help, flag


@click.group(
    name="cadence",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(__version__, prog_name="cadence")
def app() -> None:
    """Training with a big batch on a small accelerator: micro-batches, accumulation, precision, exactly right."""


class _WholeNumberOrAuto(click.ParamType):
    """--micro-batch-size: a whole number, or the word auto."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value == "auto":
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number nor auto", param, ctx)


MICRO_BATCH_SIZE = _WholeNumberOrAuto()


def _click_type(hint: Any) -> click.ParamType:
    """int, float, str, Path and their ``| None`` forms (a missing flag is always None: "not given")."""
    args = set(getattr(hint, "__args__", ())) or {hint}
    if int in args and str in args:
        return MICRO_BATCH_SIZE
    if Path in args:
        return click.Path(path_type=Path)
    if int in args:
        return click.INT
    if float in args:
        return click.FLOAT
    return click.STRING


def _metavar(hint: Any, name: str) -> str:
    kind = _click_type(hint)
    if isinstance(kind, click.Path):
        return "PATH"
    if kind is MICRO_BATCH_SIZE:
        return "N|auto"
    return {"INTEGER": "N", "FLOAT": "X"}.get(kind.name.upper(), name.upper().split("_")[-1])


def config_options(command: Any) -> Any:
    """Decorate ``command`` with --config and one option per TrainConfig field (default None = not given)."""
    hints = get_type_hints(TrainConfig)
    for field in reversed(dataclasses.fields(TrainConfig)):
        default = field.default
        help_text = field_help(field.name)
        if default is not None:
            help_text += f"  [default: {default}]"
        command = click.option(
            flag(field.name), field.name, type=_click_type(hints[field.name]), default=None, help=help_text,
            metavar=_metavar(hints[field.name], field.name),
        )(command)
    return click.option(
        "--config", "config_file", type=click.Path(path_type=Path), default=None,
        help="TOML file with the same names (with '_' instead of '-'); flags win over it.",
    )(command)


@app.command("train")
@config_options
def train_command(config_file: Path | None, **options: Any) -> None:
    """Train a model; writes a run directory (config.json, metrics.jsonl, summary.json, model.safetensors)."""
    from cadence.trainer import train

    train(build_config(toml_path=config_file, flags=options))


def _click_problem(err: click.ClickException) -> str:
    """click's errors in the same '<flag>: <message>' form as every other problem."""
    if isinstance(err, click.BadParameter) and err.param is not None and err.param.opts:
        name = max(err.param.opts, key=len)
        if isinstance(err, click.MissingParameter):
            return f"{name}: a value is required"
        return f"{name}: {err.message.rstrip('.')}"
    if isinstance(err, click.NoSuchOption):
        hint = f"; did you mean {', '.join(sorted(err.possibilities))}?" if err.possibilities else ""
        return f"{err.option_name}: no such option (see cadence train --help){hint}"
    if isinstance(err, click.BadOptionUsage):
        return f"{err.option_name}: {err.message.rstrip('.')}"
    return err.format_message()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cadence`` console script; returns the exit status."""
    from cadence.errors import UsageError
    from cadence.trainer import TrainingFailed

    try:
        app.main(args=argv if argv is not None else sys.argv[1:], prog_name="cadence", standalone_mode=False)
    except click.exceptions.Exit as done:
        return int(done.exit_code or 0)
    except click.exceptions.Abort:
        print("cadence: aborted", file=sys.stderr)
        return 130
    except click.ClickException as err:  # unknown flag, bad type, missing value
        print(f"cadence: error: {_click_problem(err)}", file=sys.stderr)
        return 2
    except UsageError as err:
        for problem in err.problems:
            print(f"cadence: error: {problem}", file=sys.stderr)
        return 2
    except TrainingFailed as err:
        print(f"cadence: training failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
