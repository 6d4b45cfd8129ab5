"""``--nproc-per-node``: checked against what the machine has before torch's launcher sees the number (no process
is started by these tests)."""

from __future__ import annotations

import pytest
import torch

from cadence.cli import main
from cadence.config import TrainConfig
from cadence.data.sources import available_cores
from cadence.distributed.launch import nproc_problem


def test_a_cpu_run_takes_at_most_one_rank_per_usable_core() -> None:
    cores = available_cores()
    config = TrainConfig(device="cpu")
    assert nproc_problem(config, cores) is None  # the 2-rank tests run on 2 cores
    problem = nproc_problem(config, cores + 1)
    assert problem is not None and str(problem) == (
        f"--nproc-per-node: {cores + 1} is more than the {cores} CPU core(s) this process may use (a CPU run takes "
        f"one core per rank); give at most {cores}")


def test_an_absurd_number_of_ranks_is_one_line_before_anything_starts(tmp_path, capsys) -> None:
    """Issue 29 item 4: 99999999999999999999 printed nothing and grew by gigabytes inside torch's launcher."""
    out = tmp_path / "run"
    status = main(["train", "--nproc-per-node", "99999999999999999999", "--device", "cpu", "--max-steps", "1",
                   "--out", str(out)])
    lines = capsys.readouterr().err.splitlines()
    assert status == 2
    assert lines == [f"cadence: error: --nproc-per-node: 99999999999999999999 is more than the {available_cores()} "
                     f"CPU core(s) this process may use (a CPU run takes one core per rank); give at most "
                     f"{available_cores()}"]
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_a_cuda_run_takes_at_most_one_rank_per_gpu(device: str) -> None:
    gpus = torch.cuda.device_count()
    config = TrainConfig(device=device)
    assert nproc_problem(config, gpus) is None
    problem = nproc_problem(config, gpus + 1)
    assert problem is not None and str(problem) == (
        f"--nproc-per-node: {gpus + 1} is more than the {gpus} GPU(s) of this machine (each rank takes its own GPU); "
        f"give at most {gpus}")
