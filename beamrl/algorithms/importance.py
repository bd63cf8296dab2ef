"""Off-policy correction between the rollout engine's policy and the trainer's old policy.

The engine samples with pi_rollout (its own kernels, maybe stale weights); the PPO ratio is taken against
pi_old (the trainer's recomputation). Each token's loss is multiplied by a weight built from
ratio = exp(old_logprob - rollout_logprob) (detached):
- "tis" (truncated IS): weight = min(ratio, cap). Token level.
- "mis" (masked IS): weight = ratio where it lies in [lo, hi], 0 elsewhere ("token" level), or the same
  test on a sequence's geometric-mean ratio exp(mean_t log ratio_t) ("sequence" level; a product over
  thousands of tokens would always be out of range). Masked tokens keep their place in the loss
  denominator, so micro-batch accumulation stays exact; they just contribute nothing.

Example:
    >>> import torch
    >>> from beamrl.algorithms import ImportanceConfig
    >>> cfg = ImportanceConfig(mode="tis", cap=2.0)
    >>> res = IMPORTANCE_CORRECTIONS.get("tis")(torch.tensor([0.0, 0.0]), torch.tensor([0.0, -5.0]),
    ...                                         torch.tensor([True, True]), torch.tensor([0, 0]), cfg)
    >>> res.weights.tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from beamrl.algorithms.aggregation import masked_mean
from beamrl.registry import Registry

if TYPE_CHECKING:
    from beamrl.algorithms.config import ImportanceConfig

IMPORTANCE_CORRECTIONS: Registry = Registry("importance correction")


@dataclass
class ImportanceResult:
    """weights [T] (detached, 0 on masked tokens), kept [T] bool (False where MIS rejected), metrics
    (detached 0-dim tensors: no host sync)."""

    weights: torch.Tensor
    kept: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _check(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor) -> None:
    if not (old.shape == rollout.shape == mask.shape == seq_ids.shape) or old.dim() != 1:
        raise ValueError(
            "old_logprobs, rollout_logprobs, loss_mask, seq_ids must be 1-D of equal length; got "
            f"{tuple(old.shape)}, {tuple(rollout.shape)}, {tuple(mask.shape)}, {tuple(seq_ids.shape)}"
        )


def _base_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio = log_ratio.exp()
    return {
        "train_rollout_logprob_abs_diff": masked_mean(log_ratio.abs(), mask),
        "ratio_mean": masked_mean(ratio, mask),
        # k3 of KL(rollout || old): the tokens were sampled by the rollout policy, so r = old / rollout.
        "train_rollout_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
    }


def _ratios(old: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor):
    """(bool mask, FP32 log ratio old - rollout (0 off the mask), ratio), detached: the corrections' shared start."""
    _check(old, rollout, loss_mask, seq_ids)
    mask = loss_mask.to(torch.bool)
    log_ratio = (old - rollout).detach().to(torch.float32)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    return mask, log_ratio, log_ratio.exp()


@IMPORTANCE_CORRECTIONS.register("tis")
def truncated_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: "ImportanceConfig",
) -> ImportanceResult:
    """TIS: weight_t = min(exp(old_t - rollout_t), cap)."""
    mask, log_ratio, ratio = _ratios(old_logprobs, rollout_logprobs, loss_mask, seq_ids)
    weights = torch.where(mask, ratio.clamp(max=cfg.cap), torch.zeros_like(ratio))
    metrics = _base_metrics(log_ratio, mask)
    metrics["truncated_fraction"] = masked_mean((ratio > cfg.cap).float(), mask)
    metrics["masked_fraction"] = torch.zeros((), device=ratio.device)
    return ImportanceResult(weights, mask.clone(), metrics)


@IMPORTANCE_CORRECTIONS.register("mis")
def masked_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: "ImportanceConfig",
) -> ImportanceResult:
    """MIS: weight_t = ratio_t if the token's (or its sequence's) ratio is in [lo, hi], else 0."""
    mask, log_ratio, ratio = _ratios(old_logprobs, rollout_logprobs, loss_mask, seq_ids)
    if cfg.level == "token":
        test_ratio = ratio
    else:
        _, dense = torch.unique(seq_ids, return_inverse=True)  # seq ids are labels, not positions
        n_seqs = int(dense.max()) + 1 if seq_ids.numel() else 0
        zeros = torch.zeros(n_seqs, dtype=log_ratio.dtype, device=log_ratio.device)
        seq_sum = zeros.index_add(0, dense, log_ratio)
        seq_len = zeros.index_add(0, dense, mask.to(log_ratio.dtype))
        test_ratio = (seq_sum / seq_len.clamp(min=1)).exp()[dense]
    in_range = (test_ratio >= cfg.lo) & (test_ratio <= cfg.hi)
    kept = mask & in_range
    weights = torch.where(kept, ratio, torch.zeros_like(ratio))
    metrics = _base_metrics(log_ratio, mask)
    metrics["masked_fraction"] = masked_mean((~in_range).float(), mask)
    return ImportanceResult(weights, kept, metrics)


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: "ImportanceConfig",
) -> ImportanceResult:
    """Dispatch on `cfg.mode` (a correction's name; "none" is not one: the caller skips the correction)."""
    return IMPORTANCE_CORRECTIONS.get(cfg.mode)(old_logprobs, rollout_logprobs, loss_mask, seq_ids, cfg)
