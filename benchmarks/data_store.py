"""Benchmark for issue 14: memory and start-up of `cadence train` as the data grows (the memory-mapped token store).

Every figure is of a real `cadence train` process tree (the command, torchrun and every rank or worker it starts),
sampled every --interval-ms from /proc while it runs: the peak of the tree's summed RSS and of its summed PSS (PSS
splits a shared page between the processes that map it, so it is the honest total for a memory-mapped store that
several ranks share; summed RSS counts such a page once per process), the kernel's own per-process peak (VmHWM,
summed) as a cross-check, the wall time, the time to the banner (data loaded, run directory created) and the time to
the first optimizer step (metrics.jsonl gains its first row). Each case runs twice: first with an empty --data-cache
(building the store is part of the start-up), then again on the same cache.

Cases (all data is generated into a temporary directory from the standard library's .py source, and deleted):
  1. text files of 3 MB, 323 MB and 3 GB (3 GB only when `cadence train` has --data-cache and 8 GiB are free);
  2. prompt/completion JSONL of 1,000 and 200,000 examples;
  3. the 3 MB and 323 MB texts again with --nproc-per-node 2, against the one-process runs of case 1;
  4. `cadence prepare-data` throughput in MB/s on the 323 MB text and the 200k JSONL, first build and cached
     (skipped while the command does not exist).
MB here is 2**20 bytes. --data-cache is passed only when `cadence train --help` lists it, so the script also measures
the loader that reads everything into memory (the 3 GB case is then skipped: it would need about 16 GB).

    .venv/bin/python benchmarks/data_store.py [--quick] [--out PATH] [--workdir DIR] [--interval-ms 25]

`make bench-data` runs it and writes benchmarks/results/data_store.json, which write_report.py renders into
BENCHMARKS.md (about 3 minutes on 2 cores without the 3 GB case). --quick (3 MB and 30 MB text, 1k and 5k JSONL, no
3 GB, no two-rank case; about a minute) writes data_store_quick.json, which BENCHMARKS.md never shows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from bench_env import environment, memory_limit_bytes, package_version

MiB = 2**20
GiB = 2**30
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "data_store.json"
TRAIN_FLAGS = ("--model", "gpt-tiny", "--seq-len", "256", "--max-steps", "2", "--micro-batch-size", "8",
               "--grad-accum-steps", "1", "--val-fraction", "0", "--eval-every", "0")
SEQ_LEN = 256
RANKS = 2
MIN_FREE_FOR_3GB = 8 * GiB
PROMPT_BYTES = (20, 200)
"""A prompt longer than --seq-len + 1 bytes leaves the completion no target, which the loader rightly rejects."""
COMPLETION_BYTES = (20, 600)
MEMORY_GUARD = 0.8
"""The tree is killed (and the case marked so) past this share of the memory available when the benchmark starts."""
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Plan:
    text: tuple[tuple[str, int], ...]  # (label, bytes); the first is the base the others are compared with
    jsonl: tuple[tuple[str, int], ...]  # (label, examples); likewise
    ranks: bool
    prepare: tuple[str, ...]  # labels of the text and JSONL inputs to time `cadence prepare-data` on


FULL = Plan(text=(("3 MB", 3 * MiB), ("323 MB", 323 * MiB), ("3 GB", 3 * GiB)),
            jsonl=(("1k", 1_000), ("200k", 200_000)), ranks=True, prepare=("323 MB", "200k"))
QUICK = Plan(text=(("3 MB", 3 * MiB), ("30 MB", 30 * MiB)), jsonl=(("1k", 1_000), ("5k", 5_000)), ranks=False,
             prepare=("30 MB", "5k"))


# ------------------------------------------------------------------------------------------------ the inputs


def stdlib_source() -> tuple[bytes, int]:
    """The standard library's .py files (site-packages and __pycache__ left out), sorted by relative path, joined
    with newlines; files that are not UTF-8 (a few encoding tests) are left out, since a .txt source must be UTF-8.
    Returns the bytes and how many files were left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in ("site-packages", "__pycache__")]
        found += [Path(directory) / name for name in files if name.endswith(".py")]
    parts, skipped = [], 0
    for path in sorted(found, key=lambda p: p.relative_to(root).as_posix()):
        content = path.read_bytes()
        try:
            content.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        parts.append(content)
    return b"\n".join(parts), skipped


