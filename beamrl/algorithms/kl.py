"""KL(policy || reference) estimators from samples of the policy, chosen by name from `KL_ESTIMATORS`.

With log r = ref_logprob - logprob at a token sampled from the policy (Schulman, "Approximating KL"):
- "k1": -log r. Unbiased for KL(p||q); high variance, can be negative. Its gradient as a loss is 0 in
  expectation, so use it for reporting or KL-in-reward, not as a loss.
- "k2": (log r)^2 / 2. Biased (low for small KL) but always >= 0; as a loss its gradient equals the
  gradient of KL(p||q) exactly in expectation.
- "k3": (r - 1) - log r. Unbiased for KL(p||q) and always >= 0 (verl's "low_var_kl"); as a loss its
  gradient is that of the reverse KL(q||p).

Example:
    >>> import torch
    >>> KL_ESTIMATORS.get("k3")(torch.tensor([-1.0]), torch.tensor([-1.0])).item()
    0.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from beamrl.algorithms.aggregation import masked_mean
from beamrl.registry import Registry

if TYPE_CHECKING:
    from beamrl.algorithms.config import KLConfig

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 = logprob - ref_logprob."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 = (logprob - ref_logprob)^2 / 2."""
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = exp(ref - logprob) - 1 - (ref - logprob)."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, cfg: "KLConfig") -> torch.Tensor:
    """Per-token KL estimate under `cfg` (estimator + clamp)."""
    kl = KL_ESTIMATORS.get(cfg.estimator)(logprobs, ref_logprobs)
    if cfg.clamp is not None:
        kl = kl.clamp(-cfg.clamp, cfg.clamp)
    return kl


def kl_penalized_scores(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    cfg: "KLConfig",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward: shaped_i = scores_i - coef * sum_{t in seq i} kl_t (detached). Returns the shaped scores
    [n_seqs] and metrics. Apply it to the shaped reward only; dynamic sampling keeps using the raw scores."""
    mask = loss_mask.to(torch.bool)
    kl = torch.where(mask, token_kl(logprobs.detach(), ref_logprobs.detach(), cfg), torch.zeros_like(logprobs))
    seq_kl = torch.zeros(scores.shape[0], dtype=kl.dtype, device=kl.device).index_add(0, seq_ids, kl)
    shaped = scores - cfg.coef * seq_kl.to(scores.dtype)
    metrics = {
        "kl_in_reward/seq_kl_mean": float(seq_kl.mean()),
        "kl_in_reward/token_kl_mean": float(masked_mean(kl, mask)),
    }
    return shaped, metrics
