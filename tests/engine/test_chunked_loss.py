"""--loss-chunk-tokens (issue 26 item 1): the head and the cross-entropy a chunk of target tokens at a time give the
whole-logits loss and gradient (fp32: to rounding), under autocast, recompute, offload and accumulation; only the
target positions reach the head; the engine keeps its label-convention check."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TINY, relative_l2

from cadence.config import TrainConfig
from cadence.engine import ChunkedCrossEntropy, Engine, token_cross_entropy_sum
from cadence.engine.chunked_loss import chunked_head_cross_entropy_sum
from cadence.memory.recompute import apply_activation_checkpointing
from cadence.models import GPT, GPTConfig
from cadence.models.heads import OutputHead
from cadence.training.components import build_loss, build_optimizer

WIDE = GPTConfig(vocab_size=1024, context_length=40, n_layer=2, n_head=2, n_embd=32)
"""A larger vocabulary than the bytes' 256, so that the logits are most of the memory, as they are in real models."""


def batch(rows: int = 3, length: int = 40, *, vocab: int = 1024, prompt: int = 0, seed: int = 1
          ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length + 1), generator=generator)
    labels = ids[:, 1:].clone()
    labels[:, :prompt] = -100  # prompt/completion data: no loss on the prompt
    return {"input_ids": ids[:, :-1], "labels": labels}


