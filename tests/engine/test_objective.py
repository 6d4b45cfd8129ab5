"""The objective seam (cadence.engine.objective): one frozen value from the flags, the sft objective's ways of computing
its loss sum chosen as every command chose them, a bare loss function being the sft objective, and the engine dividing
each of an objective's terms by its own unit counted over the whole window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_optimizer, prompt_completion_dataset, relative_l2, tiny_model

from cadence import Engine, iter_windows
from cadence.config import TrainConfig
from cadence.data import iterate_micro_batches
from cadence.engine.chunked_loss import ChunkedCrossEntropy, TargetsOnlyCrossEntropy
from cadence.engine.objective import MicroBatchLoss, Objective
from cadence.engine.token_loss import token_cross_entropy_sum
from cadence.engine.windows import IGNORE_INDEX, Batch, Window


def test_the_objective_is_made_from_the_flags_and_written_back_to_them():
    config = TrainConfig(loss_chunk_tokens=64)
    objective = Objective.from_flags(config)
    assert objective == Objective(loss_chunk_tokens=64) and objective.name == "sft"
    assert objective.flags() == {"objective": "sft", "loss_chunk_tokens": 64, "beta": 0.1, "simpo_gamma": 0.5,
                                 "desirable_weight": 1.0, "undesirable_weight": 1.0}
    dpo = Objective.from_flags(TrainConfig(objective="dpo", beta=0.3))
    assert (dpo.name, dpo.beta, dpo.pairs, dpo.needs_reference) == ("dpo", 0.3, True, True)
    assert Objective.from_flags(dpo.flags()) == dpo
    assert Objective.from_flags(objective.flags()) == objective
    assert Objective.from_flags({}) == Objective()  # a record from before the objective existed
    assert "targets" in objective.units[0] and "token mean" in objective.describe()


def test_its_problems_name_the_flag():
    [problem] = Objective.problems(TrainConfig(loss_chunk_tokens=-1))
    assert problem.where == "--loss-chunk-tokens" and "at least 0" in problem.message
    assert Objective.problems(TrainConfig()) == []
    wheres = [p.where for p in Objective.problems(TrainConfig(objective="orpo", beta=-1.0, desirable_weight=2.0,
                                                              packing=True))]
    assert wheres == ["--beta", "--desirable-weight", "--packing"]
    [problem] = Objective.problems({"objective": "ppo"})
    assert problem.where == "--objective" and "'ppo' is not one of sft, dpo" in problem.message


def test_the_sft_loss_sum_is_chosen_for_the_model_as_train_chose_it():
    model = tiny_model()
    assert isinstance(Objective(loss_chunk_tokens=16).for_model(model, vocab_size=256).loss_fn, ChunkedCrossEntropy)
    chosen = Objective().for_model(model, vocab_size=256)
    assert isinstance(chosen.loss_fn, TargetsOnlyCrossEntropy) and "target positions only" in chosen.describe()
    assert Objective().for_model(None, vocab_size=None).loss_fn is token_cross_entropy_sum
    assert Objective().loss_fn is token_cross_entropy_sum  # not yet chosen: all logits


def test_a_bare_loss_function_is_the_sft_objective_computed_by_it():
    def my_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return token_cross_entropy_sum(model, batch)

    model = tiny_model()
    engine = Engine(model, make_optimizer(model), loss_fn=my_loss)
    assert engine.objective.name == "sft" and engine.objective.loss_fn is my_loss and engine.loss_fn is my_loss
    assert Engine(model, make_optimizer(model)).objective.loss_fn is token_cross_entropy_sum
    with pytest.raises(ValueError, match="not both"):
        Engine(model, make_optimizer(model), loss_fn=my_loss, objective=Objective())


class SequenceMeanObjective(Objective):
    """A test objective of two terms with two units: each sequence's mean token loss averaged over the window's
    sequences, plus 0.5 x the token mean. Neither divisor is a micro-batch's own, so the engine must sum both units
    over the window."""

    @property
    def units(self) -> tuple[str, ...]:
        return ("sequences", "targets")

    def window_units(self, window: Window) -> tuple[int, ...]:
        return (sum(_sequences(b) for b in window.micro_batches), window.targets)

    def batch_units(self, batch, counter) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
        return (_sequences(batch), counter.targets(batch))

    def micro_batch_loss(self, model, batch, statistic=None) -> MicroBatchLoss:  # type: ignore[no-untyped-def]
        logits = model(batch["input_ids"]).float()
        per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX,
                                    reduction="none")
        targets = (batch["labels"] != IGNORE_INDEX).sum(1)
        per_sequence = per_token.sum(1) / targets.clamp(min=1)
        return MicroBatchLoss(terms=(per_sequence[targets > 0].sum(), 0.5 * per_token.sum()))


def _sequences(batch: Batch) -> int:
    return int(((batch["labels"] != IGNORE_INDEX).sum(1) > 0).sum())


def _sequence_mean_reference(dataset, steps: int) -> tuple[list[float], torch.nn.Module]:
    """One big batch of 8 per step, by hand."""
    model = tiny_model()
    optimizer = make_optimizer(model)
    losses = []
    for batch, _ in zip(iterate_micro_batches(dataset, 8, 0, 0), range(steps)):
        logits = model(batch["input_ids"]).float()
        per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX,
                                    reduction="none")
        targets = (batch["labels"] != IGNORE_INDEX).sum(1)
        loss = (per_token.sum(1) / targets).mean() + 0.5 * per_token.sum() / targets.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("micro", [8, 2, 1])
def test_each_term_is_divided_by_its_own_unit_over_the_window(micro):
    dataset = prompt_completion_dataset()
    expected_losses, expected = _sequence_mean_reference(dataset, steps=2)
    model = tiny_model()
    engine = Engine(model, make_optimizer(model), objective=SequenceMeanObjective())
    windows = iter_windows(iterate_micro_batches(dataset, micro, 0, 0), 8 // micro)
    losses = [engine.step(window).loss for window, _ in zip(windows, range(2))]
    assert losses == pytest.approx(expected_losses, rel=1e-6)
    # Adam divides by the gradient's own scale, so a parameter with a gradient near 0 moves by rounding: compared as
    # the whole model (as tests/engine/test_engine.py does), where a wrong divisor is off by far more.
    assert relative_l2(model.state_dict(), expected.state_dict()) < 1e-5


def test_evaluation_reports_the_objectives_window_loss():
    dataset = prompt_completion_dataset()
    expected_losses, _ = _sequence_mean_reference(dataset, steps=1)
    model = tiny_model()
    engine = Engine(model, make_optimizer(model), objective=SequenceMeanObjective())
    batches = list(iterate_micro_batches(dataset, 2, 0, 0))[:4]
    assert engine.evaluate(batches) == pytest.approx(expected_losses[0], rel=1e-6)