def write_text(path: Path, source: bytes, size: int) -> int:
    """``source`` repeated (newline-joined) up to ``size`` bytes, the last copy cut at a line end; returns the size."""
    written = 0
    with open(path, "wb") as handle:
        while written < size:
            piece = source if written == 0 else b"\n" + source
            last = written + len(piece) >= size
            if written + len(piece) > size:
                piece = piece[: piece.rfind(b"\n", 1, size - written) + 1] or piece[: size - written]
            handle.write(piece)
            written += len(piece)
            if last:
                break
    return written


def write_jsonl(path: Path, source: bytes, examples: int, seed: int = 14) -> int:
    """``examples`` prompt/completion lines cut from random places of ``source``; lengths uniform over PROMPT_BYTES
    and COMPLETION_BYTES (before JSON escaping). Returns the file's size."""
    rng = random.Random(seed)

    def cut(low: int, high: int) -> str:
        length = rng.randint(low, high)
        start = rng.randrange(len(source) - length)
        return source[start:start + length].decode("utf-8", errors="ignore")  # a cut through a character drops it

    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(examples):
            record = {"prompt": cut(*PROMPT_BYTES), "completion": cut(*COMPLETION_BYTES)}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path.stat().st_size


# ------------------------------------------------------------------------------------------- the measurement


def _process_tree(root: int) -> list[int]:
    """``root`` and all its descendants now, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces and ')'
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _memory(pid: int) -> tuple[int, int, int] | None:
    """(RSS, PSS, VmHWM) of one process in bytes; None once it has gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in rollup.splitlines() + status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    if "Rss" not in values:  # a zombie, or a kernel thread: nothing mapped
        return None
    return values["Rss"], values.get("Pss", values["Rss"]), values.get("VmHWM", values["Rss"])


def available_memory() -> int:
    """MemAvailable, bounded by the cgroup limit when there is one."""
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    limit = memory_limit_bytes()
    return min(x for x in (available, limit) if x) if (available or limit) else 16 * GiB


@dataclass
class Sampler:
    """Samples a process tree's memory and watches a run directory until the tree's root exits."""

    root: int
    started: float
    interval: float
    metrics: Path | None
    guard_bytes: int
    peak_rss: int = 0
    peak_pss: int = 0
    hwm: dict[int, int] = field(default_factory=dict)
    max_processes: int = 0
    samples: int = 0
    first_step_s: float | None = None
    guard_tripped: bool = False
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            rss = pss = count = 0
            for pid in _process_tree(self.root):
                measured = _memory(pid)
                if measured is None:
                    continue
                rss, pss, count = rss + measured[0], pss + measured[1], count + 1
                self.hwm[pid] = max(self.hwm.get(pid, 0), measured[2])
            self.samples += 1
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.max_processes = max(self.max_processes, count)
            if self.first_step_s is None and self.metrics is not None:
                try:
                    if self.metrics.stat().st_size > 0:
                        self.first_step_s = time.perf_counter() - self.started
                except OSError:
                    pass
            if rss > self.guard_bytes and not self.guard_tripped:
                self.guard_tripped = True
                try:
                    os.killpg(self.root, 9)  # the group this script started (start_new_session), nothing else
                except OSError:
                    pass
            self.stop.wait(self.interval)


