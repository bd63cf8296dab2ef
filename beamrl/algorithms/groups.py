"""Prompt groups: GRPO-style algorithms score each sample against the other samples of its prompt.

A batch of scores is given either as a 2-D tensor [n_prompts, n_samples] (row = group) or as a 1-D
tensor with a same-length tensor of integer group ids (any labels; groups may have different sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Groups:
    """Flattened scores with dense group indices 0..num_groups-1 (in order of first appearance for 1-D input)."""

    scores: torch.Tensor  # [N] float
    index: torch.Tensor  # [N] long, dense group index of each sample
    num_groups: int
    shape: torch.Size  # shape of the caller's scores, to restore outputs
    labels: torch.Tensor  # [num_groups]: the caller's id of each dense group (row index for 2-D input)


def as_groups(scores: torch.Tensor, group_ids: torch.Tensor | None = None) -> Groups:
    """Normalise the two accepted layouts; raises ValueError naming the bad argument."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if group_ids is None:
        if scores.dim() != 2:
            raise ValueError(
                f"scores has shape {tuple(scores.shape)}: pass [n_prompts, n_samples] or a 1-D tensor with group_ids"
            )
        n_groups, n_samples = scores.shape
        index = torch.arange(n_groups, device=scores.device).repeat_interleave(n_samples)
        labels = torch.arange(n_groups, device=scores.device)
        return Groups(scores.reshape(-1), index, n_groups, scores.shape, labels)
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"with group_ids, scores and group_ids must be 1-D of equal length; got scores {tuple(scores.shape)} "
            f"and group_ids {tuple(group_ids.shape)}"
        )
    if group_ids.dtype.is_floating_point:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    # Dense indices in order of first appearance, so group k of the output is the k-th distinct id seen.
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    first_pos = torch.full((len(uniq),), len(group_ids), dtype=torch.long, device=scores.device)
    first_pos.scatter_reduce_(0, inverse, torch.arange(len(group_ids), device=scores.device), reduce="amin")
    order = torch.argsort(first_pos)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=scores.device)
    return Groups(scores, rank[inverse], len(uniq), scores.shape, uniq[order])


def group_sum(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Sum of `values` [N] per group -> [num_groups]."""
    out = torch.zeros(groups.num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, groups.index, values)


def group_count(groups: Groups) -> torch.Tensor:
    """Number of samples per group -> [num_groups] (float, for division)."""
    return torch.bincount(groups.index, minlength=groups.num_groups).to(groups.scores.dtype)


def group_max(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Largest of `values` [N] per group -> [num_groups] (exact: no arithmetic on the values)."""
    out = torch.full((groups.num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, groups.index, values, reduce="amax")


def group_min(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Smallest of `values` [N] per group -> [num_groups] (exact: no arithmetic on the values)."""
    out = torch.full((groups.num_groups,), torch.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, groups.index, values, reduce="amin")
