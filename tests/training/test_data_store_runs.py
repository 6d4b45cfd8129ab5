"""Runs through the token store: `cadence prepare-data`, training from a prepared store, and resume against data
whose content changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import train_args, write_jsonl

from cadence.cli import main
from cadence.training.run_dir import read_metrics


def args(data: Path, out: Path, cache: Path, *extra: str, steps: int = 4) -> list[str]:
    return train_args(data, out, *extra, steps=steps, seq_len=48, micro=2, cache=cache)


def losses(run: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run)]


def test_prepare_data_prints_what_the_store_holds_and_finds_it_again(tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    cache = tmp_path / "cache"
    assert main(["prepare-data", "--data", str(data), "--data-cache", str(cache), "--seq-len", "48"]) == 0
    first = capsys.readouterr().out
    assert "built in" in first and "train: " in first and " examples, " in first and "targets" in first
    assert "at --seq-len 48:" in first and "#" in first  # the length histogram
    assert main(["prepare-data", "--data", str(data), "--data-cache", str(cache), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["built"] is False and summary["dtype"] == "uint8" and summary["train"]["examples"] > 0
    assert sum(b["examples"] for b in summary["train"]["length_histogram"]) == summary["train"]["examples"]


def test_training_on_a_prepared_store_is_training_on_its_source(tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    store = tmp_path / "store"
    assert main(["prepare-data", "--data", str(data), "--out", str(store)]) == 0
    assert (store / "store.json").is_file() and not list(tmp_path.glob(".build-*"))
    assert main(args(data, tmp_path / "from-source", tmp_path / "cache")) == 0
    assert main(args(store, tmp_path / "from-store", tmp_path / "cache")) == 0
    assert losses(tmp_path / "from-store") == losses(tmp_path / "from-source")
    configs = [json.loads((tmp_path / run / "config.json").read_text()) for run in ("from-source", "from-store")]
    assert configs[0]["data_fingerprint"] == configs[1]["data_fingerprint"]
    assert configs[1]["data_store"] == str(store)
    # --out never overwrites: a second build into the same directory is refused, naming --out.
    capsys.readouterr()
    assert main(["prepare-data", "--data", str(data), "--out", str(store)]) == 2
    assert "--out" in capsys.readouterr().err


def test_resume_refuses_data_whose_content_changed(tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert main(args(data, run, cache, steps=2)) == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    # The same file name, other content (one example more): never silently mixed into the run.
    data.write_text(data.read_text() + json.dumps({"text": "one more example to change the data"}) + "\n")
    capsys.readouterr()
    assert main(args(data, run, cache, "--resume", steps=4)) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "resume" in err.lower()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_resume_accepts_the_same_content_under_another_name_or_as_a_store(tmp_path: Path, capsys) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert main(args(data, run, cache)) == 0
    copy = tmp_path / "moved" / "renamed.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    store = tmp_path / "store"
    assert main(["prepare-data", "--data", str(copy), "--out", str(store)]) == 0
    capsys.readouterr()
    for same_content in (copy, store):
        assert main(args(same_content, run, cache, "--resume")) == 0
        assert "resuming from" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--data-cache"])
def test_an_unusable_cache_is_a_usage_error_naming_the_flag(tmp_path: Path, capsys, flag: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(args(write_jsonl(tmp_path / "d.jsonl"), tmp_path / "run", blocker / "cache")) == 2
    assert f"{flag}:" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case, extra, where", [
    ("missing", ["--data", "{tmp}/absent.jsonl"], "--data"),
    ("suffix", ["--data", "{tmp}/notes.md"], "--data"),
    ("seq-len", ["--data", "{tmp}/d.jsonl", "--seq-len", "0"], "--seq-len"),
    ("bad line", ["--data", "{tmp}/bad.jsonl"], "bad.jsonl:2"),
    ("out exists", ["--data", "{tmp}/d.jsonl", "--out", "{tmp}"], "--out"),
    ("too-long choice", ["--data", "{tmp}/d.jsonl", "--too-long", "cut"], "--too-long"),
    # Issue 30: a store that --too-long error refuses at --seq-len is written neither to the cache nor to --out.
    ("too long", ["--data", "{tmp}/long.jsonl", "--seq-len", "16", "--too-long", "error"], "long.jsonl:2"),
    ("too long --out", ["--data", "{tmp}/long.jsonl", "--seq-len", "16", "--too-long", "error", "--out",
                        "{tmp}/store"], "long.jsonl:2"),
])
def test_prepare_data_bad_input_is_one_line_per_problem_and_exit_2(tmp_path: Path, capsys, case: str,
                                                                   extra: list[str], where: str) -> None:
    write_jsonl(tmp_path / "d.jsonl")
    (tmp_path / "notes.md").write_text("hello")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine text"}\n{"text": 3}\n')
    (tmp_path / "long.jsonl").write_text(LONG_JSONL)
    cache = tmp_path / "cache"
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["prepare-data", "--data-cache", str(cache), *(a.format(tmp=tmp_path) for a in extra)]
    assert main(argv) == 2, case
    err = capsys.readouterr().err
    assert err.startswith("cadence: error: ") and where in err and "Traceback" not in err, err
    assert not cache.exists() or not [p for p in (cache / "stores").iterdir()] + [p for p in (cache / "sources")
                                                                                   .iterdir()]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == before  # no --out, no .build-*


LONG_JSONL = "".join(json.dumps(row) + "\n" for row in [
    {"prompt": "Q: 1+1?", "completion": " 2"},
    {"prompt": "Q: what is the sum of all of these numbers?", "completion": " 45"},  # longer than --seq-len 16
    {"prompt": "Q: 2+2?", "completion": " 4"},
    {"text": "a text far longer than sixteen bytes"},  # longer than --seq-len 16
    {"prompt": "Q: 3+3?", "completion": " 6"},
])


def test_examples_longer_than_seq_len_are_skipped_with_one_note_and_a_resume_keeps_the_policy(
        tmp_path: Path, capsys) -> None:
    data, run = tmp_path / "long.jsonl", tmp_path / "run"
    data.write_text(LONG_JSONL)
    base = train_args(data, run, steps=2, seq_len=16, micro=1, accum=1, cache=tmp_path / "cache")
    assert main(base) == 0
    out = capsys.readouterr().err  # the console banner
    assert "note: 2 of 5 examples are longer than --seq-len 16 and were skipped" in out and "3 examples" in out
    assert json.loads((run / "config.json").read_text())["too_long"] == "skip"
    # prepare-data says the same at that --seq-len.
    assert main(["prepare-data", "--data", str(data), "--data-cache", str(tmp_path / "cache"), "--seq-len", "16"]) == 0
    assert "note: 2 of 5 examples are longer than --seq-len 16 and were skipped" in capsys.readouterr().out
    # Other examples would be trained on: a resume refuses another --too-long.
    assert main([*base, "--resume", "--too-long", "truncate"]) == 2
    assert "--too-long: 'truncate' differs from the checkpoint's 'skip'" in capsys.readouterr().err


def test_a_cached_store_damaged_between_a_kill_and_the_resume_is_rebuilt_and_the_run_is_the_uninterrupted_one(
        tmp_path: Path, capsys) -> None:
    """Issue 29 item 3: adding 1 to every byte of the cached tokens.bin used to resume silently on other tokens."""
    data = write_jsonl(tmp_path / "data.jsonl")
    cache = tmp_path / "cache"
    assert main(args(data, tmp_path / "whole", cache)) == 0
    run = tmp_path / "run"
    assert main(args(data, run, cache)) == 0
    shutil.rmtree(sorted((run / "checkpoints").iterdir())[-1])  # as if killed after the checkpoint of step 2
    (store,) = [p for p in (cache / "stores").iterdir() if not p.name.startswith(".")]
    tokens = store / "tokens.bin"
    tokens.write_bytes(bytes((b + 1) % 256 for b in tokens.read_bytes()))
    capsys.readouterr()
    assert main(args(data, run, cache, "--resume")) == 0
    err = capsys.readouterr().err
    assert "tokens.bin does not match the checksum" in err and "building it again from the source" in err
    assert losses(run) == losses(tmp_path / "whole")


def test_resume_refuses_a_store_with_other_tokens_than_the_checkpoint_s(tmp_path: Path, capsys) -> None:
    """The run records the store's digest: the same source content read into other tokens is refused by name."""
    data = write_jsonl(tmp_path / "data.jsonl")
    run = tmp_path / "run"
    assert main(args(data, run, tmp_path / "cache", steps=2)) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["data_store_digest"].startswith("sha256:")
    config["data_store_digest"] = "sha256:" + "0" * 64  # as a store rebuilt another way would differ
    (run / "config.json").write_text(json.dumps(config))
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    from cadence.training.checkpoint import INFO_FILE, MANIFEST_FILE
    info = json.loads((checkpoint / INFO_FILE).read_text())
    info["resolved_config"]["data_store_digest"] = config["data_store_digest"]
    (checkpoint / INFO_FILE).write_text(json.dumps(info))
    import hashlib
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["sha256"] = {name: hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
                          for name in manifest["sha256"]}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(args(data, run, tmp_path / "cache", "--resume")) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "holds other tokens than the one the checkpoint was trained on" in err


