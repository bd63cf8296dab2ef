"""A receiver in a child process: a call that never answers times out naming the receiver, and the proxy then
refuses further calls (the pipe is out of step) instead of reading a stale reply."""

import importlib
import time

import pytest

from beamrl.sync.process_receiver import ProcessReceiver
from beamrl.protocols.weights import WeightSyncError


def test_wedged_child_times_out_then_proxy_refuses():
    proxy = ProcessReceiver(importlib.import_module, ("time",), name="sleepy", start_timeout=120)
    try:
        assert proxy.call("time", timeout=30) > 0  # a normal call round-trips
        with pytest.raises(WeightSyncError, match="sleepy: begin_weight_update: AttributeError"):
            proxy.begin_weight_update(5)  # the hosted object's own error comes back with its words
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"sleepy: no reply to sleep within 0.5 s"):
            proxy.call("sleep", 30, timeout=0.5)
        assert time.monotonic() - t0 < 3
        with pytest.raises(WeightSyncError, match="sleepy: unusable after an earlier failure"):
            proxy.call("time", timeout=5)
    finally:
        proxy.shutdown(timeout=2)

