"""DAPO's batch shaping: dynamic sampling (drop zero-signal groups) and soft overlong punishment.

Two reward streams exist and must not be confused:
- RAW scores: what the verifiers said (the `RewardBatchResult.totals` of `beamrl.rewards`).
- SHAPED rewards: raw + overlong penalty (+ KL-in-reward, ...), fed to the advantage estimator.
Dynamic sampling must filter on RAW scores: a group whose answers are all correct but of different lengths
has different shaped rewards yet no correctness signal, and keeping it trains on length alone (this
destroyed policies in verl-recipe PR #125). Hence `filter_groups` takes `raw_scores=` by keyword only.

Example:
    >>> import torch
    >>> raw = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    >>> res = filter_groups(raw_scores=raw, target_num_groups=4)
    >>> res.kept_groups.tolist(), res.num_needed
    ([1], 3)
    >>> from beamrl.algorithms import OverlongConfig
    >>> overlong_penalty(torch.tensor([10, 13, 16]), OverlongConfig(buffer=4), max_response_len=16).tolist()
    [0.0, -0.25, -1.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from beamrl.algorithms.groups import as_groups, group_max, group_min

if TYPE_CHECKING:
    from beamrl.algorithms.config import OverlongConfig


@dataclass
class GroupFilterResult:
    """kept_groups / dropped_groups: the groups with a non-constant / constant raw score, named as the caller
    named them (the ids in `group_ids`; row indices for 2-D scores), in order of first appearance.
    num_needed: groups still missing to reach the target after taking all kept ones (0 when full).
    num_surplus: kept groups beyond the target (take `kept_groups[:len(kept_groups) - num_surplus]`).
    suggested_num_prompts: prompts to generate next so that, at this batch's keep rate, `num_needed`
    groups survive (over-sampling); capped by `max_oversample` times num_needed."""

    kept_groups: torch.Tensor
    dropped_groups: torch.Tensor
    num_needed: int
    num_surplus: int
    suggested_num_prompts: int
    metrics: dict[str, float]


def filter_groups(
    *,
    raw_scores: torch.Tensor,
    target_num_groups: int,
    num_already_kept: int = 0,
    group_ids: torch.Tensor | None = None,
    atol: float = 0.0,
    max_oversample: float = 8.0,
) -> GroupFilterResult:
    """DAPO dynamic sampling on RAW verifier scores ([n_groups, n_samples], or 1-D with group_ids).

    A group is dropped when max - min of its raw scores <= atol (all equal: zero advantage, zero gradient).
    `num_already_kept` counts groups kept from earlier generation rounds of this step.
    """
    if target_num_groups < 1:
        raise ValueError(f"target_num_groups={target_num_groups} must be >= 1")
    if num_already_kept < 0:
        raise ValueError(f"num_already_kept={num_already_kept} must be >= 0")
    if max_oversample < 1:
        raise ValueError(f"max_oversample={max_oversample} must be >= 1")
    g = as_groups(raw_scores, group_ids)
    s = g.scores.detach().to(torch.float64)
    gmax, gmin = group_max(s, g), group_min(s, g)
    informative = (gmax - gmin) > atol
    kept = g.labels[torch.nonzero(informative).flatten()]
    dropped = g.labels[torch.nonzero(~informative).flatten()]
    have = num_already_kept + len(kept)
    num_needed = max(0, target_num_groups - have)
    num_surplus = max(0, have - target_num_groups) if len(kept) else 0
    num_surplus = min(num_surplus, len(kept))
    keep_rate = len(kept) / g.num_groups if g.num_groups else 0.0
    if num_needed == 0:
        suggested = 0
    elif keep_rate == 0:
        suggested = math.ceil(num_needed * max_oversample)
    else:
        suggested = min(math.ceil(num_needed / keep_rate), math.ceil(num_needed * max_oversample))
    # "All max" / "all min": every sample of the dropped group scored the batch's max (min). Compared on the
    # group's own min/max, never on a rounded mean (a group all at 0.7 has a mean != 0.7 in floats).
    metrics = {
        "dynamic_sampling/keep_rate": keep_rate,
        "dynamic_sampling/num_kept": float(len(kept)),
        "dynamic_sampling/num_dropped": float(len(dropped)),
        "dynamic_sampling/dropped_all_max": float(((~informative) & (gmin == s.max())).sum()) if len(s) else 0.0,
        "dynamic_sampling/dropped_all_min": float(((~informative) & (gmax == s.min())).sum()) if len(s) else 0.0,
    }
    return GroupFilterResult(kept, dropped, num_needed, num_surplus, suggested, metrics)


def overlong_penalty(response_lengths: torch.Tensor, cfg: "OverlongConfig", max_response_len: int) -> torch.Tensor:
    """Penalty (<= 0) per response from its length in tokens. Responses longer than max_response_len - buffer
    lose penalty * (len - (max_response_len - buffer)) / buffer, reaching -penalty at max_response_len (and
    beyond: truncated responses)."""
    if not 0 < cfg.buffer <= max_response_len:
        raise ValueError(f"overlong buffer={cfg.buffer} must be in [1, max_response_len={max_response_len}]")
    expected = max_response_len - cfg.buffer
    over = (response_lengths.to(torch.float64) - expected).clamp(min=0, max=cfg.buffer)
    return (over * (-cfg.penalty / cfg.buffer)).to(torch.float32) + 0.0  # + 0.0: no -0.0


def overlong_shaped_rewards(
    raw_scores: torch.Tensor, response_lengths: torch.Tensor, cfg: "OverlongConfig", max_response_len: int
) -> torch.Tensor:
    """shaped = raw + overlong_penalty(lengths): a NEW tensor (raw_scores is never modified, so the
    dynamic-sampling filter and the raw-reward logs still see the verifier's scores)."""
    if raw_scores.shape != response_lengths.shape:
        raise ValueError(
            f"raw_scores {tuple(raw_scores.shape)} and response_lengths {tuple(response_lengths.shape)} differ in shape"
        )
    return raw_scores + overlong_penalty(response_lengths, cfg, max_response_len).to(raw_scores.dtype)
