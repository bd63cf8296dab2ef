"""ForwardingReceiver forwards every WeightReceiver method by name, with the timeout it was given, and issues
pipelined calls through the same channel."""

import inspect

from beamrl.protocols.weights import PendingCall, WeightReceiver
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


def _protocol_methods():
    return [name for name, fn in inspect.getmembers(WeightReceiver, inspect.isfunction)
            if not name.startswith("_") and name != "call_async" and "timeout" in inspect.signature(fn).parameters]


def test_every_protocol_method_is_forwarded_with_its_arguments_and_timeout():
    rec = _Recorder()  # instantiable: no protocol method is left abstract
    methods = _protocol_methods()
    assert {"begin_weight_update", "end_weight_update", "abort_weight_update", "update_weights_from_tensor",
            "load_staged_bucket", "attach_staging", "served_weight_version"} <= set(methods)
    for name in methods:
        params = [p for p in inspect.signature(getattr(WeightReceiver, name)).parameters if p not in ("self", "timeout")]
        args = tuple(f"{name}:{p}" for p in params)
        getattr(rec, name)(*args, timeout=7.5)
        assert rec.calls[-1] == (name, 7.5, args), name
    assert rec.call_async("load_staged_bucket", 3.0, 1, 9).wait(3.0) == 0
    assert rec.calls[-1] == ("load_staged_bucket", 3.0, (1, 9))


def test_the_engine_calls_a_sync_makes_are_forwarded_too():
    rec = _Recorder()
    rec.abort_all(timeout=2.0)
    rec.score([[1, 2]], timeout=3.0)
    rec.resume_memory(["weights"], timeout=4.0)
    assert rec.calls == [("abort_all", 2.0, ()), ("score", 3.0, ([[1, 2]],)), ("resume_memory", 4.0, (["weights"],))]


def test_both_proxies_use_it():
    from beamrl.loop.weight_sync import ActorReceiver
    from beamrl.sync.process_receiver import ProcessReceiver

    assert issubclass(ActorReceiver, ForwardingReceiver) and issubclass(ProcessReceiver, ForwardingReceiver)
