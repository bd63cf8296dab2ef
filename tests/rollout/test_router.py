"""EngineRouter: group affinity, policies, unhealthy engines and failure reporting (fake engines)."""

import threading

import pytest

from beamrl.models.beam import preset
from beamrl.protocols.rollout import EngineError, GenerateRequest, SamplingParams
from beamrl.rollout.router import EngineRouter

from .fake_engine import FakeEngine


class CountingEngine(FakeEngine):
    """Records the prompts it served; optionally blocks until released (to hold requests in flight)."""

    def __init__(self, name, gate=None):
        super().__init__(preset("tiny"), name=name)
        self.served = []
        self.gate = gate
        self.entered = threading.Event()  # set once a generate call has reached the engine

    def generate(self, requests, timeout):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(timeout)
        self.served += [tuple(r.prompt_ids) for r in requests]
        return super().generate(requests, timeout)


def _group(prompt, n):
    return [GenerateRequest(list(prompt), SamplingParams(max_new_tokens=2)) for _ in range(n)]


def test_groups_stay_on_one_engine_and_results_keep_order():
    engines = [CountingEngine(f"e{i}") for i in range(3)]
    router = EngineRouter(engines, policy="round_robin")
    reqs = _group([1, 2], 4) + _group([3, 4], 4) + _group([5, 6], 4)
    reqs = [reqs[i] for i in (0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11)]  # interleaved groups
    out = router.generate(reqs, timeout=10)
    assert [r.prompt_ids for r in out] == [r.prompt_ids for r in reqs]
    for e in engines:
        assert len(set(e.served)) == 1 and len(e.served) == 4  # one whole group each


def test_least_outstanding_prefers_idle_engine():
    gate = threading.Event()
    busy, idle = CountingEngine("busy", gate), CountingEngine("idle")
    router = EngineRouter([busy, idle], policy="least_outstanding")
    t = threading.Thread(target=router.generate, args=(_group([1], 3), 10))
    t.start()
    assert busy.entered.wait(60), "the first group never reached the busy engine"
    assert router.outstanding()[0] == 3  # its requests are in flight there
    router.generate(_group([2], 2), timeout=10)
    assert idle.served == [(2,), (2,)]
    gate.set()
    t.join(60)
    assert not t.is_alive()
    assert busy.served == [(1,)] * 3


def test_unhealthy_engines_get_no_work_and_failures_name_the_engine():
    a, b = CountingEngine("a"), CountingEngine("b")
    router = EngineRouter([a, b])
    router.set_healthy(0, False)
    router.generate(_group([7], 2) + _group([8], 2), timeout=10)
    assert a.served == [] and len(b.served) == 4
    b.kill()
    with pytest.raises(EngineError, match="engine 1: fake engine b is dead"):
        router.generate(_group([9], 1), timeout=10)
    router.set_healthy(1, False)
    with pytest.raises(EngineError, match="no healthy"):
        router.generate(_group([9], 1), timeout=10)


def test_hung_engine_fails_within_timeout():
    e = CountingEngine("h")
    e.hang()
    router = EngineRouter([e])
    with pytest.raises(EngineError, match="timed out"):
        router.generate(_group([1], 1), timeout=0.5)


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        EngineRouter([CountingEngine("x")], policy="random")
