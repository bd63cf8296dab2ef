"""How many workers each reward component gets, and how many calls each worker runs at once.

Every component has its own workers, so a component that hangs or crashes only uses up its own. When neither
the component (`rewards[].num_workers`) nor the pool (`reward_pool.num_workers`) sets a count, it is chosen
for the machine: an equal share of the usable CPUs (at most `MAX_AUTO_WORKERS`), and for a sync function at
least `breaker_after` workers, so that a component whose every call hangs trips its breaker after about one
per-call timeout (its first calls time out together) rather than after `breaker_after` of them in a row.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from beamrl.rewards.config import RewardComponentConfig, RewardPoolConfig
from beamrl.rewards.loading import RewardFunction

MAX_AUTO_WORKERS = 8


@dataclass(frozen=True)
class ComponentPlan:
    """What the pool runs for one component. max_concurrency: calls in flight per worker (1 for sync)."""

    name: str
    ref: str
    is_async: bool
    timeout_s: float
    num_workers: int
    max_concurrency: int
    breaker_after: int


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_num_workers(is_async: bool, breaker_after: int, num_components: int, cpus: int) -> int:
    """An equal CPU share per component, capped; a sync component gets at least `breaker_after` workers."""
    share = min(MAX_AUTO_WORKERS, max(1, cpus // max(1, num_components)))
    return share if is_async else max(share, breaker_after)


def plan_components(
    components: Sequence[RewardComponentConfig],
    functions: Sequence[RewardFunction],
    pool: RewardPoolConfig,
    cpus: int | None = None,
) -> list[ComponentPlan]:
    """The resolved worker layout, one `ComponentPlan` per component (in order)."""
    cpus = usable_cpus() if cpus is None else cpus
    plans = []
    for comp, fn in zip(components, functions, strict=True):
        workers = comp.num_workers or pool.num_workers
        if workers is None:
            workers = default_num_workers(fn.is_async, comp.breaker_after, len(components), cpus)
        plans.append(
            ComponentPlan(
                name=comp.name,
                ref=fn.ref,
                is_async=fn.is_async,
                timeout_s=comp.timeout_s,
                num_workers=workers,
                max_concurrency=comp.max_concurrency if fn.is_async else 1,
                breaker_after=comp.breaker_after,
            )
        )
    return plans


def format_plan(plans: Sequence[ComponentPlan], pool: RewardPoolConfig, cpus: int | None = None) -> str:
    """The `--dry-run` lines for the reward pool."""
    cpus = usable_cpus() if cpus is None else cpus
    total = sum(p.num_workers for p in plans)
    source = (f"reward_pool.num_workers={pool.num_workers}" if pool.num_workers is not None
              else f"reward_pool.num_workers=null: chosen for this machine's {cpus} CPU(s)")
    lines = [
        f"rewards: {len(plans)} component(s), {total} worker process(es) in all ({source}, unless a component "
        f"sets num_workers); batch timeout {pool.batch_timeout_s:g} s (reward_pool.batch_timeout_s)"
    ]
    for p in plans:
        calls = f"{p.max_concurrency} async calls each" if p.is_async else "1 call each"
        breaker = f"breaker after {p.breaker_after} timeouts/crashes" if p.breaker_after else "no breaker"
        lines.append(f"  {p.name}: {p.ref}: {p.num_workers} worker(s) x {calls}; timeout {p.timeout_s:g} s per "
                     f"call; {breaker}")
    return "\n".join(lines)
