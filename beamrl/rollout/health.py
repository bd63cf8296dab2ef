"""`HealthMonitor`: periodic engine health checks with timeouts; a dead engine is replaced through a factory.

Each check calls `engine.health(timeout)` (which must itself return within the timeout; a check that raises
counts as a failure). After `max_failures` consecutive failures the engine is marked unhealthy in the router,
shut down (best effort) and rebuilt with `factory(index)`; the new engine enters the router healthy. Restarts
are reported through `on_event` (default: print), never silent. Every restart attempt counts against
`max_restarts` (None: no limit); one more than that raises `RestartBudgetExceeded`, so repeated failure is a loud
error, not an endless loop. The RL loop runs `check_once` at call boundaries (on the engines its calls cannot vouch
for) and `restart` for an engine whose call failed (`beamrl.loop.engine_recovery`); `start` runs the same round in a
background thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from beamrl.protocols.rollout import EngineError, RolloutEngine
from beamrl.rollout.router import EngineRouter


class RestartBudgetExceeded(EngineError):
    """An engine needed restarting after the restart budget (`HealthConfig.max_restarts`) was spent."""


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 30.0  # seconds between rounds
    timeout: float = 10.0  # per health call
    max_failures: int = 2  # consecutive failures before a restart
    max_restarts: int | None = None  # restart attempts allowed over the monitor's life (None: unlimited)

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.timeout <= 0:
            raise ValueError(f"HealthConfig interval/timeout must be > 0, got {self.interval}/{self.timeout}")
        if self.max_failures < 1:
            raise ValueError(f"HealthConfig.max_failures={self.max_failures} must be >= 1")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"HealthConfig.max_restarts={self.max_restarts} must be >= 0")


class HealthMonitor:
    """Checks every engine of `router`; restarts dead ones with `factory(index) -> RolloutEngine`."""

    def __init__(self, router: EngineRouter, factory: Callable[[int], RolloutEngine],
                 config: HealthConfig = HealthConfig(), on_event: Callable[[str], None] = print,
                 describe: Callable[[int], str] | None = None,
                 fatal: tuple[type[BaseException], ...] = ()) -> None:
        self.router = router
        # Errors of the factory that are not the engine's (a dead trainer rank during the resync): raised to the
        # caller, never counted as a failed restart to retry.
        self.fatal = fatal
        self.factory = factory
        self.config = config
        self.on_event = on_event
        self.describe = describe  # more about a restarted engine for its one "restarted" event (pids, sync)
        self.failures = [0] * len(router.engines)
        self.restarts = [0] * len(router.engines)
        self.attempts = 0  # restart attempts, successful or not (what the budget counts)
        self.last_error: dict[int, str] = {}  # engine index -> why its last restart failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cause: str | None = None  # why the last health check raised (None: it answered)

    def _healthy(self, engine: RolloutEngine) -> bool:
        self._cause = None
        try:
            return bool(engine.health(self.config.timeout))
        except Exception as exc:  # noqa: BLE001 - any failure to answer is "unhealthy"; the cause is said
            self._cause = f"{type(exc).__name__}: {exc}"
            return False

    def check_once(self, indices: list[int] | None = None) -> list[bool]:
        """One round over all engines, or over engines `indices` (restarting as needed); returns each checked
        engine's health before restarts."""
        states = []
        for i in range(len(self.router.engines)) if indices is None else indices:
            ok = self._healthy(self.router.engines[i])
            states.append(ok)
            if ok:
                self.failures[i] = 0
                continue
            self.failures[i] += 1
            cause = f": {self._cause}" if self._cause else ""
            self.on_event(f"engine {i} failed its health check ({self.failures[i]}/{self.config.max_failures})"
                          f"{cause}")
            if self.failures[i] >= self.config.max_failures:
                self.restart(i, f"{self.failures[i]} failed health check(s)")
        return states

    @property
    def budget_spent(self) -> bool:
        """Whether `rollout.max_engine_restarts` restarts were used (the next `restart` raises)."""
        budget = self.config.max_restarts
        return budget is not None and self.attempts >= budget

    def restart(self, index: int, reason: str) -> bool:
        """Shut engine `index` down and rebuild it with the factory (also for a caller that saw it fail a call).
        Returns whether the new engine is in the router; raises `RestartBudgetExceeded` past the budget."""
        budget = self.config.max_restarts
        if self.budget_spent:
            raise RestartBudgetExceeded(f"engine {index} needs a restart ({reason}) but the restart budget is spent: "
                                        f"{self.attempts} restart(s) already (rollout.max_engine_restarts={budget})")
        self.attempts += 1
        return self._restart(index, self.router.engines[index])

    def _restart(self, index: int, engine: RolloutEngine) -> bool:
        self.router.set_healthy(index, False)
        try:
            engine.shutdown()
        except Exception as e:  # noqa: BLE001 - a dead engine may not shut down cleanly
            self.on_event(f"engine {index}: shutdown of the dead engine failed: {e}")
        t0 = time.monotonic()
        try:
            new = self.factory(index)
        except (RestartBudgetExceeded, *self.fatal):
            raise
        except Exception as e:  # noqa: BLE001 - stay unhealthy; retried next round
            self.last_error[index] = f"{type(e).__name__}: {e}"
            self.on_event(f"engine {index}: restart failed: {self.last_error[index]}")
            return False
        self.router.replace(index, new)
        self.failures[index] = 0
        self.restarts[index] += 1
        self.last_error.pop(index, None)
        try:  # the restart happened: describing it must not turn it into a failure
            more = f": {self.describe(index)}" if self.describe is not None else ""
        except Exception as e:  # noqa: BLE001 - e.g. the new engine died again at once; its next call finds out
            more = f" (no description: {type(e).__name__}: {e})"
        self.on_event(f"engine {index} restarted in {time.monotonic() - t0:.1f} s (restart #{self.restarts[index]})"
                      f"{more}")
        return True

    def start(self) -> None:
        """Run `check_once` every `interval` seconds in a daemon thread until `stop()`."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.config.interval):
                self.check_once()

        self._thread = threading.Thread(target=loop, name="engine-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
