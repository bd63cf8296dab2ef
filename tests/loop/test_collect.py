"""The collector refuses rollout results from weights other than those the engines were last synced to (an engine
a sync did not reach would feed the trainer another policy's samples; the batch's `rollout/weight_version` metric
only showed the smallest version). The engine group is a stand-in; the real loop runs in the e2e tests."""

from types import SimpleNamespace

import pytest

from beamrl.loop.collect import PendingRollout, RolloutCollector
from beamrl.protocols.rollout import EngineError, GenerateResult


def _result(version):
    return GenerateResult([1, 2], [3], [-0.5], "stop", weight_version=version)


def test_results_from_another_weight_version_end_the_step_loudly():
    engines = SimpleNamespace(collect=lambda handle: [[_result(4), _result(3)]], recovery=None)
    collector = RolloutCollector(SimpleNamespace(recipe=SimpleNamespace()), engines)
    pending = PendingRollout(step=0, prompts=[], handle=None, started=0.0, data_state={}, version=4)
    with pytest.raises(EngineError, match=r"version\(s\) \[3\].*synced to version 4"):
        collector.finish(pending)
