"""`AlgorithmConfig`: the recipe's `algorithm` section, owned by the algorithms and read under these names.

The policy losses (`POLICY_LOSSES`) and advantage estimators (`ADVANTAGES`) take it whole; `KLConfig`,
`ImportanceConfig` and `OverlongConfig` go to `token_kl`, `importance_weights` and `overlong_shaped_rewards`.
Choices of a registered entry (advantage, loss, KL estimator, importance mode) are checked against the
registries, so a newly registered one can be chosen at once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from beamrl.algorithms.advantages import ADVANTAGES
from beamrl.algorithms.aggregation import AGGREGATIONS
from beamrl.algorithms.importance import IMPORTANCE_CORRECTIONS
from beamrl.algorithms.kl import KL_ESTIMATORS
from beamrl.algorithms.policy_loss import POLICY_LOSSES
from beamrl.config import ConfigError, Section, registry_choice


class KLConfig(Section):
    """KL(policy || reference). reference=true with coef=0 logs the KL without putting it in the loss.

    estimator: a `KL_ESTIMATORS` name. clamp: bound on |per-token value| (k3 explodes when the policy drifts
    far; verl clamps to 10), null for none."""

    coef: float = Field(0.0, ge=0)
    estimator: registry_choice(KL_ESTIMATORS) = "k3"  # type: ignore[valid-type]
    reference: bool = False
    clamp: float | None = Field(10.0, gt=0)


class ImportanceConfig(Section):
    """Rollout-vs-trainer importance correction: TIS truncates weights at `cap`; MIS masks tokens (or whole
    sequences, by their geometric-mean ratio: level 'sequence') outside [lo, hi]. mode: 'none' or an
    `IMPORTANCE_CORRECTIONS` name."""

    mode: registry_choice(IMPORTANCE_CORRECTIONS, "none") = "none"  # type: ignore[valid-type]
    cap: float | None = Field(None, gt=0)
    lo: float | None = Field(None, ge=0)
    hi: float | None = Field(None, gt=0)
    level: Literal["token", "sequence"] = "token"

    @model_validator(mode="after")
    def _check_mode(self) -> "ImportanceConfig":
        if self.mode == "tis":
            if self.cap is None or self.cap < 1:
                raise ConfigError("cap", self.cap, "TIS truncates weights at cap: a number >= 1")
            for name in ("lo", "hi"):
                if getattr(self, name) is not None:
                    raise ConfigError(name, getattr(self, name), "only used by mode 'mis'; remove it")
            if self.level != "token":
                raise ConfigError("level", self.level, "TIS is token-level; only mode 'mis' takes a level")
        elif self.mode == "mis":
            if self.lo is None or not self.lo < 1:
                raise ConfigError("lo", self.lo, "MIS masks tokens with weight outside [lo, hi]: need 0 <= lo < 1 < hi")
            if self.hi is None or not self.hi > 1:
                raise ConfigError("hi", self.hi, "MIS masks tokens with weight outside [lo, hi]: need 0 <= lo < 1 < hi")
            if self.cap is not None:
                raise ConfigError("cap", self.cap, "only used by mode 'tis'; remove it")
        elif self.mode == "none":
            for name in ("cap", "lo", "hi"):
                if getattr(self, name) is not None:
                    raise ConfigError(name, getattr(self, name), "importance.mode is 'none'; set mode 'tis' or "
                                      "'mis', or remove it")
            self.refuse_changed(("level",), "importance.mode is 'none' (level is used by mode 'mis')")
        return self


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: drop groups whose raw rewards all agree; re-sample up to N extra rounds."""

    enabled: bool = False
    max_oversample_rounds: int = Field(3, gt=0)


class OverlongConfig(Section):
    """DAPO soft overlong punishment: linear penalty over the last `buffer` tokens before the response limit
    (rollout.max_new_tokens), reaching -penalty at the limit."""

    enabled: bool = False
    buffer: int = Field(512, gt=0)
    penalty: float = Field(1.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "OverlongConfig":
        if self.enabled and self.penalty == 0:
            raise ConfigError("penalty", 0.0, "has no effect: a penalty of 0 changes no reward; set it > 0 or "
                              "enabled: false")
        return self


class AlgorithmConfig(Section):
    """Advantage estimator, policy loss and their knobs.

    normalize_std: GRPO divides by the group's std (false: Dr. GRPO). eps_clip_low/high: PPO clip range
    [1 - low, 1 + high] (DAPO clip-higher: 0.2 / 0.28). loss_agg: an `AGGREGATIONS` name (verl's).
    routing_replay: R3, null = true for MoE models."""

    advantage: registry_choice(ADVANTAGES) = "grpo"  # type: ignore[valid-type]
    normalize_std: bool = True
    loss: registry_choice(POLICY_LOSSES) = "ppo_clip"  # type: ignore[valid-type]
    eps_clip_low: float = Field(0.2, gt=0, lt=1)
    eps_clip_high: float = Field(0.2, gt=0)
    loss_agg: Literal[AGGREGATIONS] = "token-mean"  # type: ignore[valid-type]
    kl: KLConfig = Field(default_factory=KLConfig)
    importance: ImportanceConfig = Field(default_factory=ImportanceConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    routing_replay: bool | None = Field(None, description="R3; null = true for MoE models")

    @model_validator(mode="after")
    def _check_kl(self) -> "AlgorithmConfig":
        if self.kl.coef > 0 and not self.kl.reference:
            raise ConfigError("kl.reference", False, f"kl.coef={self.kl.coef} > 0 needs a reference policy; set "
                              "reference: true (or coef: 0)")
        return self
