"""The command line: flags -> TrainConfig -> library call. Thin on purpose.

Built on click directly (not typer): the options are generated from TrainConfig's fields, so the dataclass is the one
source of every name, type and help text, and click has been a stable API for a decade.

Bad input never shows a traceback: every problem is one line on stderr naming the flag or file, and the exit status
is 2. A run that fails after starting (divergence) exits with 1.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import click

from cadence import __version__
from cadence.config import DEVICE_CHOICES, TrainConfig, flag, hint_types, read_field_docs
from cadence.config.commands import PlanOptions, PrepareDataOptions, ProfileOptions, SampleOptions, VerifyOptions
from cadence.config.schema import (
    DISTRIBUTED,
    EVERYDAY,
    FIELD_NAMES,
    FROM_PLAN,
    SECTIONS,
    Section,
    command_fields,
    section_of,
)
from cadence.distributed.torchrun import torchrun_ranks
from cadence.errors import CadenceFailure, UsageError
from cadence.openmp import prefer_passive_wait

# Before any command imports torch: torch's OpenMP threads busy-wait by default, and on a machine whose cores other
# processes share that made a small --data run 10-40x slower than the built-in corpus (cadence/openmp.py says why).
prefer_passive_wait()

# Each command imports what runs it inside its function, not here: `cadence --help` and `cadence COMMAND --help` must
# answer without importing torch (about 2 of the 5 seconds a help took; issue 41). tests/test_cli_help.py checks
# that no help imports it.

OTHER_OPTION_SECTIONS: dict[str, Section] = {"config_file": FROM_PLAN, "nproc_per_node": DISTRIBUTED,
                                              "max_restarts": DISTRIBUTED}
"""The --help section of the options that are not TrainConfig fields (those have their section in the schema)."""


EVERYDAY_TITLE = "Everyday flags (the rest by section below)"

FLAG_ALIASES: dict[str, tuple[str, ...]] = {"lora_targets": ("--lora-target-modules",)}
"""Second spellings of a few flags: peft's own name for the LoRA targets."""
LIST_METAVARS: dict[str, str] = {"lora_targets": "NAME[,NAME]", "message": "[ROLE:]TEXT",
                                 "batch_ramp_tokens": "TOKENS[,TOKENS]"}
"""What a repeatable flag's value looks like, where it is not KEY=VALUE."""


class GroupedCommand(click.Command):
    """A command whose --help lists train's flags under their schema sections instead of one flat list of dozens;
    the command's own options come first, under its name."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        fields = set(FIELD_NAMES)
        sections: dict[str, list[tuple[str, str]]] = {}
        everyday: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            name = param.name or ""
            if name in EVERYDAY:
                everyday[name] = record
                continue
            if "--help" in param.opts:
                title = "Other"
            elif name in fields:
                title = section_of(name).title
            elif name in OTHER_OPTION_SECTIONS:
                title = OTHER_OPTION_SECTIONS[name].title
            else:
                title = f"{(self.name or 'command').capitalize()} options"
            sections.setdefault(title, []).append(record)
        schema_order = [section.title for section in SECTIONS]
        order = [title for title in sections if title not in schema_order and title != "Other"]
        if everyday:  # after the command's own options, in EVERYDAY's order: a first run's flags before the rare ones
            sections[EVERYDAY_TITLE] = [everyday[name] for name in EVERYDAY if name in everyday]
            order.append(EVERYDAY_TITLE)
        order += [title for title in schema_order if title in sections] + (["Other"] if "Other" in sections else [])
        for title in order:
            with formatter.section(title):
                formatter.write_dl(sections[title])


@click.group(
    name="cadence",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(__version__, prog_name="cadence")
def app() -> None:
    """Training with a big batch on a small accelerator: micro-batches, accumulation, precision, exactly right."""


class _WholeNumberOrWords(click.ParamType):
    """--micro-batch-size: a whole number, or the word auto; --effective-batch-size: also adaptive."""

    def __init__(self, words: tuple[str, ...] = ("auto",)) -> None:
        self.words = words
        self.name = "|".join(("N", *words))

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or value in self.words:
            return value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number nor {' nor '.join(self.words)}", param, ctx)


MICRO_BATCH_SIZE = _WholeNumberOrWords()


class _Path(click.Path):
    """A file or directory; never the empty string, which Path() reads as "." (--data "" trained on the current
    directory)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str) and value == "":
            self.fail("the path is empty (give . for the current directory)", param, ctx)
        return super().convert(value, param, ctx)


PATH = _Path(path_type=Path)


