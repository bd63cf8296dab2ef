"""Engine fault tolerance in the RL loop: a dead rollout engine (any of its node processes) is restarted through
the same engine-actor start path, given the current weights (a subset sync through the run's sync orchestrator,
verified: it must serve the trainer's version afterwards) and handed the requests it lost again.

`EngineRecovery` wraps the router's `HealthMonitor` (`beamrl.rollout.health`): `check` runs a health round at a
call boundary (the start of each step's rollout) over the engines a failed call would not reveal, and
`EngineGroup.collect` calls `recover` for an engine whose call failed or that failed a health check while a rollout
waited on it (every `rollout.health_check_interval_s`).
Every restart attempt counts against `rollout.max_engine_restarts`; one more ends the run with
`RestartBudgetExceeded`. A restart that fails while no engine is healthy is tried again after a growing pause
(`RETRY_DELAYS_S`), so a transient cause (a port still held, a node short of memory for a moment) does not burn
the budget in seconds. Successful restarts are counted per step (`take_restarts`, the `engine/restarts` metric).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from beamrl.loop.groups import EngineGroup, EngineHandle, TrainerRankError
from beamrl.protocols.rollout import EngineError
from beamrl.rollout.health import HealthConfig, HealthMonitor

# Pause before the n-th retry of a restart that failed while no engine was healthy (the last one repeats).
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class EngineRecovery:
    """Restarts and resyncs `engines`' dead engines. `resync(k)` brings restarted engine k to the trainer's current
    weight version and checks it serves it (the driver's: it owns the trainer and the version)."""

    def __init__(self, engines: EngineGroup, resync: Callable[[int], None], *, max_restarts: int,
                 interval_s: float, health_timeout_s: float, log: Callable[[str], None],
                 sleep: Callable[[float], None] = time.sleep):
        self.engines, self.resync, self.log, self.sleep = engines, resync, log, sleep
        self.interval_s, self.health_timeout_s = interval_s, health_timeout_s
        # One failed check is enough: a caller only asks after a failed call or a missed health answer.
        self.monitor = HealthMonitor(engines.router, self._rebuild,
                                     HealthConfig(interval=interval_s, timeout=health_timeout_s, max_failures=1,
                                                  max_restarts=max_restarts),
                                     on_event=lambda msg: log(f"rollout: {msg}"), describe=self._describe,
                                     fatal=(TrainerRankError,))  # the trainer's failure ends the run as such
        self._restarts = 0
        engines.recovery = self

    def check(self) -> None:
        """At a call boundary (the start of a rollout): a health round over the engines the rollout's own calls
        cannot vouch for, restarting the dead ones; raises if none is left healthy. Those are the engines the router
        holds unhealthy (a restart that failed while another engine was healthy) and engines on several nodes (a
        dead follower need not fail its leader's call: it could hang it). An engine on one node is not asked: the
        rollout's `generate` is its check (a dead engine fails the call, and `recover` restarts it; one that stops
        answering is found by the health checks every `interval_s` while the rollout waits on it), which saves a
        round trip per step."""
        router, followers = self.engines.router, self.engines.followers
        suspects = [k for k in range(len(self.engines.names)) if not router.is_healthy(k) or followers[k]]
        if suspects:
            self.monitor.check_once(suspects)
        self._require_one()

    def recover(self, failed: dict[int, str]) -> None:
        """Engines `failed` (index -> what went wrong) failed a call: restart each (their requests are re-issued
        by the caller, to whichever engines are healthy then). A restart that fails while no engine is healthy is
        tried again after a pause (`RETRY_DELAYS_S`), each try counting against the budget (a transient start
        failure must not end a run that has restarts left); with another engine healthy the next health round tries
        again. The monitor logs each failed restart with its error; this logs the retry."""
        for k, reason in sorted(failed.items()):
            reason = " ".join(reason.strip().splitlines()[0].split())  # Ray's death notices run to many lines
            self.log(f"rollout: engine {k} ({self.engines.names[k]}) failed: {reason}; restarting it")
            retries = 0
            while not self.monitor.restart(k, f"its restart failed ({self.monitor.last_error.get(k)})" if retries
                                           else reason) and not self._any_healthy():
                budget = self.monitor.config.max_restarts
                if self.monitor.budget_spent:
                    continue  # no pause: the next restart raises RestartBudgetExceeded at once
                delay = RETRY_DELAYS_S[min(retries, len(RETRY_DELAYS_S) - 1)]
                retries += 1
                self.log(f"rollout: no engine is healthy: restarting engine {k} ({self.engines.names[k]}) again in "
                         f"{delay:g} s (retry {retries}; {self.monitor.attempts} of "
                         f"{'unlimited' if budget is None else budget} restarts used, rollout.max_engine_restarts)")
                self.sleep(delay)
        self._require_one()

    def _any_healthy(self) -> bool:
        return any(self.engines.router.is_healthy(k) for k in range(len(self.engines.names)))

    def _require_one(self) -> None:
        if not self._any_healthy():
            why = "; ".join(f"{self.engines.names[k]}: {e}" for k, e in sorted(self.monitor.last_error.items()))
            raise EngineError(f"no rollout engine is healthy (restarts failed: {why or 'no reason recorded'})")

    def _rebuild(self, k: int) -> EngineHandle:
        """The monitor's factory: start engine k again (the monitor shut it down) and resync it."""
        self.engines.restart_engine(k)
        try:
            self.resync(k)
        except BaseException:
            self.engines.stop_engine(k)  # an engine on stale weights must not serve
            raise
        self._restarts += 1
        return EngineHandle(self.engines, k)

    def _describe(self, k: int) -> str:
        """The monitor's "restarted" event (its time includes the resync), completed: which engine, its new
        processes."""
        return f"{self.engines.names[k]} (node pids {self.engines.pids(k)}) serves the trainer's weights"

    def take_restarts(self) -> int:
        """Successful restarts since the last call (the step's `engine/restarts`)."""
        n, self._restarts = self._restarts, 0
        return n
