"""Score batches of samples with several named, weighted reward components in a worker pool.

Example:
    >>> from beamrl.rewards import RewardComponentConfig, RewardManager, RewardSample
    >>> comps = [RewardComponentConfig("acc", "dapo_math", weight=1.0, timeout_s=10.0)]
    >>> with RewardManager(comps, num_workers=2) as rm:  # doctest: +SKIP
    ...     res = rm.score([RewardSample(completion="... \\\\boxed{4}", ground_truth="4")])
    >>> res.totals, res.metrics["reward/acc/mean"]  # doctest: +SKIP
    ([1.0], 1.0)
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Sequence

from beamrl.rewards.config import RewardComponentConfig
from beamrl.rewards.invoke import CallOutcome
from beamrl.rewards.loading import RewardFunction, load_reward_fn
from beamrl.rewards.pool import RewardTask, RewardWorkerPool
from beamrl.rewards.types import ComponentScore, RewardBatchResult, RewardSample

_RESERVED = {"mean", "std", "count", "none", "errors", "timeouts", "time_mean_s"}


class RewardError(RuntimeError):
    """A component with on_error="raise" failed."""


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class RewardManager:
    """Loads every component at construction (so a bad spec or signature fails before any rollout), then
    scores batches in a `RewardWorkerPool`. Use as a context manager (or call `close()`)."""

    def __init__(
        self, components: Sequence[RewardComponentConfig], num_workers: int = 2, start_timeout_s: float = 120.0
    ) -> None:
        if not components:
            raise ValueError("RewardManager needs at least one RewardComponentConfig")
        names = [c.name for c in components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate reward component names: {dupes}")
        for c in components:
            try:  # kwargs travel to worker processes with every call
                pickle.dumps(c.kwargs)
            except Exception as e:
                raise ValueError(f"RewardComponentConfig.kwargs for {c.name!r} cannot be pickled: {e}") from e
        self.components = list(components)
        self.functions: list[RewardFunction] = [load_reward_fn(c.fn, c.kwargs) for c in self.components]
        self.pool = RewardWorkerPool(
            num_workers, preload=sorted({f.ref for f in self.functions}), start_timeout_s=start_timeout_s
        )
        self._started = False

    def __enter__(self) -> RewardManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if not self._started:
            self.pool.start()
            self._started = True

    def close(self) -> None:
        if self._started:
            self.pool.close()
            self._started = False

    def score(self, samples: Sequence[RewardSample], timeout_s: float | None = None) -> RewardBatchResult:
        """Score every sample with every component. `timeout_s` bounds the whole batch (each call is also
        bounded by its component's timeout_s). Never raises for a failing function unless on_error="raise"."""
        bad = [i for i, s in enumerate(samples) if not isinstance(s, RewardSample)]
        if bad:
            raise TypeError(
                f"RewardManager.score needs RewardSample objects; sample {bad[0]} is a {type(samples[bad[0]]).__name__}"
            )
        self.start()
        t0 = time.monotonic()
        tasks = []
        for sample in samples:
            fields = sample.fields()
            for comp, fn in zip(self.components, self.functions, strict=True):
                tasks.append(RewardTask(fn.ref, fn.call_kwargs(fields, comp.kwargs), comp.timeout_s))
        outcomes = self.pool.run(tasks, batch_timeout_s=timeout_s)
        wall = time.monotonic() - t0

        n, k = len(samples), len(self.components)
        per_comp: dict[str, list[ComponentScore]] = {c.name: [] for c in self.components}
        for i in range(n):
            for j, comp in enumerate(self.components):
                per_comp[comp.name].append(self._to_score(comp, outcomes[i * k + j], i))
        totals = [
            sum(
                c.weight * s.score
                for c, s in ((c, per_comp[c.name][i]) for c in self.components)
                if s.score is not None
            )
            for i in range(n)
        ]
        failed = [any(per_comp[c.name][i].failed for c in self.components) for i in range(n)]
        return RewardBatchResult(
            totals=[float(t) for t in totals],
            components=per_comp,
            failed=failed,
            metrics=self._metrics(per_comp, totals, wall),
        )

    @staticmethod
    def _to_score(comp: RewardComponentConfig, out: CallOutcome, index: int) -> ComponentScore:
        if out.status in ("error", "timeout"):
            if comp.on_error == "raise":
                raise RewardError(f"reward component {comp.name!r} ({comp.fn}) failed on sample {index}: {out.message}")
            score = 0.0 if comp.on_error == "zero" else None
            return ComponentScore(out.status, score, {}, out.message, out.elapsed_s)  # type: ignore[arg-type]
        return ComponentScore(out.status, out.score, out.metrics, out.message, out.elapsed_s)  # type: ignore[arg-type]

    def _metrics(self, per_comp: dict[str, list[ComponentScore]], totals: list[float], wall: float) -> dict[str, float]:
        m: dict[str, float] = {}
        for comp in self.components:
            scores = per_comp[comp.name]
            values = [s.score for s in scores if s.score is not None]
            p = f"reward/{comp.name}"
            if values:
                m[f"{p}/mean"], m[f"{p}/std"] = _mean_std(values)
            m[f"{p}/count"] = float(len(values))
            m[f"{p}/none"] = float(sum(s.status == "none" for s in scores))
            m[f"{p}/errors"] = float(sum(s.status == "error" for s in scores))
            m[f"{p}/timeouts"] = float(sum(s.status == "timeout" for s in scores))
            if scores:
                m[f"{p}/time_mean_s"] = sum(s.elapsed_s for s in scores) / len(scores)
            keys = sorted({key for s in scores for key in s.metrics})
            for key in keys:
                vals = [s.metrics[key] for s in scores if key in s.metrics]
                # A function's own metric never overwrites a built-in one (e.g. a metric called "mean").
                name = f"{p}/{key}" if key not in _RESERVED else f"{p}/fn.{key}"
                m[name] = sum(vals) / len(vals)
        if totals:
            m["reward/total/mean"], m["reward/total/std"] = _mean_std(totals)
        m["reward/wall_s"] = wall
        return m
