"""Call one reward function on one sample and turn whatever happens into a plain, picklable outcome.

This runs inside reward worker processes; it never raises for anything the user function does.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from beamrl.rewards.loading import import_ref
from beamrl.rewards.types import RewardOutput, is_finite_number

_CACHE: dict[str, Any] = {}


@dataclass
class CallOutcome:
    """status: "ok" | "none" | "error" | "timeout" | "crash" | "skipped" (the last two are set by the pool);
    message explains failures (with the traceback tail)."""

    status: str
    score: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    message: str | None = None
    elapsed_s: float = 0.0


def resolve(ref: str) -> Any:
    """Import `ref` once per process."""
    fn = _CACHE.get(ref)
    if fn is None:
        fn = _CACHE[ref] = import_ref(ref)
    return fn


async def _await(aw: Any) -> Any:
    return await aw


def normalize(ref: str, value: Any) -> CallOutcome:
    """Validate a return value: a finite number, None, or RewardOutput with finite numeric metrics."""
    if value is None:
        return CallOutcome("none")
    if isinstance(value, RewardOutput):
        if not is_finite_number(value.score):
            return CallOutcome(
                "error", message=f"{ref} returned RewardOutput(score={value.score!r}); score must be a finite number"
            )
        if not isinstance(value.metrics, dict):
            return CallOutcome(
                "error",
                message=f"{ref} returned RewardOutput.metrics of type {type(value.metrics).__name__}; need dict[str, float]",
            )
        bad = [k for k, v in value.metrics.items() if not isinstance(k, str) or not is_finite_number(v)]
        if bad:
            return CallOutcome("error", message=f"{ref} returned non-numeric or non-finite metrics {bad!r}")
        return CallOutcome("ok", float(value.score), {k: float(v) for k, v in value.metrics.items()})
    if is_finite_number(value):
        return CallOutcome("ok", float(value))
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return CallOutcome(
        "error",
        message=f"{ref} returned {type(value).__name__} {shown}; a reward function must return a finite float, "
        "None (not applicable) or RewardOutput(score, metrics)",
    )


def _raised(ref: str, e: BaseException) -> CallOutcome:
    tb = "".join(traceback.format_exception(e)[-3:]).rstrip()
    return CallOutcome("error", message=f"{ref} raised {type(e).__name__}: {e}\n{tb}")


def invoke(ref: str, call_kwargs: dict[str, Any]) -> CallOutcome:
    """Run the function (awaiting it if it is async) and normalise the result; exceptions become outcomes.
    No timeout here: a sync call is bounded by the pool, which kills its worker."""
    start = time.perf_counter()
    try:
        value = resolve(ref)(**call_kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        outcome = normalize(ref, value)
    except Exception as e:  # a user's bug is a counted failure, never the end of the run
        outcome = _raised(ref, e)
    outcome.elapsed_s = time.perf_counter() - start
    return outcome


async def invoke_async(ref: str, call_kwargs: dict[str, Any], timeout_s: float) -> CallOutcome:
    """Like `invoke`, on the worker's running event loop, with the per-call timeout enforced here: a call
    that overruns is cancelled (its worker and the other calls in flight go on)."""
    start = time.perf_counter()
    try:
        value = resolve(ref)(**call_kwargs)
        if inspect.isawaitable(value):
            task = asyncio.ensure_future(value)
            # asyncio.wait, not wait_for: wait_for waits for the cancellation to finish, which a coroutine
            # that swallows CancelledError would never do.
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                task.cancel()
                return CallOutcome(
                    "timeout", message=f"{ref} did not return within {timeout_s:g} s; the call was cancelled",
                    elapsed_s=timeout_s,
                )
            value = task.result()
        outcome = normalize(ref, value)
    except (Exception, asyncio.CancelledError) as e:  # CancelledError raised by the user's own code
        outcome = _raised(ref, e)
    outcome.elapsed_s = time.perf_counter() - start
    return outcome
