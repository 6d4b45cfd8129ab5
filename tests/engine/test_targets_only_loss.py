"""The default loss gathers the target positions before the LM head (issue 37 item 7): on prompt/completion-like data
(most positions without a target) its losses and weights are the full-logits ones (fp32: 1e-6) for the built-in GPT
and a transformers llama, under accumulation splits and beside --loss-chunk-tokens; the head never sees a position
without a target; a family with a logit transform (Gemma 2's soft-capping) gives its own full-logits loss; models whose
logits cadence cannot reproduce keep the full logits; the analytic estimate follows the target positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import TINY, relative_l2
from torch import nn

from cadence.config import TrainConfig
from cadence.engine import ChunkedCrossEntropy, Engine, TargetsOnlyCrossEntropy, token_cross_entropy_sum
from cadence.engine.token_loss import LossFn, reads_next_token_labels
from cadence.models import GPT, GPTConfig
from cadence.training.components import build_loss, build_optimizer

WIDE = GPTConfig(vocab_size=1024, context_length=40, n_layer=2, n_head=2, n_embd=32)
"""A vocabulary larger than the bytes' 256: the logits are most of the memory, as in real models."""

LLAMA = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 64, "vocab_size": 1024, "max_position_embeddings": 64}


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(WIDE)


def llama(**overrides: object) -> nn.Module:
    pytest.importorskip("transformers")
    from cadence.models.hf import build_hf_model

    torch.manual_seed(0)
    return build_hf_model("hf:llama", {**LLAMA, **overrides}).model


def prompt_completion(rows: int, *, length: int = 40, vocab: int = 1024, seed: int = 1) -> dict[str, torch.Tensor]:
    """Rows like assistant-only data: a prompt of 60-85% of the positions (no target), a completion, and right
    padding on some rows (no target either): about a fifth of the positions carry a target."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length + 1), generator=generator)
    labels = ids[:, 1:].clone()
    for row in range(rows):
        prompt = int(torch.randint(int(0.6 * length), int(0.85 * length), (), generator=generator))
        padding = int(torch.randint(0, 4, (), generator=generator))
        labels[row, :prompt] = -100
        if padding:
            labels[row, -padding:] = -100
            ids[row, length + 1 - padding:] = 0  # cadence pads on the right: no mask needed, no target there
    return {"input_ids": ids[:, :-1], "labels": labels}


def split(window: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    """One window of samples cut into micro-batches of ``micro`` rows (the same samples, another accumulation)."""
    rows = window["input_ids"].shape[0]
    return [{key: value[start:start + micro] for key, value in window.items()} for start in range(0, rows, micro)]


def loss_and_gradients(model: nn.Module, loss_fn: LossFn, micro_batch: dict[str, torch.Tensor]
                       ) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, micro_batch)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def train(model: nn.Module, loss_fn: LossFn, windows: list[dict[str, torch.Tensor]], micro: int
          ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW steps (clipped), one per window, each window cut into micro-batches of ``micro`` rows."""
    engine = Engine(model, build_optimizer(model, TrainConfig(lr=3e-3)), max_grad_norm=1.0, loss_fn=loss_fn)
    losses = [engine.step(split(window, micro)).loss for window in windows]
    return losses, {name: value.detach().clone() for name, value in model.state_dict().items()}


def data(steps: int = 3, rows: int = 8) -> list[dict[str, torch.Tensor]]:
    return [prompt_completion(rows, seed=10 + step) for step in range(steps)]


def test_most_positions_of_the_test_data_have_no_target() -> None:
    targets = sum(int((window["labels"] != -100).sum()) for window in data())
    assert 0.1 < targets / (3 * 8 * 40) < 0.35


