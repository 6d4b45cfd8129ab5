"""The next-token loss with the LM head and the cross-entropy computed a chunk of target tokens at a time
(``--loss-chunk-tokens N``), so that the [tokens x vocabulary] logits and their gradient never exist whole.

    loss = ChunkedCrossEntropy(1024)            # a LossFn: Engine(model, optimizer, loss_fn=loss)
    micro_loss_sum = loss(model, micro_batch)   # the same SUM as token_cross_entropy_sum, to rounding

How: the model's own forward runs with its output head bypassed (:func:`cadence.models.heads.head_bypassed`), which
yields the hidden states the head would have read. Only the positions that have a target are kept (one
``index_select``: prompt tokens and padding never reach the head), and those are cut into chunks of N. Each chunk runs
head -> fp32 logits -> (the family's logit transform) -> summed cross-entropy under
``torch.utils.checkpoint``: its forward keeps only the chunk's hidden states, and its backward recomputes the chunk's
logits, so at most one chunk's logits (and their gradient) are alive at a time. The chunk sums add up to the
micro-batch's loss sum, which the engine divides by the window's target count as for any loss: the gradient is the
unchunked one.

What it costs: one more head matmul per token (each chunk's forward again in the backward; under autocast also the
cast of the head's weight, once per chunk), and one host synchronisation per micro-batch (the number of target
positions decides the chunks' shapes). Precision is the unchunked path's: the head's matmul runs in the autocast
dtype, the cross-entropy in fp32.

:class:`TargetsOnlyCrossEntropy` is the same loss with one chunk of every target and no recompute: the default loss of
``cadence train`` (``--loss-chunk-tokens 0``) for every model that can be split at its head. Prompt tokens, user and
system turns and padding never reach the head, so their logits are never computed (on assistant-only chat data most
positions), and nothing is recomputed: its only costs over the full logits are the gather (one ``index_select`` of
the target rows, and its scatter back in the backward) and the host synchronisation above. Where every position is a
target (text) it saves nothing and costs about 2% more CPU time (benchmarks/targets_only_head.py); on a GPU the
synchronisation also lets the host queue no further than the current micro-batch, which the full-logits loss
(:func:`cadence.engine.token_loss.token_cross_entropy_sum`, the ``Engine``'s own default) never waits for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cadence.engine.token_loss import attention_inputs
from cadence.engine.windows import IGNORE_INDEX, Batch
from cadence.models.heads import LogitTransform, OutputHead, head_bypassed, output_head


class ChunkedCrossEntropy:
    """A :data:`cadence.engine.step.LossFn`: next-token cross-entropy summed over the targets of a micro-batch (labels
    != -100, cadence's convention: ``labels[t]`` is the target of position t), the head applied ``chunk_tokens``
    target positions at a time. Works for the built-in GPT and transformers causal LMs whose logits the head makes
    (see :mod:`cadence.models.heads`), inside DDP, FSDP2 and compiled blocks."""

    next_token_labels = True
    """The engine checks the first window's labels for the Hugging Face convention, as for the default loss."""

    chunk_tokens: int | None
    """Target positions per chunk; None: one chunk of every target (:class:`TargetsOnlyCrossEntropy`)."""

    def __init__(self, chunk_tokens: int) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens

    def __repr__(self) -> str:
        return f"ChunkedCrossEntropy({self.chunk_tokens})"

    def __call__(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return targets_only_cross_entropy_sum(model, batch, self.chunk_tokens)


class TargetsOnlyCrossEntropy(ChunkedCrossEntropy):
    """The chunked loss with one chunk of all the micro-batch's targets and no recompute: the hidden states of the
    positions with a target (labels != -100) are gathered before the LM head, so the logits of every other position
    (prompts, user and system turns, padding) are never computed. The loss and gradient are the full-logits ones
    (:func:`cadence.engine.token_loss.token_cross_entropy_sum`), to rounding.

    ``cadence train`` (and plan, profile, the noise-scale measurement: everything built by
    :func:`cadence.training.components.build_components`) uses it for ``--loss-chunk-tokens 0`` whenever the model can
    be split at its head (:func:`cadence.models.heads.chunking_problem` finds nothing)."""

    def __init__(self) -> None:
        self.chunk_tokens = None  # no chunk size: every target is in the one chunk

    def __repr__(self) -> str:
        return "TargetsOnlyCrossEntropy()"


def targets_only_cross_entropy_sum(model: torch.nn.Module, batch: Batch, chunk_tokens: int | None) -> torch.Tensor:
    """The micro-batch's next-token loss sum with the head applied to the target positions only: the model's forward
    with its head bypassed, one ``index_select`` of the positions with labels != -100, then the head and the
    cross-entropy ``chunk_tokens`` targets at a time (None: all at once) by :func:`chunked_head_cross_entropy_sum`."""
    hidden, targets, _, head = target_hidden_states(model, batch)
    return chunked_head_cross_entropy_sum(hidden, targets, head, chunk_tokens)


def target_losses(model: torch.nn.Module, batch: Batch, chunk_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's cross-entropy (one per position with labels != -100, in row-major order) and its position in the
    flattened [rows x width] batch, the head applied to the target positions only, ``chunk_tokens`` at a time (None:
    all at once): what a loss summed per sequence (a preference objective's log-probabilities) needs."""
    hidden, targets, positions, head = target_hidden_states(model, batch)
    if chunk_tokens is None or not torch.is_grad_enabled() or hidden.shape[0] <= chunk_tokens:
        return _chunk_losses(head.module, head.transform, hidden, targets), positions
    parts = [checkpoint(_chunk_losses, head.module, head.transform, rows, wanted, use_reentrant=False,
                        preserve_rng_state=False)
             for rows, wanted in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)]
    return torch.cat(parts), positions


def target_hidden_states(model: torch.nn.Module, batch: Batch
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, OutputHead]:
    """The model's forward with its output head bypassed: the head's input at every position with a target ([N, H]),
    the targets ([N]), their positions in the flattened batch ([N]) and the head."""
    head = output_head(model)
    labels = batch["labels"].flatten()
    # The one host sync: the positions with a target, before the trunk's forward is queued, so that the device
    # waits only for the work already queued (the previous micro-batch), not for this forward too.
    positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    with head_bypassed(head.module) as captured:
        output = model(batch["input_ids"], **attention_inputs(model, batch))
    del output  # the head's input (or a transform of it), not logits: nothing reads it
    if len(captured) != 1:
        raise RuntimeError(f"the model called its output head {len(captured)} times in one forward; the chunked "
                           f"loss needs exactly one call (cadence.models.heads.chunking_problem checks this)")
    hidden = captured.pop().flatten(0, 1).index_select(0, positions)
    return hidden, labels.index_select(0, positions), positions, head


def chunked_head_cross_entropy_sum(hidden: torch.Tensor, targets: torch.Tensor, head: OutputHead,
                                   chunk_tokens: int | None) -> torch.Tensor:
    """Sum over rows of ``cross_entropy(head(hidden[i]), targets[i])`` ([N, H] and [N] -> an fp32 scalar), the head
    applied ``chunk_tokens`` rows at a time (None: all N rows at once), each chunk's logits recomputed in backward
    when gradients are wanted and there is more than one chunk."""
    if chunk_tokens is None:
        # Every target in one chunk: its logits are all the logits, needed at once by its backward either way, so
        # it runs plainly (no checkpoint, nothing recomputed): the full-logits loss on the target rows alone.
        return _chunk_loss_sum(head.module, head.transform, hidden, targets)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    # One chunk holds every target: as above (measured: recomputing it costs 28% more CPU time per step for a
    # width-256 llama with a 32,000-token vocabulary, and saves nothing). Only the target gathering is left.
    recompute = torch.is_grad_enabled() and hidden.shape[0] > chunk_tokens
    for rows, wanted in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True):
        if recompute:
            # Non-reentrant: the recompute runs under the forward's autocast state and reaches the head's
            # parameters (and FSDP2's unsharded ones) without being given them. The head and the loss draw no random
            # numbers, so saving and restoring the RNG state per chunk would only cost time.
            part = checkpoint(_chunk_loss_sum, head.module, head.transform, rows, wanted, use_reentrant=False,
                              preserve_rng_state=False)
        else:
            part = _chunk_loss_sum(head.module, head.transform, rows, wanted)
        total = total + part
    return total


def _chunk_losses(head: torch.nn.Module, transform: LogitTransform | None, rows: torch.Tensor,
                  wanted: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy, as :func:`_chunk_loss_sum` computes their sum."""
    logits = head(rows).float()
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits, wanted, reduction="none")


def _chunk_loss_sum(head: torch.nn.Module, transform: LogitTransform | None, rows: torch.Tensor,
                    wanted: torch.Tensor) -> torch.Tensor:
    # The head in the autocast dtype, as the model's forward would run it; the loss in fp32, as
    # token_cross_entropy_sum computes it (a bf16 log-softmax over a large vocabulary loses digits).
    logits = head(rows).float()
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits, wanted, reduction="sum")


__all__ = ["ChunkedCrossEntropy", "TargetsOnlyCrossEntropy", "chunked_head_cross_entropy_sum", "target_hidden_states",
           "target_losses", "targets_only_cross_entropy_sum"]