def measure(command: list[str], *, metrics: Path | None, interval: float, guard_bytes: int,
            mask: dict[str, str], keep_output: bool = False) -> dict:
    """Run ``command`` to the end, sampling its process tree; every figure of one case."""
    shown = shlex.join(command)
    for path, name in mask.items():
        shown = shown.replace(path, name)
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               start_new_session=True, cwd=ROOT)
    tail: deque[str] = deque(maxlen=40)
    banner: list[float] = []

    def read() -> None:
        for raw in process.stdout:  # type: ignore[union-attr]
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            if not banner and line.startswith("run directory:"):
                banner.append(time.perf_counter() - started)
            tail.append(line)

    sampler = Sampler(process.pid, started, interval, metrics, guard_bytes)
    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=sampler.run, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        returncode = process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        returncode = process.wait()
        tail.append(f"(killed after {RUN_TIMEOUT_S} s)")
    wall = time.perf_counter() - started
    sampler.stop.set()
    for thread in threads:
        thread.join(timeout=10)
    result = {
        "command": shown, "returncode": returncode, "wall_s": round(wall, 3),
        "data_ready_s": round(banner[0], 3) if banner else None,
        "first_step_s": round(sampler.first_step_s, 3) if sampler.first_step_s is not None else None,
        "peak_rss_bytes": sampler.peak_rss, "peak_pss_bytes": sampler.peak_pss,
        "hwm_sum_bytes": sum(sampler.hwm.values()), "max_processes": sampler.max_processes,
        "samples": sampler.samples,
    }
    if sampler.guard_tripped:
        result["error"] = f"killed: the tree's RSS passed {guard_bytes / GiB:.1f} GiB (the memory guard)"
    elif returncode != 0:
        result["error"] = f"exit status {returncode}"
    if "error" in result or keep_output:
        result["output_tail"] = list(tail)
    return result


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# ------------------------------------------------------------------------------------------------- the cases


@dataclass
class Bench:
    cadence: str
    work: Path
    interval: float
    guard_bytes: int
    store: bool  # `cadence train` has --data-cache
    prepare_extra: tuple[str, ...] = ()
    counter: int = 0

    def _fresh(self, name: str) -> Path:
        self.counter += 1
        return self.work / f"{self.counter:02d}-{name}"

    def train_twice(self, name: str, data: Path, processes: int = 1) -> dict:
        """First run on an empty --data-cache, second on the cache the first left (or twice, without a store)."""
        cache = self._fresh(f"cache-{name}")
        runs = {}
        for which in ("first", "second"):
            out = self._fresh(f"run-{name}-{which}")
            command = [self.cadence, "train", *TRAIN_FLAGS, "--data", str(data), "--out", str(out)]
            if self.store:
                command += ["--data-cache", str(cache)]
            if processes > 1:
                command += ["--nproc-per-node", str(processes)]
            runs[which] = measure(command, metrics=out / "metrics.jsonl", interval=self.interval,
                                  guard_bytes=self.guard_bytes, mask={str(self.work): "$TMP"})
            if self.store:
                runs[which]["cache_bytes"] = directory_bytes(cache)
            shutil.rmtree(out, ignore_errors=True)
            print_run(f"{name} x{processes}" if processes > 1 else name, which, runs[which])
        shutil.rmtree(cache, ignore_errors=True)
        return runs

    def prepare_twice(self, name: str, data: Path, size: int) -> dict:
        cache = self._fresh(f"prepare-{name}")
        runs = {}
        for which in ("first", "second"):
            command = [self.cadence, "prepare-data", "--data", str(data), "--data-cache", str(cache),
                       *self.prepare_extra]
            run = measure(command, metrics=None, interval=self.interval, guard_bytes=self.guard_bytes,
                          mask={str(self.work): "$TMP"}, keep_output=True)
            run["mb_per_s"] = round(size / MiB / max(run["wall_s"], 1e-3), 1) if "error" not in run else None
            run["cache_bytes"] = directory_bytes(cache)
            runs[which] = run
            print_run(f"prepare {name}", which, run)
        shutil.rmtree(cache, ignore_errors=True)
        return runs


def help_text(cadence: str, *args: str) -> tuple[int, str, float]:
    started = time.perf_counter()
    done = subprocess.run([cadence, *args, "--help"], capture_output=True, text=True, cwd=ROOT)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - started


def cadence_package() -> str | None:
    """Where the measured `cadence` imports the package from (PYTHONPATH can point it at another checkout)."""
    done = subprocess.run([sys.executable, "-c", "import cadence; print(cadence.__file__)"], capture_output=True,
                          text=True, cwd=ROOT)
    return str(Path(done.stdout.strip()).parent) if done.returncode == 0 else None


