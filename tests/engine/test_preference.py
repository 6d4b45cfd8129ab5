"""The preference objectives (cadence.engine.preference) against an independent computation of each one's loss, and
every split of a window (8x1, 2x4, 1x8, a token budget's unequal micro-batches, a short last window) giving one big
batch's losses and weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import precomputed_record, preference_samples, relative_l2, tiny_model

from cadence import Engine
from cadence.data.batching import Example
from cadence.data.preference import PreferenceExample
from cadence.engine.cut import Cut
from cadence.engine.objective import Objective
from cadence.engine.reference import FrozenReference, PrecomputedReference
from cadence.engine.windows import collate_samples, epoch_windows

OBJECTIVES = ["dpo", "ipo", "simpo", "orpo", "kto"]
EFFECTIVE = 8


def summed_logps(model: torch.nn.Module, example: Example) -> torch.Tensor:
    """By hand: the sum of log p(target) over the example's targets, from its whole logits."""
    logits = model(example.input_ids[None])[0].float()
    wanted = example.labels != -100
    return logits.log_softmax(-1)[wanted].gather(1, example.labels[wanted][:, None]).sum()


def targets(example: Example) -> int:
    return int((example.labels != -100).sum())


def hand_loss(name: str, policy: torch.nn.Module, reference: torch.nn.Module, samples: list[PreferenceExample],
              beta: float = 0.1) -> torch.Tensor:
    """The objective's loss over one big batch, written out from the papers' (and TRL's) formulas."""
    c = torch.stack([summed_logps(policy, s.first) for s in samples])
    r = torch.stack([summed_logps(policy, s.second) for s in samples])
    with torch.no_grad():
        cr = torch.stack([summed_logps(reference, s.first) for s in samples])
        rr = torch.stack([summed_logps(reference, s.second) for s in samples])
    lc = torch.tensor([float(targets(s.first)) for s in samples])
    lr = torch.tensor([float(targets(s.second)) for s in samples])
    if name == "dpo":
        return -F.logsigmoid(beta * ((c - cr) - (r - rr))).mean()
    if name == "ipo":
        return (((c - cr) / lc - (r - rr) / lr - 1 / (2 * beta)) ** 2).mean()
    if name == "simpo":
        return -F.logsigmoid(beta * (c / lc - r / lr) - 0.5).mean()
    if name == "orpo":
        mc, mr = c / lc, r / lr
        log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
        return -c.sum() / lc.sum() - beta * F.logsigmoid(log_odds).mean()
    z = torch.clamp((r - rr).detach().mean(), min=0)  # kto: the mismatched sequences over the whole window
    desirable = torch.tensor([bool(s.desirable) for s in samples])
    x = c - cr
    return torch.where(desirable, 1 - torch.sigmoid(beta * (x - z)), 1 - torch.sigmoid(beta * (z - x))).mean()


def objective_for(name: str, model: torch.nn.Module, precomputed: list[PreferenceExample] | None = None) -> Objective:
    # The reference has other weights than the policy's start: its log-probabilities really enter the loss.
    reference = FrozenReference(model=tiny_model(seed=1).eval(), targets_only=True)
    objective = Objective(name=name).for_model(model, vocab_size=256)
    if precomputed is not None:  # its log-probabilities of every sample's rows, scored one sample at a time
        return objective.with_reference(PrecomputedReference(record=precomputed_record(reference, precomputed)))
    return objective.with_reference(reference)




def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    """Plain SGD: the update is the gradient, so weights compare as the gradients do (AdamW divides by each
    gradient's own scale, which turns rounding in a gradient near 0 into a whole step)."""
    return torch.optim.SGD(model.parameters(), lr=0.5)


