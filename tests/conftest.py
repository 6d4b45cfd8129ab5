"""Fixtures only; the helpers behind them live in helpers.py (import from there, not from here)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch
from helpers import prompt_completion_dataset, sample_text

from cadence.data import TokenDataset, pack_bytes


@pytest.fixture(autouse=True, scope="session")
def private_home() -> Iterator[None]:
    """HOME for the test session (and every process it starts): the default token-store cache
    (~/.cache/cadence/data) fills a throw-away folder, never the developer's own cache."""
    saved = os.environ.get("HOME")
    home = tempfile.mkdtemp(prefix="cadence-test-home-")
    os.environ["HOME"] = home
    yield
    if saved is not None:
        os.environ["HOME"] = saved
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def one_thread_per_worker() -> Iterator[None]:
    """Under pytest-xdist (make test runs two workers on this 2-core machine) each worker computes with one intra-op
    thread: two workers of two threads each would spin-wait for each other's cores. A test that compares a result
    with another process's, or sets threads itself (the one_thread fixture), is unaffected: it asks for what it needs.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # set by pytest-xdist in its workers only
        yield
        return
    saved, saved_env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    # And every process a test starts: a run in this process and one in a child must add up in the same order (the
    # bitwise resume tests compare them; 1 against 2 threads once differed in the 7th digit).
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(saved)
    if saved_env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = saved_env


@pytest.fixture
def packed_dataset() -> TokenDataset:
    """40 packed sequences of 16 tokens: every position is a target."""
    return pack_bytes(sample_text(40 * 16 + 1), 16)


@pytest.fixture
def variable_dataset() -> TokenDataset:
    return prompt_completion_dataset()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread while profiling: on 2 shared cores, OpenMP threads that spin-wait for a busy core make
    steps several times slower whenever another process runs. The memory measured does not depend on it."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (--dist loadgroup, make test), the tests that share a module-scoped fixture (a set of runs
    made once for the module, such as the distributed runs) go to one worker, so that the fixture is made once, not
    once per worker; every other test is spread over the workers one by one."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        definitions = info.name2fixturedefs.values() if info is not None else ()
        if any(defs and defs[-1].scope == "module" for defs in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
