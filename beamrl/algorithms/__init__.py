"""RL algorithms as pure-torch functions behind name registries.

- `ADVANTAGES` ("grpo"): `fn(scores, group_ids=None, cfg=None) -> advantages`.
- `POLICY_LOSSES` ("ppo_clip"): `fn(LossInputs, AlgorithmConfig) -> LossOutputs`.
- `KL_ESTIMATORS` ("k1", "k2", "k3"): `fn(logprobs, ref_logprobs) -> per-token KL`.
- `IMPORTANCE_CORRECTIONS` ("tis", "mis"): rollout-vs-trainer off-policy weights.
- DAPO: `filter_groups` (dynamic sampling on raw scores), `overlong_shaped_rewards`.
The recipe's `algorithm` section is `AlgorithmConfig` (config.py), read by these functions under its own names.
See docs/algorithms.md.
"""

from beamrl.algorithms.advantages import ADVANTAGES, grpo_advantages, per_token
from beamrl.algorithms.aggregation import AGGREGATIONS, aggregate, loss_normalizer
from beamrl.algorithms.config import (
    AlgorithmConfig,
    DynamicSamplingConfig,
    ImportanceConfig,
    KLConfig,
    OverlongConfig,
)
from beamrl.algorithms.dapo import (
    GroupFilterResult,
    filter_groups,
    overlong_penalty,
    overlong_shaped_rewards,
)
from beamrl.algorithms.importance import (
    IMPORTANCE_CORRECTIONS,
    ImportanceResult,
    importance_weights,
    masked_importance_weights,
    truncated_importance_weights,
)
from beamrl.algorithms.kl import KL_ESTIMATORS, kl_penalized_scores, token_kl
from beamrl.algorithms.policy_loss import POLICY_LOSSES, LossInputs, LossOutputs, ppo_clip_loss
from beamrl.registry import Registry

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "IMPORTANCE_CORRECTIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AlgorithmConfig",
    "DynamicSamplingConfig",
    "GroupFilterResult",
    "ImportanceConfig",
    "ImportanceResult",
    "KLConfig",
    "LossInputs",
    "LossOutputs",
    "OverlongConfig",
    "Registry",
    "aggregate",
    "filter_groups",
    "grpo_advantages",
    "importance_weights",
    "kl_penalized_scores",
    "loss_normalizer",
    "masked_importance_weights",
    "overlong_penalty",
    "overlong_shaped_rewards",
    "per_token",
    "ppo_clip_loss",
    "token_kl",
    "truncated_importance_weights",
]