@pytest.mark.parametrize("rows", [0, 2])
def test_the_loss_and_gradient_are_the_full_logits_ones(rows: int) -> None:
    """One micro-batch, fp32: only the order of the sums differs (measured: 1e-7 relative in the loss, about 1e-7
    relative L2 in the gradients). ``rows`` 0: every position of the first row loses its target too."""
    model = gpt()
    micro_batch = prompt_completion(3)
    if not rows:
        micro_batch["labels"][0] = -100
    whole, whole_grads = loss_and_gradients(model, token_cross_entropy_sum, micro_batch)
    gathered, gathered_grads = loss_and_gradients(model, TargetsOnlyCrossEntropy(), micro_batch)
    assert gathered == pytest.approx(whole, rel=1e-6)
    assert relative_l2(gathered_grads, whole_grads) < 1e-6
    for name, grad in whole_grads.items():
        assert relative_l2({name: gathered_grads[name]}, {name: grad}) < 3e-6, name


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_engine_steps_give_the_full_logits_losses_and_weights_under_any_split(family: str) -> None:
    """Three AdamW steps of 8 samples (about a fifth of the positions with a target): one pass of full logits against
    the gathered head cut 8 x 1, 4 x 2 and 2 x 4, and the chunked loss (--loss-chunk-tokens 16) at 2 x 4.

    Measured: losses within 1.6e-7 relative, weights within 5.2e-7 relative L2 (GPT) and 4e-7 (llama). That is the
    rounding floor: the full logits cut 2 x 4 instead of 8 x 1 are 5.2e-7 from themselves, most of it in the key
    biases, whose gradient is zero but for rounding (softmax ignores a shift) and which AdamW's normalisation blows up
    to a full-size step; some chunk sizes land just above 1e-6 for the same reason (7 at 2 x 4: 1.06e-6)."""
    build = gpt if family == "gpt" else llama
    windows = data()
    whole_losses, whole_weights = train(build(), token_cross_entropy_sum, windows, micro=8)
    for loss_fn, micro in [(TargetsOnlyCrossEntropy(), 8), (TargetsOnlyCrossEntropy(), 4),
                           (TargetsOnlyCrossEntropy(), 2), (ChunkedCrossEntropy(16), 2)]:
        losses, weights = train(build(), loss_fn, windows, micro=micro)
        assert losses == pytest.approx(whole_losses, rel=1e-6), (loss_fn, micro)
        assert relative_l2(weights, whole_weights) < 1e-6, (loss_fn, micro)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_head_sees_the_target_positions_only(family: str) -> None:
    """A forward hook on the head records its input's rows: the model's own (bypassed) call on every position, which
    returns its input unchanged, then one call on exactly the target rows; nothing is recomputed in backward."""
    model = gpt() if family == "gpt" else llama()
    head = model.lm_head
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    head.register_forward_hook(lambda module, args, output: calls.append((tuple(args[0].shape),
                                                                          tuple(output.shape))))
    micro_batch = prompt_completion(4)
    targets = int((micro_batch["labels"] != -100).sum())
    assert targets < 0.35 * micro_batch["labels"].numel()
    TargetsOnlyCrossEntropy()(model, micro_batch).backward()
    width = 32
    assert calls == [((4, 40, width), (4, 40, width)),  # bypassed: no logits made
                     ((targets, width), (targets, 1024))]  # the targets' logits, once
    assert "forward" not in head.__dict__  # the head's own forward is back


@pytest.mark.parametrize(("overrides", "transform"), [
    # A cap of 0.5 (Gemma 2 uses 30): the logits are deep in tanh's curve, so a misplaced cap would be far off.
    ({"head_dim": 16, "final_logit_softcapping": 0.5}, "soft-caps"),
])
def test_a_family_with_a_logit_transform_gives_its_own_full_logits_loss(overrides: dict, transform: str) -> None:
    pytest.importorskip("transformers")
    from cadence.models.heads import output_head
    from cadence.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("hf:gemma2", {**LLAMA, **overrides}).model
    assert transform in output_head(model).described
    micro_batch = prompt_completion(3)
    whole, whole_grads = loss_and_gradients(model, token_cross_entropy_sum, micro_batch)
    gathered, gathered_grads = loss_and_gradients(model, TargetsOnlyCrossEntropy(), micro_batch)
    assert gathered == pytest.approx(whole, rel=1e-6)
    assert relative_l2(gathered_grads, whole_grads) < 1e-6
    assert isinstance(build_loss(TrainConfig(), model, vocab_size=1024), TargetsOnlyCrossEntropy)


