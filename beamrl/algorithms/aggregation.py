"""Reduce per-token losses to one scalar, exactly the same whether a step runs as one batch or many micro-batches.

Modes (names as in verl):
- "token-mean" (DAPO): sum over every loss token of the step / number of loss tokens of the step.
- "seq-mean-token-mean": mean over each sequence's tokens, then sum over sequences / sequences of the step.
- "seq-mean-token-sum": sum over each sequence's tokens, then sum over sequences / sequences of the step.

Under gradient accumulation the mean's denominator must be the whole step's count, not the micro-batch's.
Compute it once per step with `loss_normalizer` (summed over micro-batches and, with data parallelism, over
ranks) and pass it in; then the sum of micro-batch losses equals the full-batch loss, value and gradient.
A sequence must not be split across micro-batches (the seq-mean modes need all its tokens together).
Sequence ids are labels: any integers, equal within a sequence (e.g. offset per micro-batch).

Example (three micro-batches `mbs` of one step):
    >>> norm = sum(loss_normalizer(mb.loss_mask, mb.seq_ids, "token-mean") for mb in mbs)  # doctest: +SKIP
    >>> loss = sum(aggregate(tok_loss(mb), mb.loss_mask, mb.seq_ids, "token-mean", norm) for mb in mbs)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def check_aggregation(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; allowed: {', '.join(AGGREGATIONS)}")


def _per_seq_sums(values: torch.Tensor, seq_ids: torch.Tensor, n_seqs: int) -> torch.Tensor:
    out = torch.zeros(n_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_ids, values)


def loss_normalizer(loss_mask: torch.Tensor, seq_ids: torch.Tensor, mode: str) -> float:
    """This micro-batch's share of the step's denominator: loss tokens ("token-mean") or sequences with at
    least one loss token (seq modes). Sum it over the step's micro-batches (and DP ranks)."""
    check_aggregation(mode)
    mask = loss_mask.to(torch.bool)
    if mode == "token-mean":
        return float(mask.sum())
    return float(torch.unique(seq_ids[mask]).numel())  # any labels, e.g. offset per micro-batch


def aggregate(
    token_values: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    mode: str,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce `token_values` [T] to a scalar (see module doc). `normalizer=None` uses this batch's own count,
    i.e. treats the batch as the whole step. Masked tokens contribute exactly 0 (NaN/inf there are ignored)."""
    check_aggregation(mode)
    if not (token_values.shape == loss_mask.shape == seq_ids.shape) or token_values.dim() != 1:
        raise ValueError(
            f"token_values, loss_mask, seq_ids must be 1-D of equal length; got {tuple(token_values.shape)}, "
            f"{tuple(loss_mask.shape)}, {tuple(seq_ids.shape)}"
        )
    if normalizer is None:
        normalizer = loss_normalizer(loss_mask, seq_ids, mode)
    mask = loss_mask.to(torch.bool)
    masked = torch.where(mask, token_values, torch.zeros_like(token_values))
    if normalizer <= 0:  # no loss token in the whole step: a zero that still carries a graph
        return masked.sum() * 0.0
    if mode == "token-mean":
        return masked.sum() / normalizer
    _, dense = torch.unique(seq_ids, return_inverse=True)  # seq ids need not be 0..n-1
    n_seqs = int(dense.max()) + 1
    seq_sum = _per_seq_sums(masked, dense, n_seqs)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / normalizer
    seq_tokens = _per_seq_sums(mask.to(token_values.dtype), dense, n_seqs)
    seq_mean = seq_sum / seq_tokens.clamp(min=1)
    return seq_mean.sum() / normalizer


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over `mask` (0 when the mask is empty); for metrics."""
    m = mask.to(torch.bool)
    n = m.sum()
    return torch.where(m, values, torch.zeros_like(values)).sum() / n.clamp(min=1)
