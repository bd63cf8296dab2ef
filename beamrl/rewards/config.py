"""Typed configuration of one reward component."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from beamrl.rewards.types import FIELDS

OnError = Literal["zero", "skip", "raise"]
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class RewardComponentConfig:
    """One named, weighted reward function.

    name: metric name (`reward/<name>/...`). fn: "pkg.module:fn", a `@reward` name, or an entry-point name.
    weight: factor in the total. timeout_s: per-call limit (the call's worker is killed past it).
    on_error: what a failed call (exception, bad return value, timeout) scores:
      "zero" -> 0.0 (counted in the component mean), "skip" -> None (excluded, like a None return),
      "raise" -> `RewardError` stops the run. Failures are always counted in `reward/<name>/errors|timeouts`.
    kwargs: extra keyword arguments for the function (must not shadow an injected field).
    """

    name: str
    fn: str
    weight: float = 1.0
    timeout_s: float = 30.0
    on_error: OnError = "zero"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"RewardComponentConfig.name={self.name!r} must match [A-Za-z0-9_.-]+ (it is a metric name)"
            )
        if not isinstance(self.fn, str) or not self.fn.strip():
            raise ValueError(f"RewardComponentConfig.fn for {self.name!r} must be a non-empty string, got {self.fn!r}")
        if not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(
                f"RewardComponentConfig.weight for {self.name!r} must be a finite number, got {self.weight!r}"
            )
        if not isinstance(self.timeout_s, (int, float)) or not (0 < self.timeout_s < math.inf):
            raise ValueError(
                f"RewardComponentConfig.timeout_s for {self.name!r} must be > 0 and finite, got {self.timeout_s!r}"
            )
        if self.on_error not in ("zero", "skip", "raise"):
            raise ValueError(
                f"RewardComponentConfig.on_error for {self.name!r} must be 'zero', 'skip' or 'raise', got {self.on_error!r}"
            )
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in self.kwargs):
            raise ValueError(f"RewardComponentConfig.kwargs for {self.name!r} must be a dict with identifier keys")
        shadowed = sorted(set(self.kwargs) & set(FIELDS))
        if shadowed:
            raise ValueError(f"RewardComponentConfig.kwargs for {self.name!r} shadow injected fields {shadowed}")
