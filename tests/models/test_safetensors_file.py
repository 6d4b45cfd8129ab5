"""The safetensors format read and written a tensor at a time (cadence.models.safetensors_file): what it writes the
safetensors package reads back bit for bit, rows are read alone, and a header that lies is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cadence.models.safetensors_file import TensorSpec, WeightsUnreadable, read_header, read_tensor, write_streamed

TENSORS = {"w": torch.randn(5, 3), "ids": torch.arange(7), "half": torch.randn(4, 2).to(torch.bfloat16),
           "scalar": torch.tensor(2.5), "none": torch.empty(0, 4)}


def test_a_streamed_file_is_what_safetensors_reads_and_rows_read_alone(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    specs = [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in TENSORS.items()]
    write_streamed(path, specs, iter(TENSORS.values()), {"format": "pt"})
    back = load_file(str(path))
    assert back.keys() == TENSORS.keys() and all(torch.equal(back[name], TENSORS[name]) for name in TENSORS)
    save_file(TENSORS, str(tmp_path / "theirs.safetensors"))  # and the reader reads the package's own files
    for file in (path, tmp_path / "theirs.safetensors"):
        stored = read_header(file)
        assert all(torch.equal(read_tensor(stored[name]), TENSORS[name]) for name in TENSORS)
        assert torch.equal(read_tensor(stored["w"], (1, 4)), TENSORS["w"][1:4])
        assert read_tensor(stored["w"], (5, 5)).shape == (0, 3)


def test_a_failed_write_leaves_no_file_and_consumes_every_tensor(tmp_path: Path) -> None:
    """Ranks gather the tensors together: a rank whose write fails still takes part in every gather."""
    consumed: list[int] = []

    def tensors():  # type: ignore[no-untyped-def]
        for index in range(3):
            consumed.append(index)
            yield torch.zeros(2) if index != 1 else torch.zeros(3)  # the second is not what was announced

    specs = [TensorSpec(f"t{index}", torch.float32, (2,)) for index in range(3)]
    with pytest.raises(ValueError, match="t1 arrived"):
        write_streamed(tmp_path / "out.safetensors", specs, tensors())
    assert consumed == [0, 1, 2] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("header", [b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}',
                                    b'{"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}', b"[1, 2]"])
def test_a_header_that_does_not_describe_its_bytes_is_refused(tmp_path: Path, header: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(WeightsUnreadable):
        read_header(path)
