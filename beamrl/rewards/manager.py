"""Score batches of samples with several named, weighted reward components, each on its own workers.

Example:
    >>> from beamrl.rewards import RewardComponentConfig, RewardManager, RewardPoolConfig, RewardSample
    >>> comps = [RewardComponentConfig(name="acc", fn="dapo_math", weight=1.0, timeout_s=10.0)]
    >>> with RewardManager(comps, RewardPoolConfig(num_workers=2)) as rm:  # doctest: +SKIP
    ...     res = rm.score([RewardSample(completion="... \\\\boxed{4}", ground_truth="4")])
    >>> res.totals, res.metrics["reward/acc/mean"]  # doctest: +SKIP
    ([1.0], 1.0)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence

from beamrl.rewards.config import RewardComponentConfig, RewardPoolConfig
from beamrl.rewards.invoke import CallOutcome
from beamrl.rewards.loading import RewardFunction, load_reward_fn
from beamrl.rewards.plan import ComponentPlan, plan_components
from beamrl.rewards.pool import RewardTask, RewardWorkerPool
from beamrl.rewards.types import ComponentScore, RewardBatchResult, RewardSample

_RESERVED = {"mean", "std", "count", "none", "errors", "timeouts", "crashes", "skipped", "breaker_tripped",
             "time_mean_s"}


class RewardError(RuntimeError):
    """A component with on_error="raise" failed."""


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("sh") else f"{n} {noun}s"


def _handled(on_error: str) -> str:
    """What became of a failed call's sample, for the console lines."""
    return ("their samples are left out of training (on_error='skip')" if on_error == "skip" else
            f"scored by on_error={on_error!r}")


def _print_to_stderr(message: str) -> None:
    print(f"[beamrl] {message}", file=sys.stderr, flush=True)