def _click_type(hint: Any) -> click.ParamType:
    """int, float, str (a Literal of choices too), Path and their ``| None`` forms (a missing flag is always None:
    "not given")."""
    args = hint_types(hint)
    if int in args and str in args:
        words = _choices(hint)
        return MICRO_BATCH_SIZE if words == ("auto",) else _WholeNumberOrWords(words)
    if Path in args:
        return PATH
    if int in args:
        return click.INT
    if float in args:
        return click.FLOAT
    return click.STRING


def _choices(hint: Any) -> tuple[str, ...]:
    """The choices of a Literal-typed field (``PrecisionName`` -> fp32, bf16, fp16), also inside ``| None``."""
    members = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    return tuple(str(choice) for member in members if get_origin(member) is Literal for choice in get_args(member))


def _metavar(hint: Any, name: str) -> str:
    choices = _choices(hint)
    if choices and not int in hint_types(hint):  # the choices themselves, as --help should show them
        return "[" + "|".join(choices) + "]"
    kind = _click_type(hint)
    if isinstance(kind, click.Path):
        return "PATH"
    if isinstance(kind, _WholeNumberOrWords):
        return kind.name
    return {"INTEGER": "N", "FLOAT": "X"}.get(kind.name.upper(), name.upper().split("_")[-1])


def dataclass_options(cls: type, names: tuple[str, ...] | None = None) -> Callable[[Any], Any]:
    """Decorate a command with one option per field of ``cls`` (default None = not given), help from docstrings."""
    hints = get_type_hints(cls)
    docs = read_field_docs(cls)
    fields = [f for f in dataclasses.fields(cls) if names is None or f.name in names]

    def decorate(command: Any) -> Any:
        for field in reversed(fields):
            help_text = docs.get(field.name, "")
            if "list" in str(hints[field.name]):  # repeatable: --model-config a=1 --model-config b=2
                command = click.option(flag(field.name), *FLAG_ALIASES.get(field.name, ()), field.name,
                                       multiple=True, default=None, metavar=LIST_METAVARS.get(field.name, "KEY=VALUE"),
                                       help=help_text)(command)
                continue
            if hints[field.name] is bool:
                # A switch with its off form (--packing / --no-packing); None = not given, so that the TOML file,
                # or on --resume the run's recorded configuration, decides.
                switch = f"{flag(field.name)}/--no-{flag(field.name)[2:]}"
                command = click.option(switch, field.name, default=None, help=help_text)(command)
                continue
            if field.default is not None:
                help_text += f"  [default: {field.default}]"
            command = click.option(
                flag(field.name), field.name, type=_click_type(hints[field.name]), default=None, help=help_text,
                metavar=_metavar(hints[field.name], field.name),
            )(command)
        return command

    return decorate