def engine_run(name: str, samples: list[PreferenceExample], cut: Cut, steps: int, seed: int = 0,
               precomputed: bool = False) -> tuple[list[float], torch.nn.Module, list[dict[str, float]]]:
    model = tiny_model()
    objective = objective_for(name, model, samples if precomputed else None)
    engine = Engine(model, optimizer_for(model), objective=objective)
    windows = epoch_windows(samples, cut=cut, grad_accum_steps=max(1, EFFECTIVE // cut.micro_batch_size), seed=seed,
                            epoch=0)
    results = [engine.step(window) for window, _ in zip(windows, range(steps))]
    return [r.loss for r in results], model, [r.objective_metrics for r in results]


def hand_run(name: str, samples: list[PreferenceExample], steps: int, seed: int = 0
             ) -> tuple[list[float], torch.nn.Module]:
    """One big batch per window, by hand (the epoch's order, as cadence draws it)."""
    from cadence.data.batching import epoch_order

    model, reference = tiny_model(), tiny_model(seed=1).eval()
    optimizer = optimizer_for(model)
    order = epoch_order(len(samples), seed, 0).tolist()
    losses = []
    for step in range(steps):
        loss = hand_loss(name, model, reference, [samples[i] for i in order[step * EFFECTIVE:(step + 1) * EFFECTIVE]])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("name", OBJECTIVES)
def test_the_first_steps_loss_is_the_independent_computation(name):
    """With a reference whose weights differ from the policy's: summed log-probabilities over each completion's
    tokens, the mean over the window's pairs (KTO: examples; ORPO: plus its NLL over the window's chosen tokens)."""
    samples = preference_samples(name)
    [loss], _, [metrics] = engine_run(name, samples, Cut(micro_batch_size=2), steps=1)
    expected, _ = hand_run(name, samples, steps=1)
    assert loss == pytest.approx(expected[0], rel=1e-6)
    assert "rewards/chosen" in metrics


@pytest.mark.parametrize("name", ["dpo", *(pytest.param(name, marks=pytest.mark.slow) for name in OBJECTIVES[1:])])
def test_every_split_gives_one_big_batchs_losses_and_weights(name):
    """20 samples of uneven lengths, windows of 8: two whole windows and a short last one of 4; micro-batches of 8,
    2 and 1 sample, and a token budget's micro-batches of unequal pair counts."""
    samples = preference_samples(name)
    hand_losses, by_hand = hand_run(name, samples, steps=3)
    whole_losses, whole, _ = engine_run(name, samples, Cut(micro_batch_size=8), steps=3)
    assert whole_losses == pytest.approx(hand_losses, rel=1e-6)
    assert relative_l2(whole.state_dict(), by_hand.state_dict()) < 1e-6
    for cut in (Cut(micro_batch_size=2), Cut(micro_batch_size=1),
                Cut(micro_batch_size=2, order="by-length", micro_batch_tokens=150)):
        losses, model, _ = engine_run(name, samples, cut, steps=3)
        assert losses == pytest.approx(whole_losses, rel=1e-6), cut
        assert relative_l2(model.state_dict(), whole.state_dict()) < 1e-6, cut


def test_a_token_budget_really_cuts_windows_into_unequal_pair_counts():
    samples = preference_samples("dpo")
    window = next(epoch_windows(samples, cut=Cut(micro_batch_size=2, order="by-length", micro_batch_tokens=150),
                                grad_accum_steps=4, seed=0, epoch=0))
    pairs = [int(b["input_ids"].shape[0]) // 2 for b in window.micro_batches]
    assert sum(pairs) == EFFECTIVE and len(set(pairs)) > 1


def test_a_per_micro_batch_pair_mean_would_be_caught():
    """TRL's reduction (each micro-batch's mean over its pairs, divided by the accumulation steps) on micro-batches of
    unequal pair counts is not one big batch's gradient: the split test above would fail on it."""
    samples = preference_samples("dpo")
    window = next(epoch_windows(samples, cut=Cut(micro_batch_size=2, order="by-length", micro_batch_tokens=150),
                                grad_accum_steps=4, seed=0, epoch=0))
    policy, reference = tiny_model(), tiny_model(seed=1).eval()
    objective = objective_for("dpo", policy)
    for batch in window.micro_batches:  # per micro-batch mean / accumulation steps
        terms = objective.micro_batch_loss(policy, batch).terms
        (terms[0] / (int(batch["input_ids"].shape[0]) // 2) / len(window.micro_batches)).backward()
    per_micro = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    from cadence.data.batching import epoch_order

    order = epoch_order(len(samples), 0, 0).tolist()
    hand_loss("dpo", policy, reference, [samples[i] for i in order[:EFFECTIVE]]).backward()
    whole = {n: p.grad for n, p in policy.named_parameters()}
    assert relative_l2(per_micro, whole) > 1e-3


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_evaluation_is_the_objectives_loss_over_everything_evaluated_as_one_window(name):
    """KTO's reference point too is taken over all the evaluated micro-batches, not one."""
    from cadence.engine.windows import collate_samples

    samples = preference_samples(name)[:7]
    model = tiny_model()
    engine = Engine(model, optimizer_for(model), objective=objective_for(name, model))
    batches = [collate_samples(samples[at:at + 3]) for at in range(0, 7, 3)]  # 3, 3 and 1 samples
    assert engine.evaluate(batches) == pytest.approx(float(hand_loss(name, model, tiny_model(seed=1).eval(), samples)),
                                                     rel=1e-6)
    assert "rewards/chosen" in engine.last_eval_metrics


def test_the_memory_meter_counts_a_frozen_references_weights():
    """On CPU the profiler sees only the step's allocations: the weights of a frozen reference, live through every
    step, are counted with the model's (the same computation with a reference that says it holds nothing peaks lower
    by exactly those bytes)."""
    samples = preference_samples("dpo")
    window = next(epoch_windows(samples, cut=Cut(micro_batch_size=8), grad_accum_steps=1, seed=0, epoch=0))
    peaks = {}
    for counted in (True, False):
        model = tiny_model()
        objective = objective_for("dpo", model)
        frozen = objective.reference
        held = frozen.held_bytes
        if not counted:
            objective = objective.with_reference(Uncounted(frozen))
        engine = Engine(model, optimizer_for(model), objective=objective)
        peaks[counted] = engine.step(window, measure_memory=True).peak_memory_bytes
    assert held >= sum(p.numel() for p in tiny_model().parameters()) * 4  # every weight, the tied head once
    assert peaks[True] - peaks[False] == held


class Uncounted:
    """A frozen reference that claims to hold no memory of its own."""

    def __init__(self, inner: FrozenReference) -> None:
        self.inner, self.description, self.held_bytes = inner, inner.description, 0

    def row_logps(self, batch):  # type: ignore[no-untyped-def]
        return self.inner.row_logps(batch)


class Recorded:
    """A reference that writes down when it scores, into the same log as the policy's forward hook."""

    def __init__(self, inner: FrozenReference, log: list[str]) -> None:
        self.inner, self.log, self.description, self.held_bytes = inner, log, inner.description, inner.held_bytes

    def row_logps(self, batch):  # type: ignore[no-untyped-def]
        self.log.append("reference")
        return self.inner.row_logps(batch)


@pytest.mark.parametrize("name", ["dpo", "ipo", "kto"])
def test_the_reference_scores_each_micro_batch_before_the_policys_forward(name):
    """The reference's forward runs first, so its activations are freed before the policy's graph exists (the other
    way round they sit on top of the policy's saved activations, and the step peaks above the estimate); KTO's window
    pass scores its mismatched rows in the same order."""
    samples = preference_samples("kto" if name == "kto" else "dpo")
    window = next(epoch_windows(samples, cut=Cut(micro_batch_size=2), grad_accum_steps=4, seed=0, epoch=0))
    model = tiny_model()
    log: list[str] = []
    objective = objective_for(name, model)  # its probe of the model runs before the log starts
    objective = objective.with_reference(Recorded(objective.reference, log))
    # The first block's forward: the policy's forward however its head runs (whole logits or the targets only).
    model.blocks[0].register_forward_pre_hook(lambda module, args: log.append("policy"))
    Engine(model, optimizer_for(model), objective=objective).step(window)
    passes = 8 if name == "kto" else 4  # KTO: the window's no-gradient pass, then the micro-batches
    assert log == ["reference", "policy"] * passes


@pytest.mark.parametrize("name", ["dpo", *(pytest.param(name, marks=pytest.mark.slow) for name in ("ipo", "kto"))])
def test_precomputed_log_probabilities_give_the_live_references_losses_and_weights(name):
    """--reference-logprobs precomputed: the reference's log-probabilities scored once, one sample at a time, then
    looked up by each row's key in micro-batches of any split (8x1, 2x4, 1x8, a token budget; KTO's mismatched rows
    in its window pass too): the live reference's losses and weights (1e-6), with no model in the reference."""
    samples = preference_samples("kto" if name == "kto" else "dpo")
    live_losses, live, _ = engine_run(name, samples, Cut(micro_batch_size=8), steps=3)
    for cut in (Cut(micro_batch_size=8), Cut(micro_batch_size=2), Cut(micro_batch_size=1),
                Cut(micro_batch_size=2, order="by-length", micro_batch_tokens=150)):
        losses, model, _ = engine_run(name, samples, cut, steps=3, precomputed=True)
        assert losses == pytest.approx(live_losses, rel=1e-6), cut
        assert relative_l2(model.state_dict(), live.state_dict()) < 1e-6, cut


def test_a_row_without_a_precomputed_log_probability_is_an_error_not_a_zero():
    samples = preference_samples("dpo")
    reference = PrecomputedReference(record=precomputed_record(FrozenReference(model=tiny_model(seed=1).eval(),
                                                                               targets_only=True), samples[:4]))
    with pytest.raises(RuntimeError, match="no precomputed reference"):
        reference.row_logps(collate_samples(samples[4:6]))
    assert reference.held_bytes == 20 * len(reference.record.logps)  # a 16-byte key and an fp32 value per row
