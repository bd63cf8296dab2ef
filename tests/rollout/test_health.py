"""HealthMonitor: dead or hung engines are restarted through the factory; healthy ones are left alone."""

import threading

from beamrl.models.beam import preset
from beamrl.rollout.health import HealthConfig, HealthMonitor
from beamrl.protocols.rollout import GenerateRequest
from beamrl.rollout.router import EngineRouter

from .fake_engine import FakeEngine


def _setup(max_failures=1, timeout=0.2):
    made = []
    restarted = threading.Event()

    def factory(i):
        e = FakeEngine(preset("tiny"), name=f"new-{i}-{len(made)}")
        made.append(e)
        restarted.set()
        return e

    engines = [FakeEngine(preset("tiny"), name=f"e{i}") for i in range(2)]
    router = EngineRouter(engines)
    events = []
    mon = HealthMonitor(router, factory, HealthConfig(interval=0.05, timeout=timeout, max_failures=max_failures),
                        on_event=events.append)
    return engines, router, mon, made, events, restarted


def test_dead_engine_is_replaced_and_served_again():
    engines, router, mon, made, events, restarted = _setup()
    engines[1].kill()
    assert mon.check_once() == [True, False]
    assert router.engines[0] is engines[0] and router.engines[1] is made[0]
    assert router.is_healthy(1) and mon.restarts == [0, 1]
    assert any("restarted" in e for e in events)
    assert router.generate([GenerateRequest([1, 2])], timeout=5)[0].output_ids


def test_hung_engine_counts_as_dead_within_the_timeout_and_needs_max_failures():
    engines, router, mon, made, events, restarted = _setup(max_failures=2)
    engines[0].hang()
    mon.check_once()
    assert engines[0].last_timeout == 0.2  # the health call was bounded by HealthConfig.timeout
    assert made == [] and mon.failures[0] == 1  # one failure is not enough
    mon.check_once()
    assert len(made) == 1 and router.engines[0] is made[0]


def test_failed_restart_keeps_engine_unhealthy_and_reports():
    engines = [FakeEngine(preset("tiny"), name="e0")]
    router = EngineRouter(engines)
    events = []

    def factory(i):
        raise RuntimeError("no GPU left")

    mon = HealthMonitor(router, factory, HealthConfig(interval=1, timeout=0.2, max_failures=1), on_event=events.append)
    engines[0].kill()
    mon.check_once()
    assert not router.is_healthy(0)
    assert any("restart failed" in e and "no GPU left" in e for e in events)


def test_background_thread_restarts():
    engines, router, mon, made, events, restarted = _setup()
    mon.start()
    try:
        engines[0].kill()
        assert restarted.wait(60), f"the monitor thread did not restart the dead engine within 60 s: {events}"
    finally:
        mon.stop()
    assert made and router.engines[0] is made[0]


def test_restart_budget_counts_attempts_and_one_more_is_a_loud_error():
    import pytest

    from beamrl.rollout.health import RestartBudgetExceeded

    engines = [FakeEngine(preset("tiny"), name="e0")]
    router = EngineRouter(engines)
    calls = []

    def factory(i):
        calls.append(i)
        if len(calls) == 1:
            raise RuntimeError("no GPU left")  # a failed attempt is spent too
        return FakeEngine(preset("tiny"), name=f"new-{len(calls)}")

    mon = HealthMonitor(router, factory, HealthConfig(interval=1, timeout=0.2, max_failures=1, max_restarts=2),
                        on_event=lambda m: None)
    assert mon.restart(0, "its call failed") is False and mon.last_error == {0: "RuntimeError: no GPU left"}
    assert mon.restart(0, "its call failed") is True and router.is_healthy(0) and mon.restarts == [1]
    router.engines[0].kill()
    with pytest.raises(RestartBudgetExceeded, match=r"engine 0 needs a restart \(1 failed health check\(s\)\) but "
                                                    r"the restart budget is spent: 2 .*max_engine_restarts=2"):
        mon.check_once()
    assert calls == [0, 0]


def test_health_config_refuses_a_negative_restart_budget():
    import pytest

    with pytest.raises(ValueError, match="max_restarts=-1"):
        HealthConfig(max_restarts=-1)


def test_a_restart_that_cannot_be_described_still_counts_as_done():
    """`describe` (the RL loop asks the new engine for its pids) failing must not turn a done restart into a
    failure: the engine is in the router, healthy, and the event says why it has no description."""
    engines, router, mon, made, events, _ = _setup()

    def describe(i):
        raise RuntimeError("the new engine died at once")

    mon.describe = describe
    engines[0].kill()
    assert mon.restart(0, "killed") is True
    assert router.engines[0] is made[0] and router.is_healthy(0)
    assert any("restarted" in e and "no description: RuntimeError: the new engine died at once" in e for e in events)


def test_a_health_check_that_raises_says_why():
    """An engine whose `health` raises (a bug, a lost connection) is unhealthy, and the event names the cause."""
    engines, router, mon, made, events, restarted = _setup(max_failures=2)

    def broken(timeout):
        raise ConnectionError("actor lost")

    engines[0].health = broken
    assert mon.check_once() == [False, True]
    assert any("engine 0 failed its health check (1/2): ConnectionError: actor lost" in e for e in events), events
