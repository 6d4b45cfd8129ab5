"""Offloading: the CPU-resident optimizer matches plain AdamW step for step; activation offload keeps gradients."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from cadence import Engine, iter_windows, token_cross_entropy_sum
from cadence.memory.choices import OFFLOAD_MODES
from cadence.memory.offload import activation_offload
from cadence.models import GPT, GPTConfig
from cadence.optim.offload import OffloadedOptimizer, offloaded_state_bytes

GPT_CONFIG = GPTConfig(vocab_size=256, context_length=16, n_layer=2, n_head=2, n_embd=32)
Schedule = Callable[[int], float]


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def two_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices, none on biases: the usual split, with a per-group option."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)) for _ in range(count)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list, schedule: Schedule | None = None,
          scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    if schedule is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    for inputs, targets in data:
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def assert_same_params(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=f"parameter {name} differs")


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def warmup_decay(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.7**step


# ------------------------------------------------------------------------------------------- OffloadedOptimizer
def test_matches_adamw_with_groups_and_lr_schedule() -> None:
    data = batches(6)
    reference, offloaded = small_model(), small_model()
    train(reference, torch.optim.AdamW(two_groups(reference), lr=1e-2), data, warmup_decay)
    optimizer = OffloadedOptimizer(two_groups(offloaded), lr=1e-2)
    train(offloaded, optimizer, data, warmup_decay)
    assert_same_params(reference, offloaded)

    # param_groups hold the model's own (device) parameters; the per-group options reached the inner optimizer.
    assert optimizer.param_groups[0]["params"][0] is offloaded[0].weight
    assert [g["weight_decay"] for g in optimizer.inner.param_groups] == [0.1, 0.0]
    assert optimizer.inner.param_groups[0]["lr"] == pytest.approx(1e-2 * warmup_decay(5))

    # The schedule really acts on the update: a constant LR ends elsewhere.
    constant = small_model()
    train(constant, OffloadedOptimizer(two_groups(constant), lr=1e-2), data, lambda step: 1.0)
    assert max_difference(constant, offloaded) > 1e-4


def test_params_without_grad_are_skipped_like_adamw() -> None:
    reference, offloaded = small_model(), small_model()
    for model in (reference, offloaded):
        model[2].requires_grad_(False)  # frozen layer: its grads stay None
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.5)
    off_opt = OffloadedOptimizer(offloaded.parameters(), lr=1e-2, weight_decay=0.5)
    frozen_before = offloaded[2].weight.detach().clone()
    train(reference, ref_opt, batches(3))
    train(offloaded, off_opt, batches(3))
    assert_same_params(reference, offloaded)
    assert torch.equal(offloaded[2].weight, frozen_before)  # not even weight decay touched it
    assert len(off_opt.state) == len(ref_opt.state) == 2


def test_grad_scaler_steps_and_skips_on_inf() -> None:
    model = small_model()
    optimizer = OffloadedOptimizer(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    (inputs, targets), = batches(1)

    def scaled_backward() -> None:
        scaler.scale(nn.functional.mse_loss(model(inputs), targets)).backward()

    before = copy.deepcopy(model)
    scaled_backward()
    scaler.unscale_(optimizer)  # walks optimizer.param_groups: must find the model's grads
    assert float(model[0].weight.grad.abs().max()) < 100  # really unscaled (a scaled grad would be ~256x)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    assert max_difference(before, model) > 1e-4
    assert scaler.get_scale() == 2.0**8

    before = copy.deepcopy(model)
    steps_before = int(optimizer.state[optimizer.masters[0]]["step"])
    scaled_backward()
    model[0].weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    assert_same_params(before, model, atol=0)
    assert int(optimizer.state[optimizer.masters[0]]["step"]) == steps_before
    assert scaler.get_scale() == 2.0**7


def test_state_dict_round_trip_resumes_exactly() -> None:
    data = batches(5)
    uninterrupted = small_model()
    train(uninterrupted, OffloadedOptimizer(two_groups(uninterrupted), lr=1e-2), data, warmup_decay)

    first = small_model()
    optimizer = OffloadedOptimizer(two_groups(first), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
    train(first, optimizer, data[:3], scheduler=scheduler)
    saved = copy.deepcopy({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})
    # The checkpoint holds the LR the scheduler set AFTER the last step, not the one the inner optimizer last used.
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(1e-2 * warmup_decay(3))
    assert all(t.device.type == "cpu" for s in saved["optimizer"]["state"].values() for t in s.values())

    resumed = copy.deepcopy(first)
    optimizer = OffloadedOptimizer(two_groups(resumed), lr=123.0)  # options come from the checkpoint
    # The usual resume order: build both, then load. (A scheduler built AFTER loading would reset the LR.)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * warmup_decay(3))
    train(resumed, optimizer, data[3:], scheduler=scheduler)
    assert_same_params(uninterrupted, resumed)


def test_parameters_written_after_construction_are_picked_up() -> None:
    """model.load_state_dict AFTER building the optimizer (the usual resume order) must not be undone by step()."""
    trained = small_model(seed=5)
    reference, offloaded = small_model(), small_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    off_opt = OffloadedOptimizer(offloaded.parameters(), lr=1e-2)
    reference.load_state_dict(trained.state_dict())
    offloaded.load_state_dict(trained.state_dict())
    train(reference, ref_opt, batches(2))
    train(offloaded, off_opt, batches(2))
    assert_same_params(reference, offloaded)


def test_deepcopy_is_independent() -> None:
    model = small_model()
    optimizer = OffloadedOptimizer(model.parameters(), lr=1e-2)
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))  # one memo: the copy steps the copied model
    train(model_copy, optimizer_copy, batches(1))
    assert_same_params(model, small_model(), atol=0)
    assert max_difference(model_copy, model) > 1e-4 and not optimizer.state


def test_host_bytes_count_masters_grads_and_state() -> None:
    model = small_model()
    numel = sum(p.numel() for p in model.parameters())
    count = len(list(model.parameters()))
    optimizer = OffloadedOptimizer(model.parameters(), lr=1e-2)
    assert offloaded_state_bytes(optimizer) == 2 * 4 * numel  # masters + gradient buffers, before any state
    train(model, optimizer, batches(1))
    # + exp_avg and exp_avg_sq (fp32) + one fp32 step counter per parameter.
    assert offloaded_state_bytes(optimizer) == 4 * 4 * numel + 4 * count
    assert offloaded_state_bytes(torch.optim.AdamW(model.parameters())) == 0
    assert OFFLOAD_MODES == ("none", "activations", "optimizer")


# ------------------------------------------------------------------------------------------------------- engine
def gpt_micro_batches(count: int, batch: int = 2) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, GPT_CONFIG.vocab_size, (batch, GPT_CONFIG.context_length + 1), generator=generator)
        out.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def offloaded_cross_entropy_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with activation_offload(torch.device("cpu")):  # around each micro-batch's forward, where the engine calls it
        return token_cross_entropy_sum(model, batch)


def engine_losses(precision: str, offload: str, windows: int = 3) -> tuple[list[float], nn.Module]:
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    if offload == "optimizer":
        optimizer: torch.optim.Optimizer = OffloadedOptimizer(two_groups(model), lr=3e-3)
    else:
        optimizer = torch.optim.AdamW(two_groups(model), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay)
    loss_fn = offloaded_cross_entropy_sum if offload == "activations" else token_cross_entropy_sum
    engine = Engine(model, optimizer, scheduler=scheduler, precision=precision, max_grad_norm=1.0, loss_fn=loss_fn)
    losses = []
    data = gpt_micro_batches(2) * windows  # the same window again: its loss must fall if training works
    for window in iter_windows(data, grad_accum_steps=2):
        result = engine.step(window)
        assert not result.skipped, result.skip_reason
        losses.append(result.loss)
    return losses, model


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_engine_with_offloaded_optimizer_matches_adamw(precision: str) -> None:
    reference, ref_model = engine_losses(precision, "none")
    offloaded, off_model = engine_losses(precision, "optimizer")
    assert offloaded == pytest.approx(reference, rel=1e-5)
    assert_same_params(ref_model, off_model, atol=1e-6)
    assert reference[-1] < reference[0]  # the run really trains


def test_engine_with_activation_offload_is_exact() -> None:
    reference, ref_model = engine_losses("fp32", "none")
    offloaded, off_model = engine_losses("fp32", "activations")
    assert offloaded == reference
    assert_same_params(ref_model, off_model, atol=0)


# ------------------------------------------------------------------------------------------- activation offload
def test_activation_offload_saves_through_host_and_keeps_grads(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = gpt_micro_batches(1)[0]

    def grads(context: Callable[[], object]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(GPT_CONFIG)
        with context():  # type: ignore[attr-defined]
            loss = token_cross_entropy_sum(model, batch)
        loss.backward()  # outside the context: the saved tensors come back from the host copies
        return [p.grad.clone() for p in model.parameters()]

    saved = 0

    def counting_pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    plain = grads(lambda: torch.autograd.graph.saved_tensors_hooks(counting_pack, lambda t: t))
    assert saved > 10

    # Every saved tensor goes through the offload's pack hook (on a CPU device it is kept as it is: already host).
    packed_devices: list[object] = []

    def offload_context() -> object:
        context = activation_offload(torch.device("cpu"))
        pack = context.pack_hook  # type: ignore[attr-defined]

        def recording_pack(tensor: torch.Tensor) -> object:
            packed = pack(tensor)
            packed_devices.append(packed[0])
            return packed

        context.pack_hook = recording_pack  # type: ignore[attr-defined]
        return context

    offloaded = grads(offload_context)
    assert len(packed_devices) == saved and set(packed_devices) == {None}
    for a, b in zip(plain, offloaded, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_activations_go_to_pinned_host_memory_without_a_host_sync() -> None:
    """On CUDA every saved tensor is copied to pinned host memory asynchronously (no host synchronisation in the
    forward, where torch's save_on_cpu blocks at each one), and the gradients are exactly those without offload."""
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in gpt_micro_batches(1)[0].items()}
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        model = GPT(GPT_CONFIG).to(device)
        hosts: list[torch.Tensor] = []
        context = activation_offload(device) if offload else contextlib.nullcontext()
        if offload:
            pack = context.pack_hook  # type: ignore[attr-defined]

            def recording_pack(tensor: torch.Tensor, pack=pack) -> object:
                packed = pack(tensor)
                hosts.append(packed[1])
                return packed

            context.pack_hook = recording_pack  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with context:
                loss = token_cross_entropy_sum(model, batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        loss.backward()
        results.append([p.grad.clone() for p in model.parameters()])
        if offload:
            assert hosts and all(h.device.type == "cpu" and h.is_pinned() for h in hosts)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_optimizer_state_on_host_params_on_device() -> None:
    device = torch.device("cuda")
    model = GPT(GPT_CONFIG).to(device)
    reference = copy.deepcopy(model)
    optimizer = OffloadedOptimizer(two_groups(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(two_groups(reference), lr=1e-2, foreach=False)
    batch = {k: v.to(device) for k, v in gpt_micro_batches(1)[0].items()}
    for net, opt in ((model, optimizer), (reference, ref_opt)):
        for _ in range(3):
            token_cross_entropy_sum(net, batch).backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(m.device.type == "cpu" and m.is_pinned() for m in optimizer.masters)
    assert optimizer.state and all(
        t.device.type == "cpu" for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    )
    for param, master in zip(model.parameters(), optimizer.masters, strict=True):
        assert torch.equal(param.cpu(), master)
    assert_same_params(reference, model, atol=1e-5)  # CPU vs CUDA AdamW arithmetic: close, not bitwise

    # Activation offload really moves saved activations off the device.
    def activation_bytes(offload: bool) -> int:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with activation_offload(device) if offload else torch.enable_grad():
            loss = token_cross_entropy_sum(model, batch)
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        optimizer.zero_grad()
        return held

    assert activation_bytes(True) < activation_bytes(False)
