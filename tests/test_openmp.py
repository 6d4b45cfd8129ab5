"""The command line's OpenMP wait policy (cadence/openmp.py): torch's OpenMP runtime, as it reports its own settings
when it loads (``OMP_DISPLAY_ENV``), waits passively under the CLI, keeps a user's choice, and nothing is changed once
torch is loaded."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from cadence.openmp import WAIT_POLICY_VARIABLES, prefer_passive_wait


def _openmp_settings(code: str, **extra: str) -> dict[str, str]:
    """What the OpenMP runtime says it runs with, in a fresh interpreter running ``code`` (which imports torch)."""
    env = {key: value for key, value in os.environ.items() if key not in WAIT_POLICY_VARIABLES}
    env.update(OMP_DISPLAY_ENV="VERBOSE", **extra)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    settings = dict(re.findall(r"^\s*(\w+) = '([^']*)'", done.stderr + done.stdout, flags=re.MULTILINE))
    if "GOMP_SPINCOUNT" not in settings:
        pytest.skip("torch's OpenMP runtime here is not GNU libgomp (it reports no GOMP_SPINCOUNT)")
    return settings


def test_the_command_line_makes_torchs_openmp_threads_wait_passively() -> None:
    # The CLI module is imported before any command imports torch (as `cadence` and `python -m cadence` do). Without
    # the passive wait libgomp spins 300000 times between parallel regions, which made small --data runs 10-40x
    # slower on a shared machine.
    settings = _openmp_settings("import cadence.cli, torch; torch.ones(100_000).sum()")
    assert settings["OMP_WAIT_POLICY"] == "PASSIVE"
    assert settings["GOMP_SPINCOUNT"] == "0"


def test_without_the_command_line_libgomp_busy_waits() -> None:
    # The control: the same runtime on its own spins, so the test above shows cadence's setting, not a default.
    settings = _openmp_settings("import torch; torch.ones(100_000).sum()")
    assert settings["GOMP_SPINCOUNT"] == "300000"


@pytest.mark.parametrize("variable, value", [("GOMP_SPINCOUNT", "12345"), ("OMP_WAIT_POLICY", "ACTIVE")])
def test_a_wait_policy_the_user_chose_is_kept(variable: str, value: str) -> None:
    settings = _openmp_settings("import cadence.cli, torch", **{variable: value})
    assert settings[variable] == value
    if variable == "OMP_WAIT_POLICY":
        assert settings["GOMP_SPINCOUNT"] != "0"


def test_nothing_is_set_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    # This test process has imported torch (cadence's imports do): libgomp has read its settings already, so a
    # setting now would only mislead whoever reads the environment (and the processes it starts).
    import torch  # noqa: F401

    for variable in WAIT_POLICY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert prefer_passive_wait() is False
    assert not any(variable in os.environ for variable in WAIT_POLICY_VARIABLES)
