"""ForwardingReceiver forwards every WeightReceiver method by name, with the timeout it was given, and issues
pipelined calls through the same channel."""

import inspect

import pytest

from beamrl.protocols.weights import PendingCall, WeightReceiver, WeightSyncError
from beamrl.sync.forwarding_receiver import ForwardingReceiver


class _Recorder(ForwardingReceiver):
    def __init__(self):
        self.calls = []

    @property
    def tp_size(self) -> int:
        return 1

    def _submit(self, method, timeout, *args):
        self.calls.append((method, timeout, args))
        return PendingCall(result=0)


#: Answered on this side: the version read that travelled with the last commit (tested below).
_LOCAL = {"call_async", "served_version_after_commit"}


def _protocol_methods():
    return [name for name, fn in inspect.getmembers(WeightReceiver, inspect.isfunction)
            if not name.startswith("_") and name not in _LOCAL and "timeout" in inspect.signature(fn).parameters]


def test_every_protocol_method_is_forwarded_with_its_arguments_and_timeout():
    rec = _Recorder()  # instantiable: no protocol method is left abstract
    methods = _protocol_methods()
    assert {"begin_weight_update", "end_weight_update", "abort_weight_update", "update_weights_from_tensor",
            "load_staged_bucket", "attach_staging", "served_weight_version"} <= set(methods)
    for name in methods:
        params = [p for p in inspect.signature(getattr(WeightReceiver, name)).parameters if p not in ("self", "timeout")]
        args = tuple(f"{name}:{p}" for p in params)
        before = len(rec.calls)
        getattr(rec, name)(*args, timeout=7.5)
        assert rec.calls[before] == (name, 7.5, args), name
    assert rec.call_async("load_staged_bucket", 3.0, 1, 9).wait(3.0) == 0
    assert rec.calls[-1] == ("load_staged_bucket", 3.0, (1, 9))


def test_the_engine_calls_a_sync_makes_are_forwarded_too():
    rec = _Recorder()
    rec.abort_all(timeout=2.0)
    rec.score([[1, 2]], timeout=3.0)
    rec.resume_memory(["weights"], timeout=4.0)
    assert rec.calls == [("abort_all", 2.0, ()), ("score", 3.0, ([[1, 2]],)), ("resume_memory", 4.0, (["weights"],))]


def test_every_proxy_uses_it():
    from beamrl.loop.weight_sync import ActorReceiver, ExpressReceiver
    from beamrl.sync.process_receiver import ProcessReceiver

    assert all(issubclass(p, ForwardingReceiver) for p in (ActorReceiver, ExpressReceiver, ProcessReceiver))


class _Engine(_Recorder):
    """A recorder whose engine serves `served` and whose commit fails when `commit_fails`."""

    def __init__(self, served=5, commit_fails=False):
        super().__init__()
        self.served, self.commit_fails = served, commit_fails

    def _submit(self, method, timeout, *args):
        self.calls.append((method, timeout, args))
        if method == "end_weight_update" and self.commit_fails:
            return PendingCall(error=WeightSyncError("commit refused"))
        return PendingCall(result=self.served if method == "served_weight_version" else None)


def test_the_version_read_travels_right_behind_the_commit_and_is_used_once():
    """`end_weight_update` issues `served_weight_version` behind the commit without waiting in between (calls run
    in issue order), so the orchestrator's version check costs no round trip of its own; a second check (no commit
    since) asks the engine again, and a failed commit leaves nothing behind to be taken for its version."""
    rec = _Engine(served=5)
    assert rec.calls_in_issue_order
    rec.end_weight_update(5, timeout=2.0)
    assert rec.calls == [("end_weight_update", 2.0, (5,)), ("served_weight_version", 2.0, ())]
    assert rec.served_version_after_commit(1.0) == 5 and len(rec.calls) == 2
    assert rec.served_version_after_commit(1.0) == 5 and rec.calls[-1] == ("served_weight_version", 1.0, ())
    bad = _Engine(served=4, commit_fails=True)
    with pytest.raises(WeightSyncError, match="commit refused"):
        bad.end_weight_update(5, timeout=2.0)
    bad.served = 7
    assert bad.served_version_after_commit(1.0) == 7  # asked afresh, not the read behind the failed commit
