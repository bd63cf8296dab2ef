"""Concurrent engine calls: one deadline for all, every failure reported with the engine's name and words."""

import threading
import time

import pytest

from beamrl.sync.calls import ReceiverCallError, run_concurrently
from beamrl.protocols.weights import WeightSyncError


def test_all_succeed_concurrently():
    started = []
    barrier = threading.Barrier(3, timeout=5)  # passes only if the three calls run at the same time

    def call(i):
        barrier.wait()
        started.append(i)

    run_concurrently("op", [(f"e{i}", lambda i=i: call(i)) for i in range(3)], timeout=5)
    assert sorted(started) == [0, 1, 2]


def test_failures_and_false_replies_are_all_reported_without_waiting_for_the_rest():
    gate = threading.Event()
    calls = [
        ("ok", lambda: None),
        ("raises", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory"))),
        ("says-no", lambda: (False, "Failed to update parameter online")),
        ("dict-no", lambda: {"success": False, "message": "cache not flushed"}),
        ("wedged", lambda: gate.wait(60)),
    ]
    t0 = time.monotonic()
    with pytest.raises(ReceiverCallError) as info:
        run_concurrently("update_weights_from_tensor", calls, timeout=30)
    gate.set()
    assert time.monotonic() - t0 < 5  # a failure ends the wait: a dead engine does not cost the whole timeout
    f = info.value.failures
    assert {"raises", "says-no", "dict-no", "wedged"} >= set(f) >= {"raises"}
    assert f["raises"] == "RuntimeError: CUDA out of memory"
    assert f.get("says-no", "Failed to update parameter online") == "Failed to update parameter online"
    assert f.get("dict-no", "cache not flushed") == "cache not flushed"
    assert f["wedged"] == "abandoned update_weights_from_tensor after another party failed"
    assert isinstance(info.value, WeightSyncError) and "update_weights_from_tensor failed on" in str(info.value)


def test_a_wedged_call_times_out_with_its_name():
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(ReceiverCallError) as info:
        run_concurrently("end_weight_update", [("ok", lambda: None), ("engine-3", lambda: gate.wait(60))], 0.5)
    gate.set()
    assert 0.5 <= time.monotonic() - t0 < 2
    assert info.value.failures == {"engine-3": "no reply to end_weight_update within 0.5 s (engine dead or wedged)"}


def test_true_reply_is_success_and_timeout_must_be_positive():
    run_concurrently("op", [("e", lambda: (True, "Success"))], timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        run_concurrently("op", [("e", lambda: None)], timeout=0)
