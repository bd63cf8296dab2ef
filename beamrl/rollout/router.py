"""`EngineRouter`: spread generate requests over several rollout engines, keeping groups together.

All samples of one prompt (one GRPO group) go to the same engine, so its prefix cache serves the shared
prompt once. Groups are placed by policy:
- `least_outstanding`: the engine with the fewest requests in flight (ties: lowest index);
- `round_robin`: engines in turn.
Engines marked unhealthy (by `HealthMonitor`) get no new groups. A failing engine fails the call with its
index and message; the router never silently re-routes (the caller decides whether to retry).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from beamrl.protocols.rollout import EngineError, GenerateRequest, GenerateResult, RolloutEngine

POLICIES = ("least_outstanding", "round_robin")


class EngineRouter:
    """Routes `generate` calls over `engines` (each engine's own `generate` runs in a worker thread)."""

    def __init__(self, engines: Sequence[RolloutEngine], policy: str = "least_outstanding") -> None:
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r}; allowed: {list(POLICIES)}")
        self.policy = policy
        self._engines = list(engines)
        self._healthy = [True] * len(engines)
        self._outstanding = [0] * len(engines)
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(engines)), thread_name_prefix="engine-router")

    @property
    def engines(self) -> list[RolloutEngine]:
        return list(self._engines)

    def outstanding(self) -> list[int]:
        with self._lock:
            return list(self._outstanding)

    def set_healthy(self, index: int, healthy: bool) -> None:
        with self._lock:
            self._healthy[index] = healthy

    def is_healthy(self, index: int) -> bool:
        with self._lock:
            return self._healthy[index]

    def replace(self, index: int, engine: RolloutEngine) -> RolloutEngine:
        """Swap in a new engine at `index` (healthy); returns the old one (the caller shuts it down)."""
        with self._lock:
            old, self._engines[index] = self._engines[index], engine
            self._healthy[index] = True
            return old

    def _pick(self, load: list[int]) -> int:
        candidates = [i for i, ok in enumerate(self._healthy) if ok]
        if not candidates:
            raise EngineError(f"no healthy rollout engine among {len(self._engines)}")
        if self.policy == "round_robin":
            return candidates[next(self._rr) % len(candidates)]
        return min(candidates, key=lambda i: (load[i], i))

    def assign(self, requests: Sequence[GenerateRequest], group_keys: Sequence[Hashable] | None = None
               ) -> dict[int, list[int]]:
        """Engine index -> positions of the requests it serves. Default group key: the prompt's token ids."""
        keys = list(group_keys) if group_keys is not None else [tuple(r.prompt_ids) for r in requests]
        if len(keys) != len(requests):
            raise ValueError(f"{len(keys)} group keys for {len(requests)} requests")
        groups: dict[Hashable, list[int]] = {}
        for pos, key in enumerate(keys):
            groups.setdefault(key, []).append(pos)
        plan: dict[int, list[int]] = {}
        with self._lock:
            load = list(self._outstanding)
            for positions in groups.values():
                idx = self._pick(load)
                load[idx] += len(positions)
                plan.setdefault(idx, []).extend(positions)
        return plan

    def generate(self, requests: Sequence[GenerateRequest], timeout: float,
                 group_keys: Sequence[Hashable] | None = None) -> list[GenerateResult]:
        """Results in request order; raises `EngineError` naming the engine if any engine fails or times out."""
        plan = self.assign(requests, group_keys)
        with self._lock:
            engines = {i: self._engines[i] for i in plan}
            for i, positions in plan.items():
                self._outstanding[i] += len(positions)
        futures = {i: self._pool.submit(engines[i].generate, [requests[p] for p in pos], timeout)
                   for i, pos in plan.items()}
        try:
            wait(futures.values(), timeout=timeout + 5.0)
            results: list[GenerateResult | None] = [None] * len(requests)
            errors = []
            for i, fut in futures.items():
                if not fut.done():
                    errors.append(f"engine {i}: no answer within {timeout:g} s")
                    continue
                exc = fut.exception()
                if exc is not None:
                    errors.append(f"engine {i}: {exc}")
                    continue
                out = fut.result()
                if len(out) != len(plan[i]):
                    errors.append(f"engine {i}: {len(out)} results for {len(plan[i])} requests")
                    continue
                for pos, res in zip(plan[i], out):
                    results[pos] = res
            if errors:
                raise EngineError("; ".join(errors))
            return results  # type: ignore[return-value]
        finally:
            with self._lock:
                for i, positions in plan.items():
                    self._outstanding[i] -= len(positions)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