def git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# ------------------------------------------------------------------------------------------------ the output


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MiB:,.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_run(name: str, which: str, run: dict) -> None:
    line = (f"  {name:<16} {which:<6} wall {_s(run['wall_s']):>7} s | data {_s(run['data_ready_s']):>6} s | "
            f"1st step {_s(run.get('first_step_s')):>6} s | RSS {_mib(run['peak_rss_bytes']):>6} MB | "
            f"PSS {_mib(run['peak_pss_bytes']):>6} MB | HWM sum {_mib(run['hwm_sum_bytes']):>6} MB")
    if run.get("mb_per_s") is not None:
        line += f" | {run['mb_per_s']:,.1f} MB/s"
    if "error" in run:
        line += f" | FAILED: {run['error']}\n    " + "\n    ".join(run["output_tail"][-8:])
    print(line, flush=True)


def print_summary(result: dict) -> None:
    """The growth figures the issue's targets are about (write_report.py judges them for BENCHMARKS.md)."""
    import write_report  # benchmarks/ is this script's directory, so on sys.path

    print("\n" + "\n".join(write_report.render_data_store(result)))


def code_record() -> dict:
    """The cadence version measured and, when it is this checkout's src/, its commit and whether src/ was modified."""
    package = cadence_package()
    record: dict = {"cadence": package_version("cadence"), "package": package}
    if package is not None and Path(package).resolve().is_relative_to((ROOT / "src").resolve()):
        record["git_commit"] = git("rev-parse", "HEAD")
        # Read-only: --no-optional-locks keeps `git status` from rewriting the index while someone else uses git.
        changes = git("--no-optional-locks", "status", "--porcelain", "--", "src")
        record["src_modified"] = None if changes is None else bool(changes)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 MB and 30 MB text, 1k and 5k JSONL; no 3 GB, no two ranks; writes data_store_quick.json")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--workdir", type=Path, default=None, help="where the temporary inputs and caches go")
    parser.add_argument("--interval-ms", type=float, default=25.0, help="memory sampling interval (20-50 ms)")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.quick and args.out == DEFAULT_OUT:
        args.out = DEFAULT_OUT.with_name("data_store_quick.json")
    began = time.perf_counter()
    cadence = str(Path(sys.executable).with_name("cadence"))
    if not Path(cadence).exists():
        cadence = shutil.which("cadence") or "cadence"
    code, train_help, _ = help_text(cadence, "train")
    if code != 0:
        print(f"`cadence train --help` failed:\n{train_help}", file=sys.stderr)
        return 1
    store = "--data-cache" in train_help
    has_ranks = "--nproc-per-node" in train_help
    prepare_code, prepare_help, prepare_help_s = help_text(cadence, "prepare-data")
    prepare = prepare_code == 0
    # The contract is `prepare-data --data PATH --data-cache DIR`; --seq-len too when it takes one (tokens may
    # depend on it), so that it builds the store `cadence train` opens.
    prepare_extra = ("--seq-len", str(SEQ_LEN)) if prepare and "--seq-len" in prepare_help else ()
    guard = int(MEMORY_GUARD * available_memory())
    notes = []
    if not store:
        notes.append("`cadence train` has no --data-cache: this measures the loader that reads every source into "
                      "memory (no store; the second run repeats the first).")
    print(f"cadence: {cadence} ({package_version('cadence')}); store (--data-cache): {'yes' if store else 'no'}; "
          f"prepare-data: {'yes' if prepare else 'no'}; memory guard {guard / GiB:.1f} GiB", flush=True)

    work = Path(tempfile.mkdtemp(prefix="cadence-bench-data-", dir=args.workdir))
    bench = Bench(cadence, work, args.interval_ms / 1000, guard, store, prepare_extra)
    result: dict = {
        "benchmark": "data_store (issue 14)", "quick": args.quick,
        "environment": environment(),
        "code": code_record(),
        "store_supported": store, "prepare_data_supported": prepare, "nproc_per_node_supported": has_ranks,
        "train_flags": list(TRAIN_FLAGS), "sample_interval_s": bench.interval,
        "memory_available_bytes": available_memory(), "memory_guard_bytes": guard,
        "mb": "2**20 bytes",
    }
    try:
        print(f"generating inputs in {work}", flush=True)
        source, left_out = stdlib_source()
        result["source"] = {"stdlib": sysconfig.get_paths()["stdlib"], "bytes": len(source),
                            "non_utf8_files_left_out": left_out}
        inputs: dict[str, tuple[Path, int]] = {}

        print("text (one process):", flush=True)
        text = []
        for label, size in plan.text:
            entry: dict = {"label": label, "target_bytes": size}
            text.append(entry)
            if size >= GiB and not store:
                entry["skipped"] = ("`cadence train` has no --data-cache; the loader that reads everything into "
                                    "memory would need about 16 GB for 3 GB of text")
            elif size >= GiB and shutil.disk_usage(work).free < MIN_FREE_FOR_3GB:
                entry["skipped"] = (f"{shutil.disk_usage(work).free / GiB:.1f} GiB free in {work.parent}, under "
                                    f"the {MIN_FREE_FOR_3GB / GiB:.0f} GiB needed for the file and its store")
            if "skipped" in entry:
                print(f"  {label}: skipped: {entry['skipped']}", flush=True)
                continue
            path = work / f"text-{label.replace(' ', '')}.txt"
            entry["bytes"] = write_text(path, source, size)
            entry.update(bench.train_twice(label.replace(" ", ""), path))
            if size >= GiB:
                path.unlink()  # used by no later case: give its disk space back now
            else:
                inputs[label] = (path, entry["bytes"])
        result["text"] = text

        print("prompt/completion JSONL:", flush=True)
        jsonl = []
        for label, examples in plan.jsonl:
            path = work / f"sft-{label}.jsonl"
            size = write_jsonl(path, source, examples)
            inputs[label] = (path, size)
            entry = {"label": label, "examples": examples, "bytes": size, "prompt_bytes": list(PROMPT_BYTES),
                     "completion_bytes": list(COMPLETION_BYTES)}
            entry.update(bench.train_twice(f"jsonl-{label}", path))
            jsonl.append(entry)
        result["jsonl"] = jsonl

        if not plan.ranks:
            result["ranks"] = {"skipped": "--quick"}
        elif not has_ranks:
            result["ranks"] = {"skipped": "`cadence train` has no --nproc-per-node"}
        else:
            print(f"text, {RANKS} ranks (--nproc-per-node {RANKS}):", flush=True)
            runs = []
            for label, _ in plan.text[:2]:
                entry = {"label": label, "bytes": inputs[label][1] if label in inputs else None}
                if label in inputs:
                    entry.update(bench.train_twice(label.replace(" ", ""), inputs[label][0], processes=RANKS))
                else:
                    entry["skipped"] = "no input"
                runs.append(entry)
            result["ranks"] = {"processes": RANKS, "runs": runs}

        if not prepare:
            result["prepare_data"] = {"skipped": "`cadence prepare-data --help` failed: the command does not exist "
                                                 "yet", "help_output": prepare_help.strip().splitlines()[-3:]}
            print(f"prepare-data: skipped ({prepare_help.strip().splitlines()[-1] if prepare_help.strip() else ''})")
        else:
            print("cadence prepare-data:", flush=True)
            runs = []
            for label in plan.prepare:
                path, size = inputs[label] if label in inputs else (None, 0)
                kind = " text" if label in dict(plan.text) else "-example JSONL"
                entry = {"label": label + kind, "bytes": size}
                if path is None:
                    entry["skipped"] = "no input"
                else:
                    entry.update(bench.prepare_twice(label.replace(" ", ""), path, size))
                runs.append(entry)
            result["prepare_data"] = {"help_s": round(prepare_help_s, 3), "extra_flags": list(prepare_extra),
                                      "runs": runs}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["notes"] = notes
    result["wall_s"] = round(time.perf_counter() - began, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)")
    failed = [run for entry in all_entries(result) for which, run in entry.items()
              if which in ("first", "second") and "error" in run]
    return 1 if failed else 0


def all_entries(result: dict) -> list[dict]:
    return [*result.get("text", []), *result.get("jsonl", []), *result.get("ranks", {}).get("runs", []),
            *result.get("prepare_data", {}).get("runs", [])]


if __name__ == "__main__":
    sys.exit(main())