def test_a_store_truncated_while_the_run_reads_it_ends_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 29 item 11: the StoreDamaged raised mid-run used to end in a traceback."""
    from cadence.training import loop

    data = write_jsonl(tmp_path / "data.jsonl")
    cache = tmp_path / "cache"
    real_after_step = loop.TrainingRun.after_step

    def truncate_after_the_first_step(self, place, outcome, caught):  # type: ignore[no-untyped-def]
        for tokens in (cache / "stores").glob("*/tokens.bin"):
            with open(tokens, "r+b") as handle:
                handle.truncate(10)
        return real_after_step(self, place, outcome, caught)

    monkeypatch.setattr(loop.TrainingRun, "after_step", truncate_after_the_first_step)
    assert main(args(data, tmp_path / "run", cache, "--prefetch-windows", "0")) == 1
    err = capsys.readouterr().err
    assert "cadence: training failed: " in err and "shorter than its store.json says" in err and "--resume" in err
    assert "Traceback" not in err


def _file_size_limit(limit_bytes: int):  # type: ignore[no-untyped-def]
    """RLIMIT_FSIZE in the child: a write past it fails with EFBIG, as a full disk fails with ENOSPC."""
    import resource
    import signal

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_store_build_that_runs_out_of_space_is_one_line_and_leaves_nothing(tmp_path: Path, kind: str) -> None:
    """Issue 29 item 6: a full cache file system while building a store ended in an ENOSPC traceback."""
    import subprocess
    import sys

    if kind == "text":
        data = tmp_path / "big.txt"
        data.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 50_000)  # 2.2 MB of tokens
    else:
        data = tmp_path / "big.jsonl"
        data.write_text("".join(json.dumps({"text": f"example {i} " * 40}) + "\n" for i in range(6000)))
    cadence = str(Path(sys.executable).with_name("cadence"))
    result = subprocess.run([cadence, *args(data, tmp_path / "run", tmp_path / "cache")], capture_output=True,
                            text=True, timeout=300, preexec_fn=_file_size_limit(1 << 20))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("cadence: data failed:")]
    assert "cannot write the token store" in line and "--data-cache" in line
    assert not (tmp_path / "run").exists()
    assert [p.name for p in (tmp_path / "cache" / "stores").iterdir()] == []


@pytest.mark.slow
def test_sigterm_during_a_parallel_jsonl_build_prints_no_worker_traceback(tmp_path: Path) -> None:
    """Issue 29 item 14: the workers used to finish their ranges and print BrokenPipeError tracebacks."""
    import signal
    import subprocess
    import sys
    import time

    data = tmp_path / "big.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i} " * 8, "completion": f"answer {i} " * 30}) + "\n"
                            for i in range(150_000)))
    cadence = str(Path(sys.executable).with_name("cadence"))
    cache = tmp_path / "cache"
    child = subprocess.Popen([cadence, *args(data, tmp_path / "run", cache)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list((cache / "stores").glob(".build-*/parts/*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    time.sleep(1.0)  # any worker left would print its traceback by now (its stderr is the pipe read above)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert child.returncode != 0
