"""Pretrained weights loaded once under FSDP2 (issue 38, item 5): a model directory is built on the meta device and
each rank reads only its own shard's rows from the safetensors; tied weights and the buffers no file holds (rotary
``inv_freq``) come out as ``from_pretrained`` makes them, and 2 FSDP2 ranks train the one-process run's losses (tests/distributed/test_save_hf_sharded.py, which also saves
from them). (The host memory it saves: benchmarks/load_once.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cadence.models.hf import build_hf_model
from cadence.models.pretrained import load_shards

transformers = pytest.importorskip("transformers")


def llama_directory(path: Path, *, tied: bool) -> Path:
    """A 2-layer, width-64 llama saved in bf16 (from_pretrained casts it to fp32, and so must the shard reader)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=tied, rope_theta=5000.0)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_the_meta_build_read_from_the_files_is_what_from_pretrained_loads(tmp_path: Path, tied: bool) -> None:
    directory = llama_directory(tmp_path / "llama", tied=tied)
    before = build_hf_model(str(directory), {})
    after = build_hf_model(str(directory), {}, shard_later=True)
    assert before.pending is None and after.pending is not None
    assert all(param.device.type == "meta" for param in after.model.parameters())
    load_shards(after.model, after.pending, torch.device("cpu"))  # one process: every tensor read whole
    mine, theirs = after.model.state_dict(), before.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[key], theirs[key]) for key in theirs)
    buffers = dict(before.model.named_buffers())
    assert any(name.endswith("inv_freq") for name in buffers)  # in no file: computed by the module
    assert all(torch.equal(buffer, buffers[name]) for name, buffer in after.model.named_buffers())
    head, embedding = after.model.get_output_embeddings().weight, after.model.get_input_embeddings().weight
    assert (head is embedding) == tied
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(after.model(input_ids=ids).logits, before.model(input_ids=ids).logits)


def test_a_directory_whose_files_lack_a_parameter_is_loaded_whole_as_before(tmp_path: Path) -> None:
    directory = llama_directory(tmp_path / "llama", tied=False)
    weights = load_file(str(directory / "model.safetensors"))
    del weights["model.norm.weight"]  # from_pretrained starts it fresh (and says so); no shard of it can be read
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    built = build_hf_model(str(directory), {}, shard_later=True)
    assert built.pending is None and any("model.norm.weight" in note for note in built.notes)