class ScaledLM(nn.Module):
    """A transformers-style causal LM whose forward scales the logits after its head, in a way no config key says:
    cadence cannot make its logits from the head's input, so it keeps the full logits."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(model_type="scaled")
        self.embed = nn.Embedding(64, 8)
        self.lm_head = nn.Linear(8, 64, bias=False)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.cumsum(self.embed(input_ids), dim=1)) * 0.5


def test_the_loss_is_chosen_from_the_configuration_and_the_model() -> None:
    config = TrainConfig()
    assert isinstance(build_loss(config, gpt(), vocab_size=1024), TargetsOnlyCrossEntropy)
    assert isinstance(build_loss(config, GPT(TINY), vocab_size=256), TargetsOnlyCrossEntropy)
    chunked = build_loss(TrainConfig(loss_chunk_tokens=64), gpt(), vocab_size=1024)
    assert type(chunked) is ChunkedCrossEntropy and chunked.chunk_tokens == 64
    assert build_loss(config, ScaledLM(), vocab_size=64) is token_cross_entropy_sum  # cannot be split at its head
    assert build_loss(config) is token_cross_entropy_sum  # no model to probe
    loss = TargetsOnlyCrossEntropy()
    assert loss.chunk_tokens is None and repr(loss) == "TargetsOnlyCrossEntropy()" and reads_next_token_labels(loss)


def test_a_transformers_llama_gets_the_gathered_head_and_a_trimmed_vocabulary_keeps_full_logits() -> None:
    pytest.importorskip("transformers")
    from cadence.models.hf import build_hf_model

    assert isinstance(build_loss(TrainConfig(), llama(), vocab_size=1024), TargetsOnlyCrossEntropy)
    torch.manual_seed(0)
    trimmed = build_hf_model("hf:inkling2_text", {**LLAMA, "head_dim": 16}).model  # unpadded_vocab_size
    assert build_loss(TrainConfig(), trimmed, vocab_size=1024) is token_cross_entropy_sum


def test_a_model_holding_bf16_weights_is_probed_under_autocast() -> None:
    """A LoRA base in bf16 (--lora-base-precision bf16) runs only under autocast, as --precision bf16 trains it: the
    probe that decides the loss runs it so too, instead of failing on a bf16 weight times an fp32 activation."""
    model = llama()
    for module in model.model.layers.modules():
        if isinstance(module, nn.Linear):
            module.to(torch.bfloat16)
    with pytest.raises(RuntimeError):  # outside autocast this model cannot run at all
        model(torch.zeros(1, 4, dtype=torch.long))
    assert isinstance(build_loss(TrainConfig(), model, vocab_size=1024), TargetsOnlyCrossEntropy)


def test_the_engine_still_refuses_hugging_face_style_labels() -> None:
    model = GPT(TINY)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    engine = Engine(model, build_optimizer(model, TrainConfig()), loss_fn=TargetsOnlyCrossEntropy())
    with pytest.raises(ValueError, match="labels equal input_ids"):
        engine.step([{"input_ids": ids, "labels": ids.clone()}])


def test_evaluation_is_the_full_logits_one() -> None:
    model = gpt()
    held_out = [prompt_completion(4, seed=9)]
    whole = Engine(model, build_optimizer(model, TrainConfig())).evaluate(held_out)
    engine = Engine(model, build_optimizer(model, TrainConfig()), loss_fn=TargetsOnlyCrossEntropy())
    gathered = engine.evaluate(held_out)
    assert gathered == pytest.approx(whole, rel=1e-6)


# ------------------------------------------------------------------------------------------------ the memory estimate
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_estimate_follows_the_target_positions_and_matches_a_measurement(precision: str) -> None:
    """The default path's estimate with the micro-batch's target count (a fifth of the positions) against the
    profiler's measurement of the gathered loss, within 10% (as the chunked loss's estimate is held to); the full
    logits' estimate (``full_logits``) against their own measurement; and the gathered estimate well below it."""
    from helpers import cpu_has_bf16

    from cadence.memory.estimate import estimate_step_memory
    from cadence.memory.measure import measure_step

    if precision == "bf16" and not cpu_has_bf16():
        pytest.skip("bf16 does not run on this CPU")  # fp16 stands in for it: autocast's copies are the same size
    config = GPTConfig(vocab_size=8192, context_length=128, n_layer=2, n_head=2, n_embd=64)
    window = [prompt_completion(4, length=128, vocab=8192, seed=5)]
    targets = int((window[0]["labels"] != -100).sum())
    estimates = {}
    for name, loss_fn in (("gathered", TargetsOnlyCrossEntropy()), ("full", token_cross_entropy_sum)):
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = build_optimizer(model, TrainConfig())
        Engine(model, optimizer, max_grad_norm=1.0, loss_fn=loss_fn).step(window)  # AdamW's state allocated
        engine = Engine(model, optimizer, precision=precision,  # type: ignore[arg-type]
                        max_grad_norm=1.0, loss_fn=loss_fn)
        measured = measure_step(model, optimizer, lambda engine=engine: engine.step(window), "cpu")
        predicted = estimate_step_memory(config, micro_batch_size=4, seq_len=128,
                                         precision=precision,  # type: ignore[arg-type]
                                         checkpointing="none", target_tokens=targets if name == "gathered" else None,
                                         full_logits=name == "full")
        print(f"{precision} {name}: predicted {predicted.peak_bytes / 2**20:.2f} MiB, measured "
              f"{measured.peak_bytes / 2**20:.2f} MiB")
        assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.10 * measured.peak_bytes, (
            name, predicted.summary(), measured.summary())
        estimates[name] = predicted.peak_bytes
    assert estimates["gathered"] < 0.6 * estimates["full"]
    # Knowing only the shapes, the estimate counts every position as a target: no lower than the full logits' by
    # more than a rounding of the gather's bookkeeping.
    conservative = estimate_step_memory(config, micro_batch_size=4, seq_len=128,
                                        precision=precision,  # type: ignore[arg-type]
                                        checkpointing="none").peak_bytes
    assert conservative >= 0.99 * estimates["full"]
    with pytest.raises(ValueError, match="full_logits"):
        estimate_step_memory(config, micro_batch_size=4, seq_len=128, precision=precision,  # type: ignore[arg-type]
                             checkpointing="none", loss_chunk_tokens=64, full_logits=True)
