"""Policy losses, chosen by name from `POLICY_LOSSES`: `fn(LossInputs, AlgorithmConfig) -> LossOutputs`.

"ppo_clip" (PPO with DAPO clip-higher), per loss token t with ratio_t = exp(logprob_t - old_logprob_t):

    l_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_clip_low, 1 + eps_clip_high)) * w_t + kl.coef * kl_t

w_t is the off-policy correction weight against the rollout policy (`importance`, 1 when its mode is "none"),
kl_t the KL(policy || reference) estimate (`kl`, 0 when coef is 0). The token losses are reduced by `loss_agg`
with the step-wide normaliser from `loss_normalizer` (see `beamrl.algorithms.aggregation`).

Example (one micro-batch that is the whole step):
    >>> import torch
    >>> from beamrl.algorithms import POLICY_LOSSES, AlgorithmConfig, LossInputs
    >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    >>> out = POLICY_LOSSES.get("ppo_clip")(
    ...     LossInputs(logprobs=lp, old_logprobs=lp.detach(), advantages=torch.tensor([1.0, -1.0]),
    ...                loss_mask=torch.tensor([True, True]), seq_ids=torch.tensor([0, 0])),
    ...     AlgorithmConfig(eps_clip_low=0.2, eps_clip_high=0.28))
    >>> out.loss.backward(); lp.grad.tolist()
    [-0.5, 0.5]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from beamrl.algorithms.aggregation import AGGREGATIONS, aggregate, masked_mean
from beamrl.algorithms.importance import importance_weights
from beamrl.algorithms.kl import token_kl
from beamrl.registry import Registry

if TYPE_CHECKING:
    from beamrl.algorithms.config import AlgorithmConfig

POLICY_LOSSES: Registry = Registry("policy loss")


@dataclass
class LossInputs:
    """One micro-batch, flattened to its T response tokens.

    logprobs: current policy (carries the graph). old_logprobs: the policy that the PPO ratio is taken
    against (pi_old, recomputed by the trainer; pass logprobs.detach() for a single on-policy update).
    rollout_logprobs: the engine's logprobs (needed when `AlgorithmConfig.importance.mode` is not "none").
    ref_logprobs: reference policy (needed when `AlgorithmConfig.kl.coef > 0`).
    advantages: per token (see `advantages.per_token`). loss_mask: bool, True on trained tokens.
    seq_ids: the sequence (0..n_seqs-1 within this micro-batch) of each token.
    normalizer: this step's denominator, summed over all its micro-batches (`loss_normalizer`);
    None treats this micro-batch as the whole step.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    normalizer: float | None = None

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if self.logprobs.dim() != 1:
            raise ValueError(f"LossInputs.logprobs must be 1-D [T], got shape {tuple(shape)}")
        for name in ("old_logprobs", "advantages", "loss_mask", "seq_ids", "rollout_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"LossInputs.{name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}")
        if self.seq_ids.dtype.is_floating_point:
            raise ValueError(f"LossInputs.seq_ids must be integer, got {self.seq_ids.dtype}")


@dataclass
class LossOutputs:
    """loss: scalar to backward. metrics: detached 0-dim tensors (means over this micro-batch's loss tokens, but
    for those in `METRIC_REDUCTIONS`; no host sync until the logger reads them)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros_like(x))


#: The policy losses' metrics that are not means over the micro-batch's loss tokens, and how their values of
#: several micro-batches, data-parallel ranks and optimizer steps combine: "sum" for a count, "max" / "min" for an
#: extreme. A max (min) over no loss token is -inf (+inf), which combines with the others as if absent. Every other
#: metric is a mean (combined token-weighted, `beamrl.loop.losses.PolicyLoss`).
METRIC_REDUCTIONS: dict[str, str] = {"num_tokens": "sum", "ratio_max": "max", "ratio_min": "min"}


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(inputs: LossInputs, cfg: "AlgorithmConfig") -> LossOutputs:
    """PPO-clip with separate low/high clip (see module doc)."""
    mask = inputs.loss_mask.to(torch.bool)
    # Masked positions may hold padding garbage (NaN, -inf). Replace them by constants up front: where()
    # sends no gradient to the unselected input, and nothing downstream can form inf*0 = NaN gradients.
    logprobs = _masked(inputs.logprobs, mask)
    old_logprobs = _masked(inputs.old_logprobs.detach(), mask)
    adv = _masked(inputs.advantages.to(logprobs.dtype), mask)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.eps_clip_low, 1.0 + cfg.eps_clip_high)
    tok_loss = torch.maximum(unclipped, clipped)

    metrics: dict[str, torch.Tensor] = {}
    if cfg.importance.mode != "none":
        if inputs.rollout_logprobs is None:
            raise ValueError(f"importance.mode={cfg.importance.mode!r} but LossInputs.rollout_logprobs is None")
        rollout = _masked(inputs.rollout_logprobs, mask)
        imp = importance_weights(old_logprobs, rollout, mask, inputs.seq_ids, cfg.importance)
        tok_loss = tok_loss * imp.weights.to(tok_loss.dtype)
        metrics.update({f"is/{k}": v for k, v in imp.metrics.items()})
    elif inputs.rollout_logprobs is not None:  # still worth watching without a correction
        diff = (old_logprobs - _masked(inputs.rollout_logprobs, mask)).detach().abs()
        metrics["is/train_rollout_logprob_abs_diff"] = masked_mean(diff, mask)

    if cfg.kl.coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError(f"kl.coef={cfg.kl.coef} but LossInputs.ref_logprobs is None")
        kl = token_kl(logprobs, _masked(inputs.ref_logprobs.detach(), mask), cfg.kl)
        kl = torch.where(mask, kl, torch.zeros_like(kl))
        tok_loss = tok_loss + cfg.kl.coef * kl
        metrics["kl_loss"] = masked_mean(kl.detach(), mask)

    loss = aggregate(tok_loss, mask, inputs.seq_ids, cfg.loss_agg, inputs.normalizer)

    with torch.no_grad():
        pos, neg = adv > 0, adv < 0
        clip_high = mask & pos & (ratio > 1.0 + cfg.eps_clip_high)  # gradient stopped by the upper clip
        clip_low = mask & neg & (ratio < 1.0 - cfg.eps_clip_low)  # gradient stopped by the lower clip
        lr = log_ratio.detach()
        r = ratio.detach()
        inf = torch.full_like(r, float("inf"))
        metrics.update(
            {
                "pg_loss": aggregate(torch.maximum(unclipped, clipped).detach(), mask, inputs.seq_ids, cfg.loss_agg),
                "clip_fraction": masked_mean((clip_high | clip_low).float(), mask),
                "clip_fraction_high": masked_mean(clip_high.float(), mask),
                "clip_fraction_low": masked_mean(clip_low.float(), mask),
                "ppo_kl": masked_mean(-lr, mask),  # k1(old || new), as miles/verl log it
                # k3 of KL(old || new): the tokens were sampled by pi_old, so r = new / old. >= 0.
                "approx_kl": masked_mean(torch.expm1(lr) - lr, mask),
                "ratio_mean": masked_mean(r, mask),
                # The extremes and the count combine over micro-batches by METRIC_REDUCTIONS, not as means.
                "ratio_max": torch.where(mask, r, -inf).max(),
                "ratio_min": torch.where(mask, r, inf).min(),
                "num_tokens": mask.sum().to(r.dtype),
            }
        )
    return LossOutputs(loss=loss, metrics=metrics)


__all__ = ["AGGREGATIONS", "METRIC_REDUCTIONS", "POLICY_LOSSES", "LossInputs", "LossOutputs", "ppo_clip_loss"]
