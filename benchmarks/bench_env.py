"""The machine and library versions a benchmark ran on, recorded into its JSON for ``write_report.py``.

Every benchmark script stores ``environment(...)`` under the key ``"environment"`` so that BENCHMARKS.md can say
where and when each number was measured without anyone typing it in. Standard library and torch only: it is imported
by scripts that run in the ``bench`` venv and by ones that do not.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import torch


def cpu_model() -> str | None:
    """The CPU's marketing name (Linux /proc/cpuinfo, else ``platform.processor()``); None when neither says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def cpu_bf16() -> str | None:
    """"native" when the CPU multiplies bf16 in hardware (avx512_bf16 or amx_bf16 in /proc/cpuinfo), "emulated"
    when it does not: there a bf16 matmul is about 10x slower than fp32 (measured on an AVX2-only EPYC), so bf16
    timings measure the emulation, not what bf16 buys. None off Linux."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), None)
    except OSError:
        return None
    if flags is None:
        return None
    return "native" if {"avx512_bf16", "amx_bf16"} & set(flags) else "emulated"


def memory_total_bytes() -> int | None:
    """Physical memory of the host (Linux /proc/meminfo, else sysconf); None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit_bytes() -> int | None:
    """The cgroup v2 memory limit when one is set: in a container it, not MemTotal, is what a run can use."""
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def gpu_name() -> str | None:
    """The first CUDA device's name, or None on a machine without one (the benchmarks then ran on the CPU)."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (x{torch.cuda.device_count()})"
    return None


def package_version(name: str) -> str | None:
    """Installed version of ``name`` from its metadata (no import, so no start-up cost); None when not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(packages: tuple[str, ...] = ()) -> dict:
    """What ``write_report.py`` shows for a result: when, on which machine, with which versions.

    ``packages`` names extra libraries the benchmark compares against (accelerate, lightning); the others are not
    recorded because they play no part in the numbers.
    """
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "cadence": package_version("cadence")}
    versions.update({name: package_version(name) for name in packages})
    return {
        # UTC and to the second: the date is what a reader needs; the time tells reruns on the same day apart.
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_model": cpu_model(),
        "cpu_bf16": cpu_bf16(),
        "arch": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_total_bytes": memory_total_bytes(),
        "memory_limit_bytes": memory_limit_bytes(),
        "gpu": gpu_name(),
        "versions": versions,
    }


RESULTS = Path(__file__).parent / "results"
"""Where every benchmark writes its JSON and ``write_report.py`` reads it."""


def write_results(stem: str, output: dict, *, quick: bool) -> Path:
    """Write ``output`` as ``results/<stem>.json``, or ``<stem>_quick.json`` for a smoke run (git ignores those and
    ``write_report.py`` never shows them, so quick numbers cannot pass for a full run's); returns the path."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{stem}{'_quick' if quick else ''}.json"
    path.write_text(json.dumps(output, indent=1))
    print(f"wrote {path}")
    return path
