"""EngineRecovery: a restart that fails while no engine is healthy is tried again within the restart budget; past
the budget the run ends loudly. (The restart of real engines is exercised end to end in test_faults.py and
test_e2e_rehearsal.py; here the engine group is a stand-in around the rollout test engine.)"""

import pytest

from beamrl.loop.engine_recovery import EngineRecovery
from beamrl.models.beam import preset
from beamrl.rollout.health import RestartBudgetExceeded
from beamrl.rollout.router import EngineRouter
from tests.rollout.fake_engine import FakeEngine


class _Engines:
    """What EngineRecovery uses of an `EngineGroup`: its router and names, and the restart of engine k (failing
    `failures` times first)."""

    def __init__(self, failures: int):
        self.names = ["e0"]
        self.router = EngineRouter([FakeEngine(preset("tiny"), name="e0")])
        self.failures, self.starts, self.stopped, self.recovery = failures, 0, [], None

    def restart_engine(self, k: int) -> None:
        self.starts += 1
        if self.starts <= self.failures:
            raise SystemError("a transient start failure")

    def stop_engine(self, k: int) -> None:
        self.stopped.append(k)

    def pids(self, k: int) -> list[int]:
        return []


def _recovery(engines, budget):
    logs, synced = [], []
    rec = EngineRecovery(engines, synced.append, max_restarts=budget, interval_s=60, health_timeout_s=1,
                         log=logs.append)
    return rec, logs, synced


def test_a_failed_restart_of_the_only_engine_is_tried_again_within_the_budget():
    engines = _Engines(failures=1)
    rec, logs, synced = _recovery(engines, budget=3)
    rec.recover({0: "actor died"})
    assert engines.starts == 2 and synced == [0] and engines.router.is_healthy(0)
    assert rec.take_restarts() == 1 and rec.monitor.attempts == 2
    assert any("trying again" in line and "a transient start failure" in line for line in logs)


def test_past_the_budget_the_run_ends_loudly():
    engines = _Engines(failures=5)
    rec, logs, synced = _recovery(engines, budget=2)
    with pytest.raises(RestartBudgetExceeded, match="rollout.max_engine_restarts=2"):
        rec.recover({0: "actor died"})
    assert engines.starts == 2 and synced == []
