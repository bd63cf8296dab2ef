"""Advantage estimators, chosen by name from `ADVANTAGES`.

Every estimator has the signature `fn(scores, group_ids=None, cfg=None) -> advantages` where `scores`
are per-sequence (shaped) rewards as [n_prompts, n_samples] or 1-D with `group_ids`, `cfg` is the recipe's
`AlgorithmConfig` (None: its defaults), and the result has the shape of `scores`. Broadcast to tokens with
`per_token(advantages, seq_ids)`.

Example:
    >>> import torch
    >>> from beamrl.algorithms import ADVANTAGES, AlgorithmConfig
    >>> adv = ADVANTAGES.get("grpo")(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), cfg=AlgorithmConfig())
    >>> [round(a, 3) for a in adv[0].tolist()]
    [0.866, -0.866, -0.866, 0.866]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from beamrl.algorithms.groups import as_groups, group_count, group_max, group_min, group_sum
from beamrl.registry import Registry

if TYPE_CHECKING:
    from beamrl.algorithms.config import AlgorithmConfig

ADVANTAGES: Registry = Registry("advantage estimator")


@ADVANTAGES.register("grpo")
def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor | None = None, cfg: "AlgorithmConfig | None" = None, *,
    eps: float = 1e-6, unbiased_std: bool = True,
) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_group) / (std_group + eps); same shape as `scores`.

    `cfg.normalize_std=False` gives Dr. GRPO (A_i = r_i - mean_group), which removes the std bias toward
    easy/hard prompts. unbiased_std picks the (n-1) denominator (torch.std default, as TRL and verl do).
    A group whose scores are all equal (its min equals its max; a group of one included) gets advantage
    exactly 0: testing the centred scores for 0 would miss scores that are not exact in binary (0.1, a
    weighted sum), whose float mean leaves a ~1e-8 residue that the tiny std then blows up."""
    if not eps >= 0:
        raise ValueError(f"grpo_advantages: eps={eps} must be >= 0")
    normalize_std = True if cfg is None else cfg.normalize_std
    g = as_groups(scores, group_ids)
    r = g.scores
    n = group_count(g)
    mean = group_sum(r, g) / n
    centred = r - mean[g.index]
    # Constant groups carry no signal: exactly 0 (never 0/0, never rounding residue / tiny std).
    constant = (group_max(r, g) == group_min(r, g))[g.index]
    if not normalize_std:
        return torch.where(constant, torch.zeros_like(centred), centred).reshape(g.shape)
    dof = (n - 1).clamp(min=1) if unbiased_std else n
    std = (group_sum(centred * centred, g) / dof).sqrt()
    adv = torch.where(constant, torch.zeros_like(centred), centred / (std[g.index] + eps))
    return adv.reshape(g.shape)


def per_token(seq_values: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sequence values [n_seqs] to tokens: out[t] = seq_values[seq_ids[t]]."""
    return seq_values.reshape(-1)[seq_ids]
