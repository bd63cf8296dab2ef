"""A receiver in a child process: pipelined calls come back in order with their own results and errors; a call that
never answers times out naming the receiver, and the proxy then refuses further calls (the pipe is out of step)
instead of reading a stale reply."""

import importlib
import operator
import time

import pytest

from beamrl.protocols.weights import WeightSyncError
from beamrl.sync.process_receiver import ProcessReceiver


def test_pipelined_calls_keep_their_order_and_results():
    proxy = ProcessReceiver(importlib.import_module, ("functools",), name="ft", start_timeout=120)
    try:
        # call_async(method, timeout, *args) runs reduce(*args, timeout): add(...) over [i, i] starting at timeout
        calls = [proxy.call_async("reduce", 30 + i, operator.add, [i, i]) for i in range(4)]
        bad = proxy.call_async("reduce", 30, "not a function", [1, 2])
        last = proxy.call_async("reduce", 40, operator.add, [5])
        assert last.wait(30) == 45  # waiting for a later call reads the earlier replies and keeps them
        with pytest.raises(WeightSyncError, match="ft: reduce: TypeError"):
            bad.wait(30)  # an error travels back to its own call
        assert [c.wait(30) for c in reversed(calls)] == [30 + i + 2 * i for i in reversed(range(4))]
    finally:
        proxy.shutdown(timeout=5)


def test_wedged_child_times_out_then_proxy_refuses():
    proxy = ProcessReceiver(importlib.import_module, ("time",), name="sleepy", start_timeout=120)
    try:
        assert proxy.call("time", timeout=30) > 0  # a normal call round-trips
        with pytest.raises(WeightSyncError, match="sleepy: begin_weight_update: AttributeError"):
            proxy.begin_weight_update(None, 5)  # the hosted object's own error comes back with its words
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"sleepy: no reply to sleep within 0.5 s"):
            proxy.call("sleep", 600, timeout=0.5)
        assert time.monotonic() - t0 < 60  # abandoned at its deadline, not after the child's 600 s sleep
        with pytest.raises(WeightSyncError, match="sleepy: unusable after an earlier failure"):
            proxy.call("time", timeout=5)
    finally:
        proxy.shutdown(timeout=2)
