"""Node-local data caches (issue 38 item 6): on several nodes each node may build or open its own token store on its
own disk, and the ranks check that they hold the same data before anything is written.

Two torchrun agents on this machine stand for two nodes (one rank each, a c10d rendezvous on loopback), each given a
--data-cache of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_jsonl

from cadence.cli import main
from cadence.errors import UsageError
from cadence.training.run_dir import read_metrics
from cadence.training.same_data import DataIdentity, different_data

ARGS = ["--seq-len", "32", "--micro-batch-size", "2", "--max-steps", "4", "--lr", "3e-3", "--val-fraction", "0.1",
        "--checkpoint-every", "0", "--too-long", "truncate"]


def two_nodes(out: Path, per_node: list[list[str]]) -> list[tuple[int, str]]:
    """``cadence train`` on two torchrun agents as two nodes, node i with the arguments ``per_node[i]`` besides
    ARGS; (exit status, stderr) of each agent."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "-m", "cadence", "train", "--grad-accum-steps", "2", "--out", str(out), *ARGS, *per_node[node]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    ) for node in (0, 1)]
    errors = [agent.communicate(timeout=300)[1] for agent in agents]
    return [(agent.returncode, error) for agent, error in zip(agents, errors, strict=True)]


@pytest.mark.slow
def test_two_nodes_with_their_own_caches_train_like_one_process(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")
    out = tmp_path / "two-nodes"
    caches = [tmp_path / "node-a-cache", tmp_path / "node-b-cache"]
    results = two_nodes(out, [["--data", str(data), "--data-cache", str(cache)] for cache in caches])
    assert [status for status, _ in results] == [0, 0], [err[-2000:] for _, err in results]
    for cache in caches:  # each node built a store of its own
        assert any(path.name == "store.json" for path in cache.rglob("store.json")), sorted(cache.rglob("*"))
    assert main(["train", "--data", str(data), "--grad-accum-steps", "4", "--out", str(tmp_path / "one"),
                 "--data-cache", str(tmp_path / "one-cache"), *ARGS]) == 0
    nodes, one = read_metrics(out), read_metrics(tmp_path / "one")
    assert [row["step"] for row in nodes] == [1, 2, 3, 4]
    for mine, theirs in zip(nodes, one, strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]


@pytest.mark.slow
def test_nodes_whose_stores_hold_other_data_stop_before_writing_naming_the_rank(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "examples.jsonl")
    other = tmp_path / "other" / "examples.jsonl"  # what a node's local copy became: one example edited
    other.parent.mkdir()
    other.write_text(data.read_text().replace("ok", "no", 1))
    out = tmp_path / "two-nodes"
    results = two_nodes(out, [["--data", str(data), "--data-cache", str(tmp_path / "node-a-cache")],
                              ["--data", str(other), "--data-cache", str(tmp_path / "node-b-cache")]])
    # torchrun's own status is 1 whenever a worker fails; each worker's (2, bad input) is in its report.
    assert [status for status, _ in results] == [1, 1], [err[-2000:] for _, err in results]
    assert all("exitcode  : 2 " in err for _, err in results), [err[-2000:] for _, err in results]
    said = [line for _, err in results for line in err.splitlines() if "do not hold the same data" in line]
    print(said)
    assert len(said) == 1, said  # rank 0 speaks for both
    assert said[0].startswith("cadence: error: --data: the ranks do not hold the same data")
    assert f"rank 1 on {socket.gethostname()} (" in said[0] and "node-b-cache" in said[0]
    assert not out.exists()  # nothing written, the directory the claim made removed again


def identity(rank: int, **changes: object) -> DataIdentity:
    found = DataIdentity(rank=rank, host=f"node-{rank}", store=f"/local/cache/{rank}/store", digest="sha256:" + "a" * 64,
                         fingerprint="sha256:" + "b" * 64, examples=(48, 5))
    return found._replace(**changes)


@pytest.mark.parametrize(("changed", "differs"), [
    ({}, False),
    ({"host": "elsewhere", "store": "/other/path"}, False),  # another place, the same data
    ({"digest": "sha256:" + "c" * 64}, True),  # other tokens (another tokenizer, another build)
    ({"fingerprint": "sha256:" + "d" * 64}, True),  # another source
    ({"examples": (47, 5)}, True),
])
def test_the_ranks_data_differ_by_content_never_by_place(changed: dict[str, object], differs: bool) -> None:
    problem = different_data([identity(0), identity(1), identity(2, **changed)])
    assert (problem is not None) is differs
    if differs:
        assert problem is not None and "rank 2 on node-2 (/local/cache/2/store" in problem and "rank 1" not in problem
        assert str(UsageError.single("--data", problem)).startswith("--data: the ranks do not hold the same data")
