"""Data that crosses the reward seam: what a reward function can be given and what it may return."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Literal

# The names a reward function may ask for as parameters (see RewardSample).
FIELDS: tuple[str, ...] = (
    "prompt",
    "completion",
    "completion_ids",
    "prompt_ids",
    "ground_truth",
    "data_source",
    "metadata",
)


@dataclass
class RewardSample:
    """One completed rollout, as reward functions see it.

    prompt: the prompt text, or the dataset's list of chat messages. completion: the decoded response.
    completion_ids / prompt_ids: token ids. ground_truth: the reference answer (any JSON value).
    data_source: dataset tag (e.g. "math_dapo"), for per-source routing. metadata: the dataset row's other fields.
    """

    prompt: Any = None
    completion: str | None = None
    completion_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    ground_truth: Any = None
    data_source: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        """The injectable fields by name."""
        return {name: getattr(self, name) for name in _field_names(type(self))}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, listed once per class (a batch asks for every sample's fields)."""
    return tuple(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class RewardOutput:
    """A score plus metrics to log (averaged per batch as `reward/<component>/<metric>`)."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


Status = Literal["ok", "none", "error", "timeout", "crash", "skipped"]
FAILED: tuple[Status, ...] = ("error", "timeout", "crash", "skipped")


@dataclass
class ComponentScore:
    """One component's verdict on one sample.

    status: "ok" (scored), "none" (function returned None: not applicable), "error" (raised or returned a
    bad value), "timeout" (overran its timeout_s, or the batch limit), "crash" (its worker process died
    during the call), "skipped" (not called: the component's circuit breaker had tripped in this batch).
    score: the function's raw score; on failure 0.0 (on_error="zero") or None (on_error="skip"); None for
    "none". elapsed_s: time inside the function (timeouts: the limit; skipped: 0).
    """

    status: Status
    score: float | None
    metrics: dict[str, float] = field(default_factory=dict)
    message: str | None = None
    elapsed_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status in FAILED


@dataclass
class RewardBatchResult:
    """Scores for a batch. totals[i] = sum over components of weight * score (None counts 0): the RAW reward,
    before any shaping (overlong, KL). failed[i]: some component failed on sample i (see `FAILED`).
    metrics: `reward/<name>/{mean,std,count,none,errors,timeouts,crashes,skipped,breaker_tripped,time_mean_s,
    <metric>}`, `reward/total/{mean,std}`, `reward/wall_s`. breaker_trips: component name -> why its breaker
    tripped in this batch (the first failure of the run of failures that tripped it). excluded[i]: a component
    with on_error="skip" failed on sample i, so sample i has no valid reward and must not be trained on."""

    totals: list[float]
    components: dict[str, list[ComponentScore]]
    failed: list[bool]
    excluded: list[bool]
    metrics: dict[str, float]
    breaker_trips: dict[str, str] = field(default_factory=dict)

    def scores(self, name: str) -> list[float | None]:
        """Raw per-sample scores of component `name`."""
        if name not in self.components:
            raise KeyError(f"no reward component {name!r}; components: {', '.join(self.components)}")
        return [c.score for c in self.components[name]]


def is_finite_number(x: Any) -> bool:
    import numbers

    return isinstance(x, numbers.Real) and math.isfinite(float(x))