class RewardManager:
    """Loads every component at construction (so a bad spec or signature fails before any rollout), then
    scores batches in a `RewardWorkerPool` (one set of workers per component; see docs/rewards.md for the
    failure model). `log` receives the breaker notices (default: stderr). Use as a context manager (or call
    `close()`)."""

    def __init__(
        self,
        components: Sequence[RewardComponentConfig],
        pool: RewardPoolConfig | None = None,
        log: Callable[[str], None] = _print_to_stderr,
    ) -> None:
        if not components:
            raise ValueError("RewardManager needs at least one RewardComponentConfig")
        names = [c.name for c in components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate reward component names: {dupes}")
        self.components = list(components)
        self.pool_config = pool if pool is not None else RewardPoolConfig()
        self.functions: list[RewardFunction] = [load_reward_fn(c.fn, c.kwargs) for c in self.components]
        self.plans: list[ComponentPlan] = plan_components(self.components, self.functions, self.pool_config)
        self.pool = RewardWorkerPool(self.plans, start_timeout_s=self.pool_config.start_timeout_s)
        self.log = log
        self._tripped_last_batch: set[str] = set()
        self._traceback_shown: set[str] = set()  # components whose failure traceback the log has shown
        self._started = False

    def __enter__(self) -> RewardManager:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the workers (they load their functions in the background; the first batch waits for them)."""
        if not self._started:
            self.pool.start()
            self._started = True

    def wait_ready(self) -> None:
        """Start the workers and wait until every one has loaded its function (`RewardPoolError` if one
        cannot); `score` does not need this, it waits for the workers it uses."""
        self.start()
        self.pool.wait_ready()

    def close(self) -> None:
        if self._started:
            self.pool.close()
            self._started = False

    def score(self, samples: Sequence[RewardSample], batch_timeout_s: float | None = None) -> RewardBatchResult:
        """Score every sample with every component. `batch_timeout_s` (default: the pool config's) bounds the
        whole batch; each call is also bounded by its component's timeout_s. Never raises for a failing
        function unless on_error="raise"."""
        bad = [i for i, s in enumerate(samples) if not isinstance(s, RewardSample)]
        if bad:
            raise TypeError(
                f"RewardManager.score needs RewardSample objects; sample {bad[0]} is a {type(samples[bad[0]]).__name__}"
            )
        self.start()
        for name in sorted(self._tripped_last_batch):
            self.log(f"reward {name!r}: retrying in this batch (its breaker had tripped in the previous one)")
        t0 = time.monotonic()
        tasks = []
        for sample in samples:
            fields = sample.fields()
            for comp, fn in zip(self.components, self.functions, strict=True):
                tasks.append(RewardTask(comp.name, fn.call_kwargs(fields, comp.kwargs)))
        limit = self.pool_config.batch_timeout_s if batch_timeout_s is None else batch_timeout_s
        run = self.pool.run(tasks, batch_timeout_s=limit)
        wall = time.monotonic() - t0
        outcomes = run.outcomes

        n, k = len(samples), len(self.components)
        per_comp: dict[str, list[ComponentScore]] = {c.name: [] for c in self.components}
        for i in range(n):
            for j, comp in enumerate(self.components):
                per_comp[comp.name].append(self._to_score(comp, outcomes[i * k + j], i))
        for comp in self.components:
            if comp.name in run.breaker_trips:
                skipped = sum(s.status == "skipped" for s in per_comp[comp.name])
                self.log(
                    f"reward {comp.name!r}: circuit breaker tripped after {comp.breaker_after} consecutive "
                    f"timeouts/crashes; {skipped} of its {n} calls in this batch were skipped "
                    f"({_handled(comp.on_error)}); it is retried next batch. First failure: "
                    f"{run.breaker_trips[comp.name]}"
                )
        self._tripped_last_batch = set(run.breaker_trips)
        for comp in self.components:
            if comp.name not in run.breaker_trips:  # a trip has its own line
                self._log_failures(comp, per_comp[comp.name])
        totals = [
            sum(
                c.weight * s.score
                for c, s in ((c, per_comp[c.name][i]) for c in self.components)
                if s.score is not None
            )
            for i in range(n)
        ]
        failed = [any(per_comp[c.name][i].failed for c in self.components) for i in range(n)]
        excluded = [any(per_comp[c.name][i].failed for c in self.components if c.on_error == "skip")
                    for i in range(n)]
        return RewardBatchResult(
            totals=[float(t) for t in totals],
            components=per_comp,
            failed=failed,
            # the totals of the samples that are trained on (a left-out sample's total lacks its failed component)
            metrics=self._metrics(per_comp, [t for t, e in zip(totals, excluded) if not e], wall, run.breaker_trips),
            breaker_trips=dict(run.breaker_trips),
            excluded=excluded,
        )

    def _log_failures(self, comp: RewardComponentConfig, scores: list[ComponentScore]) -> None:
        """One line per component and batch with failed calls (skips are the breaker's line): counted in the
        metrics too, but a reward function that fails on every sample must not look like a policy scoring 0. The
        first failure's traceback is shown once per component; later batches show its first line."""
        failed = [s for s in scores if s.status in ("error", "timeout", "crash")]
        if not failed:
            return
        counts = ", ".join(_counted(n, noun) for n, noun in (
            (sum(s.status == st for s in failed), noun) for st, noun in (("error", "error"), ("timeout", "timeout"),
                                                                        ("crash", "crash"))) if n)
        message = failed[0].message or ""
        if "\n" in message:  # a traceback under the first line (timeouts and crashes have none)
            if comp.name in self._traceback_shown:
                message = message.split("\n", 1)[0]
            self._traceback_shown.add(comp.name)
        self.log(f"reward {comp.name!r}: {len(failed)} of its {len(scores)} calls in this batch failed ({counts}), "
                 f"{_handled(comp.on_error)}. First failure: {message}")

    @staticmethod
    def _to_score(comp: RewardComponentConfig, out: CallOutcome, index: int) -> ComponentScore:
        if out.status in ("error", "timeout", "crash", "skipped"):
            if comp.on_error == "raise":
                raise RewardError(f"reward component {comp.name!r} ({comp.fn}) failed on sample {index}: {out.message}")
            score = 0.0 if comp.on_error == "zero" else None
            return ComponentScore(out.status, score, {}, out.message, out.elapsed_s)  # type: ignore[arg-type]
        return ComponentScore(out.status, out.score, out.metrics, out.message, out.elapsed_s)  # type: ignore[arg-type]

    def _metrics(
        self, per_comp: dict[str, list[ComponentScore]], totals: list[float], wall: float, trips: dict[str, str]
    ) -> dict[str, float]:
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
            m[f"{p}/crashes"] = float(sum(s.status == "crash" for s in scores))
            m[f"{p}/skipped"] = float(sum(s.status == "skipped" for s in scores))
            m[f"{p}/breaker_tripped"] = float(comp.name in trips)
            called = [s for s in scores if s.status != "skipped"]
            if called:
                m[f"{p}/time_mean_s"] = sum(s.elapsed_s for s in called) / len(called)
            keys = sorted({key for s in scores for key in s.metrics})
            for key in keys:
                vals = [s.metrics[key] for s in scores if key in s.metrics]
                # A function's own metric never overwrites a built-in one (e.g. a metric called "mean").
                name = f"{p}/{key}" if key not in _RESERVED else f"{p}/fn.{key}"
                m[name] = sum(vals) / len(vals)
        if totals:  # those of the samples that are trained on
            m["reward/total/mean"], m["reward/total/std"] = _mean_std(totals)
        m["reward/wall_s"] = wall
        return m
