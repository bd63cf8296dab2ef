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

    def __init__(self, failures: int, num_engines: int = 1):
        self.names = [f"e{k}" for k in range(num_engines)]
        self.router = EngineRouter([FakeEngine(preset("tiny"), name=n) for n in self.names])
        self.followers: list[list] = [[] for _ in self.names]  # engine k's other node processes
        self.failures, self.starts, self.stopped, self.recovery = failures, 0, [], None

    def restart_engine(self, k: int) -> None:
        self.starts += 1
        if self.starts <= self.failures:
            raise SystemError("a transient start failure")

    def stop_engine(self, k: int) -> None:
        self.stopped.append(k)

    def pids(self, k: int) -> list[int]:
        return []


def _recovery(engines, budget, pauses=None):
    logs, synced = [], []
    rec = EngineRecovery(engines, synced.append, max_restarts=budget, interval_s=60, health_timeout_s=1,
                         log=logs.append, sleep=(pauses if pauses is not None else []).append)
    return rec, logs, synced


def test_a_failed_restart_of_the_only_engine_is_tried_again_within_the_budget_after_growing_pauses():
    engines = _Engines(failures=2)
    pauses = []
    rec, logs, synced = _recovery(engines, budget=4, pauses=pauses)
    rec.recover({0: "actor died"})
    assert engines.starts == 3 and synced == [0] and engines.router.is_healthy(0)
    assert rec.take_restarts() == 1 and rec.monitor.attempts == 3
    assert pauses == [1.0, 2.0]  # not back to back: a transient cause gets time to clear
    # each failure is logged once (the monitor's line, with the error), each retry once (with its pause)
    assert sum("a transient start failure" in line for line in logs) == 2
    retries = [line for line in logs if "again in" in line]
    assert len(retries) == 2 and "again in 2 s (retry 2; 2 of 4 restarts used" in retries[1]
    done = [line for line in logs if "restarted in" in line]
    assert len(done) == 1 and "e0 (node pids []) serves the trainer's weights" in done[0]


def test_past_the_budget_the_run_ends_loudly_without_a_last_pause():
    engines = _Engines(failures=5)
    pauses = []
    rec, logs, synced = _recovery(engines, budget=2, pauses=pauses)
    with pytest.raises(RestartBudgetExceeded, match="rollout.max_engine_restarts=2"):
        rec.recover({0: "actor died"})
    assert engines.starts == 2 and synced == []
    assert pauses == [1.0]  # after the last restart allowed failed, no pause before the end


def test_the_rollout_boundary_check_asks_only_engines_a_failed_call_would_not_reveal():
    """`check` (the start of every rollout) health-checks the engines the router holds unhealthy and engines on
    several nodes; a healthy single-node engine is not asked (its `generate` is the check), saving a round trip."""
    engines = _Engines(failures=0, num_engines=3)
    asked = []
    for k, e in enumerate(engines.router.engines):
        e.health = lambda timeout, k=k: asked.append(k) or True
    engines.followers[2] = ["node1"]
    rec, logs, synced = _recovery(engines, budget=3)
    rec.check()
    assert asked == [2] and engines.starts == 0
    engines.router.set_healthy(1, False)  # e.g. its restart failed while another engine was healthy
    engines.router.engines[1].health = lambda timeout: False
    rec.check()
    assert asked == [2, 2] and engines.starts == 1 and synced == [1] and engines.router.is_healthy(1)


def test_a_trainer_rank_that_dies_during_the_resync_ends_the_run_as_a_trainer_failure():
    """Not "engine 0: restart failed", retried while the budget lasts: the driver's dead-rank path must see it."""
    from beamrl.loop.groups import TrainerRankError

    engines = _Engines(failures=0)

    def resync(k):
        raise TrainerRankError("trainer.sync_restarted: trainer rank 1 died", 1, "node-1")

    rec = EngineRecovery(engines, resync, max_restarts=4, interval_s=60, health_timeout_s=1, log=[].append,
                         sleep=[].append)
    with pytest.raises(TrainerRankError, match="rank 1 died"):
        rec.recover({0: "actor died"})
    assert rec.monitor.attempts == 1
