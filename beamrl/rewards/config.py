"""Typed configuration of the reward components and of their worker pool.

These are the recipe's own sections: `rewards:` is a list of `RewardComponentConfig`, `reward_pool:` is a
`RewardPoolConfig`; the field names are the same in the YAML and in the code that uses them.
"""

from __future__ import annotations

import pickle
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from beamrl.config import Section
from beamrl.rewards.types import FIELDS

OnError = Literal["zero", "skip", "raise"]


class RewardComponentConfig(Section):
    """One named, weighted reward function, run in its own worker processes.

    name: metric name (`reward/<name>/...`). fn: "pkg.module:fn", a `@reward` name, or an entry-point name.
    weight: factor in the total. timeout_s: per-call limit (a sync call's worker is killed past it; an async
    call is cancelled). on_error: what a failed call (exception, bad return value, crash, timeout, skipped by
    the breaker) scores: "zero" -> 0.0 (counted in the component mean), "skip" -> None, and the RL loop
    leaves the sample out of training (it has no valid reward; a None return, "not applicable", stays in), "raise"
    -> `RewardError` stops the run.
    kwargs: extra keyword arguments for the function (must not shadow an injected field).
    num_workers: worker processes of this component (null: `reward_pool.num_workers`, else chosen for the
    machine). max_concurrency: calls in flight per worker for an async function (a sync function runs one
    call at a time per worker). breaker_after: after this many consecutive timeouts or crashes in one batch
    the component's remaining calls of the batch are skipped (0: never); the next batch tries again.
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", description="metric name: letters, digits, _ . -")
    fn: str = Field(min_length=1)
    weight: float = Field(1.0, allow_inf_nan=False)
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    on_error: OnError = "zero"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    num_workers: int | None = Field(None, gt=0)
    max_concurrency: int = Field(16, gt=0)
    breaker_after: int = Field(3, ge=0)

    @field_validator("fn")
    @classmethod
    def _fn_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("fn must name a reward function, got a blank string")
        return v

    @field_validator("kwargs")
    @classmethod
    def _kwargs_injectable(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        who = f"reward {info.data.get('name', '?')!r}"
        bad = [k for k in v if not (isinstance(k, str) and k.isidentifier())]
        if bad:
            raise ValueError(f"kwargs of {who} need identifier keys (they are keyword arguments), got {bad}")
        shadowed = sorted(set(v) & set(FIELDS))
        if shadowed:
            raise ValueError(f"kwargs of {who} shadow injected fields {shadowed}")
        try:  # kwargs travel to the worker processes with every call
            pickle.dumps(v)
        except Exception as e:
            raise ValueError(f"kwargs of {who} cannot be pickled: {type(e).__name__}: {e}") from None
        return v


class RewardPoolConfig(Section):
    """The reward worker pool: one set of worker processes per component.

    num_workers: worker processes per component that does not set its own (null: chosen for the machine
    from its CPU count and the number of components; see `beamrl.rewards.plan`). batch_timeout_s: limit for
    scoring one batch; each component's calls run on its own workers, so only a component that is itself
    too slow loses calls to it. start_timeout_s: limit for a worker to start (import and warm up its function).
    """

    num_workers: int | None = Field(None, gt=0)
    batch_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    start_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False)