def loss_and_gradients(model: torch.nn.Module, loss_fn, micro_batch: dict[str, torch.Tensor]
                       ) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, micro_batch)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def model(config: GPTConfig = WIDE, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


@pytest.mark.parametrize("chunk", [1, 7, 40, 64, 10_000])
@pytest.mark.parametrize("prompt", [0, 13])
def test_the_chunked_loss_and_gradient_are_the_whole_logits_ones(chunk: int, prompt: int) -> None:
    """fp32 (the loss is fp32 on both paths): only the order of the sums differs, so they agree to rounding
    (measured: 1e-7 relative in the loss, 3e-7 to 7e-7 relative L2 in each parameter's gradient)."""
    gpt = model()
    micro_batch = batch(prompt=prompt)
    whole, whole_grads = loss_and_gradients(gpt, token_cross_entropy_sum, micro_batch)
    chunked, chunked_grads = loss_and_gradients(gpt, ChunkedCrossEntropy(chunk), micro_batch)
    assert chunked == pytest.approx(whole, rel=1e-6)
    for name, grad in whole_grads.items():
        assert relative_l2({name: chunked_grads[name]}, {name: grad}) < 3e-6, name


def test_only_the_target_positions_reach_the_head() -> None:
    gpt = model()
    rows: list[int] = []
    # The hook also sees the model's own (bypassed) call, on [batch, positions, width]; the chunks are [rows, width].
    gpt.lm_head.register_forward_hook(lambda module, args, output: rows.extend(args[0].shape[:-1]))
    micro_batch = batch(rows=2, prompt=30)  # 2 x 10 targets of 2 x 40 positions
    ChunkedCrossEntropy(8)(gpt, micro_batch).backward()
    # The bypassed call, the forward's chunks, then the backward's recomputes (last first).
    assert rows == [2, 40] + [8, 8, 4] + [4, 8, 8]
    rows.clear()
    ChunkedCrossEntropy(20)(gpt, micro_batch).backward()
    assert rows == [2, 40] + [20]  # one chunk holds every target: nothing to gain from recomputing it


def test_the_head_keeps_its_own_forward_after_the_loss() -> None:
    gpt = model()
    ChunkedCrossEntropy(8)(gpt, batch())
    assert "forward" not in gpt.lm_head.__dict__
    assert gpt(batch()["input_ids"]).shape == (3, 40, WIDE.vocab_size)


def test_a_micro_batch_without_targets_adds_nothing() -> None:
    gpt = model()
    micro_batch = batch(prompt=40)
    loss, grads = loss_and_gradients(gpt, ChunkedCrossEntropy(8), micro_batch)
    assert loss == 0.0
    assert all(float(grad.abs().sum()) == 0.0 for grad in grads.values())


def test_without_gradients_nothing_is_checkpointed_and_the_loss_is_the_same() -> None:
    gpt = model()
    micro_batch = batch(prompt=3)
    with torch.no_grad():
        chunked = ChunkedCrossEntropy(8)(gpt, micro_batch)
        whole = token_cross_entropy_sum(gpt, micro_batch)
    assert not chunked.requires_grad
    assert float(chunked) == pytest.approx(float(whole), rel=1e-6)


def test_the_chunks_sum_rows_of_any_head() -> None:
    head = torch.nn.Linear(4, 10)
    hidden, targets = torch.randn(9, 4), torch.randint(0, 10, (9,))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(head(hidden), targets, reduction="sum")
    got = chunked_head_cross_entropy_sum(hidden, targets, OutputHead(module=head), 4).detach()
    assert float(got) == pytest.approx(float(expected), rel=1e-6)  # the loss is fp32, as the default loss's
    with pytest.raises(ValueError, match="at least 1"):
        ChunkedCrossEntropy(0)


def windows(count: int = 3, *, micro: int = 2, accum: int = 2) -> list[list[dict[str, torch.Tensor]]]:
    return [[batch(rows=micro, prompt=(7 * w + 3 * m) % 20, seed=100 * w + m) for m in range(accum)]
            for w in range(count)]


def train(gpt: torch.nn.Module, loss_fn, *, precision: str = "fp32", offload: bool = False,
          steps: list[list[dict[str, torch.Tensor]]] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = Engine(gpt, build_optimizer(gpt, TrainConfig(lr=3e-3)), precision=precision,  # type: ignore[arg-type]
                    max_grad_norm=1.0, loss_fn=loss_fn, offload_activations=offload)
    losses = [engine.step(window).loss for window in steps or windows()]
    return losses, {name: value.detach().clone() for name, value in gpt.state_dict().items()}


@pytest.mark.parametrize(("checkpointing", "offload"), [("none", False), ("full", False), ("selective", False),
                                                        ("none", True)])
def test_engine_steps_give_the_whole_logits_losses_and_weights(checkpointing: str, offload: bool) -> None:
    """Three AdamW steps of 2 micro-batches, prompt lengths differing per micro-batch: the window normalisation
    is kept, whatever the recompute or offload mode."""
    reference, chunked_model = model(), model()  # not a deepcopy: recompute's forwards belong to their blocks
    for each in (reference, chunked_model):
        apply_activation_checkpointing(each, checkpointing)  # type: ignore[arg-type]
    whole_losses, whole_weights = train(reference, token_cross_entropy_sum)
    losses, weights = train(chunked_model, ChunkedCrossEntropy(16), offload=offload)
    assert losses == pytest.approx(whole_losses, rel=1e-6)
    assert relative_l2(weights, whole_weights) < 1e-6


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_under_autocast_the_head_runs_in_the_compute_dtype_and_the_loss_in_fp32(precision: str) -> None:
    from cadence.engine.precision import precision_problem

    if precision_problem(precision, torch.device("cpu")) is not None:  # type: ignore[arg-type]
        pytest.skip(f"{precision} does not run on this CPU")
    gpt = model(GPTConfig(vocab_size=1024, context_length=40, n_layer=1, n_head=2, n_embd=32))
    dtypes: list[torch.dtype] = []
    # Logits only (the hook also sees the bypassed call, which returns the fp32 hidden states).
    gpt.lm_head.register_forward_hook(
        lambda module, args, output: dtypes.append(output.dtype) if output.shape[-1] == 1024 else None)
    steps = windows(2)
    losses, _ = train(copy.deepcopy(gpt), ChunkedCrossEntropy(16), precision=precision, steps=steps)
    head_dtypes = set(dtypes)
    dtypes.clear()
    whole_losses, _ = train(gpt, token_cross_entropy_sum, precision=precision, steps=steps)
    assert head_dtypes == set(dtypes) == {torch.bfloat16 if precision == "bf16" else torch.float16}
    # The same matmuls in the same dtype, row by row: they round alike (measured about 1e-7 apart).
    assert losses == pytest.approx(whole_losses, rel=1e-4)


def test_the_engine_still_refuses_hugging_face_style_labels() -> None:
    gpt = model(TINY)
    ids = torch.randint(0, 256, (2, 16))
    engine = Engine(gpt, build_optimizer(gpt, TrainConfig()), loss_fn=ChunkedCrossEntropy(8))
    with pytest.raises(ValueError, match="labels equal input_ids"):
        engine.step([{"input_ids": ids, "labels": ids.clone()}])


def test_the_loss_is_chosen_from_the_configuration() -> None:
    assert build_loss(TrainConfig()) is token_cross_entropy_sum
    chunked = build_loss(TrainConfig(loss_chunk_tokens=512))
    assert isinstance(chunked, ChunkedCrossEntropy) and chunked.chunk_tokens == 512


def test_evaluation_uses_the_chunked_loss_too() -> None:
    gpt = model()
    held_out = [batch(prompt=4, seed=9)]
    whole = Engine(gpt, build_optimizer(gpt, TrainConfig())).evaluate(held_out)
    chunked = Engine(gpt, build_optimizer(gpt, TrainConfig()), loss_fn=ChunkedCrossEntropy(8)).evaluate(held_out)
    assert chunked == pytest.approx(whole, rel=1e-6)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_compiled_blocks_with_the_chunked_loss_give_the_eager_whole_logits_losses() -> None:
    """--compile compiles the blocks only: the head and the chunks stay eager around them."""
    from cadence.models import compile_blocks, compile_problem

    if compile_problem(torch.device("cpu")) is not None:
        pytest.skip("torch.compile does not run here")
    torch._dynamo.reset()
    steps = windows(2)
    whole_losses, whole_weights = train(model(), token_cross_entropy_sum, steps=steps)
    compiled = model()
    compile_blocks(compiled)
    losses, weights = train(compiled, ChunkedCrossEntropy(16), steps=steps)
    assert losses == pytest.approx(whole_losses, rel=1e-5)
    assert relative_l2(weights, whole_weights) < 1e-4