def _own_options(cls: type, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A command's own options (``cls``: its options dataclass; the given ones, the rest at their defaults) and
    train's flags, which every command turns into a TrainConfig the same way (:func:`_train_config`)."""
    own = {f.name for f in dataclasses.fields(cls)}
    return (cls(**{k: v for k, v in options.items() if k in own and v is not None}),
            {k: v for k, v in options.items() if k not in own})


def _train_config(config_file: Path | None, flags: dict[str, Any], *, command: str = "train") -> TrainConfig:
    """Flags over the --config file over the defaults, and then --plan's decision (where the command takes --plan:
    a flag that contradicts the plan is an error; only train runs an adaptive plan)."""
    from cadence.config.from_plan import apply_plan
    from cadence.config.sources import build_config, given_keys

    config = build_config(toml_path=config_file, flags=flags)
    if config.plan is not None:
        config = apply_plan(config, given_keys(toml_path=config_file, flags=flags), command=command)
    return config


def config_file_option(command: Any) -> Any:
    return click.option(
        "--config", "config_file", type=PATH, default=None,
        help="TOML file with the same names (with '_' instead of '-'), or a run's config.json (its recorded "
             "configuration); flags win over it.",
    )(command)


def nproc_option(command: Any) -> Any:
    return click.option(
        "--nproc-per-node", "nproc_per_node", type=click.IntRange(min=1), default=None, metavar="N",
        help="Start N processes on this machine with torchrun (one per GPU; DDP, or FSDP2 with --strategy fsdp); the "
             "same as torchrun --standalone --nproc-per-node N -m cadence COMMAND ...")(command)


@app.command("train", cls=GroupedCommand)
@config_file_option
@dataclass_options(TrainConfig, command_fields("train"))
@nproc_option
@click.option("--max-restarts", "max_restarts", type=click.IntRange(min=0), default=0, metavar="K",
              help="With --nproc-per-node: when a rank fails, start all of them again, up to K times (torchrun "
                   "--max-restarts K); each restart resumes --out from its newest complete checkpoint.")
@click.pass_context
def train_command(ctx: click.Context, config_file: Path | None, nproc_per_node: int | None, max_restarts: int,
                  **options: Any) -> None:
    """Train a model; writes a run directory (config.json, metrics.jsonl, summary.json, model.safetensors)."""
    from cadence.training.loop import train

    config = _train_config(config_file, options)
    if max_restarts and nproc_per_node is None:
        raise UsageError.single("--max-restarts", "restarts the ranks that --nproc-per-node starts; under torchrun "
                                                  "give torchrun --max-restarts instead")
    _on_every_rank(ctx, "train", config, nproc_per_node, lambda ranks: train(config, ranks=ranks),
                   max_restarts=max_restarts)


def _on_every_rank(ctx: click.Context, command: str, config: TrainConfig, nproc_per_node: int | None,
                   run: Callable[[Any], Any], *, max_restarts: int = 0) -> None:
    """``run(ranks)`` in this process, or as a rank of torchrun's group, or launched on --nproc-per-node ranks
    (restarted up to ``max_restarts`` times when one fails)."""
    from cadence.config import resolve_device
    from cadence.distributed.launch import arguments_without_nproc, launch
    from cadence.distributed.ranks import SINGLE, start, stop

    if nproc_per_node is not None:

        if torchrun_ranks() is not None:
            raise UsageError.single("--nproc-per-node", "this process was already started by torchrun; give the "
                                                        "number of processes to torchrun only")
        arguments = list((ctx.obj or {}).get("argv", []))
        rank_arguments = arguments_without_nproc(arguments[arguments.index(command) + 1:])
        raise click.exceptions.Exit(launch(command, config, nproc_per_node, rank_arguments, max_restarts=max_restarts))
    if torchrun_ranks() is None:
        run(SINGLE)
        return

    # The flags are validated inside run (every problem named); until then, only sane values start the group.
    device = resolve_device(config.device) if config.device in DEVICE_CHOICES else resolve_device("cpu")
    timeout = config.collective_timeout if config.collective_timeout > 0 else 600.0
    ranks = start(device_type=device.type, strategy=config.strategy,
                  sync_every_micro_step=config.sync_every_micro_step, timeout_s=timeout)
    try:
        run(ranks)
    except CadenceFailure as err:
        # Bad input (the ranks agree on it before raising), a failed verification and agreed failures (divergence)
        # are reached by every rank at the same point: all can leave the group together. Any other failure may be
        # one rank's alone: nothing to wait for.
        if isinstance(err, UsageError) or err.every_rank_agrees:
            stop(ranks)
        raise
    stop(ranks)


@app.command("plan", cls=GroupedCommand)
@config_file_option
@dataclass_options(TrainConfig, command_fields("plan"))
@dataclass_options(PlanOptions)
@click.pass_context
def plan_command(context: click.Context, config_file: Path | None, **options: Any) -> None:
    """Choose micro-batch, accumulation, recompute, offload and precision under --memory-budget for
    --effective-batch-size, by estimate and measured trials; writes plan.json and a report."""
    from cadence.config.sources import build_config, given_keys
    from cadence.plan.planner import make_plan

    plan_options, flags = _own_options(PlanOptions, options)
    constrained = given_keys(toml_path=config_file, flags=flags)
    config = build_config(toml_path=config_file, flags=flags)
    make_plan(config, plan_options, constrained=constrained, started=(context.obj or {}).get("started"))


@app.command("profile", cls=GroupedCommand)
@config_file_option
@dataclass_options(TrainConfig, command_fields("profile"))
@dataclass_options(ProfileOptions)
@click.option("--compare", nargs=2, type=PATH, default=None, metavar="RUN_A RUN_B",
              help="Compare two profile directories side by side instead of profiling (is B faster or leaner than A "
                   "beyond the measured run-to-run noise?).")
def profile_command(config_file: Path | None, compare: tuple[Path, Path] | None, **options: Any) -> None:
    """Profile a few training steps: time and memory per phase, top operators, tokens/s, MFU and a verdict;
    writes trace.json (Chrome/Perfetto), profile.json and a report."""
    from cadence.profiling.compare import terminal_summary, write_comparison
    from cadence.profiling.profiler import run_profile

    if compare is not None:
        given = [flag(k) for k, v in options.items() if v not in (None, ()) and k != "out"]
        if given or config_file is not None:
            raise UsageError.single(given[0] if given else "--config", "--compare takes only RUN_A RUN_B (and --out)")
        comparison, paths = write_comparison(compare[0], compare[1], options.get("out"))
        for line in terminal_summary(comparison):
            click.echo(line)
        click.echo("written: " + ", ".join(str(path) for path in paths))
        return

    profile_options, flags = _own_options(ProfileOptions, options)
    run_profile(_train_config(config_file, flags, command="profile"), profile_options)


@app.command("verify", cls=GroupedCommand)
@config_file_option
@dataclass_options(TrainConfig, command_fields("verify"))
@dataclass_options(VerifyOptions)
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the result as JSON.")
@nproc_option
@click.pass_context
def verify_command(ctx: click.Context, config_file: Path | None, as_json: bool, nproc_per_node: int | None,
                   **options: Any) -> None:
    """Check that a configuration (micro-batch x accumulation, precision, recompute, offload) gives the gradient of
    the whole effective batch in fp32; exit status 1 when it does not."""
    from cadence.verify.check import run_verify

    verify_options, flags = _own_options(VerifyOptions, options)
    config = _train_config(config_file, flags)
    _on_every_rank(ctx, "verify", config, nproc_per_node,
                   lambda ranks: run_verify(config, verify_options, as_json=as_json, ranks=ranks))


@app.command("audit", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--json", "as_json", is_flag=True, default=False, help="Print the audit report as JSON.")
@click.option("--strict", is_flag=True, default=False,
              help="Exit 1 on warnings too (performance-only findings), not only on errors (wrong math or schedule).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- python train.py [ARGS]")
def audit_command(as_json: bool, strict: bool, command: tuple[str, ...]) -> None:
    """Run your own training script with its step chain instrumented, and report the cadence it observed and every
    rule it broke (rule id, explanation, fix, file:line). Your output and exit status pass through; the exit status
    is 1 when an error-level rule fired (the loop's gradient, update or LR schedule is wrong), and with --strict
    also on a warning (performance only)."""
    from cadence.audit.run import run_script

    raise click.exceptions.Exit(run_script(list(command), as_json=as_json, strict=strict))


@app.command("prepare-data", cls=GroupedCommand)
@dataclass_options(TrainConfig, command_fields("prepare-data"))
@dataclass_options(PrepareDataOptions)
def prepare_data_command(**options: Any) -> None:
    """Tokenise --data once into a memory-mapped token store (in --data-cache, or --out DIR) and print what it
    holds: examples, tokens, targets and a length histogram. cadence train then opens it in milliseconds."""
    from cadence.config.sources import build_config
    from cadence.training.prepare_data import prepare_data

    prepare_options, flags = _own_options(PrepareDataOptions, options)
    prepare_data(build_config(toml_path=None, flags=flags), prepare_options)


@app.command("report", no_args_is_help=True)
@click.argument("run_dir", type=PATH, metavar="DIR")
def report_command(run_dir: Path) -> None:
    """(Re)build report.md and report.html (and the plots beside them) of DIR: a run directory (cadence train), a
    plan directory (cadence plan) or a profile directory (cadence profile)."""
    from cadence.rebuild import build_report

    for path in build_report(run_dir):
        click.echo(str(path))


@app.command("export", no_args_is_help=True)
@click.argument("checkpoint", type=PATH, metavar="CHECKPOINT")
@click.option("--out", "out", type=PATH, required=True, metavar="DIR",
              help="A new (or empty) directory for the save_pretrained files.")
def export_command(checkpoint: Path, out: Path) -> None:
    """Write a checkpoint of a run on a transformers model (a run's checkpoints/step-N, whole or sharded) as a
    save_pretrained directory that from_pretrained loads (under --lora-rank the adapter alone, for peft)."""
    from cadence.training.export import export_checkpoint

    for name in export_checkpoint(checkpoint, out):
        click.echo(str(out / name))


@app.command("sample", no_args_is_help=True)
@click.argument("run_dir", type=PATH, metavar="RUN_DIR")
@dataclass_options(SampleOptions)
def sample_command(run_dir: Path, **options: Any) -> None:
    """Generate text from a run's final model (or its best, or a checkpoint's): the prompt's continuation on
    stdout, which weights were used on stderr."""
    from cadence.sampling import sample

    sample_options, _ = _own_options(SampleOptions, options)
    text, run, ended = sample(run_dir, sample_options)
    click.echo(f"weights: {run.weights}" + ("" if ended else " (stopped at --max-new-tokens, not at the end of "
                                                              "sequence)"), err=True)
    click.echo(text)


def _click_problem(err: click.ClickException) -> str:
    """click's errors in the same '<flag>: <message>' form as every other problem."""
    if isinstance(err, click.BadParameter) and err.param is not None and err.param.opts:
        name = max(err.param.opts, key=len)
        if isinstance(err, click.MissingParameter):
            return f"{name}: a value is required"
        return f"{name}: {err.message.rstrip('.')}"
    if isinstance(err, click.NoSuchOption):
        command = err.ctx.info_name if err.ctx is not None else "train"
        known = [opt for param in err.ctx.command.params for opt in param.opts] if err.ctx is not None else []
        # click offers every flag sharing a few letters (--lr-shedule got --resume too): the closest only.
        close = difflib.get_close_matches(err.option_name, known or list(err.possibilities or ()), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{err.option_name}: no such option (see cadence {command} --help){hint}"
    if isinstance(err, click.BadOptionUsage):
        return f"{err.option_name}: {err.message.rstrip('.')}"
    return err.format_message()


def _warning_shower(fallback: Any, prefix: str) -> Any:
    """cadence's own notes (a UserWarning raised from cadence's code) as one ``cadence: warning:`` line; every other
    warning as Python shows it."""
    package = str(Path(__file__).resolve().parent)

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if category is UserWarning and str(Path(filename).resolve()).startswith(package):
            print(f"{prefix}warning: {message}", file=file or sys.stderr, flush=True)
        else:
            fallback(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cadence`` console script; returns the exit status."""
    # When this command started, for a plan's --time-budget: torch and the command's modules are imported after this
    # (the command line imports none of them before its command runs), so their import time counts.
    started = time.perf_counter()
    arguments = argv if argv is not None else sys.argv[1:]
    found = torchrun_ranks()
    # Under torchrun: rank 0 reports what every rank found; another rank speaks only for itself, naming its rank.
    rank = found[0] if found is not None and found[2] > 1 else None
    prefix = "cadence: " if rank is None else f"cadence: rank {rank}: "
    command = next((argument for argument in arguments if not argument.startswith("-")), None)
    if found is not None and command not in (None, "train", "verify"):
        if not rank:  # every rank would say the same
            print(f"cadence: error: cadence {command} runs in one process; start it without torchrun (train and "
                  f"verify run on several)", file=sys.stderr)
        return 2
    try:
        # Without standalone mode click returns an Exit's code instead of raising it (audit passes the script's on).
        with warnings.catch_warnings():  # restores the previous warning display on the way out
            warnings.showwarning = _warning_shower(warnings.showwarning, prefix)
            status = app.main(args=arguments, prog_name="cadence", standalone_mode=False,
                              obj={"argv": arguments, "started": started})
        if isinstance(status, int):
            return status
    except click.exceptions.Exit as done:
        return int(done.exit_code or 0)
    except click.exceptions.Abort:
        print("cadence: aborted", file=sys.stderr)
        return 130
    except click.exceptions.NoArgsIsHelpError as asked:  # bare `cadence` or `cadence report`: show how to use it
        click.echo(asked.ctx.get_help() if asked.ctx is not None else asked.format_message())
        return 0
    except click.ClickException as err:  # unknown flag, bad type, missing value
        _say(f"cadence: error: {_click_problem(err)}")
        return 2
    except CadenceFailure as err:
        # Several ranks: a failure they all reached is said once, by rank 0; a rank's own failure by that rank.
        if rank is None or err.every_rank_agrees:
            speaker = None if rank else "cadence: "
        else:
            speaker = prefix
        for line in err.lines() if speaker else []:
            _say(f"{speaker}{line}")
        return err.exit_status
    except Exception as err:  # last: the specific failures above come first
        if rank is None or not _is_collective_failure(err):
            raise
        print(f"{prefix}training failed: lost contact with another rank ({str(err).splitlines()[0]}); it probably "
              f"died or hung, see its message", file=sys.stderr)
        return 1
    return 0


def _say(line: str) -> None:
    """One line on stderr. A path the user gave may hold bytes that are not UTF-8 (undecodable argv bytes arrive as
    surrogates): they are shown escaped rather than ending in an encoding traceback."""
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)


def _is_collective_failure(err: BaseException) -> bool:
    """An error raised by torch.distributed while waiting for other ranks (closed connection, timeout)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "timed out"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
