"""How long `cadence --help` and `cadence train --help` take, each in a fresh process (issue 41, item 3).

The help must answer without importing torch (cadence/lazy.py; tests/test_cli_help.py checks that no help imports
it), target under 0.5 s on a quiet machine. Each command is run ``--runs`` times in new interpreters, interleaved
(A B C A B C ...: a slow spell of a shared machine falls on all of them alike), after `python -m compileall -q src`
so that cadence's bytecode is on disk as `make install` leaves it; the bare interpreter start (`python -c pass`) is
measured the same way, for scale. The load average before and after is recorded: on a loaded machine every figure
grows with it.

    .venv/bin/python benchmarks/cli_help.py [--runs 10]

Writes benchmarks/results/cli_help.json (``--quick``: 3 runs into cli_help_quick.json, never shown).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_env import environment, write_results  # noqa: E402 - a sibling module, by path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# The console script's own three lines (`cadence` is `from cadence.cli import main; sys.exit(main())`), run with
# src/ first on the path so that this checkout is measured, whatever cadence the interpreter has installed.
CADENCE = "import sys; from cadence.cli import main; sys.exit(main())"
COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "cadence --help": ["-c", CADENCE, "--help"],
    "cadence train --help": ["-c", CADENCE, "train", "--help"],
}
PROBE = ("import sys; sys.argv = ['cadence', {argv}]\n"
         "try:\n    from cadence.cli import main; main()\nfinally:\n"
         "    print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")


def run_once(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def imports_torch(argv: list[str], env: dict[str, str]) -> bool:
    """Whether answering this help imported torch (checked once per command, outside the timed runs)."""
    code = PROBE.format(argv=", ".join(repr(a) for a in argv))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stderr.strip().splitlines()[-1] == "TORCH"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="3 runs, into cli_help_quick.json (never shown)")
    args = parser.parse_args()
    runs = 3 if args.quick else args.runs
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(SRC)], check=True, stdout=subprocess.DEVNULL)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for args_ in COMMANDS.values():  # one untimed run each: the page cache holds the files the timed runs read
        run_once(args_, env)
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(runs):
        for name, command in COMMANDS.items():
            times[name].append(run_once(command, env))
    load_after = os.getloadavg()
    output = {
        "runs": runs,
        "median_s": {name: statistics.median(values) for name, values in times.items()},
        "min_s": {name: min(values) for name, values in times.items()},
        "times_s": times,
        "imports_torch": {"cadence --help": imports_torch(["--help"], env),
                          "cadence train --help": imports_torch(["train", "--help"], env)},
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        "environment": environment(),
    }
    for name in COMMANDS:
        print(f"{name:<24} median {output['median_s'][name]:.3f} s, fastest {output['min_s'][name]:.3f} s")
    print(f"load average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"imports torch: {output['imports_torch']}")
    write_results("cli_help", output, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
