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


@pytest.mark.parametrize("who,fn,message", [
    ("raises", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")), "RuntimeError: CUDA out of memory"),
    ("says-no", lambda: (False, "Failed to update parameter online"), "Failed to update parameter online"),
    ("dict-no", lambda: {"success": False, "message": "cache not flushed"}, "cache not flushed"),
])
def test_each_failure_and_false_reply_is_reported_with_its_words(who, fn, message):
    with pytest.raises(ReceiverCallError) as info:
        run_concurrently("update_weights_from_tensor", [("ok", lambda: None), (who, fn), ("ok-2", lambda: 1)],
                         timeout=60)
    assert info.value.failures == {who: message}  # exactly the failing party, in its own words
    assert isinstance(info.value, WeightSyncError) and f"update_weights_from_tensor failed on 1 engine(s): {who}: " \
        f"{message}" == str(info.value)


def test_a_failure_ends_the_wait_and_abandons_the_wedged_call():
    gate = threading.Event()
    with pytest.raises(ReceiverCallError) as info:
        # The wedged call never returns before the gate opens: had the caller waited for it (or for the 60 s
        # deadline), it would be reported as "no reply ... within 60 s", not as abandoned.
        run_concurrently("update_weights_from_tensor",
                         [("raises", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory"))),
                          ("wedged", lambda: gate.wait(600))], timeout=60)
    gate.set()
    assert info.value.failures == {"raises": "RuntimeError: CUDA out of memory",
                                   "wedged": "abandoned update_weights_from_tensor after another party failed"}


def test_a_wedged_call_times_out_with_its_name():
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(ReceiverCallError) as info:
        run_concurrently("end_weight_update", [("ok", lambda: None), ("engine-3", lambda: gate.wait(600))], 0.5)
    gate.set()
    elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 60  # the deadline, not the wedged call's 600 s (a loaded machine has room)
    assert info.value.failures == {"engine-3": "no reply to end_weight_update within 0.5 s (engine dead or wedged)"}


def test_true_reply_is_success_and_timeout_must_be_positive():
    run_concurrently("op", [("e", lambda: (True, "Success"))], timeout=1)
    with pytest.raises(ValueError, match="timeout"):
        run_concurrently("op", [("e", lambda: None)], timeout=0)


def _thread_of_each(calls, **kwargs):
    seen = {}

    def call(who):
        seen[who] = threading.current_thread()

    run_concurrently("op", [(who, lambda who=who: call(who)) for who in calls], timeout=5, **kwargs)
    return seen


def test_a_single_call_that_keeps_its_own_deadline_runs_in_the_callers_thread():
    """One engine behind a proxy (`bounded_calls`): no thread per call; several calls, or a call that cannot keep a
    deadline by itself, still get their threads."""
    me = threading.current_thread()
    assert _thread_of_each(["e0"], bounded_calls=True) == {"e0": me}
    assert _thread_of_each(["e0"])["e0"] is not me
    assert all(t is not me for t in _thread_of_each(["e0", "e1"], bounded_calls=True).values())


@pytest.mark.parametrize("who,fn,message", [
    ("raises", lambda: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")), "RuntimeError: CUDA out of memory"),
    ("says-no", lambda: (False, "Failed to update parameter online"), "Failed to update parameter online"),
    ("times-out", lambda: (_ for _ in ()).throw(WeightSyncError("times-out: no reply within 5 s")),
     "times-out: no reply within 5 s"),
])
def test_a_call_in_the_callers_thread_fails_as_a_threaded_one_does(who, fn, message):
    errors = []
    for bounded_calls in (True, False):
        with pytest.raises(ReceiverCallError) as info:
            run_concurrently("begin_weight_update", [(who, fn)], timeout=60, bounded_calls=bounded_calls)
        errors.append((info.value.failures, str(info.value)))
    assert errors[0] == errors[1] and errors[0][0] == {who: message}


def test_a_single_call_without_its_own_deadline_still_times_out():
    gate = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(ReceiverCallError, match="no reply to end_weight_update within 0.5 s"):
        run_concurrently("end_weight_update", [("engine-0", lambda: gate.wait(30))], 0.5)
    gate.set()
    assert time.monotonic() - t0 < 20
