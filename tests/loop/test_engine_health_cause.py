"""An engine of the RL loop's group whose health check raises (its actor died, no answer in time) is named with
that error, on both paths that check it: the health monitor's event and the group's own check. The group's Ray
call is replaced here by one that raises as `ray_get` does; the real calls run in test_engine_group.py and
test_faults.py."""

import pytest

from beamrl.loop import groups
from beamrl.loop.groups import EngineGroup, EngineHandle
from beamrl.loop.ray_utils import ActorCallError
from beamrl.rollout.health import HealthConfig, HealthMonitor
from beamrl.rollout.router import EngineRouter


class _Actor:
    class health:  # noqa: N801 - an actor method's `.remote`
        @staticmethod
        def remote(timeout):
            return "ref"


def _group(nodes):
    group = EngineGroup.__new__(EngineGroup)  # no Ray: only what the health check reads
    group.nodes, group.names, group.health_errors = nodes, ["sglang-0"], {}
    return group


def _dead(refs, timeout, what):
    raise ActorCallError(f"{what}: the actor died (killed)\n\tclass_name: EngineActor\n\tpid: 1234")  # as Ray says


def test_the_monitor_says_why_an_engine_of_the_group_is_unhealthy(monkeypatch):
    monkeypatch.setattr(groups, "ray_get", _dead)
    group = _group([[_Actor()]])
    events = []
    monitor = HealthMonitor(EngineRouter([EngineHandle(group, 0)]), factory=lambda i: None,
                            config=HealthConfig(max_failures=2), on_event=events.append)
    assert monitor.check_once() == [False]
    assert events[0].startswith("engine 0 failed its health check (1/2): ActorCallError: sglang-0.health: the "
                                "actor died (killed)") and len(events) == 1
    assert group.health_cause(0) == " (ActorCallError: sglang-0.health: the actor died (killed))"


def test_an_engine_that_answers_or_is_stopped_keeps_no_cause_from_before(monkeypatch):
    monkeypatch.setattr(groups, "ray_get", _dead)
    group = _group([[_Actor()]])
    assert group.engine_health(0, 1.0) is False and group.health_cause(0)
    monkeypatch.setattr(groups, "ray_get", lambda refs, timeout, what: [True])
    assert EngineHandle(group, 0).health(1.0) is True and group.health_cause(0) == ""
    monkeypatch.setattr(groups, "ray_get", _dead)
    group.engine_health(0, 1.0)
    group.nodes[0] = []  # stopped (restarting): unhealthy, but not for the old reason
    assert group.engine_health(0, 1.0) is False and group.health_cause(0) == ""


@pytest.mark.parametrize("raises", [True, False])
def test_the_handle_answers_false_only_when_the_check_answered(monkeypatch, raises):
    monkeypatch.setattr(groups, "ray_get", _dead if raises else (lambda refs, timeout, what: [False]))
    handle = EngineHandle(_group([[_Actor()]]), 0)
    if raises:
        with pytest.raises(ActorCallError, match="the actor died"):
            handle.health(1.0)
    else:
        assert handle.health(1.0) is False
